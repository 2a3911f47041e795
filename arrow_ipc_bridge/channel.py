"""The hot path of the publisher/session protocol: frames sent and received by the C core.

:mod:`~arrow_ipc_bridge.transport` connects and checks credentials in Python. A session then says
hello through the Python framing and hands the socket's receiving side to a :class:`Channel`; a
publisher's connection handler hands it over at once (the C serve loop passes HELLO back to Python
to answer). Channel calls run in C without the GIL (``cffi_build/channel.c``): a request round trip
then costs about what the socket costs, where the Python framing on both ends added ~40 µs. The
bytes on the wire are the same (transport.py's docstring is their spec).

The :class:`~arrow_ipc_bridge.transport.Connection` still owns the socket: every channel call holds
the connection's receive or send lock, so ``close()`` from any thread waits for it, and errors
close the connection the same way transport does.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from arrow_ipc_bridge._ffi import ffi, lib, new_error
from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    PeerClosedError,
    ProtocolError,
    TransportError,
)
from arrow_ipc_bridge.transport import Connection, Frame

__all__ = ["Channel", "error_for", "frame_from", "millis"]

_GET_IMPORTED = int(lib.AIB_GET_IMPORTED)
_GET_IMPORTED_NEW = int(lib.AIB_GET_IMPORTED_NEW)


def millis(timeout: float | None) -> int:
    """A timeout in seconds as the C core's milliseconds (-1: block)."""
    return -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))


def error_for(code: int, err: Any, what: str, timeout: float | None = None) -> BridgeError:
    """The package exception for a failed channel call."""
    message = ffi.string(err.message).decode("utf-8", "replace")
    text = f"{what}: {message}"
    if code == lib.AIB_E_PEER_CLOSED:
        return PeerClosedError(text)
    if code == lib.AIB_E_TIMEOUT:
        return BridgeTimeoutError(f"{what} timed out after {timeout} s", timeout=timeout)
    if code == lib.AIB_E_PROTOCOL:
        return ProtocolError(text)
    if code == lib.AIB_E_NOMEM:
        return TransportError(f"{what}: out of memory")
    return TransportError(text, errno=int(err.errno_value) or None)


def frame_from(raw: Any) -> Frame:
    """A Python frame (payload copied, descriptors now the caller's) from a received C frame."""
    payload = ffi.buffer(raw.payload, raw.length)[:] if raw.length else b""
    return Frame(int(raw.kind), payload, [int(raw.fds[i]) for i in range(raw.n_fds)])


