"""Client-side and accepted connections: a connected Unix socket checked and handed to its channel,
with the peer's credentials; and connect() (with a timeout while the server's backlog is full).

A :class:`Connection` reads the peer's ``SO_PEERCRED`` and hands the socket to its
:attr:`Connection.channel` (:mod:`arrow_ipc_bridge.transport.channel`, the C core's frame codec), which does
all the framing and owns the socket from then on: :meth:`Connection.send`, :meth:`Connection.recv`
and :meth:`Connection.close` are that channel's. The frame format is specified in docs/protocol.md.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time
from collections.abc import Sequence
from types import TracebackType

from arrow_ipc_bridge.errors import (
    PUBLISHER_GONE_HINT,
    BridgeTimeoutError,
    ProtocolError,
    TransportError,
)
from arrow_ipc_bridge.transport.channel import MAX_PAYLOAD, U32_MAX, Channel, Frame

__all__ = ["Connection", "connect", "check_max_payload"]

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


def check_max_payload(max_payload: int) -> int:
    """``max_payload`` when it is a valid payload limit, else :class:`ProtocolError`."""
    if isinstance(max_payload, bool) or not isinstance(max_payload, int) or not 0 <= max_payload <= U32_MAX:
        raise ProtocolError(
            f"max_payload must be an int in 0..{U32_MAX} (the u32 length field), got {max_payload!r}",
            field="max_payload",
        )
    return max_payload


class Connection:
    """A framed, bidirectional message channel over a connected ``AF_UNIX`` ``SOCK_STREAM`` socket.

    The frames are sent and received by :attr:`channel` (the C core), which serialises senders and
    receivers: one reader thread and any number of writer threads can share a connection, and
    frames from concurrent senders never interleave on the wire.

    Parameters
    ----------
    sock:
        A connected Unix stream socket. The connection takes it over (it is switched to blocking mode and
        closed by :meth:`close`).
    max_payload:
        Largest payload accepted from the peer, and allowed in :meth:`send`, in bytes.

    Attributes
    ----------
    peer_pid, peer_uid, peer_gid:
        The peer's credentials from ``SO_PEERCRED``, as the kernel recorded them when the connection was
        made (read once, here).
    channel:
        The connection's frame codec (:class:`~arrow_ipc_bridge.transport.channel.Channel`).

    Raises
    ------
    TransportError
        ``sock`` is not a connected Unix stream socket.
    """

    def __init__(self, sock: socket.socket, *, max_payload: int = MAX_PAYLOAD) -> None:
        self._max_payload = check_max_payload(max_payload)
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise TransportError(f"Connection needs an AF_UNIX SOCK_STREAM socket, got {sock!r}")
        try:
            sock.getpeername()  # ENOTCONN for a socket that is not connected
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            # Blocking mode: an untimed receive is then one system call (the channel uses
            # MSG_DONTWAIT or SO_RCVTIMEO for timed ones, so the mode never has to change).
            sock.setblocking(True)
        except OSError as exc:
            raise TransportError(f"Connection needs a connected Unix stream socket: {exc}") from exc
        self.peer_pid, self.peer_uid, self.peer_gid = _UCRED.unpack(creds)
        self._fd = sock.fileno()
        self.channel = Channel(sock, self._max_payload)

    # -- properties ------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the connection was closed (by :meth:`close`, or after a protocol error)."""
        return self.channel.closed

    @property
    def max_payload(self) -> int:
        """The payload limit, in bytes, of this connection."""
        return self._max_payload

    def fileno(self) -> int:
        """The socket's descriptor (for ``selectors``), or -1 once closed."""
        return self.channel.fileno()

    def __repr__(self) -> str:
        state = "closed" if self.channel.closed else f"fd={self._fd}"
        return f"<Connection {state} peer_pid={self.peer_pid} peer_uid={self.peer_uid}>"

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- frames (the channel's) --------------------------------------------------------------------------

    def send(
        self,
        kind: int,
        payload: bytes | bytearray | memoryview = b"",
        fds: Sequence[int] = (),
        *,
        timeout: float | None = None,
    ) -> None:
        """Send one frame (:meth:`Channel.send <arrow_ipc_bridge.transport.channel.Channel.send>`)."""
        self.channel.send(kind, payload, fds, timeout=timeout)

    def recv(self, *, timeout: float | None = None) -> Frame:
        """Receive the next frame (:meth:`Channel.recv <arrow_ipc_bridge.transport.channel.Channel.recv>`)."""
        return self.channel.recv(timeout=timeout)

    # -- lifetime (the channel's, which owns the socket) ---------------------------------------------------

    def check_open(self) -> None:
        """Raise :class:`~arrow_ipc_bridge.errors.PeerClosedError` when the connection is closed,
        :class:`~arrow_ipc_bridge.errors.ClosedError` (``reason="forked"``) in a process other than
        its own."""
        self.channel.check_open()

    def close(self) -> None:
        """Close the connection (:meth:`Channel.close <arrow_ipc_bridge.transport.channel.Channel.close>`);
        idempotent, and safe to call from any thread."""
        self.channel.close()


def connect(
    path: str | os.PathLike[str],
    *,
    timeout: float = 5.0,
    max_payload: int = MAX_PAYLOAD,
    wait_for_server: bool = False,
) -> Connection:
    """Connect to the :class:`Server` listening on ``path``.

    Parameters
    ----------
    path:
        The server's socket file.
    timeout:
        Seconds to keep trying while the server's accept queue is full (or, with
        ``wait_for_server``, while no server is there).
    max_payload:
        Payload limit of the new connection, in bytes.
    wait_for_server:
        When nothing listens on ``path`` yet (no socket file, or one that refuses: a server
        starting or restarting), try again with a short backoff until ``timeout`` instead of
        raising at once.

    Returns
    -------
    Connection
        The connection; its ``peer_pid`` etc. describe the server process.

    Raises
    ------
    TransportError
        Nothing listens on ``path`` (the message says whether the file is missing, is not a socket, or is
        a stale socket left by a dead server), or access is denied.
    BridgeTimeoutError
        The server did not take the connection within ``timeout``;
        :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` (``waiting_for="publisher"``) when
        ``wait_for_server`` and no server appeared within it.
    """
    max_payload = check_max_payload(max_payload)
    if not timeout >= 0:  # also refuses NaN
        raise ValueError(f"timeout must be a number of seconds >= 0, not {timeout!r}")
    spath = os.fspath(path)
    deadline = time.monotonic() + timeout
    if not wait_for_server:
        return _connect_once(spath, timeout, deadline, max_payload)
    delay = 0.001
    while True:
        try:
            return _connect_once(spath, timeout, deadline, max_payload)
        except TransportError as exc:
            # Missing, or a socket that refuses: a server may be on its way (it replaces a stale
            # socket file, binds, then listens). Anything else (permission denied, a path that is
            # not a socket, which no server would replace) will not mend itself.
            if not isinstance(exc.__cause__, FileNotFoundError) and not (
                isinstance(exc.__cause__, ConnectionRefusedError) and _is_socket(spath)
            ):
                raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BridgeTimeoutError(
                    f"no server appeared at {spath!r} within {round(timeout, 3)} s (last: {exc.message})",
                    waiting_for="publisher",
                    path=spath,
                    timeout=timeout,
                ) from exc
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)


