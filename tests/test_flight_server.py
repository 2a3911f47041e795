"""The Flight front (``arrow_ipc_bridge.flight.serve``) with a real gRPC server on localhost and
plain ``pyarrow.flight`` clients: listing, info, schema, do_get of every Arrow type of the test
corpus (equal after the trip), live streams under a slow client (the producer is held back, the
front holds at most ``max_in_flight`` batches), clients that leave mid-stream (nothing left held),
do_put, and the front's refusals."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.arrow_types import EXTENSION_KINDS, TYPE_KINDS, child_fields
from helpers.arrow_values import tables
from helpers.session_rig import sample_table, wait_for
from hypothesis import given, settings

import arrow_ipc_bridge as aib

flight = pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.flight import serve  # noqa: E402

# Flight moves data as Arrow IPC, which cannot tell dictionary<extension> from
# extension<dictionary> (helpers.arrow_values): the extension kinds stay out.
IPC_KINDS = TYPE_KINDS - EXTENSION_KINDS


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[aib.Publisher, flight.FlightClient]]:
    """One publisher and its front for the property test (a server per example would dominate)."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-fl-")
    pub = aib.Publisher(os.path.join(directory, "p.sock"))
    front = serve(pub, allow_unauthenticated=True)
    client = flight.connect(front.location)
    yield pub, client
    client.close()
    front.close()
    pub.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def front(publisher: aib.Publisher) -> Iterator[tuple[aib.Publisher, flight.FlightClient]]:
    with serve(publisher, allow_unauthenticated=True, allow_put=True, max_in_flight=2) as f:
        client = flight.connect(f.location)
        yield publisher, client
        client.close()


def test_list_info_and_schema_describe_each_publication(
    front: tuple[aib.Publisher, flight.FlightClient],
) -> None:
    pub, client = front
    table = sample_table(500, batches=2)
    pub.publish("table", table)
    pub.publish("batch", pa.record_batch({"x": pa.array([1.5, 2.5], pa.float32())}))
    pub.publish("array", pa.array(["a", None, "c"]))
    infos = {info.descriptor.path[0].decode(): info for info in client.list_flights()}
    assert sorted(infos) == ["array", "batch", "table"]
    info = infos["table"]
    assert info.schema.equals(table.schema)
    assert info.total_records == 500 * 2
    assert info.total_bytes > 0
    assert json.loads(info.app_metadata) == {"kind": "table", "device": "cpu"}
    (endpoint,) = info.endpoints
    assert endpoint.ticket.ticket == b"table"
    uris = [loc.uri.decode() for loc in endpoint.locations]
    assert uris[0].startswith("grpc://127.0.0.1:")
    assert uris[1].startswith("aib+unix://" + pub.path)
    assert json.loads(infos["array"].app_metadata)["kind"] == "array"
    assert infos["array"].schema.field(0).type == pa.string()
    assert infos["batch"].total_records == 2
    by_name = client.get_flight_info(flight.FlightDescriptor.for_path("batch"))
    assert by_name.schema.equals(infos["batch"].schema)
    schema = client.get_schema(flight.FlightDescriptor.for_path("table")).schema
    assert schema.equals(table.schema)
    assert [i.descriptor.path[0] for i in client.list_flights(b"ta")] == [b"table"]


def test_do_get_gives_the_published_data_and_ends_its_lease(
    front: tuple[aib.Publisher, flight.FlightClient],
) -> None:
    pub, client = front
    table = sample_table(2000, batches=3)
    pub.publish("t", table)
    pub.publish("a", pa.array([1, None, 3], pa.int16()))
    got = client.do_get(flight.Ticket(b"t")).read_all()
    assert_arrays_equal(got, table)
    arr = client.do_get(flight.Ticket(b"a")).read_all()
    assert arr.column(0).to_pylist() == [1, None, 3]
    assert wait_for(lambda: pub.active_leases == 0, 5.0), pub.active_leases


