"""Live streams end to end in one process: write / publish_stream, iteration in order, the C stream
interface, the end and a producer's error, schema changes, reserved slots (docs/streams.md)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pyarrow as pa
import pytest
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.usefixtures("no_leaks")


def batch(i: int, rows: int = 4) -> pa.RecordBatch:
    return pa.record_batch({"i": pa.array([i] * rows, pa.int64()), "s": pa.array([f"v{i}"] * rows)})


def produce(writer: aib.StreamWriter, n: int, *, close: bool = True) -> threading.Thread:
    def run() -> None:
        for i in range(n):
            writer.write(batch(i))
        if close:
            writer.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def values(live: aib.LiveStream) -> list[int]:
    out = []
    for imported in live:
        with imported:
            rb = pa.record_batch(imported)
            out.append(rb.column(0)[0].as_py())
            assert rb.column(1)[0].as_py() == f"v{out[-1]}"  # intact
    return out


def test_write_then_iterate_in_order_until_the_end(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s", max_in_flight=4)
    with aib.connect(publisher.path) as session, session.subscribe("s", timeout=30) as live:
        assert writer.subscribers == 1
        thread = produce(writer, 300)
        assert values(live) == list(range(300))
        thread.join()
        assert live.ended
        assert live.dropped == 0
        assert live.received == 300
        assert live.next_batch() is None  # the end, again
    assert wait_for(lambda: writer.leases == 0, 10)  # the publisher reads the close in its own time


def test_hundred_thousand_small_batches_arrive_in_order_and_intact(publisher: aib.Publisher) -> None:
    """The issue's count, in CI (about 6 s on the 2-core machine): reserved host slots cycled by
    the producer, every value of every batch checked by the consumer."""
    schema = pa.schema([("i", pa.int64()), ("x", pa.float64())])
    writer = publisher.open_stream("s", max_in_flight=8, slots=aib.SlotLayout(schema, rows=8))
    n = 100_000

    def run() -> None:
        for i in range(n):
            slot = writer.reserve()
            slot.columns[0][:] = i
            slot.columns[1][:] = i * 0.5
            slot.commit()
        writer.close()

    with aib.subscribe(publisher.path, "s", timeout=60) as live:
        thread = threading.Thread(target=run)
        thread.start()
        seen = 0
        for imported in live:
            with imported:
                rb = pa.record_batch(imported)
                assert rb.column(0).to_pylist() == [seen] * 8
                assert rb.column(1).to_pylist() == [seen * 0.5] * 8
            seen += 1
        thread.join()
        assert live.dropped == 0
    assert seen == n


def test_publish_stream_pumps_an_iterable_and_a_reader(publisher: aib.Publisher) -> None:
    for name, source in (
        ("list", [batch(i) for i in range(20)]),
        ("reader", pa.RecordBatchReader.from_batches(batch(0).schema, (batch(i) for i in range(20)))),
        ("table", pa.Table.from_batches([batch(i) for i in range(20)])),
    ):
        with _subscribe_then_pump(publisher, name, source) as live:
            assert values(live) == list(range(20)), name


class _subscribe_then_pump:
    """publish_stream waiting for its subscriber (a stream delivers from the moment one joins)."""

    def __init__(self, publisher: aib.Publisher, name: str, source: object) -> None:
        self.writer = publisher.publish_stream(name, source, wait_for_subscribers=1)
        self.live = aib.subscribe(publisher.path, name, timeout=30)

    def __enter__(self) -> aib.LiveStream:
        return self.live

    def __exit__(self, *exc: object) -> None:
        self.live.close()


def test_publish_stream_of_an_infinite_generator_runs_until_closed(publisher: aib.Publisher) -> None:
    def forever() -> Iterator[pa.RecordBatch]:
        i = 0
        while True:
            yield batch(i)
            i += 1

    writer = publisher.publish_stream("inf", forever(), max_in_flight=2)
    with aib.subscribe(publisher.path, "inf", timeout=30) as live:
        firsts = []
        for _ in range(5):
            imported = live.next_batch()
            assert imported is not None
            with imported:
                firsts.append(pa.record_batch(imported).column(0)[0].as_py())
        assert firsts == sorted(firsts)
        assert len(set(firsts)) == 5
        writer.close()  # the pump stops at its next write
        rest = values(live)
        assert rest == sorted(rest)


def test_producer_error_reaches_iteration_after_the_batches(publisher: aib.Publisher) -> None:
    def failing() -> Iterator[pa.RecordBatch]:
        yield batch(0)
        yield batch(1)
        raise RuntimeError("sensor unplugged")

    publisher.open_stream("probe").close()
    with _subscribe_then_pump(publisher, "f", failing()) as live:
        first = [b for b in (live.next_batch(), live.next_batch()) if b is not None]
        assert len(first) == 2
        with pytest.raises(aib.StreamError, match="sensor unplugged") as info:
            live.next_batch()
        assert info.value.reason == "failed"
        assert info.value.producer_error == "RuntimeError"
        # The batches received before the error stay valid.
        assert [pa.record_batch(b).column(0)[0].as_py() for b in first] == [0, 1]
        for b in first:
            b.release()


def test_c_stream_interface_end_and_error_through_pyarrow(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("c")
    with aib.subscribe(publisher.path, "c", timeout=30) as live:
        thread = produce(writer, 30)
        reader = pa.RecordBatchReader.from_stream(live)
        # One batch at a time: each record batch holds its lease until dropped (read_all would
        # hold all 30, more than the window of 8, and block the producer).
        got = [rb.column("i")[0].as_py() for rb in reader]
        thread.join()
        assert got == list(range(30))
        del reader

    writer = publisher.open_stream("e")
    with aib.subscribe(publisher.path, "e", timeout=30) as live:
        writer.write(batch(7))
        writer.fail(ValueError("bad frame from the camera"))
        reader = pa.RecordBatchReader.from_stream(live)
        assert reader.read_next_batch().column(0)[0].as_py() == 7
        # get_next fails; get_last_error carries the producer's error (pyarrow raises it).
        with pytest.raises(Exception, match="bad frame from the camera"):
            reader.read_next_batch()
        del reader


def test_schema_change_mid_stream_is_refused(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s")
    with aib.subscribe(publisher.path, "s", timeout=30) as live:
        writer.write(batch(0))
        with pytest.raises(aib.StreamError, match="differs") as raised:
            writer.write(pa.record_batch({"i": pa.array([1.5])}))
        assert raised.value.reason == "schema"
        with pytest.raises(aib.StreamError, match="not a table") as raised:
            writer.write(pa.table({"i": pa.array([1], pa.int64()), "s": pa.array(["x"])}))
        assert raised.value.reason == "schema"
        writer.write(batch(1))
        writer.close()
        assert values(live) == [0, 1]  # nothing of the refused ones was sent


def test_reserved_slots_are_reused_only_after_release(publisher: aib.Publisher) -> None:
    schema = pa.schema([("x", pa.float32())])
    writer = publisher.open_stream("r", max_in_flight=2, slots=aib.SlotLayout(schema, rows=4, count=2))
    with aib.subscribe(publisher.path, "r", timeout=30) as live:
        slots = []
        for i in range(2):
            slot = writer.reserve()
            slot.columns[0][:] = i
            slot.commit()
            slots.append(slot)
        held = [live.next_batch() for _ in range(2)]
        with pytest.raises(aib.BridgeTimeoutError, match="slots are held") as raised:
            writer.reserve(timeout=0.2)  # both held by the consumer
        assert raised.value.waiting_for == "credit"
        assert held[0] is not None
        held[0].release()
        again = writer.reserve(timeout=10)
        assert again is slots[0]  # the released one, memory reused in place
        with pytest.raises(aib.StreamError, match="larger than the reserved memory") as raised:
            again.commit(rows=5)
        assert raised.value.reason == "schema"
        again.columns[0][:] = 9
        again.commit(rows=3)  # fewer rows: exported anew over the same memory
        third = live.next_batch()
        assert third is not None
        with third:
            assert pa.record_batch(third).column(0).to_pylist() == [9, 9, 9]
        assert held[1] is not None
        with held[1]:
            assert pa.record_batch(held[1]).column(0).to_pylist() == [1.0] * 4
        writer.close()
        assert live.next_batch() is None


def test_fan_out_to_four_consumers_and_late_join(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("f", max_in_flight=4)
    lives = [aib.subscribe(publisher.path, "f", timeout=30) for _ in range(4)]
    try:
        results: list[list[int]] = [[] for _ in lives]
        readers = [threading.Thread(target=lambda k=k: results[k].extend(values(lives[k]))) for k in range(4)]
        for t in readers:
            t.start()
        for i in range(50):
            writer.write(batch(i))
        late = aib.subscribe(publisher.path, "f", timeout=30)
        lives.append(late)
        late_values: list[int] = []
        readers.append(threading.Thread(target=lambda: late_values.extend(values(late))))
        readers[-1].start()
        for i in range(50, 60):
            writer.write(batch(i))
        writer.close()
        for t in readers:
            t.join(30)
        assert results == [list(range(60))] * 4  # every consumer, every batch, in order
        assert late_values == list(range(50, 60))  # from now on
    finally:
        for live in lives:
            live.close()


def test_subscribe_to_a_missing_or_ended_stream(publisher: aib.Publisher) -> None:
    with pytest.raises(aib.NotPublishedError, match="no stream"):
        aib.subscribe(publisher.path, "nothing")
    publisher.open_stream("gone").close()
    with pytest.raises(aib.NotPublishedError):
        aib.subscribe(publisher.path, "gone")
    publisher.publish("table", batch(0))  # a published name is not a stream
    with pytest.raises(aib.NotPublishedError):
        aib.subscribe(publisher.path, "table")
    publisher.unpublish("table")


def test_open_stream_arguments_are_checked(publisher: aib.Publisher) -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        publisher.open_stream("x", max_in_flight=0)
    with pytest.raises(ValueError, match="on_slow"):
        publisher.open_stream("x", on_slow="later")
    writer = publisher.open_stream("x")
    with pytest.raises(ValueError, match="open already"):
        publisher.open_stream("x")
    assert publisher.stream_names() == ["x"]
    writer.close()
    with pytest.raises(aib.ClosedError, match="closed"):
        writer.write(batch(0))
    assert publisher.stream_names() == []
    with pytest.raises(ValueError, match="max_in_flight"):
        aib.subscribe(publisher.path, "x", max_in_flight=0)
    with pytest.raises(aib.InvalidArgumentError, match="numeric"):
        publisher.open_stream("y", slots=aib.SlotLayout(pa.schema([("s", pa.string())]), rows=1))


def test_session_subscribe_uses_its_own_connection(publisher: aib.Publisher) -> None:
    publisher.publish("t", batch(5))
    writer = publisher.open_stream("s")
    with aib.connect(publisher.path) as session, session.subscribe("s", timeout=30) as live:
        writer.write(batch(1))
        with session.get("t") as got:  # requests on the session go on between batches
            assert pa.record_batch(got).column(0)[0].as_py() == 5
        writer.close()
        assert values(live) == [1]
    publisher.unpublish("t")
    assert os.path.exists(publisher.path)


def test_reserved_host_slots_are_imported_as_remembered_messages(publisher: aib.Publisher) -> None:
    """Each slot's message is sent again unchanged: after a slot's first batch the consumer imports
    it as a message it remembers (no decode, no mapping), one remembered message per slot."""
    schema = pa.schema([("i", pa.int32())])
    writer = publisher.open_stream("r", max_in_flight=3, slots=aib.SlotLayout(schema, rows=4, count=3))
    with aib.subscribe(publisher.path, "r", timeout=30) as live:
        before = aib.stats().session
        held: list[aib.ImportedArray] = []
        used = set()
        for i in range(30):
            slot = writer.reserve(timeout=10)
            used.add(slot.index)
            slot.columns[0][:] = i
            slot.commit()
            imported = live.next_batch()
            assert imported is not None
            assert pa.record_batch(imported).column(0).to_pylist() == [i] * 4
            held.append(imported)
            if len(held) == 3:  # two stay held: the next reserve gets the third slot
                held.pop(0).release()
        for imported in held:
            imported.release()
        after = aib.stats().session
        assert used == {0, 1, 2}
        assert after.python_imports - before.python_imports <= 3  # each slot's first batch
        # every later batch: the remembered message imported by the C core in the receive itself
        assert after.remembered_gets - before.remembered_gets >= 27
        assert after.python_remembered_imports == before.python_remembered_imports
        assert live.repeated == 27  # after its first batch a slot travels without message or fds
        writer.close()


def test_c_device_stream_get_next_end_and_last_error(publisher: aib.Publisher) -> None:
    """The ArrowDeviceArrayStream's functions called as a C consumer would: a batch per get_next
    (host device type, no event), then the producer's error as EIO and get_last_error."""
    from arrow_ipc_bridge._ffi import ffi
    from arrow_ipc_bridge.wire.capsules import DEVICE_CPU, capsule_struct

    writer = publisher.open_stream("d")
    with aib.subscribe(publisher.path, "d", timeout=30) as live:
        writer.write(batch(3))
        writer.write(batch(4))
        writer.fail(OSError("disk gone"))
        capsule = live.__arrow_c_device_stream__()
        stream = capsule_struct(capsule, "device_stream")
        assert stream.device_type == DEVICE_CPU
        schema = ffi.new("struct ArrowSchema *")
        assert stream.get_schema(stream, schema) == 0
        assert ffi.string(schema.format) == b"+s"
        assert schema.n_children == 2
        schema.release(schema)
        got = []
        for _ in range(2):
            out = ffi.new("struct ArrowDeviceArray *")
            assert stream.get_next(stream, out) == 0
            assert out.sync_event == ffi.NULL
            got.append(out.array.length)
            out.array.release(ffi.addressof(out.array))  # ends the batch's lease
        assert got == [4, 4]
        out = ffi.new("struct ArrowDeviceArray *")
        assert stream.get_next(stream, out) == 5  # EIO
        error = ffi.string(stream.get_last_error(stream)).decode()
        assert "StreamError" in error
        assert "disk gone" in error
        del capsule  # releases the stream
    assert wait_for(lambda: writer.leases == 0, 10)  # the publisher reads the close in its own time


