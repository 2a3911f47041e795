"""Staging device publications and live streams for Flight (``arrow_ipc_bridge.flight.staging``),
run on the CPU: a host copier stands in for the GPU (its "device" is the session's host mapping),
so the planning, the pool's bounds and reuse, the slicing of large batches and the lifetime of the
buffers and leases are checked on any machine. The copier can copy at once (the earliest a real DMA
could write) or only when a fence is waited for (the latest), so that a buffer handed out while
gRPC still holds it would show as changed data. The live-stream tests at the end also run the
front's live path end to end with that copier standing in for its GPU pool."""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from collections.abc import Iterator

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.session_rig import sample_table, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.runtime import reaper

flight = pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.errors import LimitError, PeerClosedError  # noqa: E402
from arrow_ipc_bridge.flight import serve  # noqa: E402
from arrow_ipc_bridge.flight.pinned_pool import StagingPool  # noqa: E402
from arrow_ipc_bridge.flight.prefetch import Prefetcher  # noqa: E402
from arrow_ipc_bridge.flight.server import FlightFront  # noqa: E402
from arrow_ipc_bridge.flight.staging import StagedPublication, stage_live_batch  # noqa: E402


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
    reaper.settle()
    return pool.lent == 0


def _assert_all_given_back(pool: StagingPool, publisher: aib.Publisher) -> None:
    """Every staging buffer is back in ``pool`` and every lease back at ``publisher`` (soon)."""
    assert wait_for(lambda: _returned(pool), 5.0)
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


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
    with pytest.raises(LimitError, match="cannot be sliced") as raised:
        list(staged)
    assert raised.value.limit == "staging_bytes"
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
    with pytest.raises(PeerClosedError) as raised:
        next(iterator)
    assert raised.value.reason == "client_gone"
    del kept
    _assert_all_given_back(pool, publisher)


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
    _assert_all_given_back(pool, publisher)


def test_the_pool_refuses_a_bound_below_two_chunks() -> None:
    with pytest.raises(ValueError, match="max_bytes >= 2"):
        StagingPool(HostCopier(eager=True), buffer_bytes=1 << 20, max_bytes=(1 << 20) + 1)


# ---------------------------------------------------------------------------------------------------
# Live streams: each device batch staged through the pool, its lease given back once copied
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("shape", ["whole", "sliced"])
def test_a_live_batch_gives_its_lease_back_once_copied(
    publisher: aib.Publisher, session: aib.Session, eager: bool, shape: str
) -> None:
    """The import is released when its last chunk is copied, before that chunk is handed out (a
    publication's is released only when the iteration ends); the batches, rebuilt over a decode
    of their own or sliced over the buffers, stay valid and hold only their buffers."""
    table = sample_table(800) if shape == "whole" else _numbers(40_000).combine_chunks()
    publisher.publish("t", table)
    copier = HostCopier(eager=eager)
    chunk = 64 << 10
    pool = StagingPool(copier, buffer_bytes=chunk, max_bytes=64 * chunk)  # room to hold every chunk
    imported = session.get("t")
    staged = stage_live_batch(imported, pool)
    count = len(staged.chunk_sizes)
    if shape == "whole":
        assert count == 1
    else:
        assert count > 4
    iterator = iter(staged)
    got = [next(iterator) for _ in range(count)]  # every chunk, the iteration not ended
    assert imported.released
    assert wait_for(lambda: publisher.active_leases == 0, 5.0), publisher.active_leases
    assert pool.lent == count  # the buffers stay lent while their batches live
    assert_arrays_equal(pa.Table.from_batches(got, schema=staged.schema), table)
    assert next(iterator, None) is None
    staged.close()
    del got
    assert wait_for(lambda: _returned(pool), 5.0), pool.lent
    pool.close()
    assert copier.buffers == {}


def test_a_publication_keeps_its_lease_until_its_batches_are_dropped(
    publisher: aib.Publisher, session: aib.Session
) -> None:
    """The contrast: ``keep_lease`` (the default, publications) holds the lease while a batch
    rebuilt whole lives, as host data does."""
    publisher.publish("t", sample_table(800))
    pool = StagingPool(HostCopier(eager=True), buffer_bytes=64 << 10, max_bytes=4 * (64 << 10))
    staged = StagedPublication(session.get("t"), pool, chunk_bytes=64 << 10)
    got = list(staged)
    time.sleep(0.05)
    assert publisher.active_leases == 1
    del got
    _assert_all_given_back(pool, publisher)


