"""The consumer's receive of a live stream in one C call (``aib_stream_rx_next``,
cffi_build/stream_consume.c; docs/streams.md, "Consuming"): a repeated slot or ring segment is
imported by the C core from the remembered message; a ring batch refused there gives its lease
back and the stream goes on; a lease released on another thread frees its segment; the counts
(received, dropped, last sequence, repeated) are the C state's."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
from test_streams_hostile import ScriptedStreamPublisher, _end, good_batch, scripted, sock_dir  # noqa: F401
from test_streams_ring import close_ring, ring_batch

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.producer.stream_ring import HostRing
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.transport import protocol, stream_frames

pytestmark = pytest.mark.usefixtures("no_leaks")

RING_AGAIN = stream_frames.FLAG_RING | stream_frames.FLAG_SLOT_AGAIN


def test_a_refused_ring_batch_gives_its_lease_back_and_the_stream_goes_on(
    scripted,  # noqa: F811
) -> None:
    """The content check of a repeated ring segment runs in the C receive: offsets rewritten past
    the data are refused (ProtocolError), that batch's lease goes back at once, it is not counted
    as received, and the next batch of the same segment is imported again."""
    ring = HostRing("t")
    first = ring_batch(0, 1, ring, pa.record_batch({"s": pa.array(["ab", "cd"])}))
    again = [(protocol.BATCH, stream_frames.encode_batch_header(i, i + 1, 0, RING_AGAIN)) for i in (1, 2)]
    pub = scripted(pushed=[first, *again, (protocol.STREAM_END, _end(None))])
    segment = ring._segments[0]
    view = segment.buffer.view()
    try:
        with aib.subscribe(pub.path, "s", timeout=10) as live:
            imported = live.next_batch()
            assert imported is not None
            imported.release()  # its RELEASE may be held back (a few leases per frame)
            reaper.settle()
            good = bytes(view[segment.start + 8 : segment.start + 12])
            view[segment.start + 8 : segment.start + 12] = (1000).to_bytes(4, "little")
            with pytest.raises(aib.ProtocolError, match="checking buffer contents"):
                live.next_batch()
            assert pub.releases.get(timeout=5) == 2  # the refused batch's lease, given back at once
            assert (live.received, live.last_sequence) == (1, 0)
            view[segment.start + 8 : segment.start + 12] = good  # the producer writes a good batch
            imported = live.next_batch()
            assert imported is not None
            with imported:
                assert pa.record_batch(imported).column(0).to_pylist() == ["ab", "cd"]
            assert (live.received, live.last_sequence, live.repeated) == (2, 2, 2)
            assert live.dropped == 1  # sequence 1 was refused: a gap, as for a dropped batch
            assert live.next_batch() is None
        assert sorted(pub.releases.get(timeout=5) for _ in range(2)) == [1, 3]
    finally:
        del view
        close_ring(ring)


def test_a_segment_released_on_another_thread_can_be_named_again(
    scripted,  # noqa: F811
) -> None:
    """The ring segments a consumer holds live in the C receive state, which a release on any
    thread updates: once the batch is released elsewhere, the segment named again is accepted."""
    ring = HostRing("t")
    first = ring_batch(0, 1, ring, pa.record_batch({"i": pa.array([7], pa.int64())}))
    again = (protocol.BATCH, stream_frames.encode_batch_header(1, 2, 0, RING_AGAIN))
    pub = scripted(pushed=[first, again, (protocol.STREAM_END, _end(None))])
    try:
        with aib.subscribe(pub.path, "s", timeout=10) as live:
            held = live.next_batch()
            assert held is not None
            releaser = threading.Thread(target=held.release)
            releaser.start()
            releaser.join()
            reaper.settle()
            imported = live.next_batch()
            assert imported is not None
            with imported:
                assert pa.record_batch(imported).column(0).to_pylist() == [7]
            assert live.next_batch() is None
        assert sorted([pub.releases.get(timeout=5), pub.releases.get(timeout=5)]) == [1, 2]
    finally:
        close_ring(ring)


def test_remembered_slot_batches_are_the_c_cores_and_count_gaps(
    scripted,  # noqa: F811
) -> None:
    """A slot's repeats are imported by the C core (remembered_gets, no Python import); a jump in
    the sequence numbers counts as dropped batches."""
    repeats = [
        (protocol.BATCH, stream_frames.encode_batch_header(seq, seq + 10, 3, stream_frames.FLAG_SLOT_AGAIN))
        for seq in (1, 4, 5)
    ]
    pub = scripted(pushed=[good_batch(0, 10, slot=3), *repeats, (protocol.STREAM_END, _end(None))])
    with aib.subscribe(pub.path, "s", timeout=10) as live:
        first = live.next_batch()
        assert first is not None
        first.release()
        before = aib.stats().session
        values = []
        for imported in live:
            with imported:
                values.append(pa.record_batch(imported).column(0)[0].as_py())
        after = aib.stats().session
        assert values == [0, 0, 0]
        assert after.remembered_gets - before.remembered_gets == 3
        assert after.python_imports == before.python_imports
        assert (live.received, live.repeated, live.last_sequence, live.dropped) == (4, 3, 5, 2)
