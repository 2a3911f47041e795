"""The writer's ring (docs/streams.md, "The data path"): small written batches are copied into
reusable shared segments, sent once per segment and then named; batches arrive equal and in order
across reuse, growth and wrap-around; slow consumers block or lose batches per policy without the
ring growing past what they hold; hostile ring frames raise the documented errors; nothing leaks."""

from __future__ import annotations

import os
import threading

import pyarrow as pa
import pytest
from helpers.session_rig import wait_for
from test_streams_hostile import ScriptedStreamPublisher, _end, scripted, sock_dir  # noqa: F401

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.producer.stream_ring import SMALL_BATCH_BYTES, HostRing, RingSegment
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.transport import protocol, stream_frames
from arrow_ipc_bridge.wire.capsules import capture

pytestmark = pytest.mark.usefixtures("no_leaks")


def varied(i: int) -> pa.RecordBatch:
    """Batches of a few layouts (row counts, string lengths), and every 50th larger than a ring
    segment takes (exported as before): segments are reused, replaced by larger ones and skipped."""
    rows = SMALL_BATCH_BYTES // 8 + 1 if i % 50 == 49 else (100, 3, 100, 700)[i % 4]
    return pa.record_batch(
        {"i": pa.array([i] * rows, pa.int64()), "s": pa.array([f"v{i}" * (1 + i % 3)] * rows)}
    )


