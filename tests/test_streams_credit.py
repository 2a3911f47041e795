"""Credit read by the writer itself (docs/streams.md, "Slow consumers"): while the producer writes,
the subscribers' serving threads stay off their sockets, so the RELEASEs a write needs, a consumer
gone and a hostile frame are all handled by the write. Each test keeps the serving threads parked for
its whole length (``WRITER_ACTIVE_S`` made long), so only the writer can read what comes."""

from __future__ import annotations

import struct
import threading
import time

import pyarrow as pa
import pytest
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge.producer import stream_hub
from arrow_ipc_bridge.transport import protocol, stream_frames


def batch(i: int) -> pa.RecordBatch:
    return pa.record_batch({"i": pa.array([i] * 10, pa.int64())})


@pytest.fixture
def parked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving threads that never read while the test writes (the writer is 'active' for 60 s)."""
    monkeypatch.setattr(stream_hub, "WRITER_ACTIVE_S", 60.0)


def consume(path: str, name: str, window: int, count: int, out: list[int]) -> None:
    with aib.subscribe(path, name, max_in_flight=window, timeout=10) as live:
        for imported in live:
            out.append(pa.record_batch(imported).column(0)[0].as_py())
            imported.release()
            if len(out) == count:
                return


def test_the_writer_reads_the_credit_it_needs(publisher: aib.Publisher, parked: None) -> None:
    # A window of 2 and 200 batches, the serving thread parked: without the write reading the
    # RELEASEs itself it would time out ("block").
    writer = publisher.open_stream("s", max_in_flight=2, block_timeout=5.0)
    got: list[int] = []
    consumer = threading.Thread(target=consume, args=(publisher.path, "s", 2, 200, got))
    consumer.start()
    assert wait_for(lambda: writer.subscribers == 1, 5)
    for i in range(200):
        writer.write(batch(i))
    consumer.join(10)
    assert got == list(range(200))
    writer.close()


@pytest.mark.parametrize("policy", ["error", "drop_oldest"])
def test_a_consumer_that_keeps_up_is_not_slow(publisher: aib.Publisher, policy: str) -> None:
    # These policies never wait: a write short of credit reads what the consumer sent back first,
    # so a consumer that released its batches is neither ended nor dropped for.
    writer = publisher.open_stream("s", max_in_flight=2, on_slow=policy)
    got: list[int] = []
    consumer = threading.Thread(target=consume, args=(publisher.path, "s", 2, 50, got))
    consumer.start()
    assert wait_for(lambda: writer.subscribers == 1, 5)
    for i in range(50):
        assert wait_for(lambda: writer.leases + writer._state.queued < 2, 5)
        writer.write(batch(i))
    consumer.join(10)
    assert got == list(range(50))
    assert writer.dropped == 0
    writer.close()


def raw_subscriber(path: str, window: int) -> transport.Connection:
    conn = transport.connect(path, timeout=10)
    conn.send(protocol.HELLO, protocol.encode_hello())
    assert conn.recv(timeout=10).kind == protocol.WELCOME
    conn.send(protocol.SUBSCRIBE, stream_frames.encode_subscribe("s", window))
    assert conn.recv(timeout=10).kind == protocol.SUBSCRIBED
    return conn


def park_serving_thread(writer: aib.StreamWriter, conn: transport.Connection) -> None:
    """Write a batch, take it, and send a RELEASE of an unknown lease: the serving thread (in its
    receive since the subscription began) reads that one and then stays off the socket."""
    writer.write(batch(0))
    with conn.recv(timeout=10) as pushed:
        assert pushed.kind == protocol.BATCH
    conn.send(protocol.RELEASE, struct.pack("<Q", 999))


def test_a_consumer_gone_is_found_by_the_write(publisher: aib.Publisher, parked: None) -> None:
    writer = publisher.open_stream("s", max_in_flight=1, block_timeout=5.0)
    conn = raw_subscriber(publisher.path, 1)
    park_serving_thread(writer, conn)
    conn.close()  # gone with its lease held: no RELEASE of it comes
    started = time.monotonic()
    writer.write(batch(1))  # no room: the write reads the end of the connection, not its timeout
    assert time.monotonic() - started < 4.0
    assert writer.subscribers == 0
    assert writer.leases == 0
    writer.close()


def test_a_hostile_frame_read_by_the_write_ends_that_subscription(
    publisher: aib.Publisher, parked: None
) -> None:
    writer = publisher.open_stream("s", max_in_flight=1, block_timeout=5.0)
    conn = raw_subscriber(publisher.path, 1)
    park_serving_thread(writer, conn)
    conn.send(protocol.RELEASE_MANY, b"\x01" * 12)  # not a whole number of lease ids
    started = time.monotonic()
    writer.write(batch(1))  # no room: the write reads the bad frame and ends the subscription
    assert time.monotonic() - started < 4.0
    frame = conn.recv(timeout=10)
    assert frame.kind == protocol.ERROR
    with pytest.raises(aib.ProtocolError, match="RELEASE_MANY payload of 12"):
        protocol.raise_error(frame.payload)
    with pytest.raises(aib.PeerClosedError):
        conn.recv(timeout=10)
    conn.close()
    assert writer.subscribers == 0
    assert writer.leases == 0
    writer.close()


def test_releases_wait_for_the_serving_thread_once_the_writer_is_idle(publisher: aib.Publisher) -> None:
    # Not parked: the writer stops, and the serving thread reads the RELEASE within its bound.
    writer = publisher.open_stream("s", max_in_flight=4)
    with aib.subscribe(publisher.path, "s", max_in_flight=4, timeout=10) as live:
        assert wait_for(lambda: writer.subscribers == 1, 5)
        writer.write(batch(0))
        imported = live.next_batch()
        assert imported is not None
        assert writer.leases == 1
        imported.release()
        live._credit.flush()
        assert wait_for(lambda: writer.leases == 0, 5)
    writer.close()


class _Consumed:
    """An Arrow producer whose capsules were consumed already (a broken producer)."""

    def __init__(self) -> None:
        self.pair = batch(0).__arrow_c_array__()
        pa.RecordBatch._import_from_c_capsule(*self.pair)  # moves the structs out

    def __arrow_c_array__(self, requested_schema: object = None) -> tuple[object, object]:
        return self.pair


def test_a_released_capsule_pair_is_refused_and_the_stream_goes_on(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s")
    with aib.subscribe(publisher.path, "s", timeout=10) as live:
        assert wait_for(lambda: writer.subscribers == 1, 5)
        with pytest.raises(aib.ClosedError, match="already consumed or released") as raised:
            writer.write(_Consumed())
        assert raised.value.reason == "released"
        assert writer.batches_written == 0
        writer.write(batch(7))
        imported = live.next_batch()
        assert imported is not None
        assert pa.record_batch(imported).column(0)[0].as_py() == 7
        imported.release()
    writer.close()


def test_release_frames_are_read_as_hostile_input() -> None:
    frame = transport.channel.Frame.__new__(transport.channel.Frame)
    for kind, payload, match in [
        (protocol.GET, b"s", "only RELEASE"),
        (protocol.RELEASE_MANY, b"", "RELEASE_MANY payload of 0 bytes"),
    ]:
        frame.kind, frame.payload, frame.fds = kind, payload, []
        with pytest.raises(aib.ProtocolError, match=match):
            stream_hub.release_frame_ids(frame)
    frame.kind, frame.payload, frame.fds = protocol.RELEASE_MANY, struct.pack("<2Q", 3, 4), []
    assert stream_hub.release_frame_ids(frame) == (3, 4)