def test_an_unknown_name_is_answered_with_the_closest_names_served(
    front: tuple[aib.Publisher, flight.FlightClient],
) -> None:
    """NOT_FOUND names the closest publication or live stream (typo'd names are the usual cause)
    and the first names served, for do_get and get_flight_info alike; with nothing served it says
    so instead of suggesting anything."""
    publisher, client = front
    with pytest.raises(pa.ArrowKeyError, match="nothing is published or open now"):
        client.do_get(flight.Ticket(b"prices")).read_all()
    publisher.publish("prices", pa.table({"x": [1]}))
    writer = publisher.open_stream("ticks", max_in_flight=2)
    try:
        with pytest.raises(pa.ArrowKeyError) as price:
            client.do_get(flight.Ticket(b"price")).read_all()
        assert "did you mean 'prices'?" in str(price.value)
        assert "publications: 'prices'" in str(price.value)
        assert "live streams: 'ticks'" in str(price.value)
        with pytest.raises(pa.ArrowKeyError, match="did you mean 'ticks'"):
            client.get_flight_info(flight.FlightDescriptor.for_path("tick"))
        with pytest.raises(pa.ArrowKeyError) as far:
            client.do_get(flight.Ticket(b"zzzzzz")).read_all()
        assert "did you mean" not in str(far.value)
        assert "publications: 'prices'" in str(far.value)
    finally:
        writer.close()


def test_refusals_carry_their_grpc_status_and_no_server_internals(
    front: tuple[aib.Publisher, flight.FlightClient],
) -> None:
    """An unknown name is NOT_FOUND (pyarrow's client raises ArrowKeyError), a malformed ticket,
    descriptor or action INVALID_ARGUMENT (ArrowInvalid). pyarrow appends the frames of such an
    exception to its message: the only frame of the front's is the handler's ``raise``."""
    _, client = front
    with pytest.raises(pa.ArrowKeyError, match="no publication or live stream named 'missing'"):
        client.do_get(flight.Ticket(b"missing")).read_all()
    with pytest.raises(pa.ArrowInvalid, match="a ticket is the UTF-8 name"):
        client.do_get(flight.Ticket(b"\xff\xfe")).read_all()
    with pytest.raises(pa.ArrowKeyError, match="no publication"):
        client.get_flight_info(flight.FlightDescriptor.for_path("missing"))
    with pytest.raises(pa.ArrowKeyError, match="no publication"):
        client.get_schema(flight.FlightDescriptor.for_path("missing"))
    with pytest.raises(pa.ArrowInvalid, match="descriptor path is"):
        client.get_flight_info(flight.FlightDescriptor.for_path("a", "b", "c"))
    with pytest.raises(pa.ArrowInvalid, match="unknown action"):
        list(client.do_action(flight.Action("no-such-action", b"")))
    with pytest.raises(pa.ArrowKeyError) as caught:
        client.do_get(flight.Ticket(b"missing")).read_all()
    text = str(caught.value)
    for internal in ("consumer/session.py", "data_stream", "_get("):
        assert internal not in text
    frames = {line.strip() for line in text.splitlines() if line.strip().startswith("File ")}
    assert len(frames) <= 2, text  # pyarrow's _do_get and the handler's raise


@settings(max_examples=min(settings.default.max_examples, 40))
@given(table=tables(max_batches=3, max_rows=30, allow=IPC_KINDS))
def test_every_arrow_type_is_equal_after_the_trip(
    served: tuple[aib.Publisher, flight.FlightClient], table: pa.Table
) -> None:
    """Equal after the trip, or, for a dictionary whose values are a dictionary (which Arrow IPC
    cannot carry: ``test_flight_nested_dictionary.py``), refused before anything is sent."""
    pub, client = served
    pub.publish("any", table)
    if any(_dictionary_of_dictionaries(field.type) for field in table.schema):
        with pytest.raises(pa.ArrowInvalid, match="is a dictionary whose values are a dictionary"):
            client.do_get(flight.Ticket(b"any")).read_all()
        return
    got = client.do_get(flight.Ticket(b"any")).read_all()
    assert_arrays_equal(got, table)


def _dictionary_of_dictionaries(dtype: pa.DataType) -> bool:
    """Whether a dictionary's values are (not only hold) a dictionary, anywhere in the type."""
    if pa.types.is_dictionary(dtype):
        return pa.types.is_dictionary(dtype.value_type) or _dictionary_of_dictionaries(dtype.value_type)
    return any(_dictionary_of_dictionaries(field.type) for field in child_fields(dtype))


