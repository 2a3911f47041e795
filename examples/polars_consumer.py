"""A polars consumer: the producer publishes a pyarrow table, another process analyses it with polars.

``polars.DataFrame(imported)`` reads what ``session.get`` returns through the Arrow PyCapsule stream
interface (``__arrow_c_stream__``): the numeric columns stay in the producer's shared memory, mapped
into this process (polars converts string columns to its own string layout as it would for any
Arrow input). The consumer also subscribes to nothing and polls nothing: it gets the name once.

Run: ``python examples/polars_consumer.py``
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile

import numpy as np
import pyarrow as pa

import arrow_ipc_bridge as aib

ROWS = 200_000


def sensor_table(rows: int) -> pa.Table:
    """Readings of four sensors: a sensor id, a timestamp in seconds and a temperature."""
    seconds = np.arange(rows, dtype=np.int64)
    return pa.table(
        {
            "sensor": pa.array(seconds % 4, pa.int32()),
            "second": seconds,
            "celsius": 20.0 + (seconds % 4) + (seconds % 10) * 0.1,
        }
    )


def consumer(path: str) -> None:
    """The other process: get "readings" and aggregate it with polars."""
    import polars as pl  # imported where it is used: only the consumer needs polars

    with aib.connect(path, timeout=10.0) as session, session.get("readings") as imported:
        frame = pl.DataFrame(imported)
        summary = (
            frame.group_by("sensor")
            .agg(pl.len().alias("readings"), pl.col("celsius").mean().round(2).alias("mean_celsius"))
            .sort("sensor")
        )
        print(f"consumer: polars read {frame.height} rows, columns {frame.columns}", flush=True)
        for row in summary.iter_rows(named=True):
            print(
                f"consumer: sensor {row['sensor']}: {row['readings']} readings, mean {row['mean_celsius']} C",
                flush=True,
            )
        del frame, summary  # polars' columns hold the mapped memory (and the lease) until they go


def main() -> int:
    directory = tempfile.mkdtemp(prefix="aib-example-")
    path = os.path.join(directory, "publisher.sock")
    try:
        with aib.Publisher(path) as publisher:
            stats = publisher.publish("readings", sensor_table(ROWS))
            print(
                f"producer: published {ROWS} rows ({stats.copied_bytes} bytes copied once into "
                "shared memory)",
                flush=True,
            )
            child = multiprocessing.get_context("spawn").Process(target=consumer, args=(path,), daemon=True)
            child.start()
            child.join(timeout=60)
            if child.is_alive():
                child.terminate()
                child.join()
            if child.exitcode != 0:
                print(f"producer: the consumer failed (exit code {child.exitcode})", file=sys.stderr)
                return 1
            print(f"producer: done, {publisher.active_leases} leases still held", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
