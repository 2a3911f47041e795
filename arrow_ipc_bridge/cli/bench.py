"""``bench``: the bridge against the peers installed here (torch.multiprocessing, Arrow IPC stream
bytes, pickle), moving the same float64 columns between a producer and a consumer process.

The plan (devices, sizes, cases, and what is skipped and why) is made and checked before any process
starts; ``_bench_pair`` runs it in two spawned processes and ``_bench_cases`` says what each case
does. Progress goes to stderr, one line per case; the results to stdout as a table or JSON; a PNG
plot (``_bench_plot``, matplotlib) on request.

Exit statuses: 0 after a full run; 2, with one line on stderr before anything runs, for options this
machine cannot honour (a size of less than one row, ``--device cuda`` without a GPU or CuPy,
``--peers torch`` without torch, ``--plot`` without matplotlib); 1 for a failure while measuring
(one line naming the case).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from arrow_ipc_bridge.cli._bench_cases import (
    BRIDGE_CASES,
    CASE_LABELS,
    PEER_CASES,
    REFERENCE_CASE,
    Shape,
)
from arrow_ipc_bridge.cli._bench_options import (
    DEFAULT_REPEATS,
    DEFAULT_SIZES,
    PEER_NAMES,
    QUICK_REPEATS,
    QUICK_SIZES,
    format_size,
)
from arrow_ipc_bridge.cli._bench_pair import PlanItem, run_pair
from arrow_ipc_bridge.cli._output import CommandError, print_json, print_table

__all__ = ["JSON_SCHEMA", "OptionError", "Plan", "bench", "make_plan", "percentile"]

JSON_SCHEMA = "arrow_ipc_bridge.bench/1"
_WARMUP = 2
_QUICK_WARMUP = 1
# The cases hold several copies of the columns at once (pickle: the producer's columns, its pickle,
# the consumer's bytes and what it unpickles), so a size is refused above this share of the RAM.
_MEMORY_SHARE = 8
_CUPY_HINT = "pip install arrow_ipc_bridge[cuda12] (or [cuda13])"


class OptionError(Exception):
    """An option this machine cannot honour, found before anything runs: one line, exit status 2."""


@dataclass(frozen=True)
class Skipped:
    """A case (or ``"all"`` of a device's cases) left out, and why."""

    device: str
    case: str
    reason: str

    def line(self) -> str:
        what = f"{self.device} cases" if self.case == "all" else f"{CASE_LABELS[self.case]} ({self.device})"
        return f"skipped {what}: {self.reason}"


@dataclass(frozen=True)
class Plan:
    """What one run measures, in order, and what it leaves out."""

    items: list[PlanItem]
    sizes: tuple[int, ...]
    columns: int
    repeats: int
    warmup: int
    devices: list[str]
    skipped: list[Skipped] = field(default_factory=list)


# ---------- what is installed here (tests replace these) ---------------------------------------------
def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _gpu_name() -> str | None:
    """GPU 0's name, or None without a CUDA driver or GPU."""
    from arrow_ipc_bridge import cuda

    if not cuda.driver_available() or cuda.device_count() == 0:
        return None
    return str(cuda.device_name(0))


def _torch_has_cuda() -> bool:
    torch = importlib.import_module("torch")
    return bool(torch.cuda.is_available())


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# ---------- the plan ---------------------------------------------------------------------------------
def _peer_unavailable(peer: str, device: str) -> str | None:
    """Why ``peer`` cannot run on ``device`` here, or None. Arrow IPC and pickle need nothing beyond
    pyarrow and the standard library (CuPy, for CUDA, is checked with the device)."""
    if peer != "torch":
        return None
    if not _installed("torch"):
        return "torch is not installed (pip install torch)"
    if device == "cuda" and not _torch_has_cuda():
        return "this torch has no CUDA (torch.cuda.is_available() is False)"
    return None


def make_plan(args: argparse.Namespace) -> Plan:
    """The cases to run, from the parsed options and what this machine has; ``OptionError`` for an
    option it cannot honour."""
    sizes: tuple[int, ...] = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    repeats: int = args.repeats or (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    columns: int = args.columns
    if not _installed("numpy"):
        raise OptionError("bench makes its columns with numpy, which is not installed: pip install numpy")
    row_bytes = 8 * columns
    memory = _memory_bytes()
    for size in sizes:
        if size < row_bytes:
            raise OptionError(
                f"--sizes: {format_size(size)} holds no row of {columns} float64 columns ({row_bytes} bytes)"
            )
        if memory is not None and size * _MEMORY_SHARE > memory:
            raise OptionError(
                f"--sizes: {format_size(size)} is more than 1/{_MEMORY_SHARE} of this machine's "
                f"{format_size(memory)} of memory, and a case holds several copies at once"
            )
    skipped: list[Skipped] = []
    devices = ["host"] if args.device in ("host", "auto") else []
    if args.device in ("cuda", "auto"):
        gpu = _gpu_name()
        if gpu is None:
            reason = "no CUDA GPU here (the doctor command says what the driver reports)"
        elif not _installed("cupy"):
            reason = f"the CUDA cases use CuPy arrays, and CuPy is not installed: {_CUPY_HINT}"
        else:
            reason = ""
            devices.append("cuda")
        if reason and args.device == "cuda":
            raise OptionError(f"--device cuda: {reason}")
        if reason:
            skipped.append(Skipped("cuda", "all", reason))
    explicit = args.peers not in ("auto", "none")
    wanted = PEER_NAMES if args.peers == "auto" else () if args.peers == "none" else args.peers
    peers: dict[str, list[str]] = {device: [] for device in devices}
    for peer in PEER_CASES:
        if peer not in wanted:
            continue
        for device in devices:
            why = _peer_unavailable(peer, device)
            if why is None:
                peers[device].append(peer)
            elif explicit:
                raise OptionError(f"--peers {peer}: {why}")
            else:
                skipped.append(Skipped(device, peer, why))
    items = [
        PlanItem(case, size, Shape(device, columns, size // row_bytes))
        for device in devices
        for size in sizes
        for case in (*BRIDGE_CASES, *peers[device])
    ]
    warmup = _QUICK_WARMUP if args.quick else _WARMUP
    return Plan(items, tuple(sizes), columns, repeats, warmup, devices, skipped)


# ---------- numbers ----------------------------------------------------------------------------------
def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks of sorted values (numpy's default rule)."""
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _row(item: PlanItem, samples_s: Sequence[float], warmup: int) -> dict[str, Any]:
    """One case's JSON row: the timed samples' summary in µs, the first sample beside it."""
    timed = [s * 1e6 for s in samples_s[warmup:]]
    ordered = sorted(timed)
    shape = item.shape
    return {
        "device": shape.device,
        "case": item.case,
        "label": CASE_LABELS[item.case],
        "size": format_size(item.size),
        "size_bytes": item.size,
        "bytes_moved": shape.rows * shape.columns * 8,
        "columns": shape.columns,
        "rows": shape.rows,
        "n": len(timed),
        "median_us": percentile(ordered, 0.5),
        "p90_us": percentile(ordered, 0.9),
        "min_us": ordered[0],
        "max_us": ordered[-1],
        "mean_us": sum(timed) / len(timed),
        "first_us": samples_s[0] * 1e6,
        "ratio_to_bridge_fresh": None,
        "samples_us": timed,
    }


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    reference = {
        (row["device"], row["size_bytes"]): row["median_us"] for row in rows if row["case"] == REFERENCE_CASE
    }
    for row in rows:
        base = reference.get((row["device"], row["size_bytes"]))
        row["ratio_to_bridge_fresh"] = row["median_us"] / base if base else None


def _warmups(count: int) -> str:
    return f"{count} warm-up" + ("" if count == 1 else "s")


def _duration(us: float) -> str:
    if us < 1e3:
        return f"{us:.0f} us"
    if us < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.2f} s"


# ---------- machine facts ----------------------------------------------------------------------------
def _version(*distributions: str) -> str | None:
    """The installed version of the first of ``distributions`` found (CuPy has one per CUDA)."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def machine_facts() -> dict[str, Any]:
    """What a reader of the numbers needs to know about where they were taken."""
    import pyarrow as pa

    from arrow_ipc_bridge import __version__
    from arrow_ipc_bridge._ffi import WIRE_VERSION

    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "gpu": _gpu_name(),
        "kernel": platform.release(),
        "loadavg": list(os.getloadavg()),
        "versions": {
            "arrow_ipc_bridge": __version__,
            "wire_format": f"{WIRE_VERSION[0]}.{WIRE_VERSION[1]}",
            "python": platform.python_version(),
            "pyarrow": pa.__version__,
            "numpy": _version("numpy"),
            "torch": _version("torch"),
            "cupy": _version("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy"),
            "matplotlib": _version("matplotlib"),
        },
    }


# ---------- the command ------------------------------------------------------------------------------
def _progress(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


def bench(args: argparse.Namespace, *, prog: str) -> int:
    """Run the benchmark the parsed options describe; print progress, then a table or JSON, and
    write the plot. ``prog`` starts the one-line errors (``python -m arrow_ipc_bridge bench``)."""
    try:
        plan = make_plan(args)
        figure_module = _matplotlib() if args.plot else None
    except OptionError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    facts = machine_facts()
    _progress(
        f"{len(plan.items)} cases on {' and '.join(plan.devices)}, sizes "
        f"{','.join(map(format_size, plan.sizes))}, {plan.columns} float64 columns, {plan.repeats} "
        f"samples each after {_warmups(plan.warmup)}; a producer and a consumer process"
    )
    for skip in plan.skipped:
        _progress(skip.line())
    rows: list[dict[str, Any]] = []

    def on_case(index: int, samples: list[float]) -> None:
        row = _row(plan.items[index], samples, plan.warmup)
        rows.append(row)
        _progress(
            f"[{index + 1}/{len(plan.items)}] {row['device']} {row['size']} {row['label']}: median "
            f"{_duration(row['median_us'])}, p90 {_duration(row['p90_us'])}"
        )

    run_pair(plan.items, warmup=plan.warmup, repeats=plan.repeats, on_case=on_case)
    _add_ratios(rows)
    if args.plot:
        title = f"{plan.columns} float64 columns, median of {plan.repeats} hand-offs, "
        title += f"{facts['cpu_count']} CPUs"
        if facts["gpu"] and "cuda" in plan.devices:
            title += f", {facts['gpu']}"
        try:
            from arrow_ipc_bridge.cli._bench_plot import write_plot

            write_plot(args.plot, figure_module, rows, title)
        except OSError as exc:
            raise CommandError(f"writing the plot {args.plot}: {exc.strerror or exc}") from exc
    if args.json:
        _print_json(plan, facts, rows, args.plot)
    else:
        _print_text(plan, rows, args.plot)
    return 0


def _matplotlib() -> Any:
    from arrow_ipc_bridge.cli._bench_plot import PLOT_EXTRA_HINT, load_matplotlib

    try:
        return load_matplotlib()
    except ImportError:
        raise OptionError(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}") from None


def _print_text(plan: Plan, rows: list[dict[str, Any]], plot: str | None) -> None:
    print_table(
        ("device", "size", "case", "median", "p90", "vs bridge fresh"),
        [
            (
                row["device"],
                row["size"],
                row["label"],
                _duration(row["median_us"]),
                _duration(row["p90_us"]),
                "" if row["ratio_to_bridge_fresh"] is None else f"{row['ratio_to_bridge_fresh']:.2f}x",
            )
            for row in rows
        ],
    )
    print(
        f"\n{plan.repeats} timed samples per case after {_warmups(plan.warmup)}, each from the "
        "consumer's request to one value read from the columns it received; 'vs bridge fresh': the "
        "median divided by the median of the bridge's hand-off of fresh data at that size and device."
    )
    for skip in plan.skipped:
        print(skip.line())
    if plot:
        print(f"plot written to {plot}")


def _print_json(plan: Plan, facts: dict[str, Any], rows: list[dict[str, Any]], plot: str | None) -> None:
    document = {
        "schema": JSON_SCHEMA,
        "machine": facts,
        "settings": {
            "devices": plan.devices,
            "sizes_bytes": list(plan.sizes),
            "columns": plan.columns,
            "repeats": plan.repeats,
            "warmup": plan.warmup,
            "cases": sorted({item.case for item in plan.items}, key=list(CASE_LABELS).index),
        },
        "results": rows,
        "skipped": [{"device": s.device, "case": s.case, "reason": s.reason} for s in plan.skipped],
        "plot": plot,
    }
    print_json(document)
