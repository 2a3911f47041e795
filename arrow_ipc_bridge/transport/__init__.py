"""Unix sockets between the processes of one host: connecting, serving, admitting.

It makes and accepts connections; the frames that then go over them (a ``kind``, a payload and
optionally some file descriptors) are sent and received by each connection's C channel
(:mod:`arrow_ipc_bridge.transport.channel`), in the format docs/protocol.md specifies. What the
kinds and payloads mean is the conversation's: :mod:`~arrow_ipc_bridge.transport.protocol` (the
publisher/session frames), :mod:`~arrow_ipc_bridge.transport.stream_frames` (live streams' frames)
and :mod:`~arrow_ipc_bridge.transport.board` (the version board sessions read without asking).

* :mod:`~arrow_ipc_bridge.transport.connection`: :class:`Connection` (a connected socket, its peer's
  ``SO_PEERCRED``, its locks and close) and :func:`connect` (with a timeout while the server's
  backlog is full);
* :mod:`~arrow_ipc_bridge.transport.server`: :class:`Server` (accept loop, uid admission,
  connection limit, handshake deadline, the parking lot of idle connections, farewells) and
  :data:`PARK`;
* :mod:`~arrow_ipc_bridge.transport.socket_path`: the socket file (mode, stale-path replacement).

Errors
------
* cannot connect or bind (no such path, refused, path held by a live server, not a socket):
  :class:`~arrow_ipc_bridge.errors.TransportError`; a server that does not take the connection in
  time: :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError`;
* an invalid limit: :class:`~arrow_ipc_bridge.errors.ProtocolError` (a ``ValueError``);
* the frame errors are the channel's (:mod:`arrow_ipc_bridge.transport.channel`).

A client whose uid a :class:`Server` does not allow is disconnected right after ``accept``, after the
server's ``farewell`` (the publisher's: an ERROR frame naming
:class:`~arrow_ipc_bridge.errors.TransportError` (``reason="rejected"``)); without a farewell it sees
:class:`~arrow_ipc_bridge.errors.PeerClosedError` on its first :meth:`Connection.recv`.
"""

from arrow_ipc_bridge.transport.connection import Connection, connect
from arrow_ipc_bridge.transport.server import PARK, Server

__all__ = ["PARK", "Connection", "Server", "connect"]
