"""GPU: a pylibcudf consumer of a table uploaded to the GPU by another process.

The producer uploads an Arrow record batch into the bridge's CUDA IPC memory pool
(``aib.to_device``) and publishes it. The consumer (a spawned child) builds a ``pylibcudf.Table``
from what ``session.get`` returns: ``pylibcudf.Table.from_arrow`` reads it through the Arrow C
Device interface (``__arrow_c_device_array__``), so the columns come as device memory opened from
the producer's pool, with no trip through host memory. It then sums a column on the GPU.

Needs a CUDA GPU and cuDF's ``pylibcudf`` (RAPIDS) for the consumer; the producer needs only the
bridge (``aib.to_device`` talks to the CUDA driver itself).

Run: ``python examples/pylibcudf_consumer.py``
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa

import arrow_ipc_bridge as aib

ROWS = 1 << 20


def scalar_value(scalar: Any) -> Any:
    """A pylibcudf Scalar's value in Python (``to_py`` in recent pylibcudf, through Arrow before)."""
    if hasattr(scalar, "to_py"):
        return scalar.to_py()
    import pylibcudf as plc

    return plc.interop.to_arrow(scalar).as_py()


def consumer(path: str) -> None:
    """Get "events" and reduce a column with libcudf."""
    import pylibcudf as plc

    with aib.connect(path, timeout=30.0) as session, session.get("events") as imported:
        table = plc.Table.from_arrow(imported)
        print(
            f"consumer: pylibcudf table of {table.num_rows()} rows x {table.num_columns()} columns",
            flush=True,
        )
        total = plc.reduce.reduce(table.columns()[0], plc.aggregation.sum(), plc.DataType(plc.TypeId.INT64))
        print(f"consumer: sum(id) on the GPU {scalar_value(total)}", flush=True)
        del table, total


def main() -> int:
    directory = tempfile.mkdtemp(prefix="aib-example-")
    path = os.path.join(directory, "publisher.sock")
    batch = pa.record_batch({"id": np.arange(ROWS, dtype=np.int64), "value": np.ones(ROWS, dtype=np.float32)})
    try:
        on_gpu = aib.to_device(batch)  # one host-to-device copy per buffer, into the bridge's IPC pool
        with aib.Publisher(path) as publisher:
            publisher.publish("events", on_gpu)
            print(f"producer: published {ROWS} rows on the GPU", flush=True)
            child = multiprocessing.get_context("spawn").Process(target=consumer, args=(path,), daemon=True)
            child.start()
            child.join(timeout=120)
            if child.is_alive():
                child.terminate()
                child.join()
            if child.exitcode != 0:
                print(f"producer: the consumer failed (exit code {child.exitcode})", file=sys.stderr)
                return 1
            print(f"producer: expected sum(id) {ROWS * (ROWS - 1) // 2}", flush=True)
        on_gpu.release()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
