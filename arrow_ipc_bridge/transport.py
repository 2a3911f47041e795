"""Framed messages with out-of-band file descriptors over a Unix domain socket.

This is the bottom layer of the bridge: it moves *frames* (a small caller-defined ``kind``, a payload of
bytes and optionally some file descriptors) between two processes on one host. What the kinds and payloads
mean is the business of the session/publisher protocol on top; this module only frames, validates and
delivers them.

Wire format
-----------
Every frame is a fixed 16-byte header followed by the payload. All integers are little-endian::

    offset  size  field
    ------  ----  -----------------------------------------------------------------------
         0     4  magic, the bytes ``b"AIBT"``
         4     2  u16 protocol version, currently ``1`` (:data:`PROTOCOL_VERSION`)
         6     2  u16 frame kind, chosen by the layer above (0..65535)
         8     4  u32 payload length in bytes (at most the receiver's ``max_payload``)
        12     2  u16 number of file descriptors attached (at most :data:`MAX_FDS`)
        14     2  u16 reserved, must be 0
        16     n  payload

The descriptors travel as one ``SCM_RIGHTS`` control message on the ``sendmsg`` call that carries the
first byte of the header; the sender writes header and payload with as few ``sendmsg`` calls as the socket
buffer allows (normally one), and never puts bytes of two frames in one call.

The receiver reads the stream through a per-connection buffer (64 KiB, or less with a small
``max_payload``), so one ``recvmsg`` usually brings a whole frame, or several. A larger frame is read into a
buffer of exactly its payload size. Linux ends a ``recvmsg`` on a stream socket after the first send that
carried descriptors, so descriptors belong to the frame that holds the last byte of the read that brought
them: with the sending rule above, that is always the frame they were sent with. A frame whose
descriptors do not add up to its header's count is a protocol error.

Timeouts
--------
``timeout=None`` blocks; a number is the limit for the whole call, not per system call. A frame partly
received when :meth:`Connection.recv` times out is kept and completed by the next call. A
:meth:`Connection.send` that times out after part of its frame went out closes the connection (the peer
would misread what follows); one that sent nothing leaves it usable.

Trust
-----
Nothing the peer sends is trusted. The header is validated before anything is allocated for the payload
(never more than ``max_payload`` bytes); descriptors are received with ``MSG_CMSG_CLOEXEC`` and are closed
again before raising if the frame is bad, if more arrive than the header announced, if fewer arrive, or if
the kernel had to truncate them (``MSG_CTRUNC``). After a :class:`~arrow_ipc_bridge.errors.ProtocolError`
the stream is out of sync, so the connection is closed.

Errors
------
* the peer closed or died (EOF at a frame boundary, ``ECONNRESET``, ``EPIPE``) and any use of a connection
  that was closed locally: :class:`~arrow_ipc_bridge.errors.PeerClosedError` (``closed_locally=True`` for
  the latter);
* a malformed frame (bad magic, version or reserved field, length or descriptor count over a limit, wrong
  number of descriptors, EOF in the middle of a frame): :class:`~arrow_ipc_bridge.errors.ProtocolError`;
* a wait past its timeout: :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError`;
* cannot connect or bind (no such path, refused, path held by a live server, not a socket):
  :class:`~arrow_ipc_bridge.errors.TransportError`;
* an invalid frame handed to :meth:`Connection.send` (kind out of range, payload over the limit, too many
  or invalid descriptors) or an invalid limit: :class:`~arrow_ipc_bridge.errors.WireFormatError` (a
  ``ValueError``); nothing is sent and the connection stays usable.

A client whose uid a :class:`Server` does not allow is disconnected right after ``accept``, after the
server's ``farewell`` (the publisher's: an ERROR frame naming
:class:`~arrow_ipc_bridge.errors.PeerRejectedError`); without a farewell it sees
:class:`~arrow_ipc_bridge.errors.PeerClosedError` on its first :meth:`Connection.recv`.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import logging
import math
import os
import select
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final

from . import _process
from .errors import (
    BridgeError,
    BridgeTimeoutError,
    ConnectionLimitError,
    HandshakeTimeoutError,
    PeerClosedError,
    PeerRejectedError,
    ProtocolError,
    TransportError,
    WireFormatError,
)

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "HEADER_SIZE",
    "MAX_PAYLOAD",
    "MAX_FDS",
    "Frame",
    "Connection",
    "connect",
    "Server",
    "PARK",
]

logger = logging.getLogger(__name__)

MAGIC = b"AIBT"
PROTOCOL_VERSION = 1
MAX_PAYLOAD = 64 * 1024 * 1024
"""Default limit on a frame's payload, in bytes; ``max_payload`` arguments override it."""
MAX_FDS = 253
"""Most descriptors one frame may carry (the kernel's ``SCM_MAX_FD``)."""

_HEADER = struct.Struct("<4sHHIHH")
HEADER_SIZE = _HEADER.size
_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_FD_SIZE = array.array("i").itemsize
# Room for the largest legal SCM_RIGHTS message: a smaller buffer would make the kernel truncate (and
# silently close) descriptors of a legal frame, which we could only report, not recover.
_ANCBUFSIZE = socket.CMSG_SPACE(MAX_FDS * _FD_SIZE)
# Plain ints: the socket module's MSG_* constants are enum members, and enum arithmetic on every call
# costs more than the system call itself.
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SCM_RIGHTS = int(socket.SCM_RIGHTS)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_RECV_FLAGS = int(socket.MSG_CMSG_CLOEXEC)  # received descriptors never leak into a child we exec
_RECV_FLAGS_NOWAIT = _RECV_FLAGS | int(socket.MSG_DONTWAIT)
_SEND_FLAGS = int(socket.MSG_NOSIGNAL)  # EPIPE instead of a SIGPIPE that would kill the process
_SEND_FLAGS_NOWAIT = _SEND_FLAGS | int(socket.MSG_DONTWAIT)
# Frames up to this size (header included) are read through a per-connection receive buffer, usually
# whole in one system call; a larger payload is read into a bytearray of exactly the announced size.
_RECV_BUFFER = 64 * 1024
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
# The socket file's mode: the owner only, unless other uids are allowed. connect() on a Unix socket
# needs write permission on the file, so a listed uid could not connect through 0600; with other
# uids allowed the file is 0666 and SO_PEERCRED (checked on every accepted connection) is the gate.
_SOCKET_MODE_OWNER = 0o600
_SOCKET_MODE_SHARED = 0o666
# close() waits this long for a send/recv in progress to notice the shutdown before it closes the fd
# anyway. shutdown() wakes every blocked socket call at once, so this is only a safety net.
_CLOSE_WAIT_S = 5.0
_PEER_GONE_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ESHUTDOWN})
_ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _check_max_payload(max_payload: int) -> int:
    if isinstance(max_payload, bool) or not isinstance(max_payload, int) or not 0 <= max_payload <= _U32_MAX:
        raise WireFormatError(
            f"max_payload must be an int in 0..{_U32_MAX} (the u32 length field), got {max_payload!r}",
            field="max_payload",
        )
    return max_payload


