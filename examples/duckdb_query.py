"""A DuckDB query over a published table, in another process.

DuckDB finds Python objects named in a query that speak the Arrow PyCapsule stream interface, so
the object ``session.get`` returns is queried as it is: DuckDB's Arrow scan reads the producer's
memory, mapped into this process, without building a pyarrow table first. ``connection.register``
gives it a table name of its own.

Needs ``duckdb`` (``pip install duckdb``; it is in the project's test extra).

Run: ``python examples/duckdb_query.py``
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

ROWS = 500_000
SYMBOLS = ["AAPL", "MSFT", "NVDA", "AMZN"]


def trades_table(rows: int) -> pa.Table:
    index = np.arange(rows, dtype=np.int64)
    return pa.table(
        {
            "symbol": pa.DictionaryArray.from_arrays(pa.array(index % 4, pa.int8()), SYMBOLS),
            "qty": (index % 100) + 1,
            "price": 100.0 + (index % 7),
        }
    )


def consumer(path: str) -> None:
    """The other process: run SQL over the published "trades"."""
    import duckdb  # only the consumer needs DuckDB

    with (
        aib.connect(path, timeout=10.0) as session,
        session.get("trades") as trades,
        duckdb.connect() as connection,
    ):
        # A replacement scan: `trades` in the SQL is the local Python variable above.
        rows = connection.execute(
            "SELECT symbol, count(*) AS n, sum(qty * price) AS notional "
            "FROM trades GROUP BY symbol ORDER BY symbol"
        ).fetchall()
        for symbol, count, notional in rows:
            print(f"consumer: {symbol}: {count} trades, notional {notional:.1f}", flush=True)
        # Or give it a name of its own; each query reads the data afresh.
        connection.register("t", trades)
        [(largest,)] = connection.execute("SELECT max(qty) FROM t WHERE symbol = 'NVDA'").fetchall()
        print(f"consumer: largest NVDA trade {largest}", flush=True)


def main() -> int:
    directory = tempfile.mkdtemp(prefix="aib-example-")
    path = os.path.join(directory, "publisher.sock")
    try:
        with aib.Publisher(path) as publisher:
            publisher.publish("trades", trades_table(ROWS))
            print(f"producer: published {ROWS} trades", flush=True)
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