class _DeviceStreamOnly:
    """An Arrow producer offering only ``__arrow_c_device_stream__`` (as device libraries do)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __arrow_c_device_stream__(self, requested_schema: object | None = None) -> object:
        return self.inner.__arrow_c_device_stream__(requested_schema)  # type: ignore[attr-defined]


def test_publish_stream_reads_a_device_stream_batch_by_batch(publisher: aib.Publisher) -> None:
    table = pa.Table.from_batches([batch(i) for i in range(5)])
    exported = aib.export(table)
    with (
        aib.Session() as local,
        local.import_message(exported.message, exported.fds) as imported,
        _subscribe_then_pump(publisher, "dev", _DeviceStreamOnly(imported)) as live,
    ):
        assert values(live) == list(range(5))
    exported.close()


def test_a_slot_used_as_a_context_manager_is_given_back_unless_committed(publisher: aib.Publisher) -> None:
    """A reserved slot the producer does not commit (an exception while filling it, a refused
    commit, or no commit at all) goes back to the stream at the end of its ``with`` block instead of
    staying reserved; one committed in the block is the stream's (not freed twice)."""
    schema = pa.schema([("x", pa.float32())])
    writer = publisher.open_stream("cm", max_in_flight=2, slots=aib.SlotLayout(schema, rows=4, count=1))
    with aib.subscribe(publisher.path, "cm", timeout=30) as live:
        with pytest.raises(RuntimeError, match="while filling"), writer.reserve() as slot:
            raise RuntimeError("while filling")
        assert not slot.reserved
        with writer.reserve(timeout=5) as again:  # the only slot: it was given back
            assert again is slot
            with pytest.raises(aib.StreamError) as raised:
                again.commit(rows=5)  # refused: still reserved, given back at the block's end
            assert raised.value.reason == "schema"
        with writer.reserve(timeout=5) as slot:
            slot.columns[0][:] = 7
            slot.commit()
        assert not slot.reserved
        with pytest.raises(aib.BridgeTimeoutError, match="slots are held") as raised:
            writer.reserve(timeout=0.2)  # committed: the consumer holds it, the block gave nothing back
        assert raised.value.waiting_for == "credit"
        got = live.next_batch()
        assert got is not None
        with got:
            assert pa.record_batch(got).column(0).to_pylist() == [7.0] * 4
        with writer.reserve(timeout=10) as slot:
            slot.abandon()  # abandoned in the block: the block's end does nothing more
        assert writer._free == [slot]  # once, not twice
        writer.close()
        assert live.next_batch() is None