def _close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        # try/except rather than contextlib.suppress: this runs for every received descriptor.
        try:
            os.close(fd)
        except OSError:
            continue  # already closed by its owner: keep going so the rest are not leaked


def _fds_in(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors of the SCM_RIGHTS messages in ``ancdata``."""
    if len(ancdata) == 1:  # the usual case, in one step
        level, ctype, cdata = ancdata[0]
        if level == _SOL_SOCKET and ctype == _SCM_RIGHTS and not len(cdata) % _FD_SIZE:
            return array.array("i", cdata).tolist()
    fds: list[int] = []
    for level, ctype, cdata in ancdata:
        if level == _SOL_SOCKET and ctype == _SCM_RIGHTS:
            fds.extend(array.array("i", cdata[: len(cdata) - len(cdata) % _FD_SIZE]))
    return fds


def _truncated_error() -> ProtocolError:
    return ProtocolError(
        "descriptors were truncated by the kernel (more than fit, or this process is out of descriptors: "
        "check RLIMIT_NOFILE)",
        field="fds",
    )


def _fd_count_error(announced: int, received: int) -> ProtocolError:
    if received > announced:
        return ProtocolError(
            f"more descriptors arrived ({received}) than the header announced ({announced})", field="fds"
        )
    return ProtocolError(f"the header announced {announced} descriptors but {received} arrived", field="fds")


_NO_ANCDATA: tuple[tuple[int, int, array.array[int]], ...] = ()


def _payload_view(payload: bytes | bytearray | memoryview) -> tuple[memoryview, int]:
    view = memoryview(payload)
    if not view.c_contiguous:
        raise WireFormatError("the payload must be a C-contiguous buffer", field="payload")
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view, view.nbytes


def _check_kind(kind: object) -> int:
    # Int subclasses (an IntEnum of message kinds) are fine; bool is an int subclass but surely a mistake.
    if isinstance(kind, bool) or not isinstance(kind, int) or not 0 <= kind <= _U16_MAX:
        raise WireFormatError(f"frame kind must be an int in 0..{_U16_MAX}, got {kind!r}", field="kind")
    return int(kind)


def _fd_ancillary(fds: Sequence[int]) -> tuple[tuple[int, int, array.array[int]], ...]:
    if len(fds) > MAX_FDS:
        raise WireFormatError(f"{len(fds)} descriptors in one frame, at most {MAX_FDS}", field="fds")
    try:
        fd_array = array.array("i", fds)
    except (TypeError, OverflowError) as exc:
        raise WireFormatError(f"fds must be descriptor numbers: {exc}", field="fds") from exc
    if min(fd_array) < 0:
        raise WireFormatError(f"negative descriptor in {list(fds)!r}", field="fds")
    return ((_SOL_SOCKET, _SCM_RIGHTS, fd_array),)


@dataclass(slots=True)
class Frame:
    """One received frame.

    Parameters
    ----------
    kind:
        The caller-defined frame kind (0..65535).
    payload:
        The payload, as a bytes object of its own (copied out of the receive buffer: for the small
        metadata messages this transport is meant for, the copy costs far less than a system call).
    fds:
        Descriptors that came with the frame, in the order the sender listed them. They are new descriptors
        owned by the receiver, with ``FD_CLOEXEC`` set: close them with :meth:`close_fds` (or use the frame
        as a context manager), or take one over by removing it from the list (``frame.fds.pop(i)``).
    """

    kind: int
    payload: bytes
    fds: list[int] = field(default_factory=list)

    def close_fds(self) -> None:
        """Close every descriptor still in :attr:`fds` and empty the list; calling it again does nothing."""
        fds, self.fds = self.fds, []
        _close_fds(fds)

    def __enter__(self) -> Frame:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close_fds()


class Connection:
    """A framed, bidirectional message channel over a connected ``AF_UNIX`` ``SOCK_STREAM`` socket.

    One lock serialises senders and another receivers, so one reader thread and any number of writer
    threads can share a connection; frames from concurrent senders never interleave on the wire.

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

    Raises
    ------
    TransportError
        ``sock`` is not a connected Unix stream socket.
    """

    def __init__(self, sock: socket.socket, *, max_payload: int = MAX_PAYLOAD) -> None:
        self._max_payload = _check_max_payload(max_payload)
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            raise TransportError(f"Connection needs an AF_UNIX SOCK_STREAM socket, got {sock!r}")
        try:
            sock.getpeername()  # ENOTCONN for a socket that is not connected
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            # Blocking mode: an untimed call is then one system call. Timed calls use MSG_DONTWAIT per
            # call plus poll(), so the mode never has to be switched back and forth.
            sock.setblocking(True)
        except OSError as exc:
            raise TransportError(f"Connection needs a connected Unix stream socket: {exc}") from exc
        self.peer_pid, self.peer_uid, self.peer_gid = _UCRED.unpack(creds)
        self._sock = sock
        self._fd = sock.fileno()
        # A forked child inherits this object and the socket, but the conversation is the parent's.
        self._pid = _process.pid

        self._state_lock = threading.Lock()
        self._closed = False
        self._close_reason = ""

        self._send_lock = threading.Lock()
        self._send_hdr = bytearray(HEADER_SIZE)
        self._send_poll: select.poll | None = None

        self._recv_lock = threading.Lock()
        self._recv_poll: select.poll | None = None
        # Receive state, kept between calls so that a timeout never loses part of a frame: the next recv()
        # carries on where the timed-out one stopped. A buffer larger than any valid frame is pointless.
        # Allocated by the first recv(): a server's connections hand their receiving side to the C
        # channel at once, and 64 KiB of zeroed memory each would be most of what an idle one costs.
        self._rbuf_size = min(_RECV_BUFFER, HEADER_SIZE + self._max_payload)
        self._rbuf = bytearray()
        self._rview = memoryview(self._rbuf)
        self._rstart = 0  # first byte not yet handed out
        self._rend = 0  # end of the bytes received
        # Descriptors received but not yet handed out, each group with the buffer offset of the last byte
        # of the read that brought it.
        self._fd_groups: list[tuple[int, list[int]]] = []
        # A frame too large for the buffer is received into a bytearray of its own exact size.
        self._big: bytearray | None = None
        self._big_got = 0
        self._big_fds: list[int] = []
        self._kind = 0
        self._nfds = 0
        self._handed_over = False  # hand_over_receive(): the C channel receives now

    # -- properties ------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the connection was closed (by :meth:`close`, or after a protocol error)."""
        return self._closed

    @property
    def max_payload(self) -> int:
        """The payload limit, in bytes, of this connection."""
        return self._max_payload

    def fileno(self) -> int:
        """The socket's descriptor (for ``selectors``), or -1 once closed."""
        return self._sock.fileno()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self._fd}"
        return f"<Connection {state} peer_pid={self.peer_pid} peer_uid={self.peer_uid}>"

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped without close(): the socket object closes itself (with a ResourceWarning), but the
        # descriptors of a partly received frame would leak.
        try:
            fds = [fd for _, group in self._fd_groups for fd in group] + self._big_fds
        except AttributeError:  # __init__ failed before the receive state existed
            return
        if fds:
            # At interpreter shutdown module globals may already be gone; cleanup never raises.
            with contextlib.suppress(Exception):
                _close_fds(fds)

    # -- send ------------------------------------------------------------------------------------------

    def send(
        self,
        kind: int,
        payload: bytes | bytearray | memoryview = b"",
        fds: Sequence[int] = (),
        *,
        timeout: float | None = None,
    ) -> None:
        """Send one frame.

        Parameters
        ----------
        kind:
            Frame kind, 0..65535; its meaning is up to the caller.
        payload:
            The payload; any C-contiguous buffer. At most :attr:`max_payload` bytes.
        fds:
            Descriptors to pass (at most :data:`MAX_FDS`). The kernel duplicates them into the peer; the
            caller keeps ownership of its own copies and may close them as soon as this returns.
        timeout:
            Seconds to wait for the send lock and for room in the socket buffer, for the whole frame;
            ``None`` waits as long as it takes.

        Raises
        ------
        WireFormatError
            The frame is invalid (nothing was sent; the connection stays usable).
        BridgeTimeoutError
            The timeout passed. If part of the frame had already gone out, the stream is out of sync and
            the connection is closed; otherwise it stays usable.
        PeerClosedError
            The peer closed the connection, or this connection was closed.
        TransportError
            Any other socket failure.
        """
        # The common case (bytes payload, int kind, no timeout) runs straight through: this is the per-frame
        # cost that the round-trip latency is made of.
        if payload.__class__ is bytes:
            data: bytes | memoryview = payload
            size = len(payload)
        else:
            data, size = _payload_view(payload)
        if kind.__class__ is not int or not 0 <= kind <= _U16_MAX:
            kind = _check_kind(kind)
        if size > self._max_payload:
            raise WireFormatError(
                f"payload of {size} bytes is over this connection's limit of {self._max_payload} bytes",
                field="payload",
            )
        if fds:
            ancdata = _fd_ancillary(fds)
            nfds = len(fds)
        else:
            ancdata = _NO_ANCDATA
            nfds = 0

        if timeout is None:
            deadline = None
            flags = _SEND_FLAGS
            self._send_lock.acquire()
        else:
            timeout = max(float(timeout), 0.0)
            deadline = time.monotonic() + timeout
            flags = _SEND_FLAGS_NOWAIT
            if not self._send_lock.acquire(timeout=timeout):
                raise BridgeTimeoutError(
                    f"send timed out after {timeout} s waiting for another sender", timeout=timeout
                )
        try:
            if self._closed:
                raise self._closed_error()
            hdr = self._send_hdr
            _HEADER.pack_into(hdr, 0, MAGIC, PROTOCOL_VERSION, kind, size, nfds, 0)
            try:
                sent = self._sock.sendmsg((hdr, data) if size else (hdr,), ancdata, flags)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                # A failed sendmsg sent nothing: the connection stays in sync.
                raise self._send_error(exc, fds) from exc
            except BaseException:
                # Interrupted (KeyboardInterrupt from a signal handler): whether part of the frame went
                # out cannot be known, so the stream cannot be trusted any more.
                self._teardown("a send was interrupted", holding="send")
                raise
            if sent != HEADER_SIZE + size:
                self._send_rest(
                    sent,
                    data,
                    size,
                    ancdata=ancdata,
                    fds=fds,
                    flags=flags,
                    deadline=deadline,
                    timeout=timeout,
                )
        finally:
            self._send_lock.release()

    def _send_rest(
        self,
        sent: int,
        data: bytes | memoryview,
        size: int,
        *,
        ancdata: Sequence[tuple[int, int, array.array[int]]],
        fds: Sequence[int],
        flags: int,
        deadline: float | None,
        timeout: float | None,
    ) -> None:
        """Finish a frame the first sendmsg() could not send whole (the socket buffer was full)."""
        total = HEADER_SIZE + size
        hdr = self._send_hdr
        try:
            while sent < total:
                self._send_poll = self._wait(self._send_poll, select.POLLOUT, deadline, timeout, "send")
                if sent == 0:  # nothing went out yet: the descriptors still have to go with the header
                    buffers: tuple[bytes | bytearray | memoryview, ...] = (hdr, data) if size else (hdr,)
                    anc = ancdata
                elif sent < HEADER_SIZE:
                    buffers = (memoryview(hdr)[sent:], data) if size else (memoryview(hdr)[sent:],)
                    anc = _NO_ANCDATA
                else:
                    buffers = (memoryview(data)[sent - HEADER_SIZE :],)
                    anc = _NO_ANCDATA
                try:
                    sent += self._sock.sendmsg(buffers, anc, flags)
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise (self._send_error(exc, fds) if sent == 0 else self._os_error(exc, "send")) from exc
        except BaseException as exc:
            if sent:
                # Part of the frame is on the wire: the peer would read the next frame's bytes as the rest
                # of this one. The only safe thing left is to end the stream.
                self._teardown(f"a send failed mid-frame ({exc.__class__.__name__})", holding="send")
            raise

    def _send_error(self, exc: OSError, fds: Sequence[int]) -> BridgeError:
        if fds and exc.errno == errno.EBADF and not self._is_closed():
            return WireFormatError(f"one of the descriptors {list(fds)!r} is not open", field="fds")
        return self._os_error(exc, "send")

    # -- recv ------------------------------------------------------------------------------------------

    def recv(self, *, timeout: float | None = None) -> Frame:
        """Receive the next frame.

        Parameters
        ----------
        timeout:
            Seconds to wait for the whole frame (not per system call); ``None`` blocks. A frame that is
            only partly in when the time runs out is kept, and the next call completes it.

        Returns
        -------
        Frame
            The frame; the caller owns (and must close) its :attr:`Frame.fds`.

        Raises
        ------
        PeerClosedError
            The peer closed the connection at a frame boundary or died, or this connection was closed
            (also from another thread while this call waited).
        ProtocolError
            The peer broke the protocol (see the module docstring). Received descriptors were closed and
            the connection is closed.
        BridgeTimeoutError
            No complete frame within ``timeout``.
        TransportError
            Any other socket failure (the connection is closed).
        """
        if timeout is None:
            deadline = None
            self._recv_lock.acquire()
        else:
            timeout = max(float(timeout), 0.0)
            deadline = time.monotonic() + timeout
            if not self._recv_lock.acquire(timeout=timeout):
                raise BridgeTimeoutError(
                    f"recv timed out after {timeout} s waiting for another receiver", timeout=timeout
                )
        try:
            if self._closed:
                raise self._closed_error()
            if self._handed_over:
                raise BridgeError("this connection's receiving side was handed over to a C channel")
            if not self._rbuf:
                self._rbuf = bytearray(self._rbuf_size)
                self._rview = memoryview(self._rbuf)
            try:
                return self._recv_frame(deadline, timeout)
            except BridgeTimeoutError:
                raise  # the partial frame stays for the next call
            except PeerClosedError as exc:
                if self._is_closed():
                    self._drop_partial()
                    raise self._closed_error() from None
                got = self._partial()
                if got or self._fd_groups:
                    self._teardown("the peer closed it in the middle of a frame", holding="recv")
                    raise ProtocolError(
                        f"the peer closed the connection in the middle of a frame ({got} bytes in)",
                        truncated=True,
                    ) from exc
                raise
            except ProtocolError as exc:
                self._teardown(f"protocol error: {exc.message}", holding="recv")
                raise
            except Exception as exc:
                self._teardown(f"receive failed: {exc}", holding="recv")
                raise
        finally:
            self._recv_lock.release()

    def _recv_frame(self, deadline: float | None, timeout: float | None) -> Frame:
        # Frames up to the size of the receive buffer are read into it, as many bytes as are there, so one
        # recvmsg() usually brings a whole frame (or several). Per frame this costs one system call, a
        # header unpack and one copy of the payload into its bytes object; the loop is written out in one
        # function because each Python call saved is a visible share of a round trip.
        rbuf = self._rbuf
        flags = _RECV_FLAGS if deadline is None else _RECV_FLAGS_NOWAIT
        while True:
            if self._big is not None:
                return self._recv_big(deadline, timeout)
            start = self._rstart
            rend = self._rend
            if rend - start >= HEADER_SIZE:
                magic, version, kind, size, nfds, reserved = _HEADER.unpack_from(rbuf, start)
                # Validate the header before anything is allocated for the payload.
                if (
                    magic != MAGIC
                    or version != PROTOCOL_VERSION
                    or reserved
                    or size > self._max_payload
                    or nfds > MAX_FDS
                ):
                    raise self._header_error(start)
                end = start + HEADER_SIZE + size
                if end <= rend:
                    fds = self._frame_fds(end) if self._fd_groups else []
                    if len(fds) != nfds:
                        _close_fds(fds)
                        raise _fd_count_error(nfds, len(fds))
                    payload = self._rview[start + HEADER_SIZE : end].tobytes() if size else b""
                    if end == rend:
                        self._rstart = self._rend = 0
                    else:
                        self._rstart = end
                    return Frame(kind, payload, fds)
                if HEADER_SIZE + size > len(rbuf):
                    self._start_big(start, kind, size, nfds)
                    continue
                if end > len(rbuf):
                    self._compact()
            elif start + HEADER_SIZE > len(rbuf):
                self._compact()

            # Read what is there into the free end of the buffer (blocking for the first byte if untimed).
            try:
                n, ancdata, msg_flags, _ = self._sock.recvmsg_into(
                    (self._rview[self._rend :],), _ANCBUFSIZE, flags
                )
            except BlockingIOError:
                self._recv_poll = self._wait(self._recv_poll, select.POLLIN, deadline, timeout, "recv")
                continue
            except OSError as exc:
                raise self._os_error(exc, "recv") from exc
            if not n:
                raise PeerClosedError("the peer closed the connection")
            self._rend += n
            if ancdata or msg_flags & _MSG_CTRUNC:
                # The kernel returns the bytes of consecutive sends up to and including the first one
                # that carried descriptors, and stops there: so the descriptors belong to the frame that
                # holds the last byte of this read. (A sender attaches them to the send that starts a
                # frame.)
                self._fd_groups.append((self._rend - 1, _fds_in(ancdata)))
                if msg_flags & _MSG_CTRUNC:
                    raise _truncated_error()
                if len(self._fd_groups) > 1:  # one group is at most SCM_MAX_FD == MAX_FDS descriptors
                    self._check_pending_fds()

    def _check_pending_fds(self) -> None:
        # Whether a frame got exactly the descriptors it announced is checked when it is complete; this
        # only bounds what a peer can pile up before that. Frames are handed out as soon as they are
        # complete, so a legal stream has descriptors pending for at most the current frame and the next.
        pending = sum(len(fds) for _, fds in self._fd_groups)
        if pending > 2 * MAX_FDS:
            raise ProtocolError(f"{pending} descriptors arrived for incomplete frames", field="fds")

    def _frame_fds(self, end: int) -> list[int]:
        """Take the descriptors of the frame that ends at ``end`` out of the pending groups."""
        groups = self._fd_groups
        if len(groups) == 1 and groups[0][0] < end:  # the usual case
            return groups.pop()[1]
        fds: list[int] = []
        while groups and groups[0][0] < end:
            fds.extend(groups.pop(0)[1])
        return fds

    def _compact(self) -> None:
        """Move the unconsumed bytes to the front of the receive buffer to make room behind them."""
        start, end = self._rstart, self._rend
        # Through a copy: bytearray slice assignment from a view of itself is a plain memcpy, and the two
        # ranges may overlap. This runs at most once per frame that straddles the end of the buffer.
        self._rbuf[: end - start] = self._rview[start:end].tobytes()
        self._rstart, self._rend = 0, end - start
        self._fd_groups = [(offset - start, fds) for offset, fds in self._fd_groups]

    def _start_big(self, start: int, kind: int, size: int, nfds: int) -> None:
        """Switch a frame too large for the receive buffer to a buffer of its exact payload size."""
        have = self._rend - start - HEADER_SIZE
        big = bytearray(size)  # size was validated against max_payload
        big[:have] = self._rview[start + HEADER_SIZE : self._rend]
        # Everything buffered belongs to this (incomplete) frame, descriptors included.
        fds = [fd for _, group in self._fd_groups for fd in group]
        self._fd_groups = []
        self._big, self._big_got, self._big_fds = big, have, fds
        self._kind, self._nfds = kind, nfds
        self._rstart = self._rend = 0
        if len(fds) > nfds:
            raise _fd_count_error(nfds, len(fds))

    def _recv_big(self, deadline: float | None, timeout: float | None) -> Frame:
        """Receive the rest of a large frame straight into its own buffer, never past its end."""
        big = self._big
        assert big is not None
        view = memoryview(big)
        size = len(big)
        flags = _RECV_FLAGS if deadline is None else _RECV_FLAGS_NOWAIT
        while self._big_got < size:
            try:
                n, ancdata, msg_flags, _ = self._sock.recvmsg_into(
                    (view[self._big_got :],), _ANCBUFSIZE, flags
                )
            except BlockingIOError:
                self._recv_poll = self._wait(self._recv_poll, select.POLLIN, deadline, timeout, "recv")
                continue
            except OSError as exc:
                raise self._os_error(exc, "recv") from exc
            if ancdata or msg_flags & _MSG_CTRUNC:
                # Into the frame's list before any check, so that every error path closes them.
                self._big_fds.extend(_fds_in(ancdata))
                if msg_flags & _MSG_CTRUNC:
                    raise _truncated_error()
            if len(self._big_fds) > self._nfds:
                raise _fd_count_error(self._nfds, len(self._big_fds))
            if not n:
                raise PeerClosedError("the peer closed the connection")
            self._big_got += n
        fds, nfds = self._big_fds, self._nfds
        if len(fds) != nfds:
            raise _fd_count_error(nfds, len(fds))
        view.release()
        self._big, self._big_got, self._big_fds = None, 0, []
        # One copy, to hand out an immutable bytes object; large payloads are rare on this channel.
        return Frame(self._kind, bytes(big), fds)

    def _header_error(self, start: int) -> ProtocolError:
        magic, version, _, size, nfds, reserved = _HEADER.unpack_from(self._rbuf, start)
        if magic != MAGIC:
            return ProtocolError(
                f"bad magic {magic!r} (expected {MAGIC!r}): not a bridge peer", field="magic"
            )
        if version != PROTOCOL_VERSION:
            return ProtocolError(
                f"peer speaks protocol version {version}, this side speaks {PROTOCOL_VERSION}",
                field="version",
            )
        if reserved:
            return ProtocolError(f"reserved header field is {reserved}, must be 0", field="reserved")
        if nfds > MAX_FDS:
            return ProtocolError(f"frame announces {nfds} descriptors, at most {MAX_FDS}", field="fds")
        return ProtocolError(
            f"frame announces a payload of {size} bytes, over the limit of {self._max_payload}",
            field="length",
        )

    def _partial(self) -> int:
        """Bytes of an incomplete frame held (0: the stream is at a frame boundary)."""
        return self._rend - self._rstart + (HEADER_SIZE + self._big_got if self._big is not None else 0)

    def _drop_partial(self) -> None:
        fds = [fd for _, group in self._fd_groups for fd in group] + self._big_fds
        self._fd_groups = []
        self._big_fds = []
        self._big = None
        self._big_got = 0
        self._rstart = self._rend = 0
        _close_fds(fds)

    # -- shared helpers --------------------------------------------------------------------------------

    def _wait(
        self, poller: select.poll | None, event: int, deadline: float | None, timeout: float | None, op: str
    ) -> select.poll:
        if poller is None:
            # One poll object per direction, made on first need: an untimed call never needs one, and a
            # poll object may not be used by two threads at once.
            poller = select.poll()
            poller.register(self._fd, event)
        if deadline is None:
            poller.poll()
            return poller
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BridgeTimeoutError(f"{op} timed out after {timeout} s", timeout=timeout)
        # Round up: poll() takes whole milliseconds and a 0 would spin until the deadline.
        poller.poll(math.ceil(remaining * 1000))
        return poller

    def _os_error(self, exc: OSError, op: str) -> BridgeError:
        if self._closed:
            return self._closed_error()
        if exc.errno in _PEER_GONE_ERRNOS:
            return PeerClosedError(f"the peer closed the connection ({exc.strerror})", errno=exc.errno)
        return TransportError(f"{op} failed on {self!r}: {exc}", errno=exc.errno)

    def _is_closed(self) -> bool:
        # A call, not the attribute: another thread may have closed the connection since the last look,
        # which a type checker narrowing `self._closed` cannot know.
        return self._closed

    def _closed_error(self) -> PeerClosedError:
        return PeerClosedError(
            f"the connection is closed ({self._close_reason or 'closed'})", closed_locally=True
        )

    # -- handing the socket to the C channel ------------------------------------------------------------

    def hand_over_receive(self) -> bytes:
        """Stop receiving here and return the bytes already buffered, for the C core's channel
        (``arrow_ipc_bridge.channel``) to carry on from. Later :meth:`recv` calls raise.

        Raises :class:`~arrow_ipc_bridge.errors.ProtocolError` when a frame with descriptors or a
        large frame is partly received (nothing the publisher/session protocol produces).
        """
        with self._recv_lock:
            if self._fd_groups or self._big is not None:
                raise ProtocolError("cannot hand over a connection in the middle of a frame")
            data = bytes(self._rview[self._rstart : self._rend])
            self._rstart = self._rend = 0
            self._handed_over = True
            return data

    def io_locks(self) -> tuple[threading.Lock, threading.Lock]:
        """The receive and send locks, for calls made on the socket elsewhere (the C channel): hold
        them around each call, so that :meth:`close` waits for it before closing the descriptor,
        and check :meth:`check_open` once holding them."""
        return self._recv_lock, self._send_lock

    def check_open(self) -> None:
        """Raise :class:`~arrow_ipc_bridge.errors.PeerClosedError` when the connection is closed,
        :class:`~arrow_ipc_bridge.errors.ForeignProcessError` in a process other than its own."""
        if self._pid != _process.pid:
            raise _process.foreign("connection", self._pid, "connect again here")
        if self._closed:
            raise self._closed_error()

    def abort(self, reason: str, *, holding: str) -> None:
        """Close the connection while holding its :meth:`io_locks` (the stream is out of sync);
        ``holding`` is ``"recv"``, ``"send"`` or ``"both"``."""
        self._teardown(reason, holding=holding)

    # -- close -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection; idempotent, and safe to call from any thread.

        A :meth:`recv` or :meth:`send` in progress in another thread is woken (``shutdown(SHUT_RDWR)``) and
        raises :class:`~arrow_ipc_bridge.errors.PeerClosedError`; the descriptor is closed once those calls
        have let go of it, so its number cannot be reused under them. Descriptors of a partly received
        frame are closed. The peer sees end-of-file.
        """
        self._teardown("closed by close()", holding=None)

    def _teardown(self, reason: str, *, holding: str | None) -> None:
        if self._pid != _process.pid:
            # A fork child's copy: shutdown() would end the parent's conversation and the locks may
            # have been held by parent threads at the fork. Only our descriptor goes.
            self._closed = True
            self._close_reason = "closed in a forked child"
            self._sock.close()
            return
        with self._state_lock:
            already = self._closed
            if not already:
                self._closed = True
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
                self._drop_partial()
            self._sock.close()
        finally:
            for lock in acquired:
                lock.release()


def connect(
    path: str | os.PathLike[str], *, timeout: float = 5.0, max_payload: int = MAX_PAYLOAD
) -> Connection:
    """Connect to the :class:`Server` listening on ``path``.

    Parameters
    ----------
    path:
        The server's socket file.
    timeout:
        Seconds to keep trying while the server's accept queue is full.
    max_payload:
        Payload limit of the new connection, in bytes.

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
        The server did not take the connection within ``timeout``.
    """
    max_payload = _check_max_payload(max_payload)
    spath = os.fspath(path)
    deadline = time.monotonic() + max(timeout, 0.0)
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
        return Connection(sock, max_payload=max_payload)
    except BaseException:
        sock.close()
        raise


def _describe_refused(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "connection refused, no publisher is running there"
    if not stat.S_ISSOCK(st.st_mode):
        return "the path is not a socket, no publisher is running there"
    return "connection refused, no publisher is running there (a stale socket file from a server that died)"


class _Park:
    """The type of :data:`PARK`."""

    def __repr__(self) -> str:
        return "PARK"


PARK: Final = _Park()
"""What a :class:`Server` handler returns to give its thread back while keeping its connection
(``park=True``): the connection waits in the parking lot, and the handler is called again, on a new
thread, when the connection has something to read."""


@dataclass(slots=True, eq=False)
class _Slot:
    """What the server knows of one admitted connection."""

    thread: threading.Thread | None = None  # None while parked
    deadline: float | None = None  # handshake deadline (time.monotonic()), None once established


class Server:
    """Accept connections on a Unix socket and serve them on threads.

    The socket file is created with mode 0600, or 0666 when uids other than this process's are
    allowed (connecting needs write permission on the file); either way only peers whose
    ``SO_PEERCRED`` uid is allowed are served: others get the ``farewell`` and are disconnected at
    once, counted in :attr:`rejected_connections`. Each accepted connection runs ``handler(conn)`` on a
    daemon thread; when the handler returns (anything but :data:`PARK`) or raises, the connection is
    closed. A handler that raises closes only its own connection, never the server:
    :class:`~arrow_ipc_bridge.errors.PeerClosedError` is logged at debug level, other
    :class:`~arrow_ipc_bridge.errors.BridgeError` and ``OSError`` at warning level, anything else with its
    traceback at error level.

    With ``park=True`` a connection costs a thread only while it has work: a new connection waits in
    the *parking lot* (the accept thread's selector) until it is readable, and a handler that returns
    :data:`PARK` gives its thread back and is called again, on a new thread, when the connection is
    readable again. Threads are then the connections being served plus one.

    Parameters
    ----------
    path:
        Where to create the socket file. A stale socket file (nobody accepts on it) is replaced; a path
        where a server is listening, or that is not a socket, is refused. Only filesystem paths are
        supported (no abstract namespace), and ``AF_UNIX`` limits them to about 107 bytes.
    handler:
        Called with each accepted :class:`Connection`, on a thread of its own.
    allowed_uids:
        Uids allowed to connect, in addition to this process's uid (see ``include_owner``).
    include_owner:
        When true (the default) this process's own uid is always allowed. Pass ``False`` to make
        ``allowed_uids`` the complete list (an empty list then rejects everybody).
    backlog:
        Length of the kernel's queue of connections not yet accepted.
    max_payload:
        Payload limit, in bytes, of every accepted connection.
    name:
        Prefix of the server's thread names, and its name in log messages.
    max_connections:
        Most connections served at once (``None``: no limit); one more gets the ``farewell`` with
        :class:`~arrow_ipc_bridge.errors.ConnectionLimitError` and is closed.
    handshake_timeout:
        Seconds a connection has from its accept until the handler calls :meth:`established`
        (``None``: no limit). A parked connection past it gets the ``farewell`` with
        :class:`~arrow_ipc_bridge.errors.HandshakeTimeoutError` and is closed; a handler running
        meanwhile reads the deadline with :meth:`handshake_deadline` and enforces it itself.
    park:
        Give threads only to connections with something to read (above).
    farewell:
        Called with a connection the server refuses or drops (uid not allowed, over
        ``max_connections``, handshake timeout) and the error that says why, just before it is
        closed: the place to tell the client in the protocol's words. It must not block.
    on_close:
        Called once for every admitted connection, after it was closed and while no handler runs for
        it: the place to free what the handler kept for it between calls.

    Raises
    ------
    TransportError
        The path is held by a live server or by something that is not a socket, or binding failed (no such
        directory, permission denied, path too long).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler: Callable[[Connection], object],
        *,
        allowed_uids: Iterable[int] | None = None,
        include_owner: bool = True,
        backlog: int = 128,
        max_payload: int = MAX_PAYLOAD,
        name: str = "aib-server",
        max_connections: int | None = None,
        handshake_timeout: float | None = None,
        park: bool = False,
        farewell: Callable[[Connection, BridgeError], object] | None = None,
        on_close: Callable[[Connection], object] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.name = name
        self._handler = handler
        self._max_payload = _check_max_payload(max_payload)
        uids = {int(uid) for uid in allowed_uids} if allowed_uids is not None else set()
        if include_owner:
            uids.add(os.getuid())
        self._allowed_uids = frozenset(uids)
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 or None, not {max_connections!r}")
        if handshake_timeout is not None and not handshake_timeout > 0:
            raise ValueError(f"handshake_timeout must be > 0 seconds or None, not {handshake_timeout!r}")
        self._max_connections = max_connections
        self._handshake_timeout = handshake_timeout
        self._park = park
        self._farewell = farewell
        self._on_close = on_close

        self._lock = threading.Lock()
        self._closing = False
        self._pid = _process.pid
        self._stop = threading.Event()
        self._conns: dict[Connection, _Slot] = {}
        self._to_park: list[Connection] = []  # handed back by handlers; registered by the accept thread
        # Registered in the selector, with the descriptor they were registered under (accept thread
        # only): unregistering by that number works even if the connection was closed meanwhile.
        self._parked: dict[Connection, int] = {}
        # Parked connections that have not completed their handshake -> its deadline (accept thread
        # only): what the selector's timeout is computed from, without a look at every parked one.
        self._handshaking: dict[Connection, float] = {}
        self._rejected = 0
        self._over_limit = 0
        self._timed_out = 0
        self._accepted = 0

        # The accept loop waits on the listening socket, the parked connections and this pipe; a
        # handler parking a connection or close() writes to the pipe to wake it.
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        selector: selectors.BaseSelector | None = None
        sock: socket.socket | None = None
        try:
            self._selector = selector = selectors.DefaultSelector()
            sock, self._ident = self._bind(backlog)
            self._sock = sock
            selector.register(sock, selectors.EVENT_READ, "accept")
            selector.register(self._wake_r, selectors.EVENT_READ, "wake")
            self._accept_thread = threading.Thread(
                target=self._accept_loop, name=f"{name}-accept", daemon=True
            )
            self._accept_thread.start()
        except BaseException:
            if sock is not None:
                self._unlink_if_ours()
                sock.close()
            if selector is not None:
                selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise

    # -- public ----------------------------------------------------------------------------------------

    @property
    def rejected_connections(self) -> int:
        """How many connections were refused because of their uid."""
        return self._rejected

    @property
    def refused_over_limit(self) -> int:
        """How many connections were refused because ``max_connections`` were being served."""
        return self._over_limit

    @property
    def handshake_timeouts(self) -> int:
        """How many connections were closed because their handshake took too long."""
        return self._timed_out

    @property
    def allowed_uids(self) -> frozenset[int]:
        """The uids this server serves."""
        return self._allowed_uids

    @property
    def socket_mode(self) -> int:
        """The socket file's permission bits: 0o600, or 0o666 when other uids are allowed."""
        return _SOCKET_MODE_SHARED if self._allowed_uids - {os.getuid()} else _SOCKET_MODE_OWNER

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closing

    def active_connections(self) -> int:
        """How many accepted connections are open right now (served or parked)."""
        with self._lock:
            return len(self._conns)

    def serving_connections(self) -> int:
        """How many connections hold a thread right now (not parked)."""
        with self._lock:
            return sum(slot.thread is not None for slot in self._conns.values())

    def established(self, conn: Connection) -> None:
        """The handler completed ``conn``'s handshake: no handshake deadline applies any more."""
        with self._lock:
            slot = self._conns.get(conn)
            if slot is not None:
                slot.deadline = None

    def handshake_deadline(self, conn: Connection) -> float | None:
        """When ``conn``'s handshake must be complete (``time.monotonic()``), or ``None``."""
        with self._lock:
            slot = self._conns.get(conn)
            return None if slot is None else slot.deadline

    def __repr__(self) -> str:
        state = "closed" if self._closing else "listening"
        return f"<Server {self.name!r} {state} on {self.path!r}>"

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the server; idempotent.

        Stops accepting, removes the socket file (only if it is still the one this server created),
        closes every live connection (which wakes handlers blocked in ``recv``/``send`` with
        :class:`~arrow_ipc_bridge.errors.PeerClosedError`) and waits for the server's threads.

        Parameters
        ----------
        timeout:
            Seconds to wait for the threads in all. A handler still running after that (stuck outside the
            connection's calls) is logged and left behind; its thread is a daemon.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        if self._pid != _process.pid:
            # A fork child's copy: the socket file, the threads and the connections are the
            # parent's (and its locks may have been held at the fork). Only our descriptors go.
            self._closing = True
            self._sock.close()
            with contextlib.suppress(OSError):
                self._selector.close()
                os.close(self._wake_r)
                os.close(self._wake_w)
            return
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._stop.set()
        self._wake()
        me = threading.current_thread()
        if self._accept_thread is not me:
            self._accept_thread.join(max(deadline - time.monotonic(), 0.0))
        self._unlink_if_ours()
        self._sock.close()
        if self._accept_thread.is_alive():
            logger.warning("%r: the accept thread did not stop within %s s", self, timeout)
        else:
            # Only once the accept thread is gone: closing descriptors it may still be polling would let
            # their numbers be reused under it.
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

        with self._lock:
            live = [(conn, slot.thread) for conn, slot in self._conns.items()]
        for conn, thread in live:
            if thread is None:  # parked: no handler will finish it
                self._finish(conn)
            else:
                conn.close()
        for _, thread in live:
            if thread is not None and thread is not me:
                thread.join(max(deadline - time.monotonic(), 0.0))
        stuck = [
            thread.name for _, thread in live if thread is not None and thread.is_alive() and thread is not me
        ]
        if stuck:
            logger.warning("%r: handler threads still running after %s s: %s", self, timeout, stuck)

    def _wake(self) -> None:
        # Fails only when the pipe is full, and then the accept loop is being woken already.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # -- binding ---------------------------------------------------------------------------------------

    def _bind(self, backlog: int) -> tuple[socket.socket, tuple[int, int]]:
        path = self.path
        mode = self.socket_mode
        with _DirectoryLock(os.path.dirname(os.path.abspath(path))):
            self._clear_stale_path()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                # Why not umask: it is per process, so changing it around bind() races with files other
                # threads create. On Linux bind() gives the new file the mode of the socket's own inode
                # (masked by the umask), so fchmod() before bind() creates the file as 0600 from the start.
                # Elsewhere fchmod() may fail or not carry over; the chmod() after bind() covers that (and
                # widens the mode past the umask when other uids are allowed), and it happens before
                # listen(), so no client can connect while the mode is still wider.
                with contextlib.suppress(OSError):
                    os.fchmod(sock.fileno(), _SOCKET_MODE_OWNER)
                try:
                    sock.bind(path)
                except OSError as exc:
                    raise TransportError(
                        f"cannot bind a server socket at {path!r}: {exc}", path=path
                    ) from exc
                try:
                    os.chmod(path, mode)
                    st = os.lstat(path)
                    sock.listen(backlog)
                except OSError as exc:
                    _unlink_quietly(path)
                    raise TransportError(f"cannot listen on {path!r}: {exc}", path=path) from exc
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
        return sock, (st.st_dev, st.st_ino)

    def _clear_stale_path(self) -> None:
        path = self.path
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TransportError(f"cannot inspect {path!r}: {exc}", path=path) from exc
        if not stat.S_ISSOCK(st.st_mode):
            raise TransportError(
                f"{path!r} exists and is not a socket; refusing to replace it", path=path, mode=st.st_mode
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            # Nobody accepts on it: the server that made it is gone. (A live server accepting on it would
            # have taken the probe or, with a full backlog, answered EAGAIN.)
            logger.info("%s: replacing stale socket file %r", self.name, path)
            _unlink_quietly(path)
            return
        except FileNotFoundError:
            return
        except BlockingIOError as exc:
            raise TransportError(
                f"a server is already listening on {path!r} (its backlog is full)", path=path
            ) from exc
        except OSError as exc:
            raise TransportError(f"cannot probe existing socket {path!r}: {exc}", path=path) from exc
        finally:
            probe.close()
        raise TransportError(
            f"a server is already listening on {path!r}; refusing to take it over", path=path
        )

    def _unlink_if_ours(self) -> None:
        # The file may have been replaced (e.g. by a newer server after ours was presumed dead): only
        # remove the inode this server created.
        try:
            st = os.lstat(self.path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == self._ident:
            _unlink_quietly(self.path)

    # -- accepting, parking and serving ------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._selector.select(self._next_timeout())
            except OSError:
                if self._stop.is_set():
                    return
                raise
            for key, _ in events:
                if key.data == "wake":
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    if self._stop.is_set():
                        return
                elif key.data == "accept":
                    self._accept_all()
                else:
                    self._unpark(key.data)
            self._park_handed_back()
            self._expire_handshakes()

    def _accept_all(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._stop.is_set():
                    return
                if exc.errno in _ACCEPT_RESOURCE_ERRNOS:
                    # The pending connection stays queued and the socket stays readable: back off
                    # instead of spinning until descriptors or memory free up.
                    logger.warning("%r: accept failed (%s); retrying in 0.1 s", self, exc)
                    self._stop.wait(0.1)
                else:
                    logger.warning("%r: accept failed: %s", self, exc)
                return
            self._admit(sock)

    def _refuse(self, conn: Connection, error: BridgeError) -> None:
        """Tell a refused client why (the farewell), then close its connection."""
        if self._farewell is not None:
            try:
                self._farewell(conn, error)
            except Exception as exc:  # the client may be gone already; it is closed either way
                logger.debug("%r: farewell to pid %d failed: %s", self, conn.peer_pid, exc)
        conn.close()

    def _admit(self, sock: socket.socket) -> None:
        try:
            conn = Connection(sock, max_payload=self._max_payload)
        except BridgeError as exc:
            logger.debug("%r: dropped a connection that went away before it was served: %s", self, exc)
            sock.close()
            return
        if conn.peer_uid not in self._allowed_uids:
            with self._lock:
                self._rejected += 1
            logger.warning(
                "%r: rejected a connection from pid %d with uid %d (allowed uids: %s)",
                self,
                conn.peer_pid,
                conn.peer_uid,
                sorted(self._allowed_uids),
            )
            self._refuse(
                conn,
                PeerRejectedError(
                    f"uid {conn.peer_uid} is not allowed to connect (the publisher's allowed_uids)",
                    uid=conn.peer_uid,
                ),
            )
            return
        deadline = None if self._handshake_timeout is None else time.monotonic() + self._handshake_timeout
        with self._lock:
            closing = self._closing
            over = self._max_connections is not None and len(self._conns) >= self._max_connections
            if over:
                self._over_limit += 1
            elif not closing:
                self._accepted += 1
                self._conns[conn] = _Slot(deadline=deadline)
        if closing:
            conn.close()
        elif over:
            logger.warning(
                "%r: refused a connection from pid %d: %d connections served already (max_connections)",
                self,
                conn.peer_pid,
                self._max_connections,
            )
            self._refuse(
                conn,
                ConnectionLimitError(
                    f"the publisher serves its maximum of {self._max_connections} connections "
                    "(max_connections): close unused sessions or retry later",
                    limit=self._max_connections,
                ),
            )
        elif self._park:
            self._park_now(conn)  # a thread once it has something to say
        else:
            self._unpark(conn)

    def _park_now(self, conn: Connection) -> None:
        """Watch a connection without a thread (accept thread only)."""
        fd = conn.fileno()
        try:
            self._selector.register(fd, selectors.EVENT_READ, conn)
        except (KeyError, ValueError, OSError):  # closed meanwhile
            self._finish(conn)
            return
        self._parked[conn] = fd
        with self._lock:
            slot = self._conns.get(conn)
            deadline = None if slot is None else slot.deadline
        if deadline is not None:
            self._handshaking[conn] = deadline

    def _unwatch(self, conn: Connection) -> None:
        """Take a connection out of the parking lot, if it is there (accept thread only)."""
        fd = self._parked.pop(conn, None)
        self._handshaking.pop(conn, None)
        if fd is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(fd)

    def _park_handed_back(self) -> None:
        with self._lock:
            handed_back, self._to_park = self._to_park, []
        for conn in handed_back:
            self._park_now(conn)

    def _unpark(self, conn: Connection) -> None:
        """Give a connection a thread that runs the handler (accept thread only)."""
        self._unwatch(conn)
        with self._lock:
            slot = self._conns.get(conn)
            if slot is None or self._closing:
                return
            thread = threading.Thread(
                target=self._run,
                args=(conn,),
                name=f"{self.name}-fd{conn.fileno()}-pid{conn.peer_pid}",
                daemon=True,
            )
            slot.thread = thread
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread
            logger.warning("%r: cannot start a handler thread, dropping the connection: %s", self, exc)
            self._finish(conn)

    def _next_timeout(self) -> float | None:
        """Seconds until the first parked connection's handshake deadline (None: no deadline)."""
        if not self._handshaking:
            return None
        return max(min(self._handshaking.values()) - time.monotonic(), 0.0)

    def _expire_handshakes(self) -> None:
        if not self._handshaking:
            return
        now = time.monotonic()
        late = [conn for conn, deadline in self._handshaking.items() if deadline <= now]
        for conn in late:
            self._unwatch(conn)
            with self._lock:
                self._timed_out += 1
            logger.warning(
                "%r: closing a connection from pid %d: no handshake within %s s",
                self,
                conn.peer_pid,
                self._handshake_timeout,
            )
            self._refuse(conn, self.handshake_error())
            self._finish(conn)

    def handshake_error(self) -> HandshakeTimeoutError:
        """The error a connection that did not complete its handshake in time is closed with."""
        return HandshakeTimeoutError(
            f"no handshake within the publisher's handshake_timeout of {self._handshake_timeout} s",
            timeout=self._handshake_timeout,
        )

    def _run(self, conn: Connection) -> None:
        result: object = None
        try:
            result = self._handler(conn)
        except PeerClosedError as exc:
            logger.debug("%r: connection from pid %d ended: %s", self, conn.peer_pid, exc)
        except (BridgeError, OSError) as exc:
            # The text, not the exception: a handler that keeps log records would keep the exception's
            # traceback, and with it the serving frames and whatever they hold (a peer's descriptors).
            logger.warning(
                "%r: handler for pid %d failed, closing that connection: %s: %s",
                self,
                conn.peer_pid,
                exc.__class__.__name__,
                str(exc),
            )
        except Exception:
            logger.exception("%r: handler for pid %d raised, closing that connection", self, conn.peer_pid)
        if result is PARK and self._park:
            with self._lock:
                slot = self._conns.get(conn)
                parked = slot is not None and not self._closing and not conn.closed
                if parked and slot is not None:
                    slot.thread = None
                    self._to_park.append(conn)
            if parked:
                self._wake()
                return
        self._finish(conn)

    def _finish(self, conn: Connection) -> None:
        """Close an admitted connection for good and tell ``on_close`` (once)."""
        conn.close()
        with self._lock:
            slot = self._conns.pop(conn, None)
        if slot is not None and self._on_close is not None:
            try:
                self._on_close(conn)
            except Exception:
                logger.exception("%r: on_close for pid %d raised", self, conn.peer_pid)


class _DirectoryLock:
    """``flock`` on a directory, around the check-unlink-bind of a socket path.

    Without it two servers starting at once on one stale path could both find it stale; the second would
    then unlink the first one's fresh socket and bind its own, leaving the first listening on nothing. The
    lock is advisory and best effort: where the directory cannot be opened or locked, binding goes ahead
    unlocked.
    """

    def __init__(self, directory: str, timeout: float = 5.0) -> None:
        self._directory = directory
        self._timeout = timeout
        self._fd = -1

    def __enter__(self) -> None:
        try:
            fd = os.open(self._directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.005)
            except OSError:
                break
        os.close(fd)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = -1


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
