#!/usr/bin/env python
"""GPU benchmark of arrow_ipc_bridge against the usual ways of moving GPU columns between two processes.

    python benchmarks/bench_gpu.py [--sizes 1MiB,64MiB,1GiB] [--iterations 200] [--json out.json] [--quick]
    python benchmarks/bench_gpu.py --dry-run        # no GPU needed: imports, arguments, host tables, report

Producer and consumer are always separate processes started with the multiprocessing *spawn* method
(CUDA never crosses a fork). Every number is a round trip seen by the consumer, from "the consumer asks"
to "the consumer can launch work on the data" (issue 5's end point: device pointers in hand and the
consumer's own stream ordered after the producer's event; torch's rebuild does the same wait). The launch
of a CuPy/PyTorch ``sum`` of the last column follows, untimed in the main figure and reported per line as
"to kernel launched" (it adds the library's own launch cost, the same for every method):

    bare_rtt             64-byte request, 64-byte reply over a Unix stream socket between the same two
                         processes, back to back (the floor of any round trip on this machine)
    bridge_ping          Session.ping: 64 bytes echoed by the publisher's C serve loop on the session's own
                         connection, each ping followed by an untimed bridge_steady round trip, so that
                         it meets the gaps and idle threads a steady get meets (the bare round trip
                         "over the same socket" of issue 5's goal); then one more steady round trip
                         and one of each mixed table, timed (the ratios taken within one loop)
    bridge_steady        the producer published 16 CuPy float32 columns once (``from_cuda_arrays``, legacy
                         cudaMalloc memory); per round trip the consumer does session.get ->
                         __arrow_c_device_array__ -> cuStreamWaitEvent(sync_event) if the struct
                         carries one (the bridge hands it out only while the producer's work is
                         pending) | launch -> (untimed)
                         synchronise, check the sum, release. Handles are already open (the session
                         remembers the message's opened regions; the opener keeps legacy handles in an LRU)
    bridge_pool_steady   the same with columns from the bridge's IPC-enabled memory pool
                         (``cupy_allocator``): the pool is imported once; from the second get on the
                         session keeps the message with a lease (``pool_linger``), so re-gets import nothing
    bridge_fresh_legacy  the producer allocates 16 new cudaMalloc arrays and publishes them before every
                         round trip (untimed, reported as "publish"): the consumer opens 16 new handles.
                         Handles stay open in the consumer after the producer frees the memory (session
                         and opener caches), so the consumer reconnects its session (untimed) whenever
                         that would pin more than 8 GiB
    bridge_fresh_pool    the same with new IPC-pool arrays: per-buffer pointer imports after the pool import
    bridge_fresh_slab    the same with new arrays from the slab allocator (``cupy_allocator(0,
                         slab_size=256 MiB)``): carved out of kept slabs, which the consumer imports once;
                         later messages over them are imported by the C get path (or are byte for byte
                         a message remembered already). Each round also gets the steady message after
                         the same producer work (the control the per-buffer figure is taken against)
    bridge_mixed_*       a mixed table (string with nulls, list<int32> with nulls, int64 with nulls,
                         float32) uploaded with ``to_device``: published once / uploaded anew every time;
                         ``mixed_legacy``: published once from ``to_device(..., allocation="legacy")``
                         (cuMemAlloc memory: one legacy handle, remembered by the session); the default
                         pool upload is kept with a lease from its second get, like bridge_pool_steady
    raw_cached/raw_fresh the design's peer rows "raw legacy IPC": 16 (handle, offset) entries over the
                         same control socket, cuIpcOpenMemHandle per handle (or a consumer-side cache)
    torch_steady         torch.multiprocessing (spawn-context Queue): the producer puts the same 16 CUDA
                         tensors, the consumer gets them and launches the sum; it keeps each transfer until
                         the next arrives (torch's receiving cache hits: its best case)
    torch_steady_drop    the same, but the consumer drops each transfer at once (the next one reopens)
    torch_fresh          new tensors every time ("first transfer" of each)
    d2h_ipc              device -> host, Arrow IPC stream bytes through a pipe, host -> device (1 MiB and
                         64 MiB; one repeat at 1 GiB, skipped by --quick)

Results print as they arrive (a timeout still leaves data); ``--json PATH`` is rewritten after every
result. See the printed legend for what each column of the final table means.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
for _path in (_HERE, _REPO):  # the children module, and the package built in place
    if _path not in sys.path:
        sys.path.insert(0 if _path == _HERE else 1, _path)

import gpu_bench_children as kids  # noqa: E402  (needs the path set up above)
from gpu_bench_children import (  # noqa: E402
    BRIDGE_METHODS,
    DESIGN_BASELINES_US,
    DESIGN_LABELS,
    FRESH,
    METHODS,
    NCOLS,
    TORCH_METHODS,
    GiB,
    MiB,
    fmt_size,
    fmt_us,
    parse_size,
)

FLAT_GOAL = 1.5  # bridge steady state: largest median / smallest median across sizes
BARE_RATIO_GOAL = 1.5  # bridge steady state / the bare round trip over the same socket (bridge_ping)
TORCH_FACTOR_GOAL = 20.0  # torch.mp steady median / bridge steady median, at every size
POOL_US_PER_BUFFER_GOAL = 5.0  # IPC-pool pointer import per new buffer, after the pool import

LEGEND = """\
what the numbers mean
  every time is a round trip seen by the consumer process: from "the consumer asks" to "the consumer can
  launch work on the data" (device pointers in hand, its own stream waiting on the producer's event).
  "to kernel launched" adds the launch of a CuPy/PyTorch sum on the last column (its run time is not
  included). median / p90 over the measured iterations (after 1 first + warmup);
  first = the very first round trip of that method at that size in that process pair (handle opens etc.).
  ÷ bare    = this median / the bare 64-byte Unix-socket round trip between the same two processes.
  ÷ ping    = this median / the PING round trip on the session's own connection in the same rhythm.
  ÷ bridge  = this median / bridge steady-state median at the same size (how many times slower).
  torch ÷   = torch.multiprocessing steady median / this median (how many times faster than torch).
  bridge "publish" (new allocations): the producer's from_cuda_arrays + publish before each round trip,
  not inside the round trip; "publish+get" adds both per iteration.
  opens/it: CUDA driver opens per round trip in the consumer (cuda.cuda_stats() deltas)."""


# ---------------------------------------------------------------------------------------------------------
# machine facts
# ---------------------------------------------------------------------------------------------------------


def _version_of(*dists: str) -> str | None:
    from importlib import metadata

    for dist in dists:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{dist} {metadata.version(dist)}"
    return None


def machine_info() -> dict[str, Any]:
    import pyarrow as pa

    import arrow_ipc_bridge as aib

    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_total = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
                break
    git: dict[str, str] = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):

        def read_git(*cmd: str) -> str:
            out = subprocess.run(
                ["git", "-C", _REPO, *cmd], capture_output=True, text=True, timeout=10, check=False
            )
            return out.stdout.strip() if out.returncode == 0 else ""

        git["head"] = read_git("rev-parse", "--short", "HEAD")
    # A copy of a working tree (for example one sent to a GPU machine) may carry a .git that lags
    # behind it: the caller names the commit it copied in AIB_SOURCE_COMMIT.
    if os.environ.get("AIB_SOURCE_COMMIT"):
        git["source_commit"] = os.environ["AIB_SOURCE_COMMIT"]
        git["library_changes_vs_head"] = read_git(
            "diff", "--shortstat", "HEAD", "--", "arrow_ipc_bridge", "cffi_build"
        )
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hostname": platform.node(),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": model,
        "mem_total_bytes": mem_total,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "pyarrow": pa.__version__,
        "arrow_ipc_bridge": aib.__version__,
        "library_path": os.path.dirname(os.path.abspath(aib.__file__)),
        "cupy": _version_of("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "torch": _version_of("torch"),
        "git": git,
        "loadavg_at_start": os.getloadavg(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def nvidia_smi() -> dict[str, Any]:
    """Name, driver, memory and UUID of every GPU as nvidia-smi reports them ({} if it is absent)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,driver_version,memory.total,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": repr(exc)}
    gpus = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            gpus.append({"name": parts[0], "driver": parts[1], "memory": parts[2], "uuid": parts[3]})
    return {"gpus": gpus} if gpus else {"raw": out.stdout.strip(), "stderr": out.stderr.strip()}


