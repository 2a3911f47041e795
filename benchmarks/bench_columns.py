#!/usr/bin/env python
"""Usable columns: what it costs a consumer to turn an imported batch's columns into arrays.

    python benchmarks/bench_columns.py [--columns 16] [--rows 262144] [--repeat 2000] [--json out.json]

A publisher and a session in this process share one record batch of ``--columns`` float32 columns
(CUDA: CuPy arrays published with ``from_cuda_arrays``; host: a pyarrow batch), got once and held;
every figure is then the consumer's cost **per array** (one batch's time divided by the columns),
the median of ``--rounds`` rounds of ``--repeat`` batches, against the floor the array library sets
in the same run:

    CUDA (needs CuPy and a GPU; PyTorch rows need PyTorch with CUDA)
      floor cupy wrap          cupy.ndarray over cupy.cuda.UnownedMemory(ptr, size, owner) for the
                               same pointers (the library wrapping pointers itself)
      cupy wrap, device given  the same with UnownedMemory's device_id (CuPy then asks the driver
                               nothing), which is what column_arrays does
      column_arrays cupy       aib.column_arrays(imported, "cupy"): one call for the batch
      floor cupy.from_dlpack   cupy.from_dlpack of native CuPy arrays
      cupy.from_dlpack(view)   cupy.from_dlpack of our column views (made beforehand)
      floor torch.from_dlpack  torch.from_dlpack of native CuPy arrays
      torch.from_dlpack(view)  torch.from_dlpack of our column views
      column_arrays torch      aib.column_arrays(imported, "torch")
      column_view              making a view (aib.column_view(imported, i)), for scale
      view + cupy.from_dlpack  both per column (what the issue measured at ~27 us per column)
    host (needs NumPy)
      floor np.from_dlpack     numpy.from_dlpack of native NumPy arrays
      np.from_dlpack(view)     numpy.from_dlpack of our column views (versioned capsules, read-only)
      column_arrays numpy      aib.column_arrays(imported, "numpy")
      column_view              making a view, for scale
      view + np.from_dlpack    both per column

Targets (issue 15): column_arrays within 1.5x of the CuPy wrap, from_dlpack of our views within
1.2x of the same call on native CuPy arrays. Rows whose library is missing print a skip line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pyarrow as pa

import arrow_ipc_bridge as aib

Row = dict[str, Any]


def _per_array_us(run: Callable[[], object], columns: int, repeat: int, rounds: int) -> float:
    """Median over rounds of (seconds per call / columns), in microseconds; one untimed warm-up round."""
    for _ in range(max(repeat // 10, 10)):
        run()
    samples = []
    for _ in range(rounds):
        gc.disable()
        start = time.perf_counter()
        for _ in range(repeat):
            run()
        elapsed = time.perf_counter() - start
        gc.enable()
        samples.append(elapsed / repeat / columns * 1e6)
    return statistics.median(samples)


def _row(name: str, us: float, floor: float | None = None, target: float | None = None) -> Row:
    row: Row = {"name": name, "us_per_array": us}
    if floor:
        row["ratio"] = us / floor
        if target is not None:
            row["target"] = target
            row["meets_target"] = us / floor <= target
    return row


def _print(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    print(f"  {'':28s} {'us/array':>9s} {'vs floor':>9s}  target")
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else ""
        target = ""
        if "target" in row:
            target = f"<= {row['target']}x: " + ("met" if row["meets_target"] else "NOT met")
        print(f"  {row['name']:28s} {row['us_per_array']:9.2f} {ratio:>9s}  {target}")


def bench_cuda(args: argparse.Namespace, path: str) -> list[Row] | str:
    try:
        import cupy
    except ImportError:
        return "skipped: CuPy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "skipped: no CUDA device"
    except Exception as exc:  # no driver, no device
        return f"skipped: no usable CUDA device ({exc})"
    try:
        import torch

        if not torch.cuda.is_available():
            torch = None
    except ImportError:
        torch = None
    n, rows, repeat, rounds = args.columns, args.rows, args.repeat, args.rounds
    native = [cupy.arange(rows, dtype=cupy.float32) + i for i in range(n)]
    cupy.cuda.Device().synchronize()
    results: list[Row] = []
    with aib.Publisher(path) as publisher:
        publisher.publish("batch", aib.from_cuda_arrays({f"c{i}": a for i, a in enumerate(native)}))
        with aib.connect(path, timeout=30.0) as session, session.get("batch") as imported:
            aib.column_arrays(imported, "cupy")  # settles the producer's event
            views = [aib.column_view(imported, i) for i in range(n)]
            pointers = [(a.data.ptr, a.nbytes) for a in native]
            dtype = cupy.dtype(cupy.float32)
            memory, pointer, ndarray = cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer, cupy.ndarray

            def cupy_wrap() -> object:
                return [
                    ndarray((rows,), dtype, pointer(memory(p, size, imported), 0)) for p, size in pointers
                ]

            def cupy_wrap_on_device() -> object:
                return [
                    ndarray((rows,), dtype, pointer(memory(address, size, imported, 0), 0))
                    for address, size in pointers
                ]

            wrap = _per_array_us(cupy_wrap, n, repeat, rounds)
            results.append(_row("floor cupy wrap", wrap))
            # What column_arrays does per column: the device is given, so CuPy asks the driver nothing.
            results.append(
                _row("cupy wrap, device given", _per_array_us(cupy_wrap_on_device, n, repeat, rounds))
            )
            ours = _per_array_us(lambda: aib.column_arrays(imported, "cupy"), n, repeat, rounds)
            results.append(_row("column_arrays cupy", ours, wrap, 1.5))
            floor = _per_array_us(lambda: [cupy.from_dlpack(a) for a in native], n, repeat, rounds)
            results.append(_row("floor cupy.from_dlpack", floor))
            ours = _per_array_us(lambda: [cupy.from_dlpack(v) for v in views], n, repeat, rounds)
            results.append(_row("cupy.from_dlpack(view)", ours, floor, 1.2))
            if torch is None:
                print("torch rows skipped: PyTorch with CUDA is not installed")
            else:
                floor = _per_array_us(lambda: [torch.from_dlpack(a) for a in native], n, repeat, rounds)
                results.append(_row("floor torch.from_dlpack", floor))
                ours = _per_array_us(lambda: [torch.from_dlpack(v) for v in views], n, repeat, rounds)
                results.append(_row("torch.from_dlpack(view)", ours, floor, 1.2))
                ours = _per_array_us(lambda: aib.column_arrays(imported, "torch"), n, repeat, rounds)
                results.append(_row("column_arrays torch", ours, floor))
            ours = _per_array_us(lambda: [aib.column_view(imported, i) for i in range(n)], n, repeat, rounds)
            results.append(_row("column_view", ours))
            ours = _per_array_us(
                lambda: [cupy.from_dlpack(aib.column_view(imported, i)) for i in range(n)], n, repeat, rounds
            )
            results.append(_row("view + cupy.from_dlpack", ours, wrap))
    return results


def bench_host(args: argparse.Namespace, path: str) -> list[Row] | str:
    try:
        import numpy as np
    except ImportError:
        return "skipped: NumPy is not installed"
    n, rows, repeat, rounds = args.columns, args.rows, args.repeat, args.rounds
    native = [np.arange(rows, dtype=np.float32) + i for i in range(n)]
    results: list[Row] = []
    with aib.Publisher(path) as publisher:
        publisher.publish("batch", pa.record_batch({f"c{i}": a for i, a in enumerate(native)}))
        with aib.connect(path, timeout=30.0) as session, session.get("batch") as imported:
            views = [aib.column_view(imported, i) for i in range(n)]
            floor = _per_array_us(lambda: [np.from_dlpack(a) for a in native], n, repeat, rounds)
            results.append(_row("floor np.from_dlpack", floor))
            ours = _per_array_us(lambda: [np.from_dlpack(v) for v in views], n, repeat, rounds)
            results.append(_row("np.from_dlpack(view)", ours, floor))
            ours = _per_array_us(lambda: aib.column_arrays(imported, "numpy"), n, repeat, rounds)
            results.append(_row("column_arrays numpy", ours, floor))
            ours = _per_array_us(lambda: [aib.column_view(imported, i) for i in range(n)], n, repeat, rounds)
            results.append(_row("column_view", ours))
            ours = _per_array_us(
                lambda: [np.from_dlpack(aib.column_view(imported, i)) for i in range(n)], n, repeat, rounds
            )
            results.append(_row("view + np.from_dlpack", ours, floor))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--columns", type=int, default=16, help="float32 columns per batch (16)")
    parser.add_argument("--rows", type=int, default=1 << 18, help="rows per column (262144: 1 MiB each)")
    parser.add_argument("--repeat", type=int, default=2000, help="batches per timed round (2000)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds; the median is shown (7)")
    parser.add_argument("--skip-cuda", action="store_true", help="host rows only")
    parser.add_argument("--skip-host", action="store_true", help="CUDA rows only")
    parser.add_argument("--json", help="also write every figure to this file")
    args = parser.parse_args(argv)
    print(
        f"arrow_ipc_bridge {aib.__version__}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs; {args.columns} float32 columns of {args.rows} rows; "
        f"median of {args.rounds} rounds of {args.repeat} batches"
    )
    report: dict[str, Any] = {"arguments": vars(args)}
    directory = tempfile.mkdtemp(dir="/tmp")
    for section, bench, skip in (("cuda", bench_cuda, args.skip_cuda), ("host", bench_host, args.skip_host)):
        if skip:
            continue
        try:
            outcome = bench(args, os.path.join(directory, f"{section}.sock"))
        except Exception as exc:  # one section's failure must not hide the other's figures
            traceback.print_exc()
            outcome = f"failed: {exc!r}"
        if isinstance(outcome, str):
            print(f"\n{section}: {outcome}")
            report[section] = outcome
        else:
            _print(f"{section} (per array, {args.columns} columns)", outcome)
            report[section] = outcome
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
