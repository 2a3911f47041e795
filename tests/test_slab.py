"""The slab allocator's bookkeeping (cuda/slab.py), without a GPU: its range allocator against a
model, and the allocator over a stand-in pool (no driver calls are made for carving or freeing)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.cuda import slab
from arrow_ipc_bridge.cuda.slab import ALIGNMENT, SlabAllocator, SlabRanges, kept_slab


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 1 << 16),
    steps=st.lists(st.tuples(st.booleans(), st.integers(1, 1 << 14), st.integers(0, 1 << 30)), max_size=80),
)
def test_ranges_hand_out_disjoint_space_and_coalesce_back(
    size: int, steps: list[tuple[bool, int, int]]
) -> None:
    """Any sequence of takes and gives: every range handed out lies inside the slab and overlaps no
    other live one; a take fails only when no free range is large enough; free space never holds
    two adjacent ranges; once everything is given back the slab is one free range again."""
    ranges = SlabRanges(size)
    live: dict[int, int] = {}
    for take, nbytes, pick in steps:
        if take or not live:
            largest = max((length for _, length in ranges.free_ranges()), default=0)
            start = ranges.take(nbytes)
            if start is None:
                assert largest < nbytes
                continue
            assert start >= 0
            assert start + nbytes <= size
            for other, length in live.items():
                assert start + nbytes <= other or other + length <= start, "overlapping ranges"
            live[start] = nbytes
        else:
            start = sorted(live)[pick % len(live)]
            assert ranges.give(start) == live.pop(start)
        free = ranges.free_ranges()
        assert all(a + la < b for (a, la), (b, _) in itertools.pairwise(free)), "adjacent free ranges"
        assert sum(length for _, length in free) + sum(live.values()) == size
        assert ranges.used_bytes == sum(live.values())
    for start in list(live):
        ranges.give(start)
    assert ranges.free_ranges() == [(0, size)]


def test_ranges_refuse_bad_gives_and_takes() -> None:
    ranges = SlabRanges(4096)
    start = ranges.take(512)
    assert start == 0
    with pytest.raises(ValueError, match="not handed out"):
        ranges.give(512)
    ranges.give(0)
    with pytest.raises(ValueError, match="not handed out"):
        ranges.give(0)  # twice
    with pytest.raises(ValueError, match="at least one byte"):
        ranges.take(0)
    with pytest.raises(ValueError, match="positive size"):
        SlabRanges(0)


class _StandInPool:
    """Stands in for cuda.IpcMemoryPool: hands out addresses, records the calls."""

    addresses = itertools.count(1 << 40, 1 << 32)

    def __init__(self) -> None:
        self.allocations: list[tuple[int, int, int]] = []  # (address, size, stream)

    def allocate(self, nbytes: int, stream: int = 0) -> int:
        address = next(self.addresses)
        self.allocations.append((address, nbytes, stream))
        return address


def test_allocator_carves_slabs_per_stream_and_keeps_them() -> None:
    """Buffers come out of slabs (2 MiB multiples, 512-byte aligned); freed space is reused by
    allocations on the same stream only; a request larger than a slab gets a slab of its own size;
    slabs are never given back and are known to kept_slab; frees of unknown addresses raise."""
    pool: Any = _StandInPool()
    allocator = SlabAllocator(0, slab_size=3 << 20, pool=pool)
    assert allocator.slab_size == 4 << 20
    a = allocator.allocate(100, stream=7)
    b = allocator.allocate(1000, stream=7)
    ((base, size, stream),) = pool.allocations
    assert (a, size, stream) == (base, 4 << 20, 7)
    assert b == base + ALIGNMENT  # 100 bytes take one aligned unit
    assert kept_slab(base) is not None
    assert kept_slab(base).size == 4 << 20
    allocator.free(a)
    assert allocator.allocate(512, stream=7) == a  # reused on the same stream
    other = allocator.allocate(512, stream=9)  # another stream: a slab of its own
    assert len(pool.allocations) == 2
    assert other == pool.allocations[1][0]
    big = allocator.allocate(9 << 20, stream=7)  # larger than a slab: its own, rounded to 2 MiB
    assert pool.allocations[2][1:] == (10 << 20, 7)
    assert big == pool.allocations[2][0]
    assert allocator.stats() == {
        "slabs": 3,
        "reserved_bytes": (4 + 4 + 10) << 20,
        "used_bytes": 512 + 1024 + 512 + (9 << 20),
    }
    for address in (b, a, other, big):
        allocator.free(address)
    assert allocator.stats()["used_bytes"] == 0
    assert allocator.stats()["slabs"] == 3  # kept
    with pytest.raises(aib.InvalidArgumentError, match="not allocated here"):
        allocator.free(a)
    with pytest.raises(ValueError, match="slab_size"):
        SlabAllocator(0, slab_size=0, pool=pool)
    assert slab.kept_slab(base + ALIGNMENT) is None  # only slab bases are slabs


def test_finalizer_frees_queue_until_the_next_call() -> None:
    """CuPy's finalizers give space back with free_later, which only queues (the collector may run
    them inside the allocator's locked section): the next allocate, free or stats applies them; an
    address the allocator never handed out is reported with a ResourceWarning, not lost silently."""
    pool: Any = _StandInPool()
    allocator = SlabAllocator(0, slab_size=2 << 20, pool=pool)
    a = allocator.allocate(1024)
    allocator.free_later(a)
    assert allocator._live  # queued, not applied yet
    assert allocator.stats()["used_bytes"] == 0
    assert allocator.allocate(1024) == a  # the space is carved again
    allocator.free_later(a + 1)
    with pytest.warns(ResourceWarning, match="did not hand out"):
        allocator.stats()


def test_cupy_allocator_refuses_a_pool_with_slabs() -> None:
    """A slab allocator makes its own pool: asking for both is a clear error (before CuPy loads)."""
    from arrow_ipc_bridge import cuda

    with pytest.raises(ValueError, match="pool and slab_size"):
        cuda.cupy_allocator(0, pool=_StandInPool(), slab_size=2 << 20)  # type: ignore[arg-type]