def test_a_live_batch_that_cannot_start_staging_is_released(
    publisher: aib.Publisher, session: aib.Session
) -> None:
    publisher.publish("t", _numbers(100))
    pool = StagingPool(HostCopier(eager=True), buffer_bytes=64 << 10, max_bytes=2 * (64 << 10))
    imported = session.get("t")
    imported._decoded.borrow = _refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="refused"):
        stage_live_batch(imported, pool)
    assert imported.released
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def _refuse() -> None:
    raise RuntimeError("refused")


def test_closing_a_staging_that_never_started_releases_its_import(
    publisher: aib.Publisher, session: aib.Session
) -> None:
    publisher.publish("t", _numbers(100))
    pool = StagingPool(HostCopier(eager=True), buffer_bytes=64 << 10, max_bytes=2 * (64 << 10))
    imported = session.get("t")
    stage_live_batch(imported, pool).close()
    assert imported.released
    assert pool.lent == 0
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def _live_batches(count: int) -> list[pa.RecordBatch]:
    """Batches of one schema, each of its own values: mostly small ones, every fourth large
    enough (over 64 KiB) to be sliced into several chunks."""
    return [
        _numbers(12_000 if i % 4 == 3 else 700, offset=i * 100_000).combine_chunks().to_batches()[0]
        for i in range(count)
    ]


def _write_when_subscribed(
    writer: aib.StreamWriter, batches: list[pa.RecordBatch], stop: threading.Event
) -> None:
    wait_for(lambda: writer.subscribers > 0 or stop.is_set(), 10.0)
    for batch in batches:
        if stop.is_set():
            break
        writer.write(batch)
    writer.close()


@pytest.mark.parametrize("eager", [True, False])
def test_staged_live_batches_on_a_thread_never_overwrite_a_held_batch(
    publisher: aib.Publisher, session: aib.Session, eager: bool
) -> None:
    """The front's composition (``sending.live_stream``): each batch of a subscription staged
    on a ``Prefetcher`` thread one chunk ahead, the consumer holding the chunk it was handed until
    it takes the next (as gRPC does while it sends). Three buffers serve every chunk, and each
    held chunk still holds its own rows when the next arrives."""
    batches = _live_batches(12)
    expected = pa.Table.from_batches(batches)
    writer = publisher.open_stream("live", max_in_flight=2, on_slow="block", block_timeout=None)
    stop = threading.Event()
    producer = threading.Thread(target=_write_when_subscribed, args=(writer, batches, stop))
    copier = HostCopier(eager=eager)
    pool = StagingPool(copier, buffer_bytes=64 << 10, max_bytes=3 * (64 << 10))
    live = session.subscribe("live", max_in_flight=2)

    def staged() -> Iterator[pa.RecordBatch]:
        for imported in live:
            batch = stage_live_batch(imported, pool)
            try:
                yield from batch
            finally:
                batch.close()

    producer.start()
    prefetched: Prefetcher[pa.RecordBatch, pa.RecordBatch] = Prefetcher(staged(), lambda b: b, depth=1)
    try:
        held: pa.RecordBatch | None = None
        position = chunks = 0
        for batch in prefetched:
            if held is not None:
                assert held.equals(expected.slice(position, held.num_rows).to_batches()[0]), "overwritten"
                position += held.num_rows
            held = batch
            chunks += 1
            assert pool.lent <= 3
        assert held is not None
        assert held.equals(expected.slice(position, held.num_rows).combine_chunks().to_batches()[0])
        assert position + held.num_rows == expected.num_rows
        assert chunks > len(batches)  # the large batches came as several chunks
        assert pool.allocations <= 3
        assert copier.order_calls == len(batches)
        del held, batch
    finally:
        stop.set()
        prefetched.close()
        live.close()
        producer.join(10)
    assert wait_for(lambda: _returned(pool), 5.0), pool.lent
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


@pytest.fixture
def staged_front(
    publisher: aib.Publisher, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[FlightFront, StagingPool, HostCopier]]:
    """A front whose every batch is staged as a GPU batch is, through a pool of sixteen 64 KiB
    buffers over the host copier (lazy: a buffer overwritten while gRPC held it would show)."""
    copier = HostCopier(eager=False)
    pool = StagingPool(copier, buffer_bytes=64 << 10, max_bytes=16 * (64 << 10))
    with serve(publisher, allow_unauthenticated=True, max_in_flight=2) as front:
        monkeypatch.setattr(front, "_needs_staging", lambda imported: True)
        monkeypatch.setattr(front, "_staging_pool", lambda device: pool)
        yield front, pool, copier
    pool.close()