def gpu_present() -> tuple[bool, str]:
    """Whether this process sees a CUDA device through the driver (no context is created)."""
    try:
        from arrow_ipc_bridge import cuda
    except Exception as exc:
        return False, f"cannot import arrow_ipc_bridge.cuda: {exc!r}"
    try:
        if not cuda.driver_available():
            cuda.load_driver()  # raises with the driver's reason
        count = cuda.device_count()
    except Exception as exc:
        return False, str(exc)
    if count < 1:
        return False, "the CUDA driver sees no device"
    return True, f"{count} device(s)"


# ---------------------------------------------------------------------------------------------------------
# results: live printing, JSON, final report
# ---------------------------------------------------------------------------------------------------------
def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def _ratio_check(check: str, value: float, detail: str) -> dict[str, Any]:
    """A check of issue 5's round-trip goal: ``value``, a median over a bare round trip's, at most
    BARE_RATIO_GOAL."""
    return {
        "check": check,
        "value": value,
        "goal": f"<= {BARE_RATIO_GOAL}",
        "pass": value <= BARE_RATIO_GOAL,
        "detail": detail,
    }


class Collector:
    def __init__(self, args: argparse.Namespace, meta: dict[str, Any], *, synthetic: bool = False) -> None:
        self.args = args
        self.meta = meta
        self.synthetic = synthetic
        self.t0 = time.monotonic()
        self.results: dict[tuple[str, int], dict[str, Any]] = {}
        self.size_info: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.errors: list[str] = []
        self.done: dict[str, Any] = {}
        self.checks: list[dict[str, Any]] = []
        self.complete = False

    # -- live --
    def stamp(self) -> str:
        return f"[{time.monotonic() - self.t0:6.1f} s]"

    def say(self, text: str) -> None:
        print(f"{self.stamp()} {text}", flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.say(f"note: {text}")
        self.write_json()

    def error(self, text: str) -> None:
        self.errors.append(text)
        self.say(f"ERROR: {text}")
        self.write_json()

    def handle(self, pair: str, who: str, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            info = msg["ready"]
            self.meta.setdefault("children", {})[f"{pair}_{who}"] = info
            if "device_name" in info:
                self.meta["device"] = {
                    k: info.get(k)
                    for k in ("device_name", "device_uuid", "driver_version", "cuda_runtime", "cupy")
                }
                self.say(
                    f"{pair} {who} ready: {info['device_name']} ({info.get('device_uuid')}), CUDA driver "
                    f"API {info.get('driver_version')}, runtime {info.get('cuda_runtime')}, "
                    f"cupy {info.get('cupy')}"
                )
            else:
                self.say(f"{pair} {who} ready")
        if "size_info" in msg:
            info = msg["size_info"]
            self.size_info.append(info)
            self.say(self._size_line(info))
        if "note" in msg:
            self.note(str(msg["note"]))
        if "result" in msg:
            self.add_result(msg["result"])
        if "error" in msg:
            self.error(str(msg["error"]).rstrip())
        if "done" in msg:
            self.done[pair] = msg["done"]
            launch = (msg["done"] or {}).get("local_op_launch") or {}
            if launch:
                self.say(
                    f"{pair}: consumer's kernel launch on local memory (paid by every method): median "
                    f"{fmt_us(launch.get('median_us'))}"
                )
            self.write_json()

    @staticmethod
    def _size_line(info: dict[str, Any]) -> str:
        size = info.get("size", 0)
        rows = info.get("rows_per_column") or 0
        parts = [f"{info.get('pair')} set up {fmt_size(size)}: {NCOLS} x {rows:,} float32"]
        pub = info.get("publish") or {}
        for name, p in pub.items():
            parts.append(
                f"publish {name} {fmt_us(p.get('publish_us'))} ({p.get('regions')} regions, "
                f"{p.get('buffers')} buffers, {p.get('copied_bytes')} B copied"
                f"{' !! NOT ZERO-COPY' if p.get('copied_bytes') else ''})"
            )
        mixed = info.get("mixed")
        if mixed:
            parts.append(
                f"mixed {mixed['rows']:,} rows {mixed['nbytes'] / MiB:.1f} MiB (host build "
                f"{fmt_us(mixed.get('host_build_us'))}, to_device {fmt_us(mixed.get('to_device_us'))}, "
                f"publish {fmt_us((mixed.get('publish') or {}).get('publish_us'))}, "
                f"{(mixed.get('publish') or {}).get('regions')} region)"
            )
        return "; ".join(parts)

    def add_result(self, r: dict[str, Any]) -> None:
        key = (r["method"], int(r["size"]))
        self.results[key] = r
        label = METHODS.get(r["method"], r["method"])
        head = f"{label:50s} {fmt_size(r['size']):>6s}"
        if "error" in r:
            self.errors.append(f"{r['method']} {fmt_size(r['size'])}: {r['error']}")
            self.say(f"{head}  FAILED: {r['error'].strip().splitlines()[-1] if r['error'].strip() else ''}")
            self.say("  " + r["error"].rstrip().replace("\n", "\n  "))
        else:
            self.say(
                f"{head}  n={r['n']:<4d} median {fmt_us(r['median_us']):>9s}  p90 {fmt_us(r['p90_us']):>9s}"
                f"  first {fmt_us(r.get('first_us')):>9s}{self._details(r)}"
            )
        self.write_json()

    @staticmethod
    def _details(r: dict[str, Any]) -> str:
        extra = r.get("extra") or {}
        bits = []

        def med(name: str) -> str:
            return fmt_us((extra.get(name) or {}).get("median_us"))

        if "launched_us" in extra:
            bits.append(f"to kernel launched {med('launched_us')}")
        if "producer_publish_us" in extra:
            bits.append(f"publish {med('producer_publish_us')}")
        if "producer_get_handles_us" in extra:
            bits.append(f"producer cuIpcGetMemHandle x{NCOLS} {med('producer_get_handles_us')}")
        if "regions" in extra:
            bits.append(f"regions/publish {extra['regions']['mean']:.1f}")
        if (extra.get("copied_bytes") or {}).get("max"):
            bits.append(f"!! {extra['copied_bytes']['mean']:.0f} B copied per publish (not zero-copy)")
        if "opens" in extra:
            bits.append(f"opens/it {extra['opens']['mean']:.1f}")
        if "publish_plus_get_us" in extra:
            bits.append(f"publish+get {med('publish_plus_get_us')}")
        if "release_us" in extra:
            bits.append(f"release {med('release_us')}")
        per = r.get("per_iteration")
        delta = r.get("cuda_stats_delta")
        if per:
            bits.append(
                f"opens/it legacy {per.get('legacy_opens', 0):.1f} (hits {per.get('legacy_hits', 0):.1f}), "
                f"pool imports {delta.get('pool_imports', 0) if delta else 0} in all"
            )
        elif delta and r.get("iterations_total"):
            total = r["iterations_total"]
            bits.append(
                f"opens/it legacy {delta.get('legacy_opens', 0) / total:.2f} "
                f"(hits {delta.get('legacy_hits', 0) / total:.1f}), "
                f"pool imports {delta.get('pool_imports', 0)}"
            )
        opens = r.get("open_us_by_region_kind") or {}
        for kind, st in opens.items():
            bits.append(f"{kind} region open {fmt_us(st.get('median_us'))}/buffer")
        if "close_us" in extra:
            bits.append(f"close 16 handles {med('close_us')}")
        if "producer_d2h_us" in extra:
            bits.append(
                f"producer D2H {med('producer_d2h_us')}, serialize {med('producer_serialize_us')}, "
                f"send {med('producer_send_us')}"
            )
        if r.get("stopped_by_budget"):
            bits.append(f"time budget hit after {r['n']} of {r.get('planned_n')}")
        return ("  | " + "; ".join(bits)) if bits else ""

    # -- JSON --
    def as_json(self) -> dict[str, Any]:
        return _json_safe(
            {
                "benchmark": "arrow_ipc_bridge GPU (benchmarks/bench_gpu.py)",
                "synthetic_dry_run": self.synthetic,
                "complete": self.complete,
                "meta": self.meta,
                "args": vars(self.args),
                "legend": LEGEND,
                "methods": METHODS,
                "design_baselines_us": {
                    k: {fmt_size(s): v for s, v in d.items()} for k, d in DESIGN_BASELINES_US.items()
                },
                "size_info": self.size_info,
                "results": [
                    self.results[k] for k in sorted(self.results, key=lambda k: (k[1], _order(k[0])))
                ],
                "done": self.done,
                "checks": self.checks,
                "notes": self.notes,
                "errors": self.errors,
                "elapsed_s": time.monotonic() - self.t0,
            }
        )

    def write_json(self) -> None:
        path = self.args.json
        if not path:
            return
        try:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.as_json(), f, indent=1)
            os.replace(tmp, path)
        except OSError as exc:
            print(f"could not write {path}: {exc}", file=sys.stderr, flush=True)

    # -- final report --
    def get(self, method: str, size: int) -> dict[str, Any] | None:
        r = self.results.get((method, size))
        return None if r is None or "error" in r else r

    def sizes(self) -> list[int]:
        return sorted({s for _, s in self.results})

    def report(self) -> None:
        print()
        print(LEGEND)
        sizes = self.sizes()
        methods = [m for m in METHODS if any((m, s) in self.results for s in sizes)]
        print()
        header = (
            f"{'method':50s} {'size':>6s} {'n':>5s} {'median':>9s} {'p90':>9s} {'first':>9s} "
            f"{'÷ bare':>8s} {'÷ ping':>8s} {'÷ bridge':>9s} {'torch ÷':>9s}"
        )
        title = "results (SYNTHETIC NUMBERS: --dry-run formatting check)" if self.synthetic else "results"
        print(f"=== {title} ===")
        print(header)
        print("-" * len(header))
        for size in sizes:
            base = self.get("bridge_steady", size)
            torch_ = self.get("torch_steady", size)
            bare = self.get("bare_rtt", size)
            ping = self.get("bridge_ping", size)
            for m in methods:
                r = self.results.get((m, size))
                if r is None:
                    continue
                label = METHODS[m]
                if "error" in r:
                    print(f"{label:50s} {fmt_size(size):>6s}  FAILED (see errors)")
                    continue
                ratio = f"{r['median_us'] / base['median_us']:.2f}x" if base else "-"
                over_bare = f"{r['median_us'] / bare['median_us']:.1f}x" if bare else "-"
                over_ping = f"{r['median_us'] / ping['median_us']:.1f}x" if ping else "-"
                compare = torch_ and not m.startswith("torch_") and m not in ("bare_rtt", "bridge_ping")
                faster = f"{torch_['median_us'] / r['median_us']:.1f}x" if compare else "-"
                print(
                    f"{label:50s} {fmt_size(size):>6s} {r['n']:>5d} {fmt_us(r['median_us']):>9s} "
                    f"{fmt_us(r['p90_us']):>9s} {fmt_us(r.get('first_us')):>9s} "
                    f"{over_bare:>8s} {over_ping:>8s} {ratio:>9s} {faster:>9s}"
                )
            print()
        self._design_table(sizes)
        self._checks(sizes)
        if self.errors:
            print()
            print(f"=== {len(self.errors)} error(s) ===")
            for e in self.errors:
                print("  " + e.strip().splitlines()[0][:300])
        self.write_json()

    def _design_table(self, sizes: list[int]) -> None:
        print("=== peer baselines: this run's median (the design's H200 reference median) ===")
        cols = sizes or [MiB, 64 * MiB, GiB]
        head = f"{'method':52s}" + "".join(f"{fmt_size(s):>22s}" for s in cols)
        print(head)
        print("-" * len(head))
        rows = [*DESIGN_LABELS.items(), ("bridge_steady", "arrow_ipc_bridge, steady state (this library)")]
        for key, label in rows:
            cells = []
            for s in cols:
                r = self.get(key, s)
                ref = DESIGN_BASELINES_US.get(key, {}).get(s)
                here = fmt_us(r["median_us"]) if r else "-"
                cells.append(f"{here} ({fmt_us(ref)})" if ref is not None else here)
            print(f"{label:52s}" + "".join(f"{c:>22s}" for c in cells))
        print()

    def _checks(self, sizes: list[int]) -> None:
        checks: list[dict[str, Any]] = []
        steady = {s: self.get("bridge_steady", s) for s in sizes}
        medians = {s: r["median_us"] for s, r in steady.items() if r}
        if len(medians) >= 2:
            spread = max(medians.values()) / min(medians.values())
            checks.append(
                {
                    "check": "bridge steady state is flat in size (largest / smallest median)",
                    "value": spread,
                    "goal": f"<= {FLAT_GOAL}",
                    "pass": spread <= FLAT_GOAL,
                    "detail": ", ".join(f"{fmt_size(s)} {fmt_us(v)}" for s, v in medians.items()),
                }
            )
        for s in sizes:
            b, t, bare = steady.get(s), self.get("torch_steady", s), self.get("bare_rtt", s)
            ping = self.get("bridge_ping", s)
            if b and t:
                factor = t["median_us"] / b["median_us"]
                detail = f"torch {fmt_us(t['median_us'])}, bridge {fmt_us(b['median_us'])}"
                drop = self.get("torch_steady_drop", s)
                if drop:
                    detail += (
                        f"; torch with the consumer dropping each transfer {fmt_us(drop['median_us'])} "
                        f"= {drop['median_us'] / b['median_us']:.1f}x"
                    )
                checks.append(
                    {
                        "check": f"{fmt_size(s)}: torch.mp steady / bridge steady",
                        "value": factor,
                        "goal": f">= {TORCH_FACTOR_GOAL:.0f}x",
                        "pass": factor >= TORCH_FACTOR_GOAL,
                        "detail": detail,
                    }
                )
            elif b:
                checks.append(
                    {
                        "check": f"{fmt_size(s)}: torch.mp steady / bridge steady",
                        "value": None,
                        "goal": f">= {TORCH_FACTOR_GOAL:.0f}x",
                        "pass": None,
                        "detail": "torch.multiprocessing was not measured (see notes)",
                    }
                )
            if b and ping:
                detail = f"bridge {fmt_us(b['median_us'])}, PING {fmt_us(ping['median_us'])}"
                phases = b.get("extra") or {}
                if all(f"{k}_us" in phases for k in ("get", "capsules", "consumer")):
                    detail += (
                        " (medians: get {}, capsules {}, consumer's struct reads + stream wait {})".format(
                            *(fmt_us(phases[f"{k}_us"]["median_us"]) for k in ("get", "capsules", "consumer"))
                        )
                    )
                with_event = (phases.get("sync_event") or {}).get("mean")
                if with_event is not None:
                    detail += f"; sync_event handed out in {100 * with_event:.0f}% of gets"
                if bare:
                    detail += (
                        f"; against the back-to-back Python socket echo ({fmt_us(bare['median_us'])}) "
                        f"{b['median_us'] / bare['median_us']:.1f}x"
                    )
                checks.append(
                    _ratio_check(
                        f"{fmt_size(s)}: bridge steady / bare round trip on the same connection",
                        b["median_us"] / ping["median_us"],
                        detail,
                    )
                )
                interleaved = ((ping.get("extra") or {}).get("interleaved_get_us") or {}).get("median_us")
                if interleaved:
                    checks.append(
                        _ratio_check(
                            f"{fmt_size(s)}: the same, gets and PINGs interleaved in one loop",
                            interleaved / ping["median_us"],
                            f"steady get {fmt_us(interleaved)}, PING {fmt_us(ping['median_us'])}: each "
                            "timed PING and timed get follows a full get cycle, a few hundred µs apart "
                            "(the separate loops above run seconds apart; a VM's speed drifts between them)",
                        )
                    )
            elif b and bare:
                checks.append(
                    _ratio_check(
                        f"{fmt_size(s)}: bridge steady / bare 64-byte round trip (no PING measured)",
                        b["median_us"] / bare["median_us"],
                        f"bridge {fmt_us(b['median_us'])}, bare {fmt_us(bare['median_us'])}",
                    )
                )
            for mixed_key, how, interleaved_key in (
                ("bridge_mixed_steady", "to_device pool", "interleaved_mixed_get_us"),
                ("bridge_mixed_legacy_steady", "to_device legacy", "interleaved_mixed_legacy_get_us"),
            ):
                mixed = self.get(mixed_key, s)
                if mixed and ping:
                    checks.append(
                        _ratio_check(
                            f"{fmt_size(s)}: mixed table ({how}) steady / round trip on the connection",
                            mixed["median_us"] / ping["median_us"],
                            f"mixed {fmt_us(mixed['median_us'])}, PING {fmt_us(ping['median_us'])}",
                        )
                    )
                in_loop = ((ping or {}).get("extra") or {}).get(interleaved_key) or {}
                if ping and in_loop.get("median_us"):
                    checks.append(
                        _ratio_check(
                            f"{fmt_size(s)}: the same, mixed table ({how}) timed in the PING loop",
                            in_loop["median_us"] / ping["median_us"],
                            f"mixed {fmt_us(in_loop['median_us'])}, PING {fmt_us(ping['median_us'])} "
                            "(each timed after a full get cycle, in one loop)",
                        )
                    )
            fresh_pool = self.get("bridge_fresh_pool", s)
            if fresh_pool:
                by_kind = fresh_pool.get("open_us_by_region_kind") or {}
                direct = (by_kind.get("pool") or {}).get("median_us")
                driver = (by_kind.get("pool_driver") or {}).get("median_us")
                derived = None
                pool_steady = self.get("bridge_pool_steady", s)
                if b:
                    derived = (fresh_pool["median_us"] - b["median_us"]) / NCOLS
                detail = (
                    f"CudaOpener pool-region open per region, median {fmt_us(direct)}, of which the "
                    f"driver's cuMemPoolImportPointer loop (ImportedPool.import_pointers) "
                    f"{fmt_us(driver)}; from medians "
                    f"(new pool arrays - legacy steady) / {NCOLS} = {fmt_us(derived)}"
                )
                if pool_steady and b:
                    detail += f"; (pool steady - legacy steady) / {NCOLS} = " + fmt_us(
                        (pool_steady["median_us"] - b["median_us"]) / NCOLS
                    )
                checks.append(
                    {
                        "check": f"{fmt_size(s)}: IPC pool, one allocation per array, µs per new buffer",
                        "value": direct,
                        "goal": f"<= {POOL_US_PER_BUFFER_GOAL:.0f} µs",
                        "pass": None if direct is None else direct <= POOL_US_PER_BUFFER_GOAL,
                        "detail": detail,
                    }
                )
            fresh_slab = self.get("bridge_fresh_slab", s)
            control = ((fresh_slab or {}).get("extra") or {}).get("control_get_us")
            if fresh_slab and control:
                # Everything a message of 16 new buffers adds to a get, per buffer: the whole get of
                # new arrays against a get of the steady message after the same producer work.
                per_buffer = (fresh_slab["median_us"] - control["median_us"]) / NCOLS
                per_iteration = fresh_slab.get("per_iteration") or {}
                slab_extra = fresh_slab.get("extra") or {}

                def share(key: str, extra: dict[str, Any] = slab_extra) -> float:
                    return float((extra.get(key) or {}).get("mean") or 0.0)

                checks.append(
                    {
                        "check": f"{fmt_size(s)}: slab allocator, µs per new buffer (whole get)",
                        "value": per_buffer,
                        "goal": f"<= {POOL_US_PER_BUFFER_GOAL:.0f} µs",
                        "pass": per_buffer <= POOL_US_PER_BUFFER_GOAL,
                        "detail": (
                            f"(new slab arrays {fmt_us(fresh_slab['median_us'])} - the steady message "
                            f"got after the same producer work {fmt_us(control['median_us'])}) / {NCOLS}; "
                            f"legacy steady in its own rhythm {fmt_us((b or {}).get('median_us'))}; "
                            f"per round trip {per_iteration.get('pool_pointer_imports', 0.0):.2f} pointer "
                            f"imports; of the gets {100 * share('remembered'):.0f}% remembered messages, "
                            f"{100 * share('new_in_c'):.0f}% new ones imported by the C core, "
                            f"{per_iteration.get('pool_kept_hits', 0.0):.2f} kept-slab hits in Python"
                        ),
                    }
                )
            fresh = self.get("bridge_fresh_legacy", s)
            if fresh and fresh.get("per_iteration"):
                # Issue 5: at most one driver open per distinct allocation. The producer exports
                # one region per allocation; the consumer opens a handle it has not seen and finds
                # the others in its cache (the driver may give new small allocations the handle of
                # an earlier one: docs/benchmarks.md), so hits are shown beside the opens.
                per_iteration = fresh["per_iteration"]
                opens = per_iteration.get("legacy_opens", 0.0)
                # found open: by the opener (Python path) or by the C get path (new messages)
                hits = per_iteration.get("legacy_hits", 0.0) + per_iteration.get("c_legacy_hits", 0.0)
                regions = float((fresh.get("first_extra") or {}).get("regions") or NCOLS)
                checks.append(
                    {
                        "check": f"{fmt_size(s)}: new cudaMalloc arrays, driver opens per new allocation",
                        "value": opens / regions,
                        "goal": "<= 1",
                        "pass": opens <= regions,
                        "detail": f"{opens:.1f} opens + {hits:.1f} found open for {regions:.0f} "
                        f"allocations per round trip; {fmt_us(fresh['median_us'])} per round trip",
                    }
                )
        self.checks = checks
        print("=== checks ===")
        if not checks:
            print("  (nothing to check: the steady-state bridge numbers are missing)")
        for c in checks:
            verdict = {True: "PASS", False: "FAIL", None: "info"}[c["pass"]]
            value = c["value"]
            shown = "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
            print(f"  [{verdict}] {c['check']}: {shown} (goal {c['goal']}); {c['detail']}")


def _order(method: str) -> int:
    return list(METHODS).index(method) if method in METHODS else len(METHODS)


# ---------------------------------------------------------------------------------------------------------
# running the process pairs
# ---------------------------------------------------------------------------------------------------------
def _stop(procs: dict[str, Any], grace: float) -> None:
    """Join each child within ``grace`` seconds; terminate, then kill what is left."""
    end = time.monotonic() + grace
    for proc in procs.values():
        proc.join(max(0.1, end - time.monotonic()))
    for proc in procs.values():
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _drain_reports(col: Collector, pair: str, reports: dict[str, Any]) -> None:
    """Handle what the children said after the main loop stopped listening (shutdown errors)."""
    for who, conn in reports.items():
        with contextlib.suppress(EOFError, OSError):
            while conn.poll(0):
                col.handle(pair, who, conn.recv())


def supervise(
    col: Collector,
    pair: str,
    procs: dict[str, Any],
    reports: dict[str, Any],
    *,
    main: str,
    hard_deadline: float,
) -> bool:
    """Forward the children's reports until ``main`` reports done, a child fails, or the deadline."""
    from multiprocessing.connection import wait

    open_reports = dict(reports)
    while open_reports:
        remaining = hard_deadline - time.monotonic()
        if remaining <= 0:
            col.error(f"{pair}: the time limit was reached; stopping its processes (results so far kept)")
            return False
        ready = wait(list(open_reports.values()), timeout=min(1.0, remaining))
        for conn in ready:
            who = next(k for k, v in open_reports.items() if v is conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                del open_reports[who]
                continue
            col.handle(pair, who, msg)
            if "done" in msg and who == main:
                return True
        for who, proc in procs.items():
            if proc.is_alive() or proc.exitcode is None:
                continue
            conn = open_reports.get(who)
            if conn is not None and conn.poll(0):
                continue  # read what it said first
            if proc.exitcode != 0 or who == main:
                col.error(f"{pair} {who} exited with code {proc.exitcode} before the {main} finished")
                return False
    col.error(f"{pair}: every child closed its report pipe before the {main} finished")
    return False


def run_bridge_pair(col: Collector, cfg: dict[str, Any], hard_deadline: float) -> None:
    ctx = mp.get_context("spawn")
    prod_r, prod_w = ctx.Pipe(duplex=False)
    cons_r, cons_w = ctx.Pipe(duplex=False)
    d2h_r, d2h_w = ctx.Pipe(duplex=False)  # os.pipe(): the D2H peer's "Arrow IPC bytes over a pipe"
    procs = {
        "producer": ctx.Process(
            target=kids.bridge_producer, args=(cfg, prod_w, d2h_w), name="bridge-producer", daemon=True
        ),
        "consumer": ctx.Process(
            target=kids.bridge_consumer, args=(cfg, cons_w, d2h_r), name="bridge-consumer", daemon=True
        ),
    }
    reports = {"producer": prod_r, "consumer": cons_r}
    _run_pair(
        col, "bridge", procs, reports, child_ends=(prod_w, cons_w, d2h_r, d2h_w), hard_deadline=hard_deadline
    )


def _run_pair(
    col: Collector,
    pair: str,
    procs: dict[str, Any],
    reports: dict[str, Any],
    *,
    child_ends: tuple[Any, ...],
    hard_deadline: float,
) -> None:
    """Start a producer/consumer pair, supervise it until the consumer is done (or the deadline),
    stop it, collect its last reports and note non-zero exit codes."""
    try:
        for proc in procs.values():
            proc.start()
        for conn in child_ends:
            conn.close()  # the children hold their own copies; EOF now means "child gone"
        supervise(col, pair, procs, reports, main="consumer", hard_deadline=hard_deadline)
    finally:
        _stop(procs, grace=30)
        _drain_reports(col, pair, reports)
        for name, proc in procs.items():
            if proc.exitcode not in (0, None):
                col.note(f"{pair} {name} exit code {proc.exitcode}")


def run_torch_pair(col: Collector, cfg: dict[str, Any], hard_deadline: float) -> None:
    try:
        import torch.multiprocessing as tmp
    except Exception as exc:
        col.note(f"torch cannot be imported ({exc!r}): the torch.multiprocessing peer is skipped")
        return
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    cons_conn, prod_conn = ctx.Pipe()
    prod_r, prod_w = ctx.Pipe(duplex=False)
    cons_r, cons_w = ctx.Pipe(duplex=False)
    procs = {
        "producer": ctx.Process(
            target=kids.torch_producer,
            args=(cfg, prod_conn, queue, prod_w),
            name="torch-producer",
            daemon=True,
        ),
        "consumer": ctx.Process(
            target=kids.torch_consumer,
            args=(cfg, cons_conn, queue, cons_w),
            name="torch-consumer",
            daemon=True,
        ),
    }
    reports = {"producer": prod_r, "consumer": cons_r}
    try:
        ends = (prod_w, cons_w, cons_conn, prod_conn)
        _run_pair(col, "torch", procs, reports, child_ends=ends, hard_deadline=hard_deadline)
    finally:
        with contextlib.suppress(Exception):
            queue.close()
            queue.cancel_join_thread()


def run(args: argparse.Namespace, *, host_only: bool = False) -> int:
    start = time.monotonic()
    hard_end = start + args.deadline_s
    meta = machine_info()
    if not host_only:
        meta["nvidia_smi"] = nvidia_smi()
    col = Collector(args, meta)
    print("=== arrow_ipc_bridge GPU benchmark ===")
    smi = (meta.get("nvidia_smi") or {}).get("gpus") or []
    if smi:
        g = smi[0]
        print(f"device: {g['name']} ({g['uuid']}), driver {g['driver']}, {g['memory']}")
    elif host_only:
        print("device: none (--selftest-host: process plumbing only, CPU stand-ins)")
    print(
        f"date: {meta['date_utc']}; host {meta['hostname']}: {meta['nproc']} CPUs '{meta['cpu_model']}', "
        f"Linux {meta['kernel']}"
    )
    changes = meta["git"].get("library_changes_vs_head")
    if meta["git"].get("source_commit"):
        given = meta["git"]["source_commit"]
        changes = f"copied from commit {given}; against the copy's .git: {changes or 'none'}"
    print(
        f"software: Python {meta['python']}, pyarrow {meta['pyarrow']}, arrow_ipc_bridge "
        f"{meta['arrow_ipc_bridge']} ({meta['library_path']}, git {meta['git'].get('head') or '?'}"
        f"{', uncommitted: ' + changes if changes else ''}), "
        f"{meta['cupy'] or 'no cupy'}, {meta['torch'] or 'no torch'}"
    )
    print(
        f"mode: {'quick' if args.quick else 'full'}; iterations {args.iterations}; sizes "
        f"{', '.join(fmt_size(s) for s in args.sizes)}; time limit {args.deadline_s:.0f} s; "
        f"per method and size at most {args.method_budget_s:.0f} s",
        flush=True,
    )
    want_torch = any(m in TORCH_METHODS for m in args.methods)
    torch_ok = want_torch and importlib.util.find_spec("torch") is not None
    if want_torch and not torch_ok:
        col.note("torch is not installed: the torch.multiprocessing peer is skipped (pip install torch)")
    reserve = (45.0 if args.quick else 75.0) if torch_ok else 0.0
    sock_dir = tempfile.mkdtemp(prefix="aib-gpu-bench-", dir="/tmp")
    base_cfg: dict[str, Any] = {
        "sizes": args.sizes,
        "iterations": args.iterations,
        "method_budget_s": args.method_budget_s,
        "quick": args.quick,
        "methods": args.methods,
        "host_only": host_only,
    }
    try:
        if any(m in BRIDGE_METHODS for m in args.methods):
            bridge_soft = hard_end - reserve - 20.0
            cfg = {
                **base_cfg,
                "bridge_sock": os.path.join(sock_dir, "bridge.sock"),
                "ctl_sock": os.path.join(sock_dir, "ctl.sock"),
                "deadline_epoch": time.time() + (bridge_soft - time.monotonic()),
            }
            run_bridge_pair(col, cfg, hard_deadline=min(hard_end - reserve, bridge_soft + 30.0))
        if torch_ok:
            torch_soft = hard_end - 10.0
            cfg = {
                **base_cfg,
                "deadline_epoch": time.time() + (torch_soft - time.monotonic()),
                "torch_device": "cpu" if host_only else "cuda:0",
            }
            run_torch_pair(col, cfg, hard_deadline=hard_end)
    except KeyboardInterrupt:
        col.error("interrupted: reporting what was measured so far")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
        col.complete = not col.errors
        col.report()
        print(f"\ntotal {time.monotonic() - start:.1f} s" + (f"; JSON in {args.json}" if args.json else ""))
    return 0 if not col.errors else 1


# ---------------------------------------------------------------------------------------------------------
# --dry-run
# ---------------------------------------------------------------------------------------------------------
_API = [
    (
        "arrow_ipc_bridge",
        ["Publisher", "connect", "Session", "ImportedArray", "TransportError", "__version__"],
    ),
    ("arrow_ipc_bridge.arrays.device", ["to_device", "from_cuda_arrays"]),
    ("arrow_ipc_bridge.consumer.imported", ["to_host"]),
    ("arrow_ipc_bridge.wire.capsules", ["capsule_struct", "DEVICE_CUDA"]),
    ("arrow_ipc_bridge._ffi", ["ffi", "lib"]),
    ("arrow_ipc_bridge.runtime.reaper", ["drain", "pending_callbacks"]),
    ("arrow_ipc_bridge.wire.metadata", ["REGION_CUDA_LEGACY", "REGION_CUDA_POOL", "REGION_CUDA_VMM"]),
    (
        "arrow_ipc_bridge.cuda",
        [
            "driver_available",
            "device_count",
            "device_name",
            "device_uuid",
            "format_uuid",
            "driver_version",
            "device_capabilities",
            "pointer_info",
            "ipc_get_mem_handle",
            "ipc_open_mem_handle",
            "ipc_close_mem_handle",
            "stream_wait_event",
            "cupy_allocator",
            "IpcMemoryPool",
            "cuda_stats",
            "event_value",
        ],
    ),
    ("arrow_ipc_bridge.cuda.opener", ["opener", "CudaOpener"]),
    ("arrow_ipc_bridge.cuda.placer", ["event_pool", "bridge_pool"]),
]


def _synthetic_results(sizes: list[int], iterations: int) -> list[tuple[str, str, dict[str, Any]]]:
    """Plausible fake messages for every method and size, to run the report code without a GPU."""
    import random

    rng = random.Random(1)
    typical = {
        "bare_rtt": 12.0,
        "bridge_ping": 16.0,
        "bridge_steady": 60.0,
        "bridge_pool_steady": 62.0,
        "bridge_fresh_legacy": 2500.0,
        "bridge_fresh_pool": 160.0,
        "bridge_fresh_slab": 45.0,
        "bridge_mixed_steady": 62.0,
        "bridge_mixed_legacy_steady": 35.0,
        "bridge_mixed_fresh": 75.0,
        "raw_cached": 40.0,
        "raw_fresh": 1500.0,
        "torch_steady": 1300.0,
        "torch_steady_drop": 2500.0,
        "torch_fresh": 5000.0,
        "d2h_ipc": 3600.0,
    }
    out: list[tuple[str, str, dict[str, Any]]] = []
    for size in sizes:
        out.append(
            (
                "bridge",
                "consumer",
                {"size_info": {"pair": "bridge", "size": size, "rows_per_column": size // 64}},
            )
        )
        for key, base in typical.items():
            scale = (size / MiB) if key == "d2h_ipc" else 1.0
            samples = [base * scale * (1 + 0.2 * rng.random()) / 1e6 for _ in range(max(5, iterations))]
            r = kids.stats_us(samples)
            r.update(
                method=key,
                size=size,
                pair="torch" if key.startswith("torch") else "bridge",
                first_us=base * 10,
                samples_us=[],
                extra={},
            )
            if key == "bridge_ping":
                r["extra"] = {
                    "interleaved_get_us": kids.stats_us([2.2e-5]),
                    "interleaved_mixed_get_us": kids.stats_us([2.4e-5]),
                    "interleaved_mixed_legacy_get_us": kids.stats_us([2.3e-5]),
                }
            if key in FRESH:
                r["extra"] = {
                    "producer_publish_us": kids.stats_us([4e-4]),
                    "publish_plus_get_us": kids.stats_us([3e-3]),
                    "release_us": kids.stats_us([3e-5]),
                }
                if key == "bridge_fresh_slab":
                    r["extra"]["control_get_us"] = kids.stats_us([4e-5])
                r["per_iteration"] = {
                    "legacy_opens": 16.0 if key == "bridge_fresh_legacy" else 0.0,
                    "legacy_hits": 0.0,
                    "pool_imports": 0.0,
                }
                r["cuda_stats_delta"] = {"legacy_opens": 16 * 50, "legacy_hits": 0, "pool_imports": 0}
            if key == "bridge_fresh_pool":
                r["open_us_by_region_kind"] = {"pool": kids.stats_us([3.1e-6] * 20)}
            out.append((r["pair"], "consumer", {"result": r}))
    out.append(("bridge", "consumer", {"note": "synthetic note (dry run)"}))
    return out


def dry_run(args: argparse.Namespace) -> int:
    import importlib

    print("=== bench_gpu.py --dry-run: no GPU work; imports, arguments, host tables, report formatting ===")
    print(f"arguments: {vars(args)}")
    problems = []
    for module, names in _API:
        try:
            mod = importlib.import_module(module)
        except Exception as exc:
            problems.append(f"import {module}: {exc!r}")
            continue
        missing = [n for n in names if not hasattr(mod, n)]
        if missing:
            problems.append(f"{module} lacks {', '.join(missing)}")
    print("library API used by the benchmark: " + ("all present" if not problems else "; ".join(problems)))
    for name in ("numpy", "pyarrow", "cupy", "torch"):
        spec = importlib.util.find_spec(name)
        print(f"  {name}: {'installed' if spec else 'NOT installed'}")
    ok, why = gpu_present()
    print(f"GPU: {'present, ' + why if ok else 'none (' + why + ')'}")
    meta = machine_info()
    print(
        f"machine: {meta['nproc']} CPUs '{meta['cpu_model']}', Python {meta['python']}, "
        f"pyarrow {meta['pyarrow']}"
    )
    for size in args.sizes:
        t0 = time.perf_counter()
        f32 = kids.float32_host_batch(size)
        t1 = time.perf_counter()
        batch, info = kids.mixed_batch(size)
        t2 = time.perf_counter()
        if f32.num_columns != NCOLS or f32.schema.types[-1] != "float":
            problems.append(f"float32 table at {fmt_size(size)} is wrong: {f32.schema}")
        try:
            batch.validate(full=size <= 64 * MiB)
        except Exception as exc:
            problems.append(f"mixed table at {fmt_size(size)} is invalid: {exc}")
        last = batch.column(batch.num_columns - 1)
        if str(last.type) != "float" or last.null_count:
            problems.append(f"mixed table's last column must be float32 without nulls, got {last.type}")
        print(
            f"  {fmt_size(size):>6s}: float32 table {f32.num_columns} x {f32.num_rows:,} rows = "
            f"{f32.nbytes / MiB:.1f} MiB ({(t1 - t0) * 1e3:.0f} ms); mixed {info['rows']:,} rows, "
            f"{info['nbytes'] / MiB:.1f} MiB, types {info['types']}, nulls {info['null_counts']} "
            f"({(t2 - t1) * 1e3:.0f} ms)"
        )
        del f32, batch
    # the whole report path on synthetic numbers
    col = Collector(args, meta, synthetic=True)
    for pair, who, msg in _synthetic_results(args.sizes, args.iterations):
        col.handle(pair, who, msg)
    col.complete = False
    col.report()
    if args.json:
        with open(args.json) as f:
            json.load(f)  # what was written parses back
        print(f"JSON (synthetic, marked synthetic_dry_run) written to {args.json}")
    if problems:
        print("DRY RUN FOUND PROBLEMS:\n  " + "\n  ".join(problems))
        return 1
    print("dry run OK")
    return 0


# ---------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="GPU benchmark of arrow_ipc_bridge vs torch.multiprocessing, raw CUDA IPC, D2H copies.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=LEGEND,
    )
    p.add_argument("--sizes", default="1MiB,64MiB,1GiB", help="total table sizes (16 float32 columns)")
    p.add_argument(
        "--iterations", type=int, default=None, help="measured round trips (default 200, quick 30)"
    )
    p.add_argument("--json", metavar="PATH", help="write everything here (rewritten after every result)")
    p.add_argument("--quick", action="store_true", help="small iteration counts (whole run < 3 minutes)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: imports, arguments, host tables, report")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of: {', '.join(METHODS)}",
    )
    p.add_argument("--deadline-s", type=float, default=None, help="whole-run limit (default 430, quick 170)")
    p.add_argument(
        "--method-budget-s",
        type=float,
        default=None,
        help="time limit per method and size (default 12, quick 3)",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the torch.multiprocessing peer")
    p.add_argument(
        "--selftest-host",
        action="store_true",
        help="developer aid without a GPU: run the process plumbing (bare round trip, pipe peer on the host, "
        "torch queue with CPU tensors) and the report",
    )
    args = p.parse_args(argv)
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        p.error(str(exc))
    if not args.sizes:
        p.error("--sizes is empty")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    if args.no_torch:
        args.methods = [m for m in args.methods if m not in TORCH_METHODS]
    if args.iterations is None:
        args.iterations = 30 if args.quick else 200
    if args.iterations < 1:
        p.error("--iterations must be >= 1")
    if args.deadline_s is None:
        args.deadline_s = 170.0 if args.quick else 430.0  # scripts/gpu-check.sh: timeout 240 / 480
    if args.method_budget_s is None:
        args.method_budget_s = 3.0 if args.quick else 12.0
    return args


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # `timeout` and job schedulers send SIGTERM: stop the children and print what was measured.
    signal.signal(signal.SIGTERM, _sigterm)
    if args.dry_run:
        return dry_run(args)
    if args.selftest_host:
        return run(args, host_only=True)
    ok, why = gpu_present()
    if not ok:
        print(
            f"bench_gpu.py: no CUDA GPU here ({why}); nothing to measure. Use --dry-run to check the script."
        )
        return 0
    if importlib.util.find_spec("cupy") is None:
        print("bench_gpu.py: CuPy is not installed (pip install cupy-cuda13x); the producer needs it.")
        return 2
    try:
        return run(args)
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
