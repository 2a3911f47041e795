"""The version board: the publisher's page of name versions, which sessions read without asking.

A publisher keeps, for each published name, the *serial* of the entry published under it (the
version it was put at; a new one on every publish that is not an in-place renewal) and its current
version, in one 32-byte slot of a shared page (``cffi_build/board.c`` writes and reads it; the
table in ``serve.c`` keeps it current). A session maps the page read-only once (``BOARD_FD`` /
``BOARD``, docs/protocol.md). A message it remembers and re-gets holds a *standing lease* on its
entry; while the board shows that entry's serial, a get of the name imports the remembered message
in place, with no round trip, under the standing lease (``remembered.c``; docs/lifetime.md,
"Standing leases"). Anything else asks the publisher as before.

A session waiting for a newer version of a name it holds a standing lease on (``get_next``)
sleeps on the name's slot (:meth:`SessionBoard.wait_for_change`, a futex on the slot's sequence
word) instead of asking the publisher to hold a request: every write of the slot wakes it, and
its get is then local for an in-place renewal (feature ``"board_wake"``).

Trust: the page is a memfd the publisher sealed against growing, shrinking and writing through any
new mapping (``F_SEAL_FUTURE_WRITE``); a session refuses one that is not sealed so (a file that can
shrink would fault its mapping) or not the size announced. What the page says is only compared with
what the session holds: a publisher that lies about it can make a get return its older data, as a
publisher can by answering a GET with it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import threading
from typing import TYPE_CHECKING, Any

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.errors import ProtocolError
from arrow_ipc_bridge.host import F_SEAL_FUTURE_WRITE, reopen_read_only
from arrow_ipc_bridge.transport import protocol

__all__ = ["DEFAULT_SLOTS", "PublisherBoard", "SessionBoard", "decode_board", "encode_board", "open_board"]

SLOT_SIZE = int(lib.AIB_BOARD_SLOT_SIZE)
MAX_SLOTS = int(lib.AIB_BOARD_MAX_SLOTS)
DEFAULT_SLOTS = 4096
"""Slots on a publisher's board (128 KiB): names published beyond them are got by round trips."""

if TYPE_CHECKING:
    from arrow_ipc_bridge.transport.channel import Channel

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
_BOARD = struct.Struct("<I")  # BOARD's payload: the number of slots; the page's fd attached


def encode_board(n_slots: int) -> bytes:
    return _BOARD.pack(n_slots)


def decode_board(payload: bytes) -> int:
    """The slot count of a BOARD answer; :class:`ProtocolError` when malformed or out of range."""
    if len(payload) != _BOARD.size:
        raise ProtocolError(f"BOARD payload of {len(payload)} bytes, expected {_BOARD.size}")
    (n_slots,) = _BOARD.unpack(payload)
    if not 0 < n_slots <= MAX_SLOTS:
        raise ProtocolError(f"BOARD announces {n_slots} slots (1 to {MAX_SLOTS})")
    return int(n_slots)


