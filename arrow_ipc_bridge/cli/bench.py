"""``bench``: how fast the bridge hands columns from one process to another on this machine, against
the obvious peer, in the same run.

Host memory: the bridge's re-get (``session.get`` on a session with the default options,
``pa.table``, a value read) against an Arrow IPC file in ``/dev/shm`` read with ``memory_map`` and
``read_all``. On a CUDA GPU with torch: the bridge's re-get of the same columns as torch tensors
against ``torch.multiprocessing`` sending them on a Queue. ``_bench_pair`` runs the two processes,
``_bench_steps`` times each operation. The project's own figures, with more cases and options, come
from the ``benchmarks/`` folder of the source tree, not from this command.

Exit statuses: 0 after a full run; 2, with one line on stderr before anything runs, for what this
machine cannot do (a size of less than one row or too large for its memory, ``--device cuda``
without a GPU or torch with CUDA); 1 for a failure while measuring (one line naming the case).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Final

from arrow_ipc_bridge.cli._argtypes import positive_int
from arrow_ipc_bridge.cli._bench_pair import COLUMNS, LABELS, Case, describe, format_size, run_pair
from arrow_ipc_bridge.cli._output import print_json, print_table

__all__ = ["JSON_SCHEMA", "OptionError", "Plan", "bench", "make_plan", "parse_size", "register"]

JSON_SCHEMA: Final = "arrow_ipc_bridge.bench/2"
DEFAULT_SIZES: Final = (1 << 20, 64 << 20)
DEFAULT_REPEATS: Final = 100
WARMUP: Final = 10
# A host case holds its columns three times at once (the table, its copy in the bridge's memory,
# the IPC file), so a size is refused above this share of the RAM.
_MEMORY_SHARE: Final = 8
_UNITS: Final = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_SIZE: Final = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")


class OptionError(Exception):
    """What this machine cannot do, found before anything runs: one line, exit status 2."""


# ---------- options -------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864: a number, optionally with a fraction, and ``B``, ``KiB``, ``MiB`` or
    ``GiB`` (any case; none means bytes). Whole bytes, at least 1."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: use a number and B, KiB, MiB or GiB, e.g. 64MiB"
        )
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be a whole number of bytes, at least 1")
    return int(value)


def _parse_sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of sizes, each given once; returned smallest first."""
    sizes: list[int] = []
    for part in text.split(","):
        size = parse_size(part)
        if size in sizes:
            raise argparse.ArgumentTypeError(f"{format_size(size)} is given twice")
        sizes.append(size)
    return tuple(sorted(sizes))


def register(sub: Any) -> None:
    """Add the ``bench`` subcommand to the command line's subparsers."""
    p = sub.add_parser(
        "bench",
        help="time the bridge against an Arrow IPC file (and torch.multiprocessing on a GPU)",
        description=f"Publish {COLUMNS} float64 columns of each size in one process and get them "
        "again and again in another: the bridge's re-get against an Arrow IPC file in /dev/shm read "
        "with memory_map (host memory) and, with a CUDA GPU and torch, against torch.multiprocessing "
        "(GPU 0), sampled in alternation. Progress on stderr; a table, or JSON, on stdout. Exit 2 "
        "for what this machine cannot do, 1 when a case fails.",
    )
    p.add_argument(
        "--sizes",
        type=_parse_sizes,
        default=DEFAULT_SIZES,
        help=f"bytes of all columns, comma-separated (default {','.join(map(format_size, DEFAULT_SIZES))})",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=DEFAULT_REPEATS,
        help=f"timed samples per method and size, after {WARMUP} warm-ups (default {DEFAULT_REPEATS})",
    )
    p.add_argument(
        "--device",
        choices=("host", "cuda", "auto"),
        default="auto",
        help="host memory, GPU 0, or auto: host, and the GPU too when there is one with torch",
    )
    p.add_argument("--json", action="store_true", help="print JSON (results and machine facts)")


# ---------- what this machine has (tests replace these) ---------------------------------------------
def _gpu_name() -> str | None:
    """GPU 0's name, or None without a CUDA driver or GPU."""
    from arrow_ipc_bridge import cuda

    if not cuda.driver_available() or cuda.device_count() == 0:
        return None
    return str(cuda.device_name(0))


def _torch_cuda() -> str | None:
    """Why torch cannot hold CUDA tensors here, or None when it can."""
    if importlib.util.find_spec("torch") is None:
        return "the GPU cases use torch tensors and torch is not installed (pip install torch)"
    if not importlib.import_module("torch").cuda.is_available():
        return "this torch has no CUDA (torch.cuda.is_available() is False)"
    return None


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# ---------- the plan ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The cases of one run, in order, and the devices left out with the reason."""

    cases: list[Case]
    sizes: tuple[int, ...]
    repeats: int
    devices: list[str]
    skipped: dict[str, str] = field(default_factory=dict)