def _stream_writer(pub: aib.Publisher, name: str, *, max_in_flight: int) -> aib.StreamWriter:
    return pub.open_stream(name, max_in_flight=max_in_flight, on_slow="block", block_timeout=None)


def _write_when_subscribed(writer: aib.StreamWriter, count: int, rows: int, stop: threading.Event) -> None:
    wait_for(lambda: writer.subscribers > 0 or stop.is_set(), 10.0)
    for i in range(count):
        if stop.is_set():
            break
        writer.write(pa.record_batch({"seq": pa.array([i] * rows, pa.int64())}))
    writer.close()


def test_a_slow_client_holds_the_producer_back_and_the_front_holds_little(
    front: tuple[aib.Publisher, flight.FlightClient],
) -> None:
    pub, client = front
    writer = _stream_writer(pub, "live", max_in_flight=2)
    stop = threading.Event()
    rows = 32 * 1024  # 256 KiB a batch
    producer = threading.Thread(target=_write_when_subscribed, args=(writer, 60, rows, stop))
    producer.start()
    try:
        reader = client.do_get(flight.Ticket(b"live"))
        first = reader.read_chunk().data
        assert first.column(0)[0].as_py() == 0
        # The client stops reading: the producer must stop soon, the front holding its window.
        time.sleep(0.5)
        stalled_at = writer.batches_written
        time.sleep(0.5)
        assert writer.batches_written == stalled_at, "the producer kept writing past a stalled client"
        assert stalled_at < 40, f"{stalled_at} batches written while the client read 1"
        assert writer.leases <= 2 + 1  # the window, and the batch being handed over
        received = [first]
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            received.append(chunk.data)
        seqs = [batch.column(0)[0].as_py() for batch in received]
        assert seqs == list(range(60))
    finally:
        stop.set()
        producer.join(10)
    assert wait_for(lambda: pub.active_leases == 0, 5.0)


def test_a_live_stream_of_dictionary_columns_reaches_the_client(
    front: tuple[aib.Publisher, flight.FlightClient],
) -> None:
    """Each batch's dictionary goes out before the batch (and a changed one replaces it): a
    dictionary-encoded column comes back equal, batch by batch."""
    pub, client = front
    writer = _stream_writer(pub, "labels", max_in_flight=2)
    batches = [
        pa.record_batch({"label": pa.array(words).dictionary_encode(), "n": pa.array(range(len(words)))})
        for words in (["a", "b", "a"], ["c", "c"], ["a", "d", "e", "d"])
    ]

    def write() -> None:
        wait_for(lambda: writer.subscribers > 0, 10.0)
        for batch in batches:
            writer.write(batch)
        writer.close()

    producer = threading.Thread(target=write)
    producer.start()
    try:
        got = client.do_get(flight.Ticket(b"labels")).read_all()
    finally:
        producer.join(10)
    assert got.column("label").to_pylist() == ["a", "b", "a", "c", "c", "a", "d", "e", "d"]
    assert got.column("n").to_pylist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]


def test_a_client_leaving_mid_stream_leaves_nothing_held(
    front: tuple[aib.Publisher, flight.FlightClient],
) -> None:
    pub, client = front
    writer = pub.open_stream("live", max_in_flight=2, on_slow="drop_oldest")
    threads_before = threading.active_count()
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set():
            writer.write(pa.record_batch({"seq": [i]}))
            i += 1
            time.sleep(0.002)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        reader = client.do_get(flight.Ticket(b"live"))
        reader.read_chunk()
        reader.read_chunk()
        assert writer.subscribers == 1
        reader.cancel()
        client.close()
        assert wait_for(lambda: writer.subscribers == 0, 10.0), "the front kept the subscription"
        assert wait_for(lambda: writer.leases == 0, 10.0)
    finally:
        stop.set()
        producer.join(10)
        writer.close()
    assert wait_for(lambda: threading.active_count() <= threads_before + 1, 10.0)
    assert wait_for(lambda: pub.active_leases == 0, 5.0)


