"""A dictionary whose values are a dictionary cannot cross Arrow IPC, so not Flight: pyarrow's
writer drops the inner encoding (an IPC schema field has one dictionary encoding, and its type
cannot be a dictionary) and its reader takes the inner dictionary's indices for the values. The
first test shows it with pyarrow alone; the others check that the front refuses such a column by
its path before anything is sent (INVALID_ARGUMENT, ``pyarrow.ArrowInvalid``), leaves it out of
its listing, serves its neighbours, and holds no lease afterwards; and that a dictionary whose
values only *hold* a dictionary further down (a list or struct of dictionaries) is served equal."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib

flight = pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.flight import serve  # noqa: E402
from arrow_ipc_bridge.flight.tables import nested_dictionary  # noqa: E402


class _Tagged(pa.ExtensionType):
    """An extension type over any storage (for a dictionary reached through an extension)."""

    def __init__(self, storage: pa.DataType) -> None:
        super().__init__(storage, "arrow_ipc_bridge.test.nested_dictionary")

    def __arrow_ext_serialize__(self) -> bytes:
        return b""

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type: pa.DataType, serialized: bytes) -> _Tagged:
        return cls(storage_type)


def _inner() -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(
        pa.array([1, 0, 2, 1], pa.int32()), pa.array([10, 20, 30], pa.int32())
    )


def _dictionary_of_dictionaries() -> pa.DictionaryArray:
    """Values [20, 10, 30, 20, 10]: outer indices into the inner dictionary's slots."""
    return pa.DictionaryArray.from_arrays(pa.array([0, 1, 2, 3, 1], pa.int8()), _inner())


def _ipc_trip(table: pa.Table, **options: object) -> pa.Table:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as writer:
        writer.write_table(table)
    return pa.ipc.open_stream(sink.getvalue()).read_all()


@pytest.mark.parametrize(
    "options", [{}, {"unify_dictionaries": True}, {"emit_dictionary_deltas": True}], ids=str
)
def test_pyarrow_ipc_alone_reads_a_dictionary_of_dictionaries_back_wrong(options: dict[str, object]) -> None:
    """If this fails, pyarrow learnt to carry it: the front's refusal can go (``docs/flight.md``)."""
    table = pa.table({"d": _dictionary_of_dictionaries()})
    assert table.column("d").to_pylist() == [20, 10, 30, 20, 10]
    back = _ipc_trip(table, **options)
    # What any reader (a Flight client, or the front reading a do_put) gets: one dictionary, of
    # the outer index type and the inner value type, whose values are the inner indices.
    assert back.schema.field("d").type == pa.dictionary(pa.int8(), pa.int32())
    assert back.column("d").to_pylist() == [1, 0, 2, 1, 0]
    inner_strings = pa.array(["x", "y", "z"]).dictionary_encode()
    strings = pa.DictionaryArray.from_arrays(pa.array([2, 0, 1], pa.int8()), inner_strings)
    with pytest.raises(OSError, match="buffer_index out of range"):  # string values: too few buffers
        _ipc_trip(pa.table({"d": strings}), **options)


def test_a_dictionary_of_lists_or_structs_of_dictionaries_crosses_ipc_intact() -> None:
    inner = pa.array(["a", "b", "c", "a"]).dictionary_encode()
    of_lists = pa.DictionaryArray.from_arrays(
        pa.array([2, 0, 1], pa.int8()), pa.ListArray.from_arrays(pa.array([0, 2, 3, 4], pa.int32()), inner)
    )
    of_structs = pa.DictionaryArray.from_arrays(
        pa.array([3, 0, 1], pa.int8()),
        pa.StructArray.from_arrays([inner, pa.array([1, 2, 3, 4])], ["k", "n"]),
    )
    table = pa.table({"l": of_lists, "s": of_structs})
    assert nested_dictionary(table.schema) is None
    assert _ipc_trip(table).equals(table)


def _types() -> dict[str, tuple[pa.DataType, tuple[str, pa.DataType] | None]]:
    """Column types and what ``nested_dictionary`` must find in them: the path and the type there."""
    dd = _dictionary_of_dictionaries().type
    plain = pa.dictionary(pa.int32(), pa.string())
    through_extension = pa.dictionary(pa.int8(), _Tagged(plain))
    extension = _Tagged(dd)
    return {
        "top level": (dd, ("c", dd)),
        "struct field": (pa.struct([("ok", pa.int8()), ("d", dd)]), ("c.d", dd)),
        "list values": (pa.list_(dd), ("c.item", dd)),
        "map values": (pa.map_(pa.string(), dd), ("c.entries.value", dd)),
        "dictionary of extension of dictionary": (through_extension, ("c", through_extension)),
        "extension of dictionary of dictionary": (extension, ("c", extension)),
        "inside a dictionary's struct values": (
            pa.dictionary(pa.int8(), pa.struct([("k", dd)])),
            ("c.k", dd),
        ),
        "plain dictionary": (plain, None),
        "dictionary of lists of dictionaries": (pa.dictionary(pa.int8(), pa.list_(plain)), None),
        "struct of dictionaries": (pa.struct([("a", plain), ("b", pa.list_(plain))]), None),
    }


