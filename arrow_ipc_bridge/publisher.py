"""Producer side server: publish named Arrow objects, serve them to sessions under leases.

Each published name holds an :class:`~arrow_ipc_bridge.exporter.Exported` (captured data, its region
fds and the encoded message, made once at publish time, so a ``get`` costs one frame). The names,
messages and leases live in the C core (``cffi_build/serve.c``), whose serve loop answers GET and
RELEASE (and PING) frames without the GIL; this module handles the handshake, LIST and errors. An entry, and
with it the producer's buffers, lives until it is unpublished *and* every lease on it ended; then
its keeper owner dies and the reaper closes the export record. A session that disconnects or dies
gives back all its leases at once (its connection's lease table is freed when the socket closes).
"""

from __future__ import annotations

import logging
import os
import threading
from types import TracebackType
from typing import Any

from arrow_ipc_bridge import _process, _reaper, protocol, transport
from arrow_ipc_bridge._ffi import WIRE_VERSION, ffi, lib, new_error, raise_for
from arrow_ipc_bridge.channel import Channel, frame_from
from arrow_ipc_bridge.errors import (
    BridgeError,
    NotPublishedError,
    ProtocolError,
    RegionError,
)
from arrow_ipc_bridge.exporter import CopyPolicy, ExportStats, export

__all__ = ["Publisher"]

_log = logging.getLogger("arrow_ipc_bridge")


