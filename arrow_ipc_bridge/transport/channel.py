"""Frames over a connected Unix socket, sent and received by the C core: the package's one frame codec.

Every frame of the publisher/session protocol goes through a :class:`Channel`, the handshake
included; the frame format, how descriptors travel with frames and the limits are specified in
docs/protocol.md ("Frames"). Channel calls run in C without the GIL (``cffi_build/channel.c``).

A channel owns its socket (a :class:`~arrow_ipc_bridge.transport.Connection` makes it and hands
it over: ``conn.channel``): one lock serialises receivers and another senders, every call holds
the one it needs, so :meth:`Channel.close` from any thread waits for it, and a failure that leaves
the stream out of sync closes the channel. Nothing here refers back to the connection: whoever
holds the channel (a session's lease releases) keeps the socket open, and dropping the last
reference closes it.

Errors (docs/protocol.md, "Frames", says when each is raised): the peer gone or the channel closed
here: :class:`~arrow_ipc_bridge.errors.PeerClosedError`; a malformed frame:
:class:`~arrow_ipc_bridge.errors.ProtocolError` (the channel closes); a wait past its timeout:
:class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` (the channel closes only when part of a frame
had moved); an invalid frame handed to :meth:`Channel.send`:
:class:`~arrow_ipc_bridge.errors.ProtocolError` (nothing sent).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

from arrow_ipc_bridge._ffi import ffi, lib, new_error
from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    LimitError,
    PeerClosedError,
    ProtocolError,
    TransportError,
)
from arrow_ipc_bridge.runtime import process

__all__ = ["MAX_FDS", "MAX_PAYLOAD", "Channel", "Frame", "error_for", "frame_from", "millis"]

MAX_PAYLOAD: Final = 64 * 1024 * 1024
"""Default limit on a frame's payload, in bytes; ``max_payload`` arguments override it."""
MAX_FDS: Final = int(lib.AIB_MAX_FDS)
"""Most descriptors one frame may carry (the kernel's ``SCM_MAX_FD``)."""
U32_MAX: Final = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_GET_IMPORTED = int(lib.AIB_GET_IMPORTED)
_GET_IMPORTED_NEW = int(lib.AIB_GET_IMPORTED_NEW)
_STREAM_NOTHING = int(lib.AIB_STREAM_NOTHING)
_STREAM_BATCH = int(lib.AIB_STREAM_BATCH)
_STREAM_NEW = int(lib.AIB_STREAM_NEW)
_STREAM_FRAME = int(lib.AIB_STREAM_FRAME)
_STREAM_DONE = frozenset({_STREAM_BATCH, _STREAM_NOTHING})  # nothing more to hand back
# What aib_channel_send refuses before anything went out (the frame itself is invalid).
_INVALID_FRAME = frozenset({int(lib.AIB_E_LIMIT), int(lib.AIB_E_STATE)})
# Send failures after which the stream is still in step (nothing went out, or nobody is left).
_SEND_KEEPS_OPEN = frozenset({int(lib.AIB_E_TIMEOUT), int(lib.AIB_E_PEER_CLOSED)}) | _INVALID_FRAME
# close() waits this long for a send/recv in progress to notice the shutdown before it closes the fd
# anyway. shutdown() wakes every blocked socket call at once, so this is only a safety net.
_CLOSE_WAIT_S = 5.0

logger = logging.getLogger(__name__)


def millis(timeout: float | None) -> int:
    """A timeout in seconds as the C core's milliseconds (-1: block)."""
    return -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))


def error_for(
    code: int,
    err: Any,
    what: str,
    timeout: float | None = None,
    *,
    peer_closed_hint: str = "",
    waiting_for: str = "receive",
) -> BridgeError:
    """The package exception for a failed channel call; ``peer_closed_hint`` ends the message of a
    :class:`~arrow_ipc_bridge.errors.PeerClosedError` (what to do now that the peer is gone),
    ``waiting_for`` is the :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError`'s (``"send"``,
    ``"receive"`` or ``"answer"``: a request's reply)."""
    message = ffi.string(err.message).decode("utf-8", "replace")
    text = f"{what}: {message}"
    if code == lib.AIB_E_PEER_CLOSED:
        return PeerClosedError(f"{text}: {peer_closed_hint}" if peer_closed_hint else text)
    if code == lib.AIB_E_TIMEOUT:
        return BridgeTimeoutError(
            f"{what} timed out after {timeout} s", waiting_for=waiting_for, timeout=timeout
        )
    if code == lib.AIB_E_PROTOCOL:
        where = ffi.string(err.field).decode("utf-8", "replace")
        return ProtocolError(text, field=where) if where else ProtocolError(text)
    if code == lib.AIB_E_NOMEM:
        return TransportError(f"{what}: out of memory")
    return TransportError(text, errno=int(err.errno_value) or None)