def test_a_staged_live_stream_reaches_a_plain_client_equal(
    publisher: aib.Publisher, staged_front: tuple[FlightFront, StagingPool, HostCopier]
) -> None:
    front, pool, copier = staged_front
    batches = _live_batches(30)
    writer = publisher.open_stream("live", max_in_flight=2, on_slow="block", block_timeout=None)
    stop = threading.Event()
    producer = threading.Thread(target=_write_when_subscribed, args=(writer, batches, stop))
    producer.start()
    try:
        with flight.connect(front.location) as client:
            got = client.do_get(flight.Ticket(b"live")).read_all()
    finally:
        stop.set()
        producer.join(10)
    assert_arrays_equal(got, pa.Table.from_batches(batches))
    assert copier.order_calls == len(batches)  # every batch went through the staging
    # ~50 chunks served by the few buffers one client keeps busy, reused (a whole batch's buffer
    # comes back through a reaper notice, a moment after gRPC drops it: one or two spare).
    assert pool.allocations <= 6, pool.allocations
    assert pool.allocated_bytes <= pool.max_bytes
    del got
    assert wait_for(lambda: pool.lent == 0, 5.0), pool.lent
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_a_stalled_client_of_a_staged_live_stream_holds_a_few_buffers_and_no_lease_past_the_window(
    publisher: aib.Publisher, staged_front: tuple[FlightFront, StagingPool, HostCopier]
) -> None:
    front, pool, _ = staged_front
    batches = [
        pa.record_batch({"seq": pa.array([i] * (32 * 1024), pa.int64())}) for i in range(60)
    ]  # 256 KiB
    writer = publisher.open_stream("live", max_in_flight=2, on_slow="block", block_timeout=None)
    stop = threading.Event()
    producer = threading.Thread(target=_write_when_subscribed, args=(writer, batches, stop))
    producer.start()
    try:
        with flight.connect(front.location) as client:
            reader = client.do_get(flight.Ticket(b"live"))
            try:
                received = [reader.read_chunk().data]
                time.sleep(0.5)
                stalled_at = writer.batches_written
                time.sleep(0.5)
                assert writer.batches_written == stalled_at, "the producer kept writing past a stalled client"
                assert stalled_at < 40, f"{stalled_at} batches written while the client read 1"
                # The chunk gRPC is sending, the one queued, the one the worker copied (and one gRPC
                # may not have dropped yet): not the whole 16-buffer pool.
                assert pool.lent <= 4, pool.lent
                assert writer.leases <= 2  # the subscription's window; staged batches hold none
                while True:
                    try:
                        received.append(reader.read_chunk().data)
                    except StopIteration:
                        break
            except BaseException:
                reader.cancel()  # else the front's send waits for this reader, and its close with it
                raise
    finally:
        stop.set()
        producer.join(10)
    table = pa.Table.from_batches(received)
    assert table.column("seq").to_pylist() == [i for i in range(60) for _ in range(32 * 1024)]
    del received, table
    assert wait_for(lambda: pool.lent == 0, 5.0), pool.lent
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_a_client_leaving_a_staged_live_stream_leaves_nothing_held(
    publisher: aib.Publisher, staged_front: tuple[FlightFront, StagingPool, HostCopier]
) -> None:
    front, pool, _ = staged_front
    writer = publisher.open_stream("live", max_in_flight=2, on_slow="drop_oldest")
    threads_before = threading.active_count()
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set():
            writer.write(_numbers(12_000 if i % 2 else 500, offset=i).combine_chunks().to_batches()[0])
            i += 1
            time.sleep(0.002)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        client = flight.connect(front.location)
        reader = client.do_get(flight.Ticket(b"live"))
        reader.read_chunk()
        reader.read_chunk()
        assert writer.subscribers == 1
        reader.cancel()
        client.close()
        assert wait_for(lambda: writer.subscribers == 0, 10.0), "the front kept the subscription"
        assert wait_for(lambda: writer.leases == 0, 10.0), writer.leases
        assert wait_for(lambda: _returned(pool), 10.0), pool.lent
    finally:
        stop.set()
        producer.join(10)
        writer.close()
    assert wait_for(lambda: threading.active_count() <= threads_before + 1, 10.0)
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)
