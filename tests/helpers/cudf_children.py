"""The producer process of tests/test_cudf.py (spawned: CUDA must never be initialised before a
fork): GPU tables, a GPU record batch, a live stream of GPU batches and, where cuDF is installed, a
cuDF DataFrame, all published for a pylibcudf consumer."""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
import pyarrow as pa

from helpers.optional_modules import import_failure


def expected_batch(index: int, rows: int) -> pa.RecordBatch:
    """Batch ``index`` of the tables published: ids ``index * rows`` onwards (a batch read at the
    wrong index shows), values ``index + 0.5``, a validity bitmap on the values."""
    values = np.full(rows, index + 0.5)
    mask = np.zeros(rows, dtype=bool)
    mask[::7] = True
    return pa.record_batch(
        {
            "id": pa.array(np.arange(index * rows, (index + 1) * rows, dtype=np.int64)),
            "value": pa.array(values, mask=mask),
        }
    )


def expected_table(batches: int, rows: int) -> pa.Table:
    return pa.Table.from_batches([expected_batch(i, rows) for i in range(batches)])


def tables_producer(path: str, rows: int, ready: Any, done: Any) -> None:
    """Publish "one" (``aib.to_device`` of a table of one batch), "three" (of three batches),
    "batch" (of a record batch), the live stream "ticks" (the three batches, pumped from the GPU
    table once a consumer subscribed) and, with cuDF, "frame" (a ``cudf.DataFrame``'s pylibcudf
    table as it is); set ``ready``, serve until ``done``."""
    import arrow_ipc_bridge as aib

    try:
        one = aib.to_device(expected_table(1, rows))
        three = aib.to_device(expected_table(3, rows))
        batch = aib.to_device(expected_batch(0, rows))
        ticks = aib.to_device(expected_table(3, rows))
        kept: list[Any] = []
        with aib.Publisher(path) as pub:
            pub.publish("one", one)
            pub.publish("three", three)
            pub.publish("batch", batch)
            pub.publish_stream("ticks", ticks, wait_for_subscribers=1, block_timeout=120)
            if import_failure("cudf") is None:
                import cudf

                frame = cudf.DataFrame.from_arrow(expected_table(1, rows))
                table, _ = frame.to_pylibcudf()
                kept += [frame, table]  # the published columns live while they are served
                pub.publish("frame", table)
            ready.set()
            done.wait(300)
        for imported in (one, three, batch, ticks):
            imported.release()
    except BaseException:
        traceback.print_exc()
        raise