def close_fds(fds: Iterable[int]) -> None:
    """Close descriptors, going on past any already closed (so that none of the rest leaks)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            continue


@dataclass(slots=True)
class Frame:
    """One received frame.

    Parameters
    ----------
    kind:
        The caller-defined frame kind (0..65535).
    payload:
        The payload, as a bytes object of its own (copied out of the channel's receive buffer).
    fds:
        Descriptors that came with the frame, in the order the sender listed them. They are new
        descriptors owned by the receiver, with ``FD_CLOEXEC`` set: close them with
        :meth:`close_fds` (or use the frame as a context manager), or take one over by removing it
        from the list (``frame.fds.pop(i)``).
    """

    kind: int
    payload: bytes
    fds: list[int] = field(default_factory=list)

    def close_fds(self) -> None:
        """Close every descriptor still in :attr:`fds` and empty the list; calling it again does nothing."""
        fds, self.fds = self.fds, []
        close_fds(fds)

    def __enter__(self) -> Frame:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close_fds()


def frame_from(raw: Any) -> Frame:
    """A Python frame (payload copied, descriptors now the caller's) from a received C frame."""
    payload = ffi.buffer(raw.payload, raw.length)[:] if raw.length else b""
    return Frame(int(raw.kind), payload, [int(raw.fds[i]) for i in range(raw.n_fds)])


def _check_kind(kind: object) -> int:
    # Int subclasses (an IntEnum of message kinds) are fine; bool is an int subclass but surely a mistake.
    if isinstance(kind, bool) or not isinstance(kind, int) or not 0 <= kind <= _U16_MAX:
        raise ProtocolError(f"frame kind must be an int in 0..{_U16_MAX}, got {kind!r}", field="kind")
    return int(kind)


def _fd_array(fds: Sequence[int]) -> Any:
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"{len(fds)} descriptors in one frame, at most {MAX_FDS}", field="fds")
    if not all(type(fd) is int or (isinstance(fd, int) and not isinstance(fd, bool)) for fd in fds):
        raise ProtocolError(f"fds must be descriptor numbers, got {list(fds)!r}", field="fds")
    if min(fds) < 0 or max(fds) > 0x7FFFFFFF:
        raise ProtocolError(f"not a descriptor number in {list(fds)!r}", field="fds")
    return ffi.new("int[]", list(fds))


class Channel:
    """Frames over a connection's socket, sent and received in C.

    Parameters
    ----------
    sock
        A connected Unix stream socket in blocking mode, taken over: closed by :meth:`close` (or
        when the channel is dropped).
    max_payload
        Largest payload accepted from the peer, and allowed in :meth:`send`, in bytes.

    Attributes
    ----------
    farewell
        Called with the :class:`~arrow_ipc_bridge.errors.ProtocolError` when a receive finds that the
        peer broke the framing (a frame over a limit, a bad header), just before the channel closes:
        what is sent then still starts at a frame boundary, so a server can tell its client why. It
        must not block (send with ``timeout=0``); what it raises is ignored. ``None``: just close.
    """

    def __init__(self, sock: socket.socket, max_payload: int) -> None:
        raw = lib.aib_channel_new(sock.fileno(), max_payload)
        if raw == ffi.NULL:
            raise MemoryError("allocating a channel")
        self.max_payload = max_payload
        self.raw = ffi.gc(raw, lib.aib_channel_free)
        self._sock = sock
        # A forked child inherits this object and the socket, but the conversation is the parent's.
        self._pid = process.pid
        self._state_lock = threading.Lock()
        self._close_reason = ""
        # What a PeerClosedError tells the user to do, set by whoever knows the peer (a session's
        # connection: connect to the publisher again); kept in the close reason later calls show.
        self.peer_closed_hint = ""
        self._recv_lock = threading.Lock()
        self._send_lock = threading.Lock()
        # Used under the receive lock only (one receive at a time).
        self._frame = ffi.new("aib_frame *")
        self._result = ffi.new("aib_get_result *")
        self._err = new_error()
        self._send_err = new_error()
        self.farewell: Callable[[BridgeError], object] | None = None

    def send(
        self,
        kind: int,
        payload: bytes | bytearray | memoryview = b"",
        fds: Sequence[int] = (),
        *,
        timeout: float | None = None,
        tail: bytes = b"",
    ) -> None:
        """Send one frame.

        ``payload`` is any C-contiguous buffer; ``tail`` (bytes) follows it in the same frame, so a
        caller that sends a header before a message it keeps needs no joined copy of the two.
        Together they are at most :attr:`max_payload` bytes. ``fds`` are duplicated into the peer
        (at most :data:`MAX_FDS`; the caller keeps its own copies). ``timeout`` bounds the whole
        call, waiting for other senders included (``None``: no limit). See the module docstring
        for the errors.
        """
        if kind.__class__ is not int or not 0 <= kind <= _U16_MAX:
            kind = _check_kind(kind)
        if payload.__class__ is bytes:
            data: Any = payload
            size = len(payload)
        else:
            view = memoryview(payload)
            if not view.c_contiguous:
                raise ProtocolError("the payload must be a C-contiguous buffer", field="payload")
            data = ffi.from_buffer(view)
            size = view.nbytes
        if tail.__class__ is not bytes:
            raise ProtocolError(
                f"the payload's tail must be bytes, not {type(tail).__name__}", field="payload"
            )
        if size + len(tail) > self.max_payload:
            raise ProtocolError(
                f"payload of {size + len(tail)} bytes is over this connection's limit of "
                f"{self.max_payload} bytes",
                field="payload",
            )
        fd_array = _fd_array(fds) if fds else ffi.NULL
        timeout_ms = millis(timeout)
        lock = self._send_lock
        # Untimed first: a lock nobody holds (the usual case) costs no timed wait.
        if not lock.acquire(False):
            if timeout is None:
                lock.acquire()
            elif not lock.acquire(timeout=max(timeout, 0.0)):
                raise BridgeTimeoutError(
                    f"send timed out after {timeout} s waiting for another sender",
                    waiting_for="send",
                    timeout=timeout,
                )
        try:
            if self._pid != process.pid:
                self.check_open()  # raises: a forked child's copy
            # A channel closed here is refused by the C call itself (nothing sent; the error below
            # names the close), so an open channel's send makes one C call.
            err = self._send_err  # one per channel, used under the send lock
            rc = lib.aib_channel_send(
                self.raw, kind, data, size, tail, len(tail), fd_array, len(fds), timeout_ms, err
            )
            if rc == 0:
                return
            exc = self._send_failure(rc, err, timeout, fds=bool(fds))
        finally:
            lock.release()
        # A timeout before anything went out leaves the stream in step; so does a peer that is gone
        # (nobody is left to misread it, and what it sent before leaving, a farewell ERROR frame,
        # can still be received), and descriptors the kernel refused to pass (ETOOMANYREFS: sendmsg
        # sent nothing, as the C loop's GET answers rely on too). Anything else closes the
        # connection: closed after letting go of the send lock, because close() takes the receive
        # lock first and a request holds both in that order.
        if rc not in _SEND_KEEPS_OPEN and not (
            isinstance(exc, LimitError) and exc.limit == "descriptors_in_flight"
        ):
            self.close()
        raise exc

    def _send_failure(self, rc: int, err: Any, timeout: float | None, *, fds: bool) -> BridgeError:
        """The exception for a failed aib_channel_send (called holding the send lock)."""
        if fds and rc == lib.AIB_E_OS and err.errno_value == errno.ETOOMANYREFS and not self._closed:
            return LimitError(
                "the kernel refused to pass the frame's descriptors (ETOOMANYREFS: too many in "
                "flight to peers that do not read); nothing was sent and the connection goes on",
                limit="descriptors_in_flight",
            )
        if rc in _INVALID_FRAME:  # refused before anything went out
            message = ffi.string(err.message).decode("utf-8", "replace")
            return ProtocolError(message, field=ffi.string(err.field).decode() or "frame")
        if rc == lib.AIB_E_PROTOCOL:  # timed out with part of the frame on the wire
            return BridgeTimeoutError(
                f"send timed out after {timeout} s in the middle of a frame (connection closed)",
                waiting_for="send",
                timeout=timeout,
            )
        return self._closed_or(
            error_for(
                rc,
                err,
                "sending a frame",
                timeout,
                peer_closed_hint=self.peer_closed_hint,
                waiting_for="send",
            )
        )

    def recv(self, *, timeout: float | None = None) -> Frame:
        """The next frame; the caller owns (and must close) its :attr:`Frame.fds`.

        ``timeout`` bounds the whole call (``None`` blocks). A timeout before the frame's first
        byte leaves the connection usable; any other failure closes it.
        """
        err = new_error()
        if timeout is None:
            self._recv_lock.acquire()
        else:
            timeout = max(float(timeout), 0.0)
            if not self._recv_lock.acquire(timeout=timeout):
                raise BridgeTimeoutError(
                    f"recv timed out after {timeout} s waiting for another receiver",
                    waiting_for="receive",
                    timeout=timeout,
                )
        try:
            self.check_open()
            rc = lib.aib_channel_recv(self.raw, millis(timeout), self._frame, err)
            if rc == 0:
                return frame_from(self._frame)
            if rc == lib.AIB_E_TIMEOUT and not lib.aib_channel_mid_frame(self.raw):
                raise error_for(rc, err, "receiving a frame", timeout)
            raise self.failed(rc, err, "receiving a frame", timeout, holding="recv")
        finally:
            self._recv_lock.release()

    def recv_batch(
        self, stream: tuple[Any, Any, int, Any, int], spin_ns: int, timeout: float | None, out: Any, err: Any
    ) -> tuple[int, Frame | None]:
        """A live stream's next frame, and its batch imported when the session remembers its
        message: one call of ``aib_stream_rx_next`` (``cffi_build/bridge_stream.h``) under the
        receive lock. ``stream``: the stream's fixed arguments (its ``aib_stream_rx``, the session's
        remembered set, the lease token base, the session's lease keeper, the content check's
        code). ``spin_ns`` >= 0: only a frame that arrives within that many nanoseconds
        (looked for without sleeping), else ``AIB_STREAM_NOTHING``; < 0: waits up to ``timeout``.
        Returns the call's code with ``out`` (and ``err``, for a refused or broken batch) filled,
        and a frame for ``AIB_STREAM_FRAME`` (the frame received: its descriptors the caller's) and
        ``AIB_STREAM_NEW`` (the batch's message as its payload; its descriptors when they came with
        the frame, else ``out``'s kept copies, borrowed). A failure of the channel itself raises as
        :meth:`recv` does."""
        lock = self._recv_lock
        # Untimed first: a lock nobody holds (the usual case) costs no timed wait.
        if not lock.acquire(False):
            if timeout is None:
                lock.acquire()
            elif not lock.acquire(timeout=timeout):
                raise BridgeTimeoutError(
                    f"recv timed out after {timeout} s waiting for another receiver",
                    waiting_for="receive",
                    timeout=timeout,
                )
        try:
            if self._closed or self._pid != process.pid:
                self.check_open()
            raw = self._frame
            rx, remembered, lease_tokens, keeper, level = stream
            timeout_ms = millis(timeout)
            rc = lib.aib_stream_rx_next(
                rx, self.raw, remembered, lease_tokens, keeper, level, spin_ns, timeout_ms, out, raw, err
            )
            if rc in _STREAM_DONE:
                return rc, None
            if rc == _STREAM_NEW:
                # Copied under the lock: the payload lies in the channel's buffer until the next receive.
                message = ffi.buffer(out.message, out.message_len)[:]
                fds = [int(raw.fds[i]) for i in range(raw.n_fds)] if out.fds_are_frames else []
                return rc, Frame(int(raw.kind), message, fds)
            if rc == _STREAM_FRAME:
                return rc, frame_from(raw)
            if rc >= _STREAM_NOTHING:  # refused or broken: err says why
                return rc, None
            if rc == lib.AIB_E_TIMEOUT and not lib.aib_channel_mid_frame(self.raw):
                raise error_for(rc, err, "receiving a frame", timeout)
            raise self.failed(rc, err, "receiving a frame", timeout, holding="recv")
        finally:
            self._recv_lock.release()

    def recv_ready(self, poller: Any, *, timeout: float = 1.0) -> Frame | None:
        """The next frame when one has arrived (buffered, or the socket readable by ``poller``, a
        ``select.poll`` with this socket registered), else None at once; None too while another
        thread receives (its receive gets the frame). For a thread that looks for frames between
        other work without sleeping on the socket. ``timeout`` bounds the rest of a frame whose
        first bytes have come; the errors are :meth:`recv`'s."""
        if not self._recv_lock.acquire(False):
            return None
        try:
            if lib.aib_channel_buffered(self.raw) == 0 and not poller.poll(0):
                return None
            self.check_open()
            err = new_error()
            rc = lib.aib_channel_recv(self.raw, millis(timeout), self._frame, err)
            if rc == 0:
                return frame_from(self._frame)
            raise self.failed(rc, err, "receiving a frame", timeout, holding="recv")
        finally:
            self._recv_lock.release()

    def request(self, kind: int, payload: bytes, *, timeout: float | None) -> Frame:
        """Send a request and receive its answer (the session's round trip, one C call).

        The caller serialises requests; the send lock is held too so that lease releases from
        other threads never interleave with the request's bytes.
        """
        err = new_error()
        with self._recv_lock, self._send_lock:
            self.check_open()
            rc = lib.aib_channel_request(
                self.raw, kind, payload, len(payload), millis(timeout), self._frame, err
            )
            if rc:
                raise self.failed(rc, err, "a request", timeout, holding="both", waiting_for="answer")
            return frame_from(self._frame)

    def get(
        self, name: bytes, remembered: Any, lease_tokens: int, keeper: Any, *, board: Any, timeout_ms: int
    ) -> tuple[tuple[int, Any, int, Any, int, int] | None, Frame | None]:
        """The session's GET in one C call (``aib_session_get``); ``timeout_ms`` < 0 blocks.

        ``board``: the publisher's version board mapped here (``board.SessionBoard``), or None.
        Returns ``((remembered message id, lease owner, its address, sync slot or NULL, version,
        flags), None)`` when the name's message is in ``remembered`` (the session's remembered
        messages, ``aib_remembered``) and is imported already: from the board with no round trip
        (``flags & AIB_GET_LOCAL``) or from the answer. The owner is the caller's: wrap it at once;
        it holds the lease (token ``lease_tokens | lease id``) or the message's standing lease, and
        ``keeper``. ``version`` is 0 when the answer did not say it. ``((0, owner, address, slot,
        version, flags), frame)`` when it was a new message the C core imported over regions open
        in this process (``aib_import_new``; the frame is the answer); else ``(None, frame)`` with
        the answer for the caller.
        """
        err = self._err
        result = self._result
        with self._recv_lock, self._send_lock:
            self.check_open()
            rc = lib.aib_session_get(
                self.raw,
                name,
                len(name),
                timeout_ms,
                remembered,
                lease_tokens,
                keeper,
                ffi.NULL if board is None else board.address,
                0 if board is None else board.n_slots,
                result,
                self._frame,
                err,
            )
            if rc in {_GET_IMPORTED, _GET_IMPORTED_NEW}:
                imported = (
                    result.entry_id,
                    result.owner,
                    result.owner_address,
                    result.sync_slot,
                    result.version,
                    result.flags,
                )
                # entry id 0 for a new message: the frame carries the message it imported
                return imported, None if rc == _GET_IMPORTED else frame_from(self._frame)
            if rc:
                timeout = None if timeout_ms < 0 else timeout_ms / 1000
                raise self.failed(rc, err, "a request", timeout, holding="both", waiting_for="answer")
            return None, frame_from(self._frame)

    def quiet(self) -> bool:
        """Whether the channel is open and nothing waits to be read on it: no buffered bytes, the
        socket neither readable nor closed by the peer (``aib_channel_quiet``: one ``poll``)."""
        with self._recv_lock:
            return bool(lib.aib_channel_quiet(self.raw))  # False once closed

    def locked(self) -> tuple[threading.Lock, threading.Lock]:
        """Both locks, for a C call that receives and sends on this channel (the serve loop)."""
        return self._recv_lock, self._send_lock

    def failed(
        self,
        rc: int,
        err: Any,
        what: str,
        timeout: float | None = None,
        *,
        holding: str,
        waiting_for: str = "receive",
    ) -> BridgeError:
        """The exception for a failed call; the connection is closed (the stream position is unknown
        after a failed receive: a timed-out frame is not kept). Call it holding the lock(s) named:
        ``"recv"`` or ``"both"`` (never the send lock alone: the locks are taken receive first)."""
        exc = self._closed_or(
            error_for(rc, err, what, timeout, peer_closed_hint=self.peer_closed_hint, waiting_for=waiting_for)
        )
        farewell = self.farewell
        refused = holding == "recv" and not self._closed and lib.aib_channel_refused(self.raw)
        if farewell is not None and refused:
            try:
                farewell(exc)
            except Exception as failure:  # the peer may be gone or not reading; it is closed either way
                logger.debug("%r: farewell failed: %s", self, failure)
        self._teardown(f"{what} failed: {exc}", holding=holding)
        return exc

    def _closed_or(self, exc: BridgeError) -> BridgeError:
        """``exc``, or the connection's own error when it was closed here meanwhile (a close from
        another thread wakes a blocked call, which then sees what looks like the peer leaving)."""
        if self._closed:
            try:
                self.check_open()
            except BridgeError as closed:
                return closed
        return exc

    # -- the socket's lifetime -------------------------------------------------------------------------

    @property
    def _closed(self) -> bool:
        # The C channel owns the state (aib_channel_mark_closed): the C core's local getter reads it
        # there, under the receive lock, through aib_channel_quiet.
        return bool(lib.aib_channel_closed(self.raw))

    @property
    def closed(self) -> bool:
        """Whether the channel was closed (by :meth:`close`, or after a failure)."""
        return self._closed

    def fileno(self) -> int:
        """The socket's descriptor, or -1 once closed."""
        return self._sock.fileno()

    def check_open(self) -> None:
        """Raise :class:`~arrow_ipc_bridge.errors.PeerClosedError` when the channel is closed,
        :class:`~arrow_ipc_bridge.errors.ClosedError` (``reason="forked"``) in a process other than
        its own."""
        if self._pid != process.pid:
            raise process.foreign("connection", self._pid, "connect again here")
        if self._closed:
            raise PeerClosedError(
                f"the connection is closed ({self._close_reason or 'closed'})", closed_locally=True
            )

    def close(self) -> None:
        """Close the channel and its socket; idempotent, and safe to call from any thread.

        A call in progress in another thread is woken (``shutdown(SHUT_RDWR)``) and raises
        :class:`~arrow_ipc_bridge.errors.PeerClosedError`; the descriptor is closed once those calls
        have let go of it, so its number cannot be reused under them. Descriptors of a partly
        received frame are closed. The peer sees end-of-file.
        """
        self._teardown("closed by close()", holding=None)

    def _teardown(self, reason: str, *, holding: str | None) -> None:
        if self._pid != process.pid:
            # A fork child's copy: shutdown() would end the parent's conversation and the locks may
            # have been held by parent threads at the fork. Only our descriptor goes.
            lib.aib_channel_mark_closed(self.raw)
            self._close_reason = "closed in a forked child"
            self._sock.close()
            return
        with self._state_lock:
            already = bool(lib.aib_channel_mark_closed(self.raw))
            if not already:
                self._close_reason = reason
        if not already:
            # Fails only when the peer is gone already (ENOTCONN): then there is nothing to wake.
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        elif holding is not None:
            # Another thread is closing and may be waiting for the lock this one holds: leave the rest
            # to it rather than wait for each other.
            return
        acquired: list[threading.Lock] = []
        try:
            for name, lock in (("recv", self._recv_lock), ("send", self._send_lock)):
                if holding in (name, "both"):
                    continue
                if lock.acquire(timeout=_CLOSE_WAIT_S):
                    acquired.append(lock)
                else:
                    logger.warning(
                        "%r: a %s call did not end within %s s of shutdown", self, name, _CLOSE_WAIT_S
                    )
            if holding in ("recv", "both") or self._recv_lock in acquired:
                # The descriptors of a partly received frame go now, not when the channel is freed.
                lib.aib_channel_drop(self.raw)
            self._sock.close()
        finally:
            for lock in acquired:
                lock.release()