class Publisher:
    """Serve Arrow objects by name over a Unix socket, on a background thread.

    Parameters
    ----------
    path
        Socket file to create (mode 0600). A stale one is replaced; a live publisher's is refused.
    allowed_uids
        Extra uids allowed to connect (this process's uid always is).
    copy
        Default copy policy for :meth:`publish` (see :func:`~arrow_ipc_bridge.export`).

    Examples
    --------
    >>> with aib.Publisher("/tmp/demo.sock") as pub:  # doctest: +SKIP
    ...     pub.publish("trades", table)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        allowed_uids: list[int] | None = None,
        copy: CopyPolicy = "if_needed",
    ) -> None:
        self._pid = _process.pid  # a forked child inherits this object; it serves nothing there
        self._lock = threading.Lock()
        self._names: set[str] = set()
        table = lib.aib_pubtable_new()
        if table == ffi.NULL:
            raise MemoryError("allocating the publication table")
        self._table = ffi.gc(table, lib.aib_pubtable_unref)
        self._copy: CopyPolicy = copy
        self.publisher_id = os.urandom(16).hex()
        self._server = transport.Server(path, self._serve, allowed_uids=allowed_uids, name="aib-publisher")
        self.path = self._server.path

    # ---------- publishing --------------------------------------------------------------------------
    def publish(self, name: str, obj: object, *, copy: CopyPolicy | None = None) -> ExportStats:
        """Publish ``obj`` as ``name`` (replacing an earlier object of that name).

        Sessions holding leases on the replaced object keep it until they release it. Returns what
        the export cost (regions, bytes copied).
        """
        raw_name = protocol.encode_name(name)  # validates the name
        self._check_open()
        # Pool fds stay out of the message: a session asks for each pool's fd once (POOL_FD), so
        # the hot answers carry no descriptor for pool data.
        exported = export(obj, copy=copy or self._copy, pool_fds=False)
        # The entry's keeper: when the last of (publication, leases) lets go, the reaper closes it.
        keeper = lib.aib_owner_new(_reaper.register(exported.close))
        if keeper == ffi.NULL:
            exported.close()
            raise MemoryError("allocating a publication keeper")
        fds = list(exported.fds)
        err = new_error()
        try:
            with self._lock:
                if self._server.closed:  # closed while we exported
                    raise BridgeError("this publisher is closed")
                message = exported.message
                rc = lib.aib_pubtable_put(
                    self._table, raw_name, len(raw_name), message, len(message), fds, len(fds), keeper, err
                )
                if rc:
                    raise_for(rc, err, f"publishing {name!r}")
                self._names.add(name)
        finally:
            lib.aib_owner_unref(keeper)  # the entry holds its own reference (or none: then it closes)
            _reaper.drain()  # a replaced object without leases is closed now, not later
        return exported.stats

    def unpublish(self, name: str) -> None:
        """Stop serving ``name``; its data lives on until every lease on it has ended."""
        raw_name = protocol.encode_name(name)
        self._check_process()
        with self._lock:
            absent = lib.aib_pubtable_remove(self._table, raw_name, len(raw_name))
            self._names.discard(name)
        if absent:
            raise NotPublishedError(f"nothing is published as {name!r}")
        _reaper.drain()

    def names(self) -> list[str]:
        self._check_process()
        with self._lock:
            return sorted(self._names)

    @property
    def active_leases(self) -> int:
        """Leases currently held by sessions (all names together)."""
        return int(lib.aib_pubtable_leases(self._table))

    @property
    def active_sessions(self) -> int:
        return self._server.active_connections()

    def _check_open(self) -> None:
        self._check_process()
        if self._server.closed:
            raise BridgeError("this publisher is closed")

    def _check_process(self) -> None:
        if self._pid != _process.pid:
            raise _process.foreign("publisher", self._pid, "publish from a Publisher made here")

    # ---------- serving one session -----------------------------------------------------------------
    def _serve(self, conn: transport.Connection) -> None:
        channel = Channel(conn)
        served = lib.aib_server_conn_new(self._table, channel.raw)
        if served == ffi.NULL:
            raise MemoryError("allocating a connection's lease table")
        raw_frame = ffi.new("aib_frame *")
        err = new_error()
        recv_lock, send_lock = channel.locked()
        try:
            while True:
                # GET for published names and RELEASE are answered in C; the rest comes back here.
                with recv_lock, send_lock:
                    conn.check_open()
                    rc = lib.aib_serve(served, raw_frame, err)
                    if rc == lib.AIB_E_PEER_CLOSED:
                        return
                    if rc != lib.AIB_SERVE_FRAME:
                        raise channel.failed(rc, err, "serving a session", holding="both")
                    frame = frame_from(raw_frame)
                try:
                    self._answer(channel, frame)
                except (NotPublishedError, RegionError) as exc:  # the session may go on
                    channel.send(protocol.ERROR, protocol.encode_error(exc))
                except ProtocolError as exc:
                    _log.warning("arrow_ipc_bridge: closing session pid %s: %s", conn.peer_pid, exc)
                    channel.send(protocol.ERROR, protocol.encode_error(exc))
                    return
        finally:
            lib.aib_server_conn_free(served)  # gives this session's leases back
            _reaper.drain()

    def _answer(self, channel: Channel, frame: transport.Frame) -> None:
        """The frames the C loop leaves to Python: handshake, LIST, POOL_FD, unknown names, bad frames."""
        if frame.kind == protocol.HELLO:
            version = protocol.decode_hello(frame.payload)
            if version != protocol.PROTOCOL_VERSION:
                raise ProtocolError(
                    f"session speaks protocol {version}, this publisher {protocol.PROTOCOL_VERSION}"
                )
            channel.send(protocol.WELCOME, protocol.encode_json(self._welcome()))
        elif frame.kind == protocol.LIST:
            channel.send(protocol.NAMES, protocol.encode_json(self.names()))
        elif frame.kind == protocol.POOL_FD:
            self._send_pool_fd(channel, protocol.decode_pool_identity(frame.payload))
        elif frame.kind == protocol.GET:
            name = protocol.decode_name(frame.payload)  # ProtocolError for a malformed name
            raise NotPublishedError(f"nothing is published as {name!r}")
        elif frame.kind == protocol.RELEASE:
            protocol.decode_lease(frame.payload)  # the C loop takes every well-formed RELEASE
            raise ProtocolError("malformed RELEASE frame")
        elif frame.kind == protocol.PING:  # the C loop answers every PING up to MAX_PING bytes
            raise ProtocolError(f"PING payload of {len(frame.payload)} bytes (at most {protocol.MAX_PING})")
        else:
            raise ProtocolError(f"unexpected frame kind {frame.kind}")

    @staticmethod
    def _send_pool_fd(channel: Channel, identity: bytes) -> None:
        """Answer POOL_FD: the fd of one of our IPC pools that an exported message named. Messages
        leave pool fds out (see publish), so each session process asks once per pool."""
        from arrow_ipc_bridge.cuda import placer as cuda_regions  # loads no CUDA until a pool is named

        fd = cuda_regions.pool_fd_for(identity)  # RegionError for anything else
        try:
            channel.send(protocol.POOL, identity, [fd])
        finally:
            os.close(fd)

    def _welcome(self) -> dict[str, Any]:
        return {
            "protocol": protocol.PROTOCOL_VERSION,
            "wire": list(WIRE_VERSION),
            "publisher_id": self.publisher_id,
            "pid": os.getpid(),
            "features": list(protocol.FEATURES),
        }

    # ---------- lifetime ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._server.closed

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving (idempotent). Sessions are disconnected; what they already mapped stays valid.

        In a child of ``fork`` this only drops the child's copies of the descriptors: the socket
        file, the sessions and the published data stay the parent's."""
        self._server.close(timeout)
        if self._pid != _process.pid:
            return
        with self._lock:
            lib.aib_pubtable_clear(self._table)
            self._names.clear()
        _reaper.drain()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