class PublisherBoard:
    """The publisher's board: a zeroed memfd of ``n_slots`` slots mapped writable here, sealed so
    that no one can map it writable again, resize it or unseal it; :attr:`fd` is a read-only one.
    Raises :class:`OSError` where the kernel cannot seal so (Linux < 5.1): the publisher then offers
    no board."""

    def __init__(self, n_slots: int = DEFAULT_SLOTS) -> None:
        size = n_slots * SLOT_SIZE
        fd = os.memfd_create("aib-version-board", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            page = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                # After our only writable mapping exists: later mappings can only read.
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            except BaseException:
                page.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        try:
            # The mapping keeps the page; the fd sessions get is a read-only one (docs/security.md).
            fd = reopen_read_only(fd)
        except BaseException:
            page.close()
            raise
        self.fd = fd
        """The read-only descriptor a BOARD answer carries."""
        self.n_slots = n_slots
        self._page = page
        self.address: Any = ffi.from_buffer(page, require_writable=True)
        """The page, for ``aib_pubtable_set_board``."""

    def close(self) -> None:
        """Unmap and close; the table must have let go of the page first (``set_board(NULL)``)."""
        if self._page.closed:
            return
        ffi.release(self.address)
        self._page.close()
        os.close(self.fd)


class SessionBoard:
    """A publisher's board mapped read-only in a session, from a BOARD answer's fd (the caller
    still owns and closes it). :class:`ProtocolError` for a file that is not the sealed page of
    ``n_slots`` slots a publisher makes."""

    def __init__(self, fd: int, n_slots: int) -> None:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != n_slots * SLOT_SIZE:
            raise ProtocolError(
                f"the publisher's version board is not a file of {n_slots} slots "
                f"({n_slots * SLOT_SIZE} bytes; got {info.st_size})"
            )
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            # EINVAL: a file that cannot carry seals (a disk file, not a memfd) cannot be sealed either.
            raise ProtocolError(
                f"the publisher's version board is not a sealed memfd (reading its seals failed: {exc})"
            ) from exc
        if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
            # A page that can shrink would fault (SIGBUS) a session reading it.
            raise ProtocolError("the publisher's version board is not sealed against resizing")
        self.n_slots = n_slots
        try:
            self._page = mmap.mmap(fd, n_slots * SLOT_SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as exc:  # EACCES: a descriptor opened without read access
            raise ProtocolError(f"the publisher's version board cannot be mapped read-only: {exc}") from exc
        self.address: Any = ffi.from_buffer(self._page)
        """The page, for ``aib_session_get``."""
        # Threads in peek() / wait_for_change() (slot -> how many): close() wakes them and unmaps
        # the page only once they are out (the C get path reads it under the session's request lock).
        self._users: dict[int, int] = {}
        self._closing = False
        self._cond = threading.Condition(threading.Lock())
        self._seen = ffi.new("uint64_t[3]")  # seq, serial, version of a peek (under _cond)
        self._stop = ffi.new("int *")  # set by close(): spinning threads look again at once

    def peek(self, slot: int) -> tuple[int, int, int] | None:
        """``(seq, serial, version)`` of ``slot`` now, for :meth:`wait_for_change`; None when the
        slot stayed busy (a writer died mid-write: ask the publisher) or the board is closing."""
        with self._cond:
            if self._closing or not 0 <= slot < self.n_slots:
                return None
            seen = self._seen
            if not lib.aib_board_peek(self.address, slot, seen, seen + 1, seen + 2):
                return None
            return int(seen[0]), int(seen[1]), int(seen[2])

    def wait_for_change(self, slot: int, seq: int, timeout: float, *, spin: bool = False) -> bool:
        """Sleep until ``slot`` is written after :meth:`peek` saw ``seq`` (the publisher's write wakes
        it), the board closes, or ``timeout`` seconds pass; False when the time passed. The GIL is
        released meanwhile. Returns at once when the slot changed since the peek. ``spin``: poll
        the slot instead of sleeping, keeping the core busy (no wake-up to wait for)."""
        with self._cond:
            if self._closing:
                return True  # the caller looks again and finds the session closed
            self._users[slot] = self._users.get(slot, 0) + 1
        try:
            nanoseconds = max(0, int(timeout * 1e9))
            if spin:
                return bool(lib.aib_board_spin(self.address, slot, seq, nanoseconds, self._stop))
            return not lib.aib_board_wait(self.address, slot, seq, nanoseconds)
        finally:
            with self._cond:
                left = self._users[slot] - 1
                if left:
                    self._users[slot] = left
                else:
                    del self._users[slot]
                self._cond.notify_all()

    def close(self) -> None:
        """Wake the threads waiting on a slot, then unmap once they are out; the session's gets must
        have stopped using the page (the request lock held)."""
        with self._cond:
            if self._page.closed:
                return
            self._closing = True
            self._stop[0] = 1
            for slot in self._users:
                lib.aib_board_wake(self.address, slot)
            # A waiter between its registration and its sleep misses the wake-up and sleeps out its
            # timeout, which get_next keeps short (its liveness check); so this wait is bounded.
            self._cond.wait_for(lambda: not self._users, timeout=5.0)
            if self._users:
                return  # never unmap under a sleeper: the page stays mapped until the process ends
            ffi.release(self.address)
            self._page.close()


def open_board(channel: Channel, timeout: float) -> SessionBoard:
    """Ask the publisher at the other end of ``channel`` for its board (BOARD_FD) and map it
    read-only; :class:`ProtocolError` for an answer that is not a sealed board of the size it
    says, the publisher's error for an ERROR."""
    frame = channel.request(protocol.BOARD_FD, b"", timeout=timeout)
    try:
        if frame.kind == protocol.ERROR:
            protocol.raise_error(frame.payload)
        if frame.kind != protocol.BOARD or len(frame.fds) != 1:
            raise ProtocolError(f"expected BOARD with one descriptor, got frame kind {frame.kind}")
        return SessionBoard(frame.fds[0], decode_board(frame.payload))
    finally:
        frame.close_fds()  # the mapping keeps the page
