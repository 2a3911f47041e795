"""The bounded pool of pinned host buffers that device data is staged through for gRPC.

A :class:`StagingPool` never holds more than ``max_bytes`` of pinned memory (buffers idle and lent
together), whatever the number of clients; a chunk that cannot get a buffer waits until one comes
back (a slow client holds the buffers of the chunks gRPC has not sent yet). A buffer is lent to one
chunk at a time (a :class:`Loan`) and goes back only when the last pyarrow object over it is gone,
which is when gRPC has sent the chunk and dropped it: nothing gRPC still holds is ever overwritten.
One chunk needs at most ``max(buffer_bytes, its own size)``; a batch that cannot be sliced and is
larger than ``max_bytes`` is refused (:class:`~arrow_ipc_bridge.errors.LimitError`,
``limit="staging_bytes"``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from arrow_ipc_bridge.errors import ClosedError, LimitError, PeerClosedError
from arrow_ipc_bridge.flight.copier import Copier

__all__ = [
    "CHUNK_BYTES",
    "MAX_STAGING_BYTES",
    "Loan",
    "StagingPool",
]

CHUNK_BYTES = 64 << 20  # a chunk's size: large enough that per-chunk costs vanish, small enough to overlap
MAX_STAGING_BYTES = 256 << 20  # pinned memory of one front per device: four chunks in flight
_POLL_S = 0.25  # how often a chunk waiting for a buffer looks whether its client went away


class Loan:
    """A pool buffer lent to one chunk; :meth:`give_back` (idempotent, any thread) returns it."""

    __slots__ = ("__weakref__", "_lock", "_pool", "address", "size")

    def __init__(self, pool: StagingPool, address: int, size: int) -> None:
        self._pool: StagingPool | None = pool
        self._lock = threading.Lock()
        self.address = address
        self.size = size

    def give_back(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self.address, self.size)


class StagingPool:
    """Pinned host buffers of ``buffer_bytes`` (more for a chunk that needs more), reused across
    chunks and ``do_get`` calls, never more than ``max_bytes`` in all (idle and lent).

    Thread-safe; a buffer is lent to one chunk at a time and comes back when the last object over it
    is gone. ``close()`` frees the idle buffers now and each lent one when it comes back.
    """

    def __init__(
        self, copier: Copier, *, buffer_bytes: int = CHUNK_BYTES, max_bytes: int = MAX_STAGING_BYTES
    ):
        if buffer_bytes < 1 or max_bytes < 2 * buffer_bytes:
            raise ValueError(
                f"staging needs max_bytes >= 2 * buffer_bytes (one chunk sent, one copied), "
                f"not {max_bytes} and {buffer_bytes}"
            )
        self.copier = copier
        self.buffer_bytes = buffer_bytes
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._idle: list[tuple[int, int]] = []  # (size, address)
        self._allocated = 0  # bytes of every buffer, idle and lent
        self._lent = 0
        self._allocations = 0
        self._closed = False

    # -- facts, for tests and the benchmark --
    @property
    def allocated_bytes(self) -> int:
        """Pinned bytes held now, idle and lent."""
        return self._allocated

    @property
    def lent(self) -> int:
        """Buffers lent to chunks now."""
        return self._lent

    @property
    def allocations(self) -> int:
        """Buffers allocated since the pool was made (reuse keeps this flat)."""
        return self._allocations

    def acquire(self, nbytes: int, cancelled: Callable[[], bool] = lambda: False) -> Loan:
        """A buffer of at least ``nbytes``; waits while the pool is at ``max_bytes``.

        Raises
        ------
        LimitError
            ``nbytes`` is more than ``max_bytes`` (``limit="staging_bytes"``).
        PeerClosedError
            ``cancelled()`` turned true while waiting (``reason="client_gone"``).
        ClosedError
            The pool is closed.
        """
        if nbytes > self.max_bytes:
            raise LimitError(
                f"a batch of {nbytes} bytes that cannot be sliced needs more than the staging pool "
                f"may hold ({self.max_bytes} bytes): publish smaller record batches, or raise "
                "serve(staging_bytes=...)",
                limit="staging_bytes",
                value=self.max_bytes,
            )
        nbytes = max(nbytes, 1)
        to_free: list[int] = []
        with self._cond:
            while True:
                if self._closed:
                    raise ClosedError("the staging pool is closed", what="staging pool")
                fits = [entry for entry in self._idle if entry[0] >= nbytes]
                if fits:
                    entry = min(fits)
                    self._idle.remove(entry)
                    self._lent += 1
                    return Loan(self, entry[1], entry[0])
                size = max(nbytes, self.buffer_bytes)
                if self._allocated + size > self.max_bytes:
                    size = nbytes
                # Idle buffers too small for this chunk make room for one that fits.
                while self._allocated + size > self.max_bytes and self._idle:
                    idle_size, address = self._idle.pop(0)
                    self._allocated -= idle_size
                    to_free.append(address)
                if self._allocated + size <= self.max_bytes:
                    self._allocated += size
                    self._lent += 1
                    break
                if cancelled():
                    raise PeerClosedError(
                        "the client went away while its chunk waited for a buffer", reason="client_gone"
                    )
                self._cond.wait(_POLL_S)
        try:
            for address in to_free:
                self.copier.free(address)
            address = self.copier.allocate(size)
        except BaseException:
            with self._cond:
                self._allocated -= size
                self._lent -= 1
                self._cond.notify_all()
            raise
        self._allocations += 1
        return Loan(self, address, size)

    def _give_back(self, address: int, size: int) -> None:
        with self._cond:
            self._lent -= 1
            if not self._closed:
                self._idle.append((size, address))
                self._idle.sort()
                self._cond.notify_all()
                return
            self._allocated -= size
        self.copier.free(address)

    def close(self) -> None:
        """Free the idle buffers; buffers still lent are freed when they come back (idempotent)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._allocated -= sum(size for size, _ in idle)
            self._cond.notify_all()
        for _, address in idle:
            self.copier.free(address)