def test_written_batches_arrive_equal_and_in_order_across_segment_reuse(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s", max_in_flight=4)
    n = 300
    with aib.connect(publisher.path) as session, session.subscribe("s", timeout=30) as live:

        def run() -> None:
            for i in range(n):
                writer.write(varied(i))
            writer.close()

        thread = threading.Thread(target=run)
        thread.start()
        got = 0
        for imported in live:
            with imported:
                assert pa.record_batch(imported).equals(varied(got)), got
            got += 1
        thread.join()
        assert got == n
        # Reused: 300 batches in a ring near the window (credit 4: at most 4 held, plus the one
        # being written); a batch of a layout its segment held last named the segment alone.
        assert live.repeated > 0
        assert writer._ring.segments <= 2 * 4 + 2
    assert wait_for(lambda: writer.leases == 0, 10)


def test_two_subscribers_read_every_batch_of_a_shared_segment(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s", max_in_flight=2)
    with (
        aib.subscribe(publisher.path, "s", timeout=30) as a,
        aib.subscribe(publisher.path, "s", timeout=30) as b,
    ):

        def run() -> None:
            for i in range(40):
                writer.write(varied(i))
            writer.close()

        thread = threading.Thread(target=run)
        thread.start()
        for i in range(40):
            for live in (a, b):
                imported = live.next_batch()
                assert imported is not None
                with imported:
                    assert pa.record_batch(imported).equals(varied(i))
        thread.join()


def test_a_consumer_that_holds_its_batches_blocks_the_writer(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s", max_in_flight=2, block_timeout=0.3)
    with aib.subscribe(publisher.path, "s", timeout=10) as live:
        writer.write(varied(0))
        writer.write(varied(1))
        held = [live.next_batch(), live.next_batch()]
        with pytest.raises(aib.BridgeTimeoutError) as raised:
            writer.write(varied(2))
        assert raised.value.waiting_for == "credit"
        for imported in held:
            assert imported is not None
            imported.release()
        assert wait_for(lambda: writer.leases == 0, 10)
        writer.write(varied(3))  # a released segment is reused
        imported = live.next_batch()
        assert imported is not None
        with imported:
            assert pa.record_batch(imported).equals(varied(3))
        assert writer._ring.segments == 3  # the refused batch 2 was placed before the write waited


def test_drop_oldest_keeps_the_ring_bounded_by_what_the_consumer_holds(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s", max_in_flight=2, on_slow="drop_oldest")
    with aib.subscribe(publisher.path, "s", timeout=10) as live:
        for i in range(50):
            writer.write(varied(i % 4))  # small ones only
        # 2 leased + 2 queued hold segments (and one is being filled); the 46 dropped gave theirs back.
        assert writer._ring.segments <= 2 + 2 + 1
        assert writer.dropped == 46
        got = []
        for _ in range(4):
            imported = live.next_batch(timeout=5)
            assert imported is not None
            with imported:
                got.append(pa.record_batch(imported).column(0)[0].as_py())
        assert got == [0, 1, 48 % 4, 49 % 4]  # the first two, then the newest two
        assert live.dropped == 46


# ---------- hostile ring frames -----------------------------------------------------------------
def ring_batch(sequence: int, lease: int, ring: HostRing, rb: pa.RecordBatch) -> tuple[int, bytes, list[int]]:
    segment = ring.place(capture(rb))
    assert segment is not None
    header = stream_frames.encode_batch_header(sequence, lease, segment.index, stream_frames.FLAG_RING)
    return (protocol.BATCH, header + segment.message, [os.dup(segment.buffer.fd)])


def close_ring(ring: HostRing) -> None:
    """The test plays the producer: its segments are closed here, the one it placed batches in too."""
    ring.close()
    for segment in ring._segments:
        segment.close()


def test_a_segment_reused_before_it_was_released_is_a_protocol_error(
    scripted,  # noqa: F811
) -> None:
    ring = HostRing("t")
    first = ring_batch(0, 1, ring, pa.record_batch({"i": pa.array([0], pa.int64())}))
    # The same segment named again while the consumer still holds the first batch in it.
    again = (
        protocol.BATCH,
        stream_frames.encode_batch_header(1, 2, 0, stream_frames.FLAG_RING | stream_frames.FLAG_SLOT_AGAIN),
    )
    pub = scripted(pushed=[first, again])
    try:
        with aib.subscribe(pub.path, "s", timeout=10) as live:
            held = live.next_batch()
            assert held is not None
            with pytest.raises(
                aib.ProtocolError, match="reuses ring segment 0 while this consumer still holds"
            ):
                live.next_batch()
            held.release()
    finally:
        close_ring(ring)


def test_a_segment_reused_after_release_carries_the_new_contents_checked(
    scripted,  # noqa: F811
) -> None:
    """Named again after its release, a segment's new contents are read, and checked: offsets the
    producer rewrote past the data raise the content check's ProtocolError."""
    ring = HostRing("t")
    first = ring_batch(0, 1, ring, pa.record_batch({"s": pa.array(["ab", "cd"])}))
    again = (
        protocol.BATCH,
        stream_frames.encode_batch_header(1, 2, 0, stream_frames.FLAG_RING | stream_frames.FLAG_SLOT_AGAIN),
    )
    pub = scripted(pushed=[first, again, (protocol.STREAM_END, _end(None))])
    segment = ring._segments[0]
    try:
        with aib.subscribe(pub.path, "s", timeout=10) as live:
            imported = live.next_batch()
            assert imported is not None
            with imported:
                assert pa.record_batch(imported).column(0).to_pylist() == ["ab", "cd"]
            reaper.settle()
            # The producer rewrites the offsets (int32 at the segment's start) past the 4 data bytes.
            view = segment.buffer.view()
            view[segment.start + 8 : segment.start + 12] = (1000).to_bytes(4, "little")
            with pytest.raises(aib.ProtocolError):
                live.next_batch()
            assert live.next_batch() is None  # the stream goes on: its end
    finally:
        close_ring(ring)


def test_a_ring_batch_claiming_more_than_its_segment_is_refused(
    scripted,  # noqa: F811
) -> None:
    """A message claiming its region is larger than the segment's file: refused before mapping."""
    ring = HostRing("t")
    kind, payload, fds = ring_batch(0, 1, ring, pa.record_batch({"i": pa.array([0], pa.int64())}))
    small = aib.allocate_shared(4096, name="small")  # sealed like a segment, smaller than claimed
    os.close(fds[0])
    pub = scripted(pushed=[(kind, payload, [os.dup(small.fd)]), (protocol.STREAM_END, _end(None))])
    try:
        with aib.subscribe(pub.path, "s", timeout=10) as live:
            with pytest.raises(aib.ProtocolError, match="past the end"):
                live.next_batch()
            assert live.next_batch() is None
    finally:
        small.close()
        close_ring(ring)


def test_a_ring_batch_in_an_unsealed_file_is_refused(
    scripted,  # noqa: F811
) -> None:
    ring = HostRing("t")
    kind, payload, fds = ring_batch(0, 1, ring, pa.record_batch({"i": pa.array([0], pa.int64())}))
    os.close(fds[0])
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, ring._segments[0].size)
    pub = scripted(pushed=[(kind, payload, [unsealed]), (protocol.STREAM_END, _end(None))])
    try:
        with aib.subscribe(pub.path, "s", timeout=10) as live:
            with pytest.raises(aib.ProtocolError, match="ring segment"):
                live.next_batch()
            assert pub.releases.get(timeout=5) == 1  # the refused batch's lease goes back
            assert live.next_batch() is None
    finally:
        close_ring(ring)


# ---------- the ring's one C call (aib_ring_place) ------------------------------------------------
def _holds(message: bytes, segment: RingSegment, expected: pa.RecordBatch) -> bool:
    """Whether the batch a placed message names, read from the segment by a session's import, is
    ``expected``."""
    with aib.Session() as session, session.import_message(message, [segment.buffer.fd]) as imported:
        return bool(pa.record_batch(imported).equals(expected))


def test_place_copies_the_buffers_and_replaces_a_segment_too_small() -> None:
    ring = HostRing("t")
    try:
        first = pa.record_batch({"i": pa.array(range(100), pa.int64()), "s": pa.array(["ab", None] * 50)})
        segment = ring.place(capture(first))
        assert segment is not None
        assert _holds(segment.message, segment, first)
        ring.free(segment)
        # 20,000 int64 rows (160 KB) do not fit the 64 KiB segment: a larger file, same index.
        second = pa.record_batch({"i": pa.array(range(20_000), pa.int64()), "s": pa.array(["x"] * 20_000)})
        grown = ring.place(capture(second))
        assert grown is not None
        assert (grown.index, grown.generation) == (segment.index, segment.generation + 1)
        assert grown.size >= 20_000 * 8
        assert ring.segments == 1
        assert _holds(grown.message, grown, second)
        ring.free(grown)
    finally:
        close_ring(ring)


def test_a_batch_too_large_for_the_ring_makes_no_segment() -> None:
    """A stream of large batches never creates a segment (the batch is measured first)."""
    ring = HostRing("t")
    try:
        rows = SMALL_BATCH_BYTES // 8 + 1
        assert ring.place(capture(pa.record_batch({"i": pa.array([1] * rows, pa.int64())}))) is None
        assert ring.segments == 0
        placed = ring.place(capture(pa.record_batch({"i": pa.array([1], pa.int64())})))
        assert placed is not None
        assert ring.segments == 1
        ring.free(placed)
        # With a free segment at hand the large batch is refused without copying, and it stays free.
        assert ring.place(capture(pa.record_batch({"i": pa.array([1] * rows, pa.int64())}))) is None
        assert ring.segments == 1
        assert len(ring._free) == 1
    finally:
        close_ring(ring)
