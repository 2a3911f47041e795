"""New device buffers that cost consumers no driver call: sub-allocation from kept IPC-pool slabs.

A consumer imports each IPC-pool allocation with ``cuMemPoolImportPointer``, whose cost grows with
the allocation (the driver maps all of it), and must free the import before the producer frees the
allocation, so a producer that allocates new arrays every step makes every consumer import every
buffer anew.

:class:`SlabAllocator` allocates large pool allocations ("slabs") and carves buffers out of them.
Slabs are **kept for the life of the process**: they are never returned to the pool, so a consumer
may keep a slab imported after its last lease (the bridge flags such regions
``REGION_FLAG_KEPT``), and a new buffer carved from a slab the consumer already imported costs it a
table lookup. The price: the producer's device memory only grows, to its peak use rounded up to
slabs (as with CuPy's default pool, except that ``free_all_blocks`` has no equivalent here).

Freed space is reused only by allocations on the stream its slab belongs to, the rule CuPy's pool
follows: work queued on that stream before the free finishes before work on a reuse starts.
"""

from __future__ import annotations

import bisect
import collections
import threading
import warnings
from dataclasses import dataclass

from arrow_ipc_bridge.cuda._driver import (
    _stream_value,
)
from arrow_ipc_bridge.cuda.pools import IpcMemoryPool
from arrow_ipc_bridge.errors import InvalidArgumentError

__all__ = [
    "ALIGNMENT",
    "DEFAULT_SLAB_SIZE",
    "SlabAllocator",
    "SlabRanges",
    "kept_slab",
]


