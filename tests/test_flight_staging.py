"""Staging device publications for Flight (``arrow_ipc_bridge.flight.staging``), run on the CPU: a
host copier stands in for the GPU (its "device" is the session's host mapping), so the planning,
the pool's bounds and reuse, the slicing of large batches and the lifetime of the buffers are
checked on any machine. The copier can copy at once (the earliest a real DMA could write) or only
when a fence is waited for (the latest), so that a buffer handed out while gRPC still holds it would
show as changed data."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.session_rig import sample_table, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import _reaper

pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.flight.staging import (
    StagedPublication,
    StagingCancelledError,
    StagingLimitError,
    StagingPool,
)


class HostCopier:
    """A stand-in device: host buffers, copies by memmove (at once, or at the fence's wait)."""

    def __init__(self, *, eager: bool) -> None:
        self.eager = eager
        self.buffers: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self.queued: list[tuple[int, int, int]] = []
        self.copies = 0
        self.freed = 0
        self.order_calls = 0

    def allocate(self, nbytes: int) -> int:
        buffer = ctypes.create_string_buffer(nbytes)
        address = ctypes.addressof(buffer)
        self.buffers[address] = buffer
        return address

    def free(self, address: int) -> None:
        del self.buffers[address]  # KeyError: freed twice, or never allocated
        self.freed += 1

    def order_after_producer(self, imported: object) -> None:
        self.order_calls += 1

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.copies += 1
        if self.eager:
            ctypes.memmove(dst, src, nbytes)
        else:
            self.queued.append((dst, src, nbytes))

    def fence(self) -> object:
        return len(self.queued)

    def wait(self, fence: object) -> None:
        assert isinstance(fence, int)
        for dst, src, nbytes in self.queued[:fence]:
            ctypes.memmove(dst, src, nbytes)
        del self.queued[:fence]

    def close(self) -> None:
        pass


def _returned(pool: StagingPool) -> bool:
    gc.collect()
    _reaper.drain()
    return pool.lent == 0


@pytest.fixture
def session(publisher: aib.Publisher) -> Iterator[aib.Session]:
    with aib.connect(publisher.path) as s:
        yield s


def _numbers(rows: int, *, offset: int = 0) -> pa.Table:
    ids = range(offset, offset + rows)
    return pa.table(
        {
            "i": pa.array([i if i % 7 else None for i in ids], pa.int64()),
            "f": pa.array([float(i) / 3 for i in ids], pa.float32()),
            "b": pa.array([i % 3 == 0 if i % 11 else None for i in ids], pa.bool_()),
            "t": pa.array(list(ids), pa.timestamp("us")),
        }
    )


@pytest.mark.parametrize("eager", [True, False])
def test_staged_batches_equal_the_publication(
    publisher: aib.Publisher, session: aib.Session, eager: bool
) -> None:
    table = sample_table(1500, batches=3)  # nested, dictionary, string and null columns: staged whole
    publisher.publish("t", table)
    copier = HostCopier(eager=eager)
    pool = StagingPool(copier, buffer_bytes=1 << 20, max_bytes=4 << 20)
    staged = StagedPublication(session.get("t"), pool, chunk_bytes=1 << 20)
    assert len(staged.chunk_sizes) == 3
    got = pa.Table.from_batches(list(staged), schema=staged.schema)
    assert_arrays_equal(got, table)
    assert copier.order_calls == 1
    del got
    assert wait_for(lambda: _returned(pool), 5.0), pool.lent
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    pool.close()
    assert copier.buffers == {}


def test_buffers_are_reused_across_chunks_and_gets(publisher: aib.Publisher, session: aib.Session) -> None:
    publisher.publish("t", pa.Table.from_batches(_numbers(40_000).to_batches(max_chunksize=5000)))
    copier = HostCopier(eager=True)
    pool = StagingPool(copier, buffer_bytes=1 << 20, max_bytes=3 << 20)
    for _ in range(3):
        staged = StagedPublication(session.get("t"), pool, chunk_bytes=1 << 20)
        assert len(staged.chunk_sizes) == 8
        for batch in staged:
            assert batch.num_rows == 5000
        del batch
        assert wait_for(lambda: _returned(pool), 5.0)
    # Eight chunks, three gets: three buffers served them all (the batch the loop holds, the chunk
    # copied ahead, the chunk being copied).
    assert pool.allocations == 3
    assert pool.allocated_bytes <= pool.max_bytes
    pool.close()
    assert copier.freed == 3


@pytest.mark.parametrize("offset", [0, 3])
def test_a_large_fixed_width_batch_is_sliced_into_bounded_chunks(
    publisher: aib.Publisher, session: aib.Session, offset: int
) -> None:
    table = _numbers(50_000 + offset).combine_chunks().slice(offset)  # one batch, maybe at an offset
    publisher.publish("big", table)
    copier = HostCopier(eager=False)
    chunk = 64 << 10
    pool = StagingPool(copier, buffer_bytes=chunk, max_bytes=4 * chunk)
    staged = StagedPublication(session.get("big"), pool, chunk_bytes=chunk)
    sizes = staged.chunk_sizes
    assert len(sizes) > 10
    assert max(sizes) <= chunk
    # Each batch is checked and dropped as it comes: holding them all would hold every buffer,
    # and the bounded pool would wait for one forever (as for a client that stops reading).
    position = count = 0
    for batch in staged:
        assert_arrays_equal(pa.Table.from_batches([batch]), table.slice(position, batch.num_rows))
        position += batch.num_rows
        count += 1
    assert (position, count) == (table.num_rows, len(sizes))
    assert pool.allocated_bytes <= pool.max_bytes
    del batch
    assert wait_for(lambda: _returned(pool), 5.0)


@pytest.mark.parametrize("eager", [True, False])
def test_no_buffer_is_overwritten_while_a_batch_over_it_lives(
    publisher: aib.Publisher, session: aib.Session, eager: bool
) -> None:
    """The consumer keeps the batch it was handed until it takes the next one (as gRPC does while
    it sends): each batch must still hold its own rows when dropped, after later chunks were
    copied, with only three buffers for twelve chunks."""
    table = pa.Table.from_batches(_numbers(12_000).to_batches(max_chunksize=1000))
    publisher.publish("t", table)
    expected = table.to_batches()
    copier = HostCopier(eager=eager)
    pool = StagingPool(copier, buffer_bytes=64 << 10, max_bytes=3 * (64 << 10))
    staged = StagedPublication(session.get("t"), pool, chunk_bytes=64 << 10)
    held: pa.RecordBatch | None = None
    seen = 0
    for batch in staged:
        if held is not None:
            assert held.equals(expected[seen - 1]), f"batch {seen - 1} changed while it was held"
        held = batch
        seen += 1
    assert held is not None
    assert held.equals(expected[-1])
    assert seen == 12
    assert pool.allocations <= 3
    del held, batch
    assert wait_for(lambda: _returned(pool), 5.0)


def test_a_batch_too_large_to_stage_is_refused_and_nothing_is_held(
    publisher: aib.Publisher, session: aib.Session
) -> None:
    strings = pa.table({"s": pa.array([f"row-{i:08d}" * 4 for i in range(20_000)])})  # ~1 MiB, unsliceable
    publisher.publish("s", strings)
    pool = StagingPool(HostCopier(eager=True), buffer_bytes=64 << 10, max_bytes=256 << 10)
    staged = StagedPublication(session.get("s"), pool, chunk_bytes=64 << 10)
    with pytest.raises(StagingLimitError, match="cannot be sliced"):
        list(staged)
    assert pool.lent == 0
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_a_client_gone_while_waiting_for_a_buffer_stops_the_staging(
    publisher: aib.Publisher, session: aib.Session
) -> None:
    publisher.publish("t", pa.Table.from_batches(_numbers(8000).to_batches(max_chunksize=1000)))
    # Three buffers: the two batches kept, and the chunk copied ahead of the second.
    pool = StagingPool(HostCopier(eager=True), buffer_bytes=64 << 10, max_bytes=3 * (64 << 10))
    gone = False
    staged = StagedPublication(session.get("t"), pool, chunk_bytes=64 << 10, cancelled=lambda: gone)
    iterator = iter(staged)
    kept = [next(iterator), next(iterator)]  # held, as by a client that stopped reading
    gone = True
    with pytest.raises(StagingCancelledError):
        next(iterator)
    del kept
    assert wait_for(lambda: _returned(pool), 5.0)
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_a_staging_abandoned_midway_gives_back_buffers_and_lease(
    publisher: aib.Publisher, session: aib.Session
) -> None:
    publisher.publish("t", pa.Table.from_batches(_numbers(8000).to_batches(max_chunksize=1000)))
    copier = HostCopier(eager=False)
    pool = StagingPool(copier, buffer_bytes=64 << 10, max_bytes=4 * (64 << 10))
    staged = StagedPublication(session.get("t"), pool, chunk_bytes=64 << 10)
    first = next(iter(staged))
    staged.close()  # the chunk copied ahead is waited for, then given back
    assert copier.queued == []
    assert first.num_rows == 1000
    del first
    assert wait_for(lambda: _returned(pool), 5.0)
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_the_pool_refuses_a_bound_below_two_chunks() -> None:
    with pytest.raises(ValueError, match="max_bytes >= 2"):
        StagingPool(HostCopier(eager=True), buffer_bytes=1 << 20, max_bytes=(1 << 20) + 1)
