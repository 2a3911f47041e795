"""pyarrow to pyarrow in shared host memory: a publisher process and a consumer process.

The producer (this process) publishes two tables under two names on a Unix socket:

- "prices": built in memory from ``aib.allocate_shared``, so it is shared with no copy at all;
- "trades": built by pyarrow on the ordinary heap, which the bridge copies once, at publish, into a
  sealed memfd (the default policy ``copy="if_needed"``; ``copy="never"`` would refuse it).

The consumer (a child started with ``multiprocessing``'s spawn) connects, gets both and reads them
with pyarrow. What it reads is the producer's memory mapped into the consumer: nothing is copied or
serialized on the way, only a small metadata message and file descriptors cross the socket.

Run: ``python examples/pyarrow_host.py``
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import arrow_ipc_bridge as aib

ROWS = 1_000_000


def shared_prices(rows: int) -> tuple[pa.Table, aib.SharedHostBuffer]:
    """A one-column table whose values live in bridge-owned shared memory (zero-copy to publish)."""
    buffer = aib.allocate_shared(rows * 8, name="prices")
    values = np.frombuffer(buffer.view(), dtype=np.float64)
    values[:] = np.arange(rows, dtype=np.float64) * 0.5  # written in place, before publishing
    column = pa.Array.from_buffers(pa.float64(), rows, [None, buffer.as_pyarrow()])
    return pa.table({"price": column}), buffer


def consumer(path: str) -> None:
    """The other process: connect, get each name, read it with pyarrow."""
    with aib.connect(path, timeout=10.0) as session:
        print(f"consumer: the publisher serves {sorted(session.list())}", flush=True)
        with session.get("prices") as imported:
            prices = pa.table(imported)  # a view of the mapped memory, no copy
            total = pc.sum(prices["price"]).as_py()
            print(f"consumer: prices has {prices.num_rows} rows, sum {total:.1f}", flush=True)
        with session.get("trades") as imported:
            trades = pa.table(imported)
            by_symbol = trades.group_by("symbol").aggregate([("qty", "sum")]).sort_by("symbol")
            print(f"consumer: trades per symbol {by_symbol.to_pydict()}", flush=True)
        # Leaving each `with` block gives the lease back once pyarrow released what it built from it
        # (`prices` and `trades` still hold it here; they go when this function returns).


def main() -> int:
    directory = tempfile.mkdtemp(prefix="aib-example-")  # the socket file lives here, removed at the end
    path = os.path.join(directory, "publisher.sock")
    prices, prices_memory = shared_prices(ROWS)
    trades = pa.table({"symbol": ["AAPL", "MSFT", "AAPL", "NVDA", "MSFT"], "qty": [10, 5, 7, 3, 1]})
    try:
        with aib.Publisher(path) as publisher:
            zero_copy = publisher.publish("prices", prices, copy="never")  # refuses to copy
            copied = publisher.publish("trades", trades)  # copy="if_needed": one sealed copy
            print(f"producer: prices published, {zero_copy.copied_bytes} bytes copied", flush=True)
            print(f"producer: trades published, {copied.copied_bytes} bytes copied once", flush=True)

            # spawn: a fresh interpreter (a fork would inherit the publisher's threads and sockets);
            # daemon: ended with this process should anything here fail.
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
        prices_memory.close()
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