@pytest.mark.parametrize("case", list(_types()))
def test_nested_dictionary_names_the_column_path(case: str) -> None:
    dtype, expected = _types()[case]
    assert nested_dictionary(pa.schema([("first", pa.int64()), ("c", dtype)])) == expected


@pytest.fixture
def client(publisher: aib.Publisher) -> Iterator[flight.FlightClient]:
    with serve(publisher, allow_unauthenticated=True) as front, flight.connect(front.location) as c:
        yield c


def _shapes() -> dict[str, tuple[pa.Table, str]]:
    """Tables holding a dictionary of dictionaries, and the path the refusal names."""
    dd = _dictionary_of_dictionaries()
    n = len(dd)
    ok = pa.array(range(n), pa.int64())
    return {
        "top level": (pa.table({"ok": ok, "d": dd}), "d"),
        "in a struct": (pa.table({"ok": ok, "s": pa.StructArray.from_arrays([ok, dd], ["x", "d"])}), "s.d"),
        "in a list": (
            pa.table({"l": pa.ListArray.from_arrays(pa.array([0, 2, n], pa.int32()), dd)}),
            "l.item",
        ),
    }


@pytest.mark.parametrize("shape", list(_shapes()))
def test_the_front_refuses_it_by_path_and_serves_the_rest(
    publisher: aib.Publisher, client: flight.FlightClient, shape: str
) -> None:
    table, path = _shapes()[shape]
    publisher.publish("nested", table)
    neighbour = pa.table({"x": pa.array([1, 2, 3], pa.int32())})
    publisher.publish("plain", neighbour)
    why = re.escape(f"column '{path}' of 'nested' is a dictionary whose values are a dictionary")
    descriptor = flight.FlightDescriptor.for_path("nested")
    with pytest.raises(pa.ArrowInvalid, match=why) as caught:
        client.get_flight_info(descriptor)
    assert "Arrow IPC, which Flight sends, cannot carry it" in str(caught.value)
    with pytest.raises(pa.ArrowInvalid, match=why):
        client.get_schema(descriptor)
    with pytest.raises(pa.ArrowInvalid, match=why):
        client.do_get(flight.Ticket(b"nested")).read_all()
    # The listing leaves it out (its schema would be listed wrong); the neighbour is served.
    assert [info.descriptor.path[0] for info in client.list_flights()] == [b"plain"]
    assert_arrays_equal(client.do_get(flight.Ticket(b"plain")).read_all(), neighbour)
    assert wait_for(lambda: publisher.active_leases == 0, 5.0), publisher.active_leases


def test_a_dictionary_holding_dictionaries_further_down_is_served_equal(
    publisher: aib.Publisher, client: flight.FlightClient
) -> None:
    inner = pa.array(["a", "b", "c", "a"]).dictionary_encode()
    of_lists = pa.DictionaryArray.from_arrays(
        pa.array([2, 0, 1], pa.int8()), pa.ListArray.from_arrays(pa.array([0, 2, 3, 4], pa.int32()), inner)
    )
    table = pa.table({"l": of_lists, "n": pa.array([1, 2, 3])})
    publisher.publish("t", table)
    assert_arrays_equal(client.do_get(flight.Ticket(b"t")).read_all(), table)
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_a_live_stream_of_it_is_refused_and_its_subscription_ends(
    publisher: aib.Publisher, client: flight.FlightClient
) -> None:
    writer = publisher.open_stream("live", max_in_flight=2, on_slow="block", block_timeout=None)
    batch = pa.record_batch({"s": pa.StructArray.from_arrays([_dictionary_of_dictionaries()], ["d"])})
    stop = threading.Event()

    def write() -> None:
        wait_for(lambda: writer.subscribers > 0 or stop.is_set(), 10.0)
        if not stop.is_set():
            writer.write(batch)
        writer.close()  # the stream ends: a front that sent the batch would not keep the client waiting

    producer = threading.Thread(target=write)
    producer.start()
    try:
        why = re.escape("column 's.d' of 'live' is a dictionary whose values are a dictionary")
        with pytest.raises(pa.ArrowInvalid, match=why):
            client.do_get(flight.Ticket(b"live"), options=flight.FlightCallOptions(timeout=30)).read_all()
        assert wait_for(lambda: writer.subscribers == 0, 10.0), "the front kept the subscription"
        assert wait_for(lambda: writer.leases == 0, 10.0), writer.leases
    finally:
        stop.set()
        producer.join(10)
        writer.close()
    assert wait_for(lambda: publisher.active_leases == 0, 5.0), publisher.active_leases
