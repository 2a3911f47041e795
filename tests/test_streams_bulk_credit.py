"""Credit in bulk and bounded looks (docs/streams.md, "Slow consumers"): under policy "block" a
consumer that keeps up gives its leases back a few per frame even while it waits for batches; it
sends what it holds back at once when the producer may be out of credit for it, and before it sleeps;
its look for a batch without sleeping is skipped after a wait longer than the look."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.consumer import live_stream
from arrow_ipc_bridge.producer import stream_hub
from arrow_ipc_bridge.transport.channel import Frame

pytestmark = pytest.mark.usefixtures("no_leaks")


def batch(i: int) -> pa.RecordBatch:
    return pa.record_batch({"i": pa.array([i] * 10, pa.int64())})


@pytest.fixture
def release_frames(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lease count of every RELEASE / RELEASE_MANY the publisher reads, in order."""
    seen: list[int] = []
    decode = stream_hub.release_frame_ids

    def counting(frame: Frame) -> tuple[int, ...]:
        ids = decode(frame)
        seen.append(len(ids))
        return ids

    monkeypatch.setattr(stream_hub, "release_frame_ids", counting)
    return seen


def test_a_consumer_waiting_for_each_batch_gives_credit_back_a_few_leases_per_frame(
    publisher: aib.Publisher, release_frames: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The producer writes a batch per millisecond; the consumer, always ahead, waits for each one
    # looking (a long look, so it never sleeps mid-stream). Each wait once sent the one lease it
    # had released: now the leases go 4 to a frame (half the window of 8).
    monkeypatch.setattr(live_stream, "SPIN_S", 5.0)
    writer = publisher.open_stream("s", max_in_flight=8, block_timeout=10)
    n = 80
    got: list[int] = []
    with aib.subscribe(publisher.path, "s", timeout=10) as live:
        assert wait_for(lambda: writer.subscribers == 1, 5)

        def produce() -> None:
            for i in range(n):
                writer.write(batch(i))
                time.sleep(0.001)
            writer.close()

        producer = threading.Thread(target=produce)
        producer.start()
        for imported in live:
            with imported:
                got.append(pa.record_batch(imported).column(0)[0].as_py())
        producer.join(10)
    assert got == list(range(n))
    assert wait_for(lambda: writer.leases == 0, 5)
    assert sum(release_frames) == n
    assert len(release_frames) <= n // 4 + 2, release_frames


def test_credit_the_producer_waits_for_goes_at_once_not_after_the_look(
    publisher: aib.Publisher, release_frames: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The consumer holds 5 batches of its window of 8 and released 3 (under the 4 it sends at):
    # the producer's next write waits for that credit, so the consumer's next wait sends it at
    # once instead of looking for a batch first (a look of 3 s here).
    monkeypatch.setattr(live_stream, "SPIN_S", 3.0)
    writer = publisher.open_stream("s", max_in_flight=8, block_timeout=10)
    with aib.subscribe(publisher.path, "s", timeout=10) as live:
        assert wait_for(lambda: writer.subscribers == 1, 5)
        for i in range(8):
            writer.write(batch(i))
        taken = [live.next_batch() for _ in range(8)]
        for imported in taken[:3]:
            assert imported is not None
            imported.release()
        assert release_frames == []  # held back: 3 of the 4 it sends at
        producer = threading.Thread(target=writer.write, args=(batch(8),))
        producer.start()
        started = time.monotonic()
        ninth = live.next_batch()
        assert time.monotonic() - started < 1.5
        assert ninth is not None
        assert pa.record_batch(ninth).column(0)[0].as_py() == 8
        producer.join(5)
        ninth.release()
        for imported in taken[3:]:
            assert imported is not None
            imported.release()
        writer.close()
        assert live.next_batch() is None
    assert wait_for(lambda: writer.leases == 0, 5)


def test_a_slow_producer_is_waited_for_asleep_after_one_long_wait(
    publisher: aib.Publisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch every 0.4 s and a look of 0.2 s: the first wait looks (0.2 s of CPU) and then
    # sleeps; later waits sleep at once, costing (almost) no CPU while the producer is slow.
    monkeypatch.setattr(live_stream, "SPIN_S", 0.2)
    writer = publisher.open_stream("s", max_in_flight=8)
    cpu: list[float] = []
    with aib.subscribe(publisher.path, "s", timeout=10) as live:
        assert wait_for(lambda: writer.subscribers == 1, 5)
        for i in range(3):
            timer = threading.Timer(0.4, writer.write, args=(batch(i),))
            timer.start()
            before = time.thread_time()
            imported = live.next_batch()
            cpu.append(time.thread_time() - before)
            timer.join()
            assert imported is not None
            imported.release()
        writer.close()
        assert live.next_batch() is None
    assert cpu[0] > 0.1, cpu  # the first wait looked
    assert max(cpu[1:]) < 0.05, cpu  # the later ones did not
    assert wait_for(lambda: writer.leases == 0, 5)


def test_a_write_waiting_for_a_slow_consumer_sleeps_at_once_after_one_long_wait(
    publisher: aib.Publisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window of 1 and a consumer that releases each batch 0.4 s after it came, a look of 0.2 s:
    # the first write that waits looks (0.2 s of CPU), the later ones sleep at once.
    monkeypatch.setattr(stream_hub, "SPIN_S", 0.2)
    writer = publisher.open_stream("s", max_in_flight=1, block_timeout=10)
    n = 4
    with aib.subscribe(publisher.path, "s", max_in_flight=1, timeout=10) as live:
        assert wait_for(lambda: writer.subscribers == 1, 5)

        def consume() -> None:
            for _ in range(n):
                imported = live.next_batch()
                assert imported is not None
                time.sleep(0.4)
                imported.release()

        consumer = threading.Thread(target=consume)
        consumer.start()
        cpu: list[float] = []
        for i in range(n):
            before = time.thread_time()
            writer.write(batch(i))
            cpu.append(time.thread_time() - before)
        consumer.join(10)
        writer.close()
        assert live.next_batch() is None
    assert cpu[1] > 0.1, cpu  # the first write that waited looked
    assert max(cpu[2:]) < 0.05, cpu  # the later ones did not
    assert wait_for(lambda: writer.leases == 0, 5)
