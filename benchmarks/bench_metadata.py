"""Cost of the metadata path per hand-off, in one process (no transport, no region mapping).

    python benchmarks/bench_metadata.py [--columns 1,16,64,256] [--json out.json]

producer = describe + place buffers + encode; consumer = decode + validate + rebuild schema and
array structs + release them. Reports the best of several runs of many iterations (the machine is
shared; the minimum is the least disturbed estimate) and the per-node cost, to show linear growth.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import pyarrow as pa

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.wire.capsules import capture
from arrow_ipc_bridge.wire.metadata import Decoded, Described, DeviceInfo, process_region


def _batch(columns: int) -> pa.RecordBatch:
    return pa.record_batch({f"c{i}": pa.array([float(i)] * 1024, pa.float32()) for i in range(columns)})


def _best_us(fn, iterations: int, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter_ns()
        for _ in range(iterations):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / iterations / 1000)
    return best


def measure(columns: int, iterations: int) -> dict[str, float]:
    captured = capture(_batch(columns))
    device = DeviceInfo(device_type=1)
    regions = [process_region()]
    bases = ffi.new("uint64_t[]", [0])

    def producer() -> bytes:
        described = Described(captured)
        lib.aib_described_place_all(described._d, 0, 0)  # every buffer at its address: process_region
        return described.encode(device, regions)

    message = producer()

    def consumer() -> None:
        decoded = Decoded(message, allow_process_regions=True)
        schema = ffi.new("struct ArrowSchema *")
        array = ffi.new("struct ArrowArray *")
        decoded.rebuild_schema(schema)
        decoded.rebuild_array(0, bases, array)
        array.release(array)
        schema.release(schema)
        decoded.close()

    p = _best_us(producer, iterations)
    c = _best_us(consumer, iterations)
    nodes = columns + 1
    return {
        "columns": columns,
        "nodes": nodes,
        "message_bytes": len(message),
        "producer_us": round(p, 2),
        "consumer_us": round(c, 2),
        "total_us": round(p + c, 2),
        "per_node_us": round((p + c) / nodes, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--columns", default="1,16,64,256")
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--json")
    args = parser.parse_args()
    columns = [int(c) for c in args.columns.split(",")]
    rows = [measure(c, max(200, args.iterations // max(1, c // 16))) for c in columns]
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(f"# {time.strftime('%Y-%m-%d')} {platform.python_version()} on {os.cpu_count()} cores, {cpu}")
    widths = (8, 6, 6, 12, 12, 9, 8)
    header = ("columns", "nodes", "bytes", "producer µs", "consumer µs", "total µs", "µs/node")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print(
            f"{r['columns']:>8} {r['nodes']:>6} {r['message_bytes']:>6} {r['producer_us']:>12} "
            f"{r['consumer_us']:>12} {r['total_us']:>9} {r['per_node_us']:>8}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
