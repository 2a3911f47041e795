"""Lifetime of live streams: a consumer that disconnects or is killed frees what it held; a producer
that dies or closes gives consumers a clear error while the batches they hold stay valid
(docs/streams.md, "Lifetime")."""

from __future__ import annotations

import os
import signal
import threading

import pyarrow as pa
import pytest
from helpers import stream_children
from helpers.session_rig import SPAWN, fd_count, wait_for

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.usefixtures("no_leaks")


def batch(i: int) -> pa.RecordBatch:
    return pa.record_batch({"i": pa.array([i] * 3, pa.int64())})


def test_a_consumer_closing_mid_stream_frees_its_leases(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s", max_in_flight=4)
    live = aib.subscribe(publisher.path, "s", timeout=30)
    for i in range(4):
        writer.write(batch(i))
    held = [live.next_batch() for _ in range(2)]
    assert wait_for(lambda: writer.leases == 4, 10)
    live.close()  # the two held and the two unread go back
    assert wait_for(lambda: writer.leases == 0 and writer.subscribers == 0, 10)
    writer.write(batch(9))  # no one blocks the producer any more
    del held
    writer.close()


def test_a_killed_consumer_frees_its_leases_and_unblocks_the_producer(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("k", max_in_flight=2, on_slow="block", block_timeout=60)
    ready = SPAWN.Event()
    child = SPAWN.Process(
        target=stream_children.holding_consumer_main, args=(publisher.path, "k", 2, ready), daemon=True
    )
    child.start()
    try:
        assert wait_for(lambda: writer.subscribers == 1, 60)
        writer.write(batch(0))
        writer.write(batch(1))
        assert ready.wait(60)
        done = threading.Event()
        thread = threading.Thread(target=lambda: (writer.write(batch(2)), done.set()))
        thread.start()
        assert not done.wait(0.3)  # blocked by the child, which holds its window
        os.kill(child.pid, signal.SIGKILL)
        assert done.wait(30)  # its connection closed: its leases ended, the write went on
        thread.join()
        assert wait_for(lambda: writer.leases == 0 and writer.subscribers == 0, 10)
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        writer.close()


def test_a_killed_producer_gives_a_clear_error_and_held_batches_stay_valid(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "prod.sock")
    ready = SPAWN.Event()
    child = SPAWN.Process(target=stream_children.streaming_producer_main, args=(path, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(60)
        with aib.subscribe(path, "live", timeout=30) as live:
            held = live.next_batch()
            assert held is not None
            value = pa.record_batch(held).column(0)[0].as_py()
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
            error: BaseException | None = None
            for _ in range(10):  # what was in the socket first (at most its window), then the error
                try:
                    more = live.next_batch()
                except aib.PeerClosedError as exc:
                    error = exc
                    break
                assert more is not None
                more.release()
            assert isinstance(error, aib.PeerClosedError)
            assert "went away mid-stream" in str(error)
            # The held batch's memory is still mapped and unchanged.
            assert pa.record_batch(held).column(0).to_pylist() == [value] * 8
            held.release()
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        child.join(10)


def test_publisher_close_ends_open_streams_with_an_error(sock_dir: str) -> None:
    pub = aib.Publisher(os.path.join(sock_dir, "p.sock"))
    writer = pub.open_stream("s")
    live = aib.subscribe(pub.path, "s", timeout=30)
    try:
        writer.write(batch(1))
        pub.close()
        first = live.next_batch()
        assert first is not None
        with first:
            assert pa.record_batch(first).column(0)[0].as_py() == 1
        with pytest.raises(aib.PeerClosedError, match="publisher closed"):
            live.next_batch()
        with pytest.raises(aib.BridgeError, match="closed"):
            writer.write(batch(2))
    finally:
        live.close()
        pub.close()


def test_batches_outlive_their_stream_and_subscription(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s")
    live = aib.subscribe(publisher.path, "s", timeout=30)
    writer.write(batch(4))
    writer.close()
    imported = live.next_batch()
    assert imported is not None
    rb = pa.record_batch(imported)  # a consumer's struct holds the mapping
    imported.release()
    assert live.next_batch() is None
    live.close()
    assert rb.column(0).to_pylist() == [4, 4, 4]
    del rb


def test_publisher_close_frees_the_slots_of_an_open_stream(sock_dir: str) -> None:
    """Reserved slots (shared memory and their descriptors) go when the publisher closes with the
    stream still open: free ones then, held ones when their consumer releases them, a reserved one
    at its commit."""
    base = fd_count()
    pub = aib.Publisher(os.path.join(sock_dir, "p.sock"))
    schema = pa.schema([("i", pa.int64())])
    layout = aib.SlotLayout(schema, rows=4, count=4)
    # drop_oldest: every release goes at once (never reached: the window is not exceeded)
    writer = pub.open_stream("s", max_in_flight=4, on_slow="drop_oldest", slots=layout)
    live = aib.subscribe(pub.path, "s", timeout=30)
    try:
        for i in range(3):
            slot = writer.reserve(timeout=10)
            slot.columns[0][:] = i
            slot.commit()
        reserved = writer.reserve(timeout=10)  # a fourth slot
        first = live.next_batch()
        assert first is not None
        first.release()  # its slot is free again ...
        assert wait_for(lambda: writer.leases == 2, 10)
        second = live.next_batch()  # ... this one is held across the close
        pub.close()
        with pytest.raises(aib.BridgeError, match="closed"):
            reserved.commit()
        assert second is not None
        assert pa.record_batch(second).column(0).to_pylist() == [1] * 4
        second.release()
        live.close()
        # Every slot's memory and descriptor is gone while the writer object still lives.
        assert wait_for(lambda: fd_count() == base, 10), f"{fd_count()} descriptors open, {base} before"
        assert writer.closed
    finally:
        live.close()
        pub.close()


def test_subscriptions_past_max_subscriptions_are_refused_clearly(sock_dir: str) -> None:
    """Each subscription holds a publisher thread for its whole life: past ``max_subscriptions`` a
    SUBSCRIBE gets LimitError (a LimitError and a StreamError), its connection
    is closed, and the publisher's GETs and other subscriptions go on; a closed subscription frees
    its place."""
    with pytest.raises(ValueError, match="max_subscriptions"):
        aib.Publisher(os.path.join(sock_dir, "bad.sock"), max_subscriptions=0)
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), max_subscriptions=2) as pub:
        writer = pub.open_stream("s", max_in_flight=2)
        pub.publish("t", pa.array([1, 2]))
        first = aib.subscribe(pub.path, "s", timeout=30)
        second = aib.subscribe(pub.path, "s", timeout=30)
        refused_before = aib.stats().streams.subscriptions_refused
        with pytest.raises(aib.LimitError, match="max_subscriptions") as refused:
            aib.subscribe(pub.path, "s", timeout=30)
        assert refused.value.limit == "max_subscriptions"
        assert refused.value.value == 2  # the publisher's max_subscriptions
        assert aib.stats().streams.subscriptions_refused == refused_before + 1
        with aib.connect(pub.path) as session, session.get("t") as got:  # GETs are served as before
            assert pa.array(got).to_pylist() == [1, 2]
        writer.write(batch(1))
        for live in (first, second):
            got_batch = live.next_batch()
            assert got_batch is not None
            got_batch.release()
        first.close()
        # Its serving thread gives its place back once it has seen the connection end.
        assert wait_for(lambda: pub._streams.subscriptions == 1, 10)
        third = aib.subscribe(pub.path, "s", timeout=30)  # the closed one's place
        writer.close()
        assert third.next_batch() is None
        third.close()
        second.close()
