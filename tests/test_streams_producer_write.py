"""The writer's per-batch path (docs/streams.md, "Producing"): a ring segment is the batch it holds
and keeps its message object while the layout stays; one C call places a batch given its capsules'
addresses and refuses device data and released structs; a BATCH goes as a header and the message in
one frame; a channel closed here refuses a send in the C core; a subscriber that joins mid-stream
gets every segment's message and descriptor before a batch that only names the segment."""

from __future__ import annotations

import socket
import threading

import pyarrow as pa
import pytest
from helpers.session_rig import wait_for
from test_streams_ring import close_ring, varied

import arrow_ipc_bridge as aib
from arrow_ipc_bridge._ffi import capsule_address, ffi, lib, new_error
from arrow_ipc_bridge.errors import ClosedError, PeerClosedError, ProtocolError
from arrow_ipc_bridge.producer.stream_hub import Batch
from arrow_ipc_bridge.producer.stream_ring import HostRing, RingSegment
from arrow_ipc_bridge.transport import Connection
from arrow_ipc_bridge.transport.channel import Channel, Frame
from arrow_ipc_bridge.wire.capsules import DEVICE_CPU, capsule_struct

pytestmark = pytest.mark.usefixtures("no_leaks")


def _addresses(pair: tuple[object, object]) -> tuple[int, int]:
    schema = capsule_address[lib.AIB_CAPSULE_SCHEMA](pair[0])
    array = capsule_address[lib.AIB_CAPSULE_DEVICE_ARRAY](pair[1])
    assert schema
    assert array
    return schema, array


def _holds(segment: RingSegment, expected: pa.RecordBatch) -> bool:
    with (
        aib.Session() as session,
        session.import_message(segment.message, [segment.buffer.fd]) as imported,
    ):
        return bool(pa.record_batch(imported).equals(expected))


# ---------- the ring's segments are the batches -----------------------------------------------------
def test_a_segment_is_its_batch_and_keeps_its_message_while_the_layout_stays() -> None:
    ring = HostRing("t")
    try:
        first = pa.record_batch({"i": pa.array([1] * 100, pa.int64())})
        second = pa.record_batch({"i": pa.array([2] * 100, pa.int64())})
        third = pa.record_batch({"i": pa.array([3] * 7, pa.int64())})
        fourth = pa.record_batch({"i": pa.array([4.0] * 7, pa.float64())})  # a message as long
        # Kept while placed: the capsules release the batches' structs when they go.
        pairs = [rb.__arrow_c_device_array__() for rb in (first, second, third, fourth)]
        segment = ring.place_at(*_addresses(pairs[0]), True)
        assert isinstance(segment, RingSegment)
        assert isinstance(segment, Batch)
        assert (segment.refs, segment.ring, segment.slot) == (1, True, 0)
        message = segment.message
        assert _holds(segment, first)
        segment.unref()  # the last holder: back to the ring
        assert ring._free == [segment]
        # Other values, the same layout: the same segment, the same message object (not a copy).
        again = ring.place_at(*_addresses(pairs[1]), True)
        assert again is segment
        assert again.message is message
        assert _holds(again, second)
        again.unref()
        # Another layout (fewer rows): a new message, read as the new batch.
        changed = ring.place_at(*_addresses(pairs[2]), True)
        assert changed is segment
        assert changed.message != message
        assert _holds(changed, third)
        changed.unref()
        # Another type, a message of the same length: its bytes are compared, not its length.
        third_message = changed.message
        retyped = ring.place_at(*_addresses(pairs[3]), True)
        assert retyped is segment
        assert len(retyped.message) == len(third_message)
        assert retyped.message != third_message
        assert _holds(retyped, fourth)
        retyped.unref()
    finally:
        close_ring(ring)


def test_a_device_array_off_the_cpu_is_not_placed() -> None:
    """The C call reads the device array's device type: data on a device is not the ring's (the
    writer exports it instead), and no segment is made for it."""
    ring = HostRing("t")
    batch = pa.record_batch({"i": pa.array([5] * 10, pa.int64())})
    pair = batch.__arrow_c_device_array__()
    device_array = capsule_struct(pair[1], "device_array")
    try:
        device_array.device_type = 2  # ARROW_DEVICE_CUDA, as a device producer would say
        assert ring.place_at(*_addresses(pair), True) is None
        assert ring.segments == 0
        device_array.device_type = DEVICE_CPU
        segment = ring.place_at(*_addresses(pair), True)
        assert segment is not None
        assert _holds(segment, batch)
        segment.unref()
        # With a free segment at hand: turned away too, and the segment stays free.
        device_array.device_type = 2
        assert ring.place_at(*_addresses(pair), True) is None
        assert ring._free == [segment]
        assert ring.segments == 1
    finally:
        device_array.device_type = DEVICE_CPU
        close_ring(ring)


def test_a_released_struct_is_refused_with_nothing_placed() -> None:
    ring = HostRing("t")
    batch = pa.record_batch({"i": pa.array([5] * 10, pa.int64())})
    pair = batch.__arrow_c_device_array__()
    array = ffi.addressof(capsule_struct(pair[1], "device_array"), "array")
    array.release(array)  # consumed: its release is NULL now
    try:
        with pytest.raises(ClosedError, match="already consumed or released") as raised:
            ring.place_at(*_addresses(pair), True)
        assert raised.value.reason == "released"
        # The measuring call refused it: no segment was made.
        assert ring.segments == 0
    finally:
        close_ring(ring)


