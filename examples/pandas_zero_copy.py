"""pandas without copying: what to pass to ``to_pandas`` so a published table is not copied again.

``pa.table(imported).to_pandas()`` with its defaults consolidates columns of one dtype into 2-D
blocks, which copies every byte into this process's private memory (a 256 MiB table costs
256 MiB more). Two options keep pandas on the producer's shared memory, mapped here:

- ``to_pandas(split_blocks=True)``: one NumPy block per column, each a view of the Arrow buffer
  (numeric columns without nulls; such arrays are read-only, like the mapping);
- ``to_pandas(types_mapper=pd.ArrowDtype)``: pandas columns backed by the Arrow arrays themselves
  (every type, nulls included).

The consumer reads the table three ways and prints how much its private (anonymous) memory grew
each time, from ``RssAnon`` in ``/proc/self/status``; the shared mapping shows as ``RssShmem``.

Needs ``pandas`` (``pip install pandas``; it is in the project's test extra).

Run: ``python examples/pandas_zero_copy.py``
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

import arrow_ipc_bridge as aib

COLUMNS = 8
ROWS = 1 << 20  # 8 float64 columns of 1 Mi rows: 64 MiB
MIB = 1 << 20


def memory_kib(field: str) -> int:
    """One of this process's memory counters (kB) from /proc/self/status: RssAnon, RssShmem, ..."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} is not in /proc/self/status (Linux 4.5 or later has it)")


def private_growth_mib(make_frame: Callable[[], Any]) -> tuple[float, float]:
    """Build a DataFrame with ``make_frame()``, read every value once, and return how much private
    memory grew (MiB) and the sum of all values."""
    gc.collect()
    before = memory_kib("RssAnon")
    frame = make_frame()
    total = float(frame.sum().sum())  # touches every page of every column
    grown = (memory_kib("RssAnon") - before) / 1024
    del frame
    gc.collect()
    return grown, total


def consumer(path: str) -> None:
    """The other process: three ways from the published table to a pandas DataFrame."""
    import pandas as pd  # only the consumer needs pandas

    with aib.connect(path, timeout=10.0) as session, session.get("wide") as imported:
        table = pa.table(imported)  # no copy: a view of the shared memory
        print(
            f"consumer: {table.num_rows} rows x {table.num_columns} columns, {table.nbytes / MIB:.0f} MiB",
            flush=True,
        )
        # The zero-copy ways first: memory a copy took is not always given back to the system at once.
        ways = [
            ("split_blocks=True", functools.partial(table.to_pandas, split_blocks=True)),
            ("types_mapper=pd.ArrowDtype", functools.partial(table.to_pandas, types_mapper=pd.ArrowDtype)),
            ("default (copies)", table.to_pandas),
        ]
        for label, make_frame in ways:
            grown, total = private_growth_mib(make_frame)
            print(
                f"consumer: to_pandas({label}): private memory +{grown:.1f} MiB, sum {total:.0f}", flush=True
            )
        print(f"consumer: shared memory mapped {memory_kib('RssShmem') / 1024:.0f} MiB", flush=True)
        del ways, table  # they hold the mapped memory (and the lease) until they go


def main() -> int:
    directory = tempfile.mkdtemp(prefix="aib-example-")
    path = os.path.join(directory, "publisher.sock")
    values = np.arange(ROWS, dtype=np.float64)
    table = pa.table({f"c{i}": values + i for i in range(COLUMNS)})
    try:
        with aib.Publisher(path) as publisher:
            publisher.publish("wide", table)
            print(f"producer: published {table.nbytes / MIB:.0f} MiB", flush=True)
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
