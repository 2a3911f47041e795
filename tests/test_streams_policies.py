"""What a stream does with a slow consumer: block (and its timeout), drop the oldest, end its
subscription with an error (docs/streams.md, "Slow consumers")."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.usefixtures("no_leaks")


def batch(i: int) -> pa.RecordBatch:
    return pa.record_batch({"i": pa.array([i, i], pa.int64())})


def first_value(imported: aib.ImportedArray) -> int:
    with imported:
        value: int = pa.record_batch(imported).column(0)[0].as_py()
    return value


def take(live: aib.LiveStream) -> aib.ImportedArray:
    imported = live.next_batch()
    assert imported is not None
    return imported


def test_block_waits_for_credit_and_goes_on_when_a_batch_is_released(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("b", max_in_flight=2, on_slow="block", block_timeout=30)
    with aib.subscribe(publisher.path, "b", timeout=30) as live:
        writer.write(batch(0))
        writer.write(batch(1))
        held = [take(live), take(live)]
        done = threading.Event()
        thread = threading.Thread(target=lambda: (writer.write(batch(2)), done.set()))
        thread.start()
        assert not done.wait(0.5)  # blocked: the consumer holds its whole window
        assert writer.batches_written == 2
        held[0].release()
        assert done.wait(10)  # unblocked by the release
        thread.join()
        assert first_value(take(live)) == 2
        held[1].release()
        writer.close()
        assert live.next_batch() is None


def test_block_timeout_raises_and_sends_nothing(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("b", max_in_flight=1, on_slow="block", block_timeout=0.2)
    with aib.subscribe(publisher.path, "b", timeout=30) as live:
        writer.write(batch(0))
        held = take(live)
        started = time.monotonic()
        with pytest.raises(aib.BridgeTimeoutError, match=r"waited 0\.2 s") as info:
            writer.write(batch(1))
        assert info.value.waiting_for == "credit"
        assert time.monotonic() - started >= 0.15
        assert isinstance(info.value, aib.BridgeTimeoutError)
        held.release()
        writer.write(batch(2))  # the stream goes on; the refused batch never existed
        assert first_value(take(live)) == 2
        assert live.dropped == 0
        writer.close()
        assert live.next_batch() is None


def test_drop_oldest_keeps_the_newest_and_counts_the_gap(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("d", max_in_flight=2, on_slow="drop_oldest")
    with aib.subscribe(publisher.path, "d", timeout=30) as live:
        writer.write(batch(0))
        writer.write(batch(1))
        held = [take(live), take(live)]
        started = time.monotonic()
        for i in range(2, 8):  # never blocks: queued (a window's worth), the oldest dropped
            writer.write(batch(i))
        assert time.monotonic() - started < 5
        assert writer.dropped == 4
        for imported in held:
            imported.release()
        assert [first_value(take(live)), first_value(take(live))] == [6, 7]
        assert live.dropped == 4  # the gap in sequence numbers
        assert live.last_sequence == 7
        writer.close()
        assert live.next_batch() is None
        assert live.dropped == 4


def test_error_policy_ends_only_the_slow_consumer(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("e", max_in_flight=2, on_slow="error")
    slow = aib.subscribe(publisher.path, "e", timeout=30)
    fast = aib.subscribe(publisher.path, "e", timeout=30)
    try:
        got: list[int] = []
        for i in range(6):
            writer.write(batch(i))
            got.append(first_value(take(fast)))
            # Credit comes back when the publisher has read the RELEASE: wait for it, or the fast
            # consumer could look slow too (the slow one holds what it was sent: at most 2).
            held_by_slow = min(i + 1, 2)
            assert wait_for(lambda n=held_by_slow: writer.leases == n, 10)
        assert got == list(range(6))
        held = [take(slow), take(slow)]  # it received its window, then was ended
        with pytest.raises(aib.StreamError, match="policy 'error'") as raised:
            slow.next_batch()
        assert raised.value.reason == "slow_consumer"
        with pytest.raises(aib.StreamError) as raised:
            slow.next_batch()  # ended stays ended
        assert raised.value.reason == "slow_consumer"
        assert [first_value(b) for b in held] == [0, 1]  # what it received stays valid
        assert writer.subscribers == 1
        writer.close()
        assert fast.next_batch() is None
    finally:
        slow.close()
        fast.close()


def test_a_consumer_asking_for_a_smaller_window_gets_it(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("w", max_in_flight=8, on_slow="drop_oldest")
    with aib.subscribe(publisher.path, "w", max_in_flight=1, timeout=30) as live:
        assert live.max_in_flight == 1
        assert live.policy == "drop_oldest"
        writer.write(batch(0))
        held = take(live)
        writer.write(batch(1))
        writer.write(batch(2))  # queue of one: 1 dropped
        held.release()
        assert first_value(take(live)) == 2
        assert live.dropped == 1
        writer.close()
        assert live.next_batch() is None


def test_credit_released_while_the_consumer_waits_goes_out_at_once(publisher: aib.Publisher) -> None:
    """Releases are sent a few at a time (RELEASE_MANY), but never held back while the consumer
    waits for a batch: here the producer waits for that very credit."""
    writer = publisher.open_stream("c", max_in_flight=8, on_slow="block", block_timeout=30)
    with aib.subscribe(publisher.path, "c", timeout=20) as live:
        for i in range(8):
            writer.write(batch(i))
        held = [take(live) for _ in range(8)]
        producer = threading.Thread(target=lambda: writer.write(batch(8)))
        producer.start()  # blocked: the consumer holds its whole window
        releaser = threading.Timer(0.3, held[0].release)  # one release, while next_batch waits
        releaser.start()
        assert first_value(take(live)) == 8
        producer.join(10)
        releaser.join()
        for imported in held[1:]:
            imported.release()
        writer.close()
        assert live.next_batch() is None
