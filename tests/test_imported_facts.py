"""What an imported object says about itself: ``schema``, ``type``, ``num_rows``, ``nbytes``,
``device`` and a repr naming what it holds, for arrays, record batches and tables, read from the
message (no data copied); released objects refuse the facts and say so in their repr."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow as pa
import pytest

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.fixture
def session(publisher: aib.Publisher) -> Iterator[aib.Session]:
    with aib.connect(publisher.path, timeout=10.0) as session:
        yield session


def _table() -> pa.Table:
    batches = [
        pa.record_batch(
            {"id": pa.array(range(start, stop), pa.int64()), "s": [f"v{i}" for i in range(start, stop)]}
        )
        for start, stop in ((0, 300), (300, 700))
    ]
    return pa.Table.from_batches(batches)


def _buffer_bytes(arrays: list[pa.Array]) -> int:
    """What the arrays' buffers hold (pyarrow's ``nbytes`` counts string data by the offsets instead)."""
    return sum(buf.size for array in arrays for buf in array.buffers() if buf is not None)


def test_a_table(publisher: aib.Publisher, session: aib.Session) -> None:
    table = _table()
    publisher.publish("t", table)
    with session.get("t") as imported:
        assert isinstance(imported, aib.ImportedStream)
        assert imported.schema == table.schema
        assert imported.type == pa.struct(list(table.schema))
        assert imported.num_rows == 700
        nbytes = _buffer_bytes([column for batch in table.to_batches() for column in batch.columns])
        assert imported.nbytes == nbytes  # two batches, no buffer shared between them
        assert imported.device == "cpu"
        assert repr(imported) == (
            f"<ImportedStream 't' table of 2 batches, 700 rows, {nbytes} bytes, cpu, [id: int64, s: string]>"
        )
    assert repr(imported) == "<ImportedStream 't' released>"


def test_a_record_batch_and_a_plain_array(publisher: aib.Publisher, session: aib.Session) -> None:
    batch = _table().to_batches()[1]
    publisher.publish("b", batch)
    publisher.publish("a", pa.array([1.0, None, 3.0]))
    with session.get("b") as imported:
        assert isinstance(imported, aib.ImportedArray)
        assert imported.schema == batch.schema
        assert imported.num_rows == 400
        assert imported.nbytes == _buffer_bytes(batch.columns)
        assert repr(imported).startswith("<ImportedArray 'b' record batch, 400 rows, ")
    with session.get("a") as imported:
        # a plain array's root is the one field of its schema
        assert imported.schema == pa.schema([pa.field("", pa.float64())])
        assert imported.type == pa.float64()
        assert imported.num_rows == 3
        assert imported.nbytes == pa.array([1.0, None, 3.0]).nbytes  # validity bitmap and values
        assert repr(imported).startswith("<ImportedArray 'a' array, 3 rows, ")


def test_slices_of_one_buffer_count_once(publisher: aib.Publisher, session: aib.Session) -> None:
    """Batches that are slices of one memory-mapped array, shared zero-copy: every batch references
    the same buffer, and ``nbytes`` is the memory spanned, not a sum per batch."""
    from helpers.session_rig import write_shm_ipc_file

    values = pa.array(range(1000), pa.int64())
    path = write_shm_ipc_file(pa.table({"v": values}))
    try:
        mapped = pa.ipc.open_file(pa.memory_map(path)).read_all()
        sliced = pa.Table.from_batches(mapped.to_batches(max_chunksize=250))
        publisher.publish("sliced", sliced, copy="never")
        del mapped, sliced
    finally:
        os.unlink(path)
    with session.get("sliced") as imported:
        assert imported.batch_count == 4
        assert imported.num_rows == 1000
        assert imported.nbytes == values.nbytes


def test_facts_of_a_released_object_raise(publisher: aib.Publisher, session: aib.Session) -> None:
    publisher.publish("t", _table())
    imported = session.get("t")
    imported.release()
    for fact in ("schema", "type", "num_rows", "nbytes"):
        with pytest.raises(aib.ClosedError, match="imported t was released") as raised:
            getattr(imported, fact)
        assert raised.value.reason == "released"
    assert imported.device == "cpu"  # where it was: no message needed
