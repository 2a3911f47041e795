"""pylibcudf and cuDF read what the bridge hands out for GPU data (marker: gpu; needs pylibcudf,
and cudf for the DataFrame test): a GPU table of one batch through ``plc.Table.from_arrow``, a table
of several batches one batch at a time, a GPU record batch, each batch of a live stream of GPU data,
and a cuDF DataFrame published on one end and rebuilt on the other. The producer is a spawned child
(tests/helpers/cudf_children.py). What it checks on the CPU: tests/test_device_protocol.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers import cudf_children
from helpers.optional_modules import import_failure

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.gpu
_CTX = mp.get_context("spawn")
ROWS = 1 << 16
NAMES = ["id", "value"]
HOST_METHODS = ("__arrow_c_array__", "__arrow_c_stream__")


@pytest.fixture(scope="module")
def plc(cuda_device: int) -> Any:
    return pytest.importorskip("pylibcudf", reason="needs cuDF's pylibcudf (RAPIDS)")


@pytest.fixture(scope="module")
def producer(plc: Any) -> Iterator[str]:
    """The socket path of a producer child publishing the GPU data (cudf_children.tables_producer)."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-cudf-")
    path = os.path.join(directory, "s.sock")
    ready, done = _CTX.Event(), _CTX.Event()
    child = _CTX.Process(target=cudf_children.tables_producer, args=(path, ROWS, ready, done), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 120
        while not ready.wait(0.5) and child.is_alive() and time.monotonic() < deadline:
            pass  # a producer that died (its traceback is on stderr) fails the fixture at once
        assert ready.is_set(), f"the producer did not get ready (exit code {child.exitcode})"
        yield path
    finally:
        done.set()
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join()
        shutil.rmtree(directory, ignore_errors=True)
    assert child.exitcode == 0


def _to_arrow(plc: Any, table: Any) -> pa.Table:
    """A pylibcudf table on the host, columns named as published (a copy: for comparing only).
    ``Table.to_arrow`` in recent pylibcudf (``interop.to_arrow`` is deprecated there), the
    ``interop`` function before."""
    metadata = [plc.interop.ColumnMetadata(name) for name in NAMES]
    if hasattr(table, "to_arrow"):
        arrow = table.to_arrow(metadata=metadata)
    else:
        arrow = plc.interop.to_arrow(table, metadata=metadata)
    return arrow if isinstance(arrow, pa.Table) else pa.table(arrow)


def _assert_equal(got: pa.Table, expected: pa.Table | pa.RecordBatch) -> None:
    expected = expected if isinstance(expected, pa.Table) else pa.Table.from_batches([expected])
    assert got.num_rows == expected.num_rows
    for name in NAMES:
        assert got.column(name).combine_chunks().equals(expected.column(name).combine_chunks()), name


def test_a_gpu_table_of_one_batch_reads_with_pylibcudf(plc: Any, producer: str) -> None:
    """aib.to_device(pa_table), published: an ImportedDeviceStream without host methods, whose one
    batch pylibcudf's from_arrow takes as a device array (it took the refusing host stream before)."""
    with aib.connect(producer, timeout=30.0) as session, session.get("one") as imported:
        assert isinstance(imported, aib.ImportedStream)
        assert imported.device.startswith("cuda:")
        assert not any(hasattr(imported, method) for method in HOST_METHODS)
        table = plc.Table.from_arrow(imported)
        _assert_equal(_to_arrow(plc, table), cudf_children.expected_table(1, ROWS))
        del table


def test_a_gpu_table_of_three_batches_is_read_batch_by_batch(plc: Any, producer: str) -> None:
    """Three batches: from_arrow of the table raises the bridge's error naming them (no silent
    concatenation); each batch(i) reads as it is; libcudf concatenates when asked."""
    with aib.connect(producer, timeout=30.0) as session, session.get("three") as imported:
        with pytest.raises(aib.BridgeError, match="table of 3 batches"):
            plc.Table.from_arrow(imported)
        tables = [plc.Table.from_arrow(imported.batch(i)) for i in range(imported.batch_count)]
        for i, table in enumerate(tables):
            _assert_equal(_to_arrow(plc, table), cudf_children.expected_batch(i, ROWS))
        whole = plc.concatenate.concatenate(tables)
        _assert_equal(_to_arrow(plc, whole), cudf_children.expected_table(3, ROWS))
        del tables, whole


def test_a_gpu_record_batch_reads_with_pylibcudf(plc: Any, producer: str) -> None:
    with aib.connect(producer, timeout=30.0) as session, session.get("batch") as imported:
        assert isinstance(imported, aib.ImportedArray)
        assert not any(hasattr(imported, method) for method in HOST_METHODS)
        table = plc.Table.from_arrow(imported)
        _assert_equal(_to_arrow(plc, table), cudf_children.expected_batch(0, ROWS))
        del table


def test_each_batch_of_a_live_gpu_stream_reads_with_pylibcudf(plc: Any, producer: str) -> None:
    """publish_stream of a GPU table (pumped through its device stream): each batch received is a
    GPU record batch without host methods that from_arrow reads, in order, equal."""
    received = 0
    with aib.subscribe(producer, "ticks", timeout=60.0) as live:
        for batch in live:
            with batch:
                assert not any(hasattr(batch, method) for method in HOST_METHODS)
                table = plc.Table.from_arrow(batch)
                _assert_equal(_to_arrow(plc, table), cudf_children.expected_batch(received, ROWS))
                del table
            received += 1
    assert received == 3


def test_cudf_dataframes_on_both_ends(plc: Any, producer: str) -> None:
    """A cudf.DataFrame's pylibcudf table published as it is, rebuilt as a cudf.DataFrame."""
    why = import_failure("cudf")
    if why is not None:
        pytest.skip(f"DataFrames need RAPIDS' cudf: {why}")
    import cudf

    with aib.connect(producer, timeout=30.0) as session, session.get("frame") as imported:
        frame = cudf.DataFrame.from_pylibcudf(plc.Table.from_arrow(imported), metadata={"columns": NAMES})
        _assert_equal(frame.to_arrow(preserve_index=False), cudf_children.expected_table(1, ROWS))
        del frame