# ---------- the send side -----------------------------------------------------------------------------
def test_a_tail_follows_the_payload_in_the_same_frame(channels: tuple[Channel, Channel]) -> None:
    a, b = channels
    a.send(13, b"head", tail=b"-tail")
    assert b.recv(timeout=5) == Frame(13, b"head-tail", [])
    a.send(13, memoryview(b"view"), tail=b"+")
    assert b.recv(timeout=5) == Frame(13, b"view+", [])


def test_a_bad_tail_is_refused_and_nothing_is_sent(channels: tuple[Channel, Channel]) -> None:
    a, b = channels
    with pytest.raises(ProtocolError, match="tail must be bytes"):
        a.send(13, b"head", tail=bytearray(b"x"))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="over this connection's limit"):
        a.send(13, b"h", tail=b"x" * a.max_payload)  # together over the limit
    a.send(14, b"next")  # the connection goes on: nothing of the refused frames went out
    assert b.recv(timeout=5) == Frame(14, b"next", [])


def test_the_core_refuses_a_send_on_a_channel_closed_here() -> None:
    """The C send checks the channel's closed mark itself (channel.py makes no call of its own
    before it): nothing reaches the socket, and the wrapper names the close."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    raw = lib.aib_channel_new(a.fileno(), 1024)
    try:
        lib.aib_channel_mark_closed(raw)
        err = new_error()
        rc = lib.aib_channel_send(raw, 7, b"x", 1, ffi.NULL, 0, ffi.NULL, 0, 0, err)
        assert rc == lib.AIB_E_PEER_CLOSED
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(16)  # nothing was written
    finally:
        lib.aib_channel_free(raw)
        a.close()
        b.close()
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    cc, cd = Connection(c), Connection(d)
    try:
        cc.channel.close()
        with pytest.raises(PeerClosedError, match="closed by close") as raised:
            cc.channel.send(7, b"x")
        assert raised.value.closed_locally is True  # type: ignore[attr-defined]
    finally:
        cc.close()
        cd.close()


# ---------- subscribers and segments ------------------------------------------------------------------
def test_a_subscriber_joining_mid_stream_gets_each_segment_in_full_first(publisher: aib.Publisher) -> None:
    """Segments the first subscriber knows already (named alone to it) go to a later one with their
    message and descriptor first; layouts change within segments, so messages change under reuse."""
    writer = publisher.open_stream("s", max_in_flight=4)
    joined = threading.Event()
    n = 120

    def run() -> None:
        for i in range(n):
            if i == n // 2:
                assert joined.wait(30)
            writer.write(varied(i % 49))  # no batch too large for the ring: all placed in it
        writer.close()

    with aib.subscribe(publisher.path, "s", timeout=30) as first:
        thread = threading.Thread(target=run)
        thread.start()
        try:
            for i in range(n // 2):
                imported = first.next_batch()
                assert imported is not None
                with imported:
                    assert pa.record_batch(imported).equals(varied(i % 49)), i
            with aib.subscribe(publisher.path, "s", timeout=30) as late:
                joined.set()
                for i in range(n // 2, n):
                    for live in (first, late):
                        imported = live.next_batch()
                        assert imported is not None
                        with imported:
                            assert pa.record_batch(imported).equals(varied(i % 49)), i
                assert late.next_batch() is None
                assert first.next_batch() is None
                assert late.last_sequence == n - 1
                assert first.repeated > 0
                assert late.repeated > 0
        finally:
            joined.set()
            thread.join()


class _SwappedCapsules:
    """A producer whose ``__arrow_c_array__`` answers its capsules in the wrong order."""

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.batch = batch

    def __arrow_c_array__(self, requested_schema: object = None) -> tuple[object, object]:
        schema, array = self.batch.__arrow_c_array__()
        return array, schema


def test_a_write_of_misnamed_capsules_names_them_and_the_stream_goes_on(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s", max_in_flight=2)
    batch = pa.record_batch({"i": pa.array([1, 2], pa.int64())})
    with aib.subscribe(publisher.path, "s", timeout=10) as live:
        with pytest.raises(aib.InvalidArgumentError, match="expected a PyCapsule named 'arrow_schema'"):
            writer.write(_SwappedCapsules(batch))
        assert writer.batches_written == 0  # nothing was sent
        assert writer.write(batch) == 0
        imported = live.next_batch(timeout=10)
        assert imported is not None
        with imported:
            assert pa.record_batch(imported).equals(batch)
        writer.close()


def test_credit_coming_back_wakes_no_thread_waiting_on_the_stream(publisher: aib.Publisher) -> None:
    """RELEASEs notify nobody: the serving thread waits on the stream's condition while the writer
    is active, and a notify per RELEASE woke it only to wait again (a thread switch each time)."""
    writer = publisher.open_stream("s", max_in_flight=4)
    state = writer._state
    notified: list[int] = []
    with aib.subscribe(publisher.path, "s", timeout=30) as live:
        original = state.cond.notify_all

        def counting(n: int = 1) -> None:
            notified.append(n)
            original()

        state.cond.notify_all = counting  # type: ignore[method-assign]
        n = 100
        thread = threading.Thread(target=lambda: [writer.write(varied(i % 4)) for i in range(n)])
        thread.start()
        for i in range(n):
            imported = live.next_batch()
            assert imported is not None
            with imported:
                assert pa.record_batch(imported).equals(varied(i % 4))
        thread.join()
        # 100 batches released, most of them back through the writer's credit reads (RELEASE_MANY
        # frames every half window): no notify (the old code notified once per frame).
        assert writer.leases <= 4  # at most one window held back by the consumer
        assert notified == []
        live.close()  # the rest of the releases, and the end of the subscription (its detach notifies)
        assert wait_for(lambda: writer.leases == 0, 10)
        state.cond.notify_all = original  # type: ignore[method-assign]
    writer.close()