def test_a_client_leaving_mid_get_ends_the_lease(front: tuple[aib.Publisher, flight.FlightClient]) -> None:
    pub, client = front
    pub.publish("big", pa.table({"x": pa.array(range(4_000_000), pa.int64())}).combine_chunks())
    reader = client.do_get(flight.Ticket(b"big"))
    reader.read_chunk()
    reader.cancel()
    client.close()
    assert wait_for(lambda: pub.active_leases == 0, 10.0), pub.active_leases


def test_do_put_publishes_into_the_publisher(front: tuple[aib.Publisher, flight.FlightClient]) -> None:
    pub, client = front
    table = sample_table(300, batches=2)
    _put(client, flight.FlightDescriptor.for_path("uploaded"), table)
    assert "uploaded" in pub.names()
    with aib.connect(pub.path) as session, session.get("uploaded") as imported:
        assert_arrays_equal(pa.table(imported), table)
    assert_arrays_equal(client.do_get(flight.Ticket(b"uploaded")).read_all(), table)


def _put(client: flight.FlightClient, descriptor: flight.FlightDescriptor, table: pa.Table) -> None:
    writer, _ = client.do_put(descriptor, table.schema)
    writer.write_table(table)
    writer.close()  # the server's answer (or refusal) comes here


def test_do_put_refusals(publisher: aib.Publisher) -> None:
    table = pa.table({"x": pa.array(range(1000), pa.int64())})
    with serve(publisher, allow_unauthenticated=True) as f, flight.connect(f.location) as client:
        refused = pytest.raises(flight.FlightUnauthorizedError, match="does not take do_put")
        with refused:
            _put(client, flight.FlightDescriptor.for_path("u"), table)
    with (
        serve(publisher, allow_unauthenticated=True, allow_put=True, max_put_bytes=4000) as f,
        flight.connect(f.location) as client,
    ):
        with pytest.raises(pa.ArrowInvalid, match="over max_put_bytes"):
            _put(client, flight.FlightDescriptor.for_path("u"), table)
        with pytest.raises(pa.ArrowInvalid, match="device must be 'cuda:N'"):
            _put(client, flight.FlightDescriptor.for_path("u", "gpu7"), table.slice(0, 10))
    assert publisher.names() == []


def test_serve_refuses_what_would_be_unsafe_or_wrong(publisher: aib.Publisher) -> None:
    with pytest.raises(ValueError, match="anyone who reaches it"):
        serve(publisher)
    with pytest.raises(ValueError, match="grpc\\+tls:// location needs tls_certificates"):
        serve(publisher, "grpc+tls://127.0.0.1:0", allow_unauthenticated=True)
    with pytest.raises(ValueError, match="verify_client needs root_certificates"):
        serve(publisher, allow_unauthenticated=True, verify_client=True)
    # over plain gRPC no client certificate is asked for: verify_client would authenticate nobody
    with pytest.raises(ValueError, match="need TLS"):
        serve(publisher, verify_client=True, root_certificates=b"-----BEGIN CERTIFICATE-----")
    with pytest.raises(ValueError, match="at least 16 characters"):
        serve(publisher, tokens=["short"])
    with pytest.raises(ValueError, match="allow_put needs a Publisher"):
        serve(publisher.path, allow_unauthenticated=True, allow_put=True)
    with pytest.raises(ValueError, match="location must be grpc"):
        serve(publisher, "http://127.0.0.1:0", allow_unauthenticated=True)


def test_a_front_by_socket_path_serves_another_process_publisher(publisher: aib.Publisher) -> None:
    publisher.publish("t", pa.table({"x": [1, 2, 3]}))
    with serve(publisher.path, allow_unauthenticated=True) as f, flight.connect(f.location) as client:
        assert [i.descriptor.path[0] for i in client.list_flights()] == [b"t"]
        assert client.do_get(flight.Ticket(b"t")).read_all().column(0).to_pylist() == [1, 2, 3]
        # The publisher goes away: calls say so, and do not hang.
        publisher.close()
        with pytest.raises(flight.FlightUnavailableError, match="publisher is not reachable"):
            list(client.list_flights())


def test_importing_the_package_does_not_import_flight() -> None:
    import subprocess

    code = "import arrow_ipc_bridge, sys; print('pyarrow.flight' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
