"""Empty slices past offset 0 through the Flight front (``flight.tables.sendable``).

pyarrow gives an array it imports over the C Data Interface 0-byte buffers when the array is empty,
whatever its offset, and pyarrow's IPC writer then slices such a buffer at a negative length: the
IPC body has a negative length, and under Flight gRPC's ``sendmsg`` fails with EINVAL and takes the
client's channel with it (``docs/flight.md``, "Empty slices"). Every import of the bridge comes
through the C Data Interface, so each case here, a column holding such a slice somewhere in its
tree, broke ``do_get`` before the front rebuilt those columns.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.flight.tables import host_table, sendable

flight = pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.flight import serve  # noqa: E402


def _gone() -> pa.Array:
    """An empty slice past offset 0 of an int64 array."""
    return pa.array(range(10), pa.int64()).slice(5, 0)


def _empty_lists() -> pa.Array:
    """Three empty lists whose values are an empty slice past offset 0."""
    return pa.ListArray.from_arrays(pa.array([0, 0, 0, 0], pa.int32()), _gone())


def _with_rows(column: pa.Array) -> pa.Table:
    return pa.table({"x": column, "n": pa.array(range(len(column)), pa.int64())})


def _zero_row_batch_first(values: pa.Array) -> pa.Table:
    """A table whose first batch is a zero-row slice (at row 2) of its second: what the property
    test of ``test_flight_server.py`` first failed on."""
    batch = pa.record_batch({"x": values, "n": pa.array(range(len(values)), pa.int64())})
    return pa.Table.from_batches([batch.slice(2, 0), batch])


CASES: dict[str, Callable[[], pa.Table]] = {
    "zero-row-int64": lambda: _zero_row_batch_first(pa.array(range(6), pa.int64())),
    "zero-row-interval": lambda: _zero_row_batch_first(
        pa.array([(1, 2, 3)] * 6, pa.month_day_nano_interval())
    ),
    "zero-row-string": lambda: _zero_row_batch_first(pa.array(["aa", "bb", "cc", None])),
    "zero-row-dictionary": lambda: _zero_row_batch_first(
        pa.DictionaryArray.from_arrays(pa.array([0, 1, 0, 1], pa.int8()), pa.array(["p", "q"]))
    ),
    "list": lambda: _with_rows(_empty_lists()),
    "list-sliced": lambda: _with_rows(_empty_lists().slice(1)),
    "large-list": lambda: _with_rows(pa.LargeListArray.from_arrays(pa.array([0, 0, 0], pa.int64()), _gone())),
    "fixed-size-list-of-0": lambda: _with_rows(
        pa.Array.from_buffers(pa.list_(pa.int64(), 0), 3, [None], children=[_gone()])
    ),
    "list-view": lambda: _with_rows(
        pa.ListViewArray.from_arrays(
            pa.array([0, 0, 0], pa.int32()), pa.array([0, 0, 0], pa.int32()), _gone()
        )
    ),
    "map": lambda: _with_rows(
        pa.MapArray.from_arrays(
            pa.array([0, 0, 0], pa.int32()),
            pa.array(["k"]).slice(1, 0),
            pa.array([1], pa.int64()).slice(1, 0),
        )
    ),
    "struct-with-nulls": lambda: _with_rows(
        pa.StructArray.from_arrays(
            [pa.array([1, 2, 3], pa.int64()), _empty_lists()],
            names=["a", "b"],
            mask=pa.array([False, True, False]),
        ).slice(1)
    ),
    "sparse-union": lambda: _with_rows(
        pa.UnionArray.from_sparse(
            pa.array([0, 1, 1], pa.int8()), [pa.array([1, 2, 3], pa.int64()), _empty_lists()]
        )
    ),
    "dense-union": lambda: _with_rows(
        pa.UnionArray.from_dense(
            pa.array([0, 0, 0], pa.int8()),
            pa.array([0, 1, 2], pa.int32()),
            [pa.array([1, 2, 3], pa.int64()), _gone()],
        ).slice(1)
    ),
    "dictionary-of-nothing": lambda: _with_rows(
        pa.DictionaryArray.from_arrays(
            pa.array([None, None, None], pa.int8()), pa.array(["a", "b"]).slice(2, 0)
        )
    ),
    "run-end-encoded": lambda: _with_rows(
        pa.RunEndEncodedArray.from_arrays(pa.array([2, 4], pa.int32()), _empty_lists().slice(1))
    ),
}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[aib.Publisher, aib.Session, flight.FlightClient]]:
    """One publisher, a session of it and a front with one client for all the cases: a case that
    breaks the client's channel fails the cases after it too, as it did the property test."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-fl-empty-")
    pub = aib.Publisher(os.path.join(directory, "p.sock"))
    session = aib.connect(pub.path)
    front = serve(pub, allow_unauthenticated=True)
    client = flight.connect(front.location)
    yield pub, session, client
    client.close()
    front.close()
    session.close()
    pub.close()
    shutil.rmtree(directory, ignore_errors=True)


def _imported_table(session: aib.Session, name: str) -> pa.Table:
    imported = session.get(name)
    try:
        return host_table(imported)
    finally:
        imported.release()


def _ipc_round_trip(table: pa.Table) -> pa.Table:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return pa.ipc.open_stream(sink.getvalue()).read_all()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_column_holding_an_empty_slice_crosses_the_front_equal(
    served: tuple[aib.Publisher, aib.Session, flight.FlightClient], case: str
) -> None:
    pub, _, client = served
    table = CASES[case]()
    pub.publish(case, table)
    got = client.do_get(flight.Ticket(case.encode())).read_all()
    assert_arrays_equal(got, table)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_imported_table_is_written_intact_by_pyarrow_ipc(
    served: tuple[aib.Publisher, aib.Session, flight.FlightClient], case: str
) -> None:
    """Without gRPC: what the front hands to gRPC, written and read back by pyarrow's IPC."""
    pub, session, _ = served
    table = CASES[case]()
    pub.publish(f"ipc-{case}", table)
    assert_arrays_equal(_ipc_round_trip(_imported_table(session, f"ipc-{case}")), table)


def test_only_columns_holding_one_are_rebuilt_and_over_the_same_buffers(
    served: tuple[aib.Publisher, aib.Session, flight.FlightClient],
) -> None:
    pub, session, _ = served
    pub.publish("plain", pa.table({"x": pa.array(range(100), pa.int64())}))
    plain = _imported_table(session, "plain")
    assert sendable(plain) is plain

    pub.publish("mixed", CASES["struct-with-nulls"]())
    imported = session.get("mixed")
    try:
        raw = pa.table(imported)
    finally:
        imported.release()
    sent = sendable(raw)
    assert sent is not raw
    assert sent.column("n").chunk(0).buffers()[1].address == raw.column("n").chunk(0).buffers()[1].address
    # The struct was rebuilt around its mended list field; its int64 field is the same memory.
    raw_a, sent_a = raw.column("x").chunk(0).field("a"), sent.column("x").chunk(0).field("a")
    assert sent_a.buffers()[1].address == raw_a.buffers()[1].address
    assert sent_a.offset == raw_a.offset