class Channel:
    """Frames over a connection's socket, sent and received in C.

    Parameters
    ----------
    conn
        A connection whose receiving side is handed over here (its own ``recv`` is refused from
        now on); sending through the connection stays allowed and is serialised with ours.
    """

    def __init__(self, conn: Connection) -> None:
        seed = conn.hand_over_receive()
        raw = lib.aib_channel_new(conn.fileno(), conn.max_payload, seed, len(seed))
        if raw == ffi.NULL:
            raise MemoryError("allocating a channel")
        self.conn = conn
        self.raw = ffi.gc(raw, lib.aib_channel_free)
        self._recv_lock, self._send_lock = conn.io_locks()
        # Used under the receive lock only (one receive at a time).
        self._frame = ffi.new("aib_frame *")
        self._result = ffi.new("aib_get_result *")
        self._err = new_error()
        self._freed = False

    def free(self) -> None:
        """Free the C channel now, closing the descriptors of frames not yet taken (idempotent).

        Only once no thread uses the channel any more (a server's ``on_close``). Without this the C
        channel lived until the garbage collector found this object, and anything that kept it
        reachable (a log record holding an exception whose traceback holds the serving frame) kept a
        peer's descriptors open in this process."""
        if not self._freed:
            self._freed = True
            ffi.release(self.raw)

    def send(
        self, kind: int, payload: bytes = b"", fds: Sequence[int] = (), *, timeout: float | None = None
    ) -> None:
        """Send one frame. A timeout before anything went out leaves the connection usable; any
        other failure closes it."""
        err = new_error()
        fd_array = ffi.new("int[]", list(fds)) if fds else ffi.NULL
        timeout_ms = -1 if timeout is None else millis(timeout)
        with self._send_lock:
            self.conn.check_open()
            rc = lib.aib_channel_send(
                self.raw, kind, payload, len(payload), ffi.NULL, 0, fd_array, len(fds), timeout_ms, err
            )
        if rc:
            exc = error_for(rc, err, "sending a frame", timeout)
            if rc != lib.AIB_E_TIMEOUT:
                # Closed after letting go of the send lock: close() takes the receive lock first,
                # and a request holds both in that order.
                self.conn.close()
            raise exc

    def recv(self, *, timeout: float | None = None) -> Frame:
        """The next frame; on any failure (a timeout too) the connection is closed."""
        err = new_error()
        with self._recv_lock:
            self.conn.check_open()
            rc = lib.aib_channel_recv(self.raw, millis(timeout), self._frame, err)
            if rc:
                raise self.failed(rc, err, "receiving a frame", timeout, holding="recv")
            return frame_from(self._frame)

    def request(self, kind: int, payload: bytes, *, timeout: float | None) -> Frame:
        """Send a request and receive its answer (the session's round trip, one C call).

        The caller serialises requests; the send lock is held too so that lease releases from
        other threads never interleave with the request's bytes.
        """
        err = new_error()
        with self._recv_lock, self._send_lock:
            self.conn.check_open()
            rc = lib.aib_channel_request(
                self.raw, kind, payload, len(payload), millis(timeout), self._frame, err
            )
            if rc:
                raise self.failed(rc, err, "a request", timeout, holding="both")
            return frame_from(self._frame)

    def get(
        self, name: bytes, cache: Any, lease_tokens: int, keeper: Any, timeout_ms: int
    ) -> tuple[tuple[int, Any, int, Any] | None, Frame | None]:
        """The session's GET in one C call (``aib_session_get``); ``timeout_ms`` < 0 blocks.

        Returns ``((cache entry id, lease owner, its address, sync slot or NULL), None)`` when the
        answer was a message remembered in ``cache`` and is imported already (the owner is the
        caller's: wrap it at once; its token is ``lease_tokens | lease id`` and it holds ``keeper``);
        ``((0, owner, address, slot), frame)`` when it was a new message the C core imported over
        regions open in this process (``aib_import_new``; the frame is the ITEM); else
        ``(None, frame)`` with the answer for the caller.
        """
        err = self._err
        result = self._result
        with self._recv_lock, self._send_lock:
            self.conn.check_open()
            rc = lib.aib_session_get(
                self.raw, name, len(name), timeout_ms, cache, lease_tokens, keeper, result, self._frame, err
            )
            if rc == _GET_IMPORTED:
                return (result.entry_id, result.owner, result.owner_address, result.sync_slot), None
            if rc == _GET_IMPORTED_NEW:  # entry id 0; the frame carries the message it imported
                imported = (0, result.owner, result.owner_address, result.sync_slot)
                return imported, frame_from(self._frame)
            if rc:
                timeout = None if timeout_ms < 0 else timeout_ms / 1000
                raise self.failed(rc, err, "a request", timeout, holding="both")
            return None, frame_from(self._frame)

    def locked(self) -> tuple[threading.Lock, threading.Lock]:
        """Both locks, for a C call that receives and sends on this channel (the serve loop)."""
        return self._recv_lock, self._send_lock

    def failed(
        self, rc: int, err: Any, what: str, timeout: float | None = None, *, holding: str
    ) -> BridgeError:
        """The exception for a failed call; the connection is closed (the stream position is unknown
        after a failed receive: a timed-out frame is not kept). Call it holding the lock(s) named:
        ``"recv"`` or ``"both"`` (never the send lock alone: the locks are taken receive first)."""
        exc = error_for(rc, err, what, timeout)
        self.conn.abort(f"{what} failed: {exc}", holding=holding)
        return exc