def make_plan(args: argparse.Namespace) -> Plan:
    """The cases to run, from the parsed options and what this machine has; ``OptionError`` for what
    it cannot do."""
    sizes: tuple[int, ...] = args.sizes
    row_bytes = 8 * COLUMNS
    memory = _memory_bytes()
    for size in sizes:
        if size < row_bytes:
            raise OptionError(
                f"--sizes: {format_size(size)} holds no row of {COLUMNS} float64 columns ({row_bytes} bytes)"
            )
        if memory is not None and size * _MEMORY_SHARE > memory:
            raise OptionError(
                f"--sizes: {format_size(size)} is more than 1/{_MEMORY_SHARE} of this machine's "
                f"{format_size(memory)} of memory, and a case holds several copies at once"
            )
    devices = ["host"] if args.device in ("host", "auto") else []
    skipped: dict[str, str] = {}
    if args.device in ("cuda", "auto"):
        why = (
            "no CUDA GPU here (the doctor command says what the driver reports)"
            if _gpu_name() is None
            else None
        )
        why = why or _torch_cuda()
        if why is None:
            devices.append("cuda")
        elif args.device == "cuda":
            raise OptionError(f"--device cuda: {why}")
        else:
            skipped["cuda"] = why
    peer = {"host": "ipc_file", "cuda": "torch"}
    cases = [Case(device, size, ("bridge", peer[device])) for device in devices for size in sizes]
    return Plan(cases, sizes, args.repeats, devices, skipped)


# ---------- numbers -------------------------------------------------------------------------------
def _rows(case: Case, samples_s: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The case's JSON rows, one per method: its timed samples' summary in µs, and its median over
    the bridge's."""
    rows: list[dict[str, Any]] = []
    for method in case.methods:
        timed = [s * 1e6 for s in samples_s[method][WARMUP:]]
        # statistics' "inclusive" quantiles interpolate between ranks, as numpy's default does
        p90 = statistics.quantiles(timed, n=10, method="inclusive")[8] if len(timed) > 1 else timed[0]
        rows.append(
            {
                "device": case.device,
                "method": method,
                "label": LABELS[method],
                "size": format_size(case.size),
                "size_bytes": case.size,
                "columns": COLUMNS,
                "rows": case.rows,
                "n": len(timed),
                "median_us": statistics.median(timed),
                "p90_us": p90,
                "min_us": min(timed),
                "max_us": max(timed),
                "samples_us": timed,
            }
        )
    bridge = rows[0]["median_us"]
    for row in rows:
        row["ratio_to_bridge"] = row["median_us"] / bridge
    return rows


def _duration(us: float) -> str:
    if us < 1e3:
        return f"{us:.1f} us" if us < 100 else f"{us:.0f} us"
    if us < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.2f} s"


# ---------- machine facts -------------------------------------------------------------------------
def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
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
            "torch": _version("torch"),
        },
    }


# ---------- the command ---------------------------------------------------------------------------
def _progress(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


def bench(args: argparse.Namespace, *, prog: str) -> int:
    """Run the benchmark the parsed options describe; progress on stderr, then a table or JSON.
    ``prog`` starts the one-line errors (``python -m arrow_ipc_bridge bench``)."""
    try:
        plan = make_plan(args)
    except OptionError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    facts = machine_facts()
    _progress(
        f"{' and '.join(plan.devices)}, sizes {','.join(map(format_size, plan.sizes))}, {COLUMNS} float64 "
        f"columns, {plan.repeats} samples per method after {WARMUP} warm-ups; a producer and a "
        "consumer process"
    )
    for device, reason in plan.skipped.items():
        _progress(f"skipped {device}: {reason}")
    rows: list[dict[str, Any]] = []

    def on_case(index: int, samples: dict[str, list[float]]) -> None:
        case = plan.cases[index]
        done = _rows(case, samples)
        rows.extend(done)
        medians = ", ".join(f"{row['label']} {_duration(row['median_us'])}" for row in done)
        _progress(f"[{index + 1}/{len(plan.cases)}] {describe(case)}: median {medians}")

    run_pair(plan.cases, warmup=WARMUP, repeats=plan.repeats, on_case=on_case)
    if args.json:
        print_json(
            {
                "schema": JSON_SCHEMA,
                "machine": facts,
                "settings": {
                    "devices": plan.devices,
                    "sizes_bytes": list(plan.sizes),
                    "columns": COLUMNS,
                    "repeats": plan.repeats,
                    "warmup": WARMUP,
                },
                "results": rows,
                "skipped": [{"device": device, "reason": reason} for device, reason in plan.skipped.items()],
            }
        )
        return 0
    print_table(
        ("device", "size", "method", "median", "p90", "x bridge"),
        [
            (
                row["device"],
                row["size"],
                row["label"],
                _duration(row["median_us"]),
                _duration(row["p90_us"]),
                f"{row['ratio_to_bridge']:.2f}x",
            )
            for row in rows
        ],
    )
    print(
        f"\n{plan.repeats} timed samples per method after {WARMUP} warm-ups, the methods in alternation; "
        "each from the consumer's request to one value read from what it received; 'x bridge': the "
        "median over the bridge's at that size and device."
    )
    for device, reason in plan.skipped.items():
        print(f"skipped {device}: {reason}")
    return 0