ALIGNMENT = 512  # what CuPy's pool aligns to; enough for any Arrow buffer (64-byte recommendation)
DEFAULT_SLAB_SIZE = 256 << 20
_SLAB_GRANULE = 2 << 20  # slabs are whole multiples of the driver's 2 MiB mapping granularity


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class SlabRanges:
    """The free space of one slab, by offset: best-fit allocation and coalescing frees.

    Pure bookkeeping (no driver): offsets and sizes only. Not thread-safe; the allocator locks."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError("a slab has a positive size")
        self.size = size
        self._starts: list[int] = [0]  # free ranges, sorted by start, never adjacent
        self._lengths: list[int] = [size]
        self._used: dict[int, int] = {}  # start -> length of every range handed out
        self.used_bytes = 0

    def take(self, nbytes: int) -> int | None:
        """The start of ``nbytes`` of free space (the smallest free range that fits, lowest offset
        first among equals), or None when no range is large enough."""
        if nbytes <= 0:
            raise ValueError("take at least one byte")
        best = -1
        for i, length in enumerate(self._lengths):
            if length >= nbytes and (best < 0 or length < self._lengths[best]):
                best = i
                if length == nbytes:
                    break
        if best < 0:
            return None
        start = self._starts[best]
        if self._lengths[best] == nbytes:
            del self._starts[best]
            del self._lengths[best]
        else:
            self._starts[best] += nbytes
            self._lengths[best] -= nbytes
        self._used[start] = nbytes
        self.used_bytes += nbytes
        return start

    def give(self, start: int) -> int:
        """Return the range that :meth:`take` handed out at ``start``; returns its length.
        ValueError for a start not handed out (or given back already)."""
        nbytes = self._used.pop(start, None)
        if nbytes is None:
            raise ValueError(f"offset {start} was not handed out (or was given back already)")
        self.used_bytes -= nbytes
        i = bisect.bisect_left(self._starts, start)
        end = start + nbytes
        joins_next = i < len(self._starts) and self._starts[i] == end
        joins_previous = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start
        if joins_previous and joins_next:
            self._lengths[i - 1] += nbytes + self._lengths[i]
            del self._starts[i]
            del self._lengths[i]
        elif joins_previous:
            self._lengths[i - 1] += nbytes
        elif joins_next:
            self._starts[i] = start
            self._lengths[i] += nbytes
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, nbytes)
        return nbytes

    def free_ranges(self) -> list[tuple[int, int]]:
        """(start, length) of every free range, in order (for tests and statistics)."""
        return list(zip(self._starts, self._lengths, strict=True))


@dataclass(eq=False)
class _Slab:
    base: int
    size: int
    stream: int
    pool: IpcMemoryPool  # held here too: a pool is never destroyed under its slabs
    ranges: SlabRanges
    export_data: bytes | None = None  # cuMemPoolExportPointer of base, made once (placer.py)


# Every slab of the process, by base address: the placer asks whether an allocation is a kept slab
# (and for its export data, made once so consumers see the same handle every time). Slabs are never
# removed: that is the promise consumers rely on.
_slabs: dict[int, _Slab] = {}
_slabs_lock = threading.Lock()


def kept_slab(base: int) -> _Slab | None:
    """The slab whose allocation starts at ``base``, if it is one (a region of it is flagged kept)."""
    with _slabs_lock:
        return _slabs.get(base)


class SlabAllocator:
    """Device buffers carved out of kept IPC-pool allocations (see the module docstring).

    Parameters
    ----------
    device : int
        Device ordinal.
    slab_size : int
        Bytes per slab (rounded up to 2 MiB); a request larger than that gets a slab of its own size.
    pool : IpcMemoryPool, optional
        The pool slabs come from; default: a new one (reachable as ``allocator.pool``).
    """

    def __init__(
        self, device: int = 0, *, slab_size: int = DEFAULT_SLAB_SIZE, pool: IpcMemoryPool | None = None
    ) -> None:
        if not isinstance(slab_size, int) or isinstance(slab_size, bool) or slab_size <= 0:
            raise ValueError(f"slab_size must be a positive number of bytes, not {slab_size!r}")
        self.device = device
        self.slab_size = _align(slab_size, _SLAB_GRANULE)
        self.pool = pool if pool is not None else IpcMemoryPool(device)
        self._lock = threading.Lock()
        self._by_stream: dict[int, list[_Slab]] = {}
        self._live: dict[int, _Slab] = {}  # address handed out -> its slab
        # Addresses given back by finalizers (free_later): the garbage collector may run one on a
        # thread that holds the lock already, in the middle of an allocation, so they only queue
        # here (deque appends need no lock) and the next call that takes the lock applies them.
        self._freed_later: collections.deque[int] = collections.deque()

    def allocate(self, nbytes: int, stream: object = 0) -> int:
        """A device address of at least ``nbytes`` (512-byte aligned) for work on ``stream``
        (0: the legacy default stream). Carved from a slab of that stream; a new slab is allocated
        (stream-ordered, ``cuMemAllocFromPoolAsync``) when none has room."""
        size = _align(max(int(nbytes), 1), ALIGNMENT)
        stream_value = _stream_value(stream)
        with self._lock:
            self._apply_freed_later()
            slabs = self._by_stream.setdefault(stream_value, [])
            for slab in slabs:
                offset = slab.ranges.take(size)
                if offset is not None:
                    address = slab.base + offset
                    self._live[address] = slab
                    return address
            slab_bytes = max(self.slab_size, _align(size, _SLAB_GRANULE))
            base = self.pool.allocate(slab_bytes, stream_value)
            slab = _Slab(base, slab_bytes, stream_value, self.pool, SlabRanges(slab_bytes))
            with _slabs_lock:
                _slabs[base] = slab
            slabs.append(slab)
            offset = slab.ranges.take(size)
            assert offset == 0
            self._live[base] = slab
            return base

    def free(self, address: int) -> None:
        """Give a buffer's space back to its slab (no driver call; the slab stays)."""
        with self._lock:
            self._apply_freed_later()
            if not self._give_back(address):
                raise InvalidArgumentError(
                    f"address {address:#x} was not allocated here (or was freed)", argument="ptr"
                )

    def free_later(self, address: int) -> None:
        """:meth:`free` from a finalizer: queued, applied by the next call that takes the lock."""
        self._freed_later.append(address)

    def _give_back(self, address: int) -> bool:
        slab = self._live.pop(address, None)
        if slab is None:
            return False
        slab.ranges.give(address - slab.base)
        return True

    def _apply_freed_later(self) -> None:
        """Under the lock: the addresses finalizers gave back."""
        while self._freed_later:
            address = self._freed_later.popleft()
            if not self._give_back(address):
                warnings.warn(
                    f"a finalizer gave back {address:#x}, which this slab allocator did not hand out",
                    ResourceWarning,
                    stacklevel=2,
                )

    def stats(self) -> dict[str, int]:
        """``slabs``, ``reserved_bytes`` (all slabs) and ``used_bytes`` (handed out, aligned)."""
        with self._lock:
            self._apply_freed_later()
            slabs = [slab for group in self._by_stream.values() for slab in group]
            return {
                "slabs": len(slabs),
                "reserved_bytes": sum(slab.size for slab in slabs),
                "used_bytes": sum(slab.ranges.used_bytes for slab in slabs),
            }