def _connect_once(spath: str, timeout: float, deadline: float, max_payload: int) -> Connection:
    """One connect; waits (until ``deadline``) only while the server's accept queue is full."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Non-blocking: a Unix connect either completes at once or fails with EAGAIN when the server's
        # backlog is full; polling then gives a timeout that a blocking connect would not honour.
        sock.setblocking(False)
        delay = 0.001
        while True:
            try:
                sock.connect(spath)
                break
            except BlockingIOError as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BridgeTimeoutError(
                        f"connect to {spath!r} timed out after {timeout} s: a publisher is listening there "
                        "but does not accept connections (backlog full or stuck)",
                        waiting_for="publisher",
                        path=spath,
                        timeout=timeout,
                    ) from exc
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.05)
            except FileNotFoundError as exc:
                raise TransportError(
                    f"cannot connect to {spath!r}: no such socket file, no publisher is running there",
                    path=spath,
                    errno=exc.errno,
                ) from exc
            except ConnectionRefusedError as exc:
                what = _describe_refused(spath)
                raise TransportError(
                    f"cannot connect to {spath!r}: {what}", path=spath, errno=exc.errno
                ) from exc
            except PermissionError as exc:
                raise TransportError(
                    f"cannot connect to {spath!r}: permission denied (the publisher there belongs to another "
                    "user or the directory is not searchable)",
                    path=spath,
                    errno=exc.errno,
                ) from exc
            except OSError as exc:
                raise TransportError(
                    f"cannot connect to {spath!r}: {exc}", path=spath, errno=exc.errno
                ) from exc
        conn = Connection(sock, max_payload=max_payload)
        # The server of every connection made here is a publisher: its going away is answered by
        # connecting again, which the errors of this connection say.
        conn.channel.peer_closed_hint = PUBLISHER_GONE_HINT
        return conn
    except BaseException:
        sock.close()
        raise


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return True  # gone meanwhile: as good as missing, worth another try


def _describe_refused(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "connection refused, no publisher is running there"
    if not stat.S_ISSOCK(st.st_mode):
        return "the path is not a socket, no publisher is running there"
    return "connection refused, no publisher is running there (a stale socket file from a server that died)"
