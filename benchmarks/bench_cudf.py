#!/usr/bin/env python
"""pylibcudf reading GPU data through the bridge, against uploading the same rows from host Arrow.

    python benchmarks/bench_cudf.py [--rows 1048576] [--iterations 200] [--json out.json]

A spawned producer uploads a record batch and a table of one batch (an int64 and a float32 column,
``--rows`` rows) with ``aib.to_device`` and publishes both. The consumer (this process) times, per
iteration:

    get + from_arrow (batch)   session.get("batch") -> pylibcudf.Table.from_arrow(imported): the
                               columns as device memory opened from the producer's pool (no copy)
    get + from_arrow (table)   the same for the one-batch GPU table (its batch as a device array)
    host upload                pylibcudf.Table.from_arrow(pa_table) of the same rows in host memory:
                               libcudf copies them to the GPU

each followed by ``cuCtxSynchronize`` (inside the timing, so queued work is counted) and, untimed,
the table's release (and the import's). The first iterations (warm-ups) are not counted. Prints the
medians and 90th percentiles and their ratio; ``--json`` writes them. Needs a CUDA GPU and pylibcudf.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

WARMUPS = 10


def host_batch(rows: int) -> Any:
    import numpy as np
    import pyarrow as pa

    return pa.record_batch({"id": np.arange(rows, dtype=np.int64), "value": np.ones(rows, dtype=np.float32)})


def producer(path: str, rows: int, ready: Any, done: Any) -> None:
    import pyarrow as pa

    import arrow_ipc_bridge as aib

    batch = aib.to_device(host_batch(rows))
    table = aib.to_device(pa.Table.from_batches([host_batch(rows)]))
    with aib.Publisher(path) as pub:
        pub.publish("batch", batch)
        pub.publish("table", table)
        ready.set()
        done.wait(600)
    batch.release()
    table.release()


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))] * 1e6,
        "n": len(ordered),
    }


def measure(path: str, rows: int, iterations: int) -> dict[str, Any]:
    import pyarrow as pa
    import pylibcudf as plc

    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge import cuda

    results: dict[str, Any] = {}
    with aib.connect(path, timeout=60.0) as session:
        for name in ("batch", "table"):
            samples = []
            for i in range(WARMUPS + iterations):
                start = time.perf_counter()
                imported = session.get(name)
                table = plc.Table.from_arrow(imported)
                cuda.synchronize(0)
                elapsed = time.perf_counter() - start
                if table.num_rows() != rows:
                    raise SystemExit(f"{name}: {table.num_rows()} rows read, {rows} published")
                del table
                imported.release()
                if i >= WARMUPS:
                    samples.append(elapsed)
            results[f"get_from_arrow_{name}"] = _summary(samples)
    host = pa.Table.from_batches([host_batch(rows)])
    samples = []
    for i in range(WARMUPS + iterations):
        start = time.perf_counter()
        table = plc.Table.from_arrow(host)
        cuda.synchronize(0)
        elapsed = time.perf_counter() - start
        del table
        if i >= WARMUPS:
            samples.append(elapsed)
    results["host_upload"] = _summary(samples)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1 << 20)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-bench-cudf-")
    path = os.path.join(directory, "s.sock")
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=producer, args=(path, args.rows, ready, done), daemon=True)
    child.start()
    try:
        if not ready.wait(120):
            print(f"the producer did not get ready (exit code {child.exitcode})", file=sys.stderr)
            return 1
        results = measure(path, args.rows, args.iterations)
    finally:
        done.set()
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join()
        shutil.rmtree(directory, ignore_errors=True)
    if child.exitcode != 0:
        print(f"the producer exited {child.exitcode}", file=sys.stderr)
        return 1
    upload = results["host_upload"]["median_us"]
    print(
        f"pylibcudf, {args.rows} rows (int64 + float32), {args.iterations} iterations after "
        f"{WARMUPS} warm-ups:"
    )
    for key, label in (
        ("get_from_arrow_batch", "get + from_arrow, GPU record batch"),
        ("get_from_arrow_table", "get + from_arrow, GPU table (one batch)"),
        ("host_upload", "from_arrow of host Arrow (upload)"),
    ):
        row = results[key]
        print(
            f"  {label:42s} median {row['median_us']:9.1f} us  p90 {row['p90_us']:9.1f} us"
            f"  ({upload / row['median_us']:.1f}x the upload's speed)"
        )
    if args.json:
        import pylibcudf as plc

        meta = {
            "rows": args.rows,
            "iterations": args.iterations,
            "warmups": WARMUPS,
            "python": platform.python_version(),
            "pylibcudf": getattr(plc, "__version__", None),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
