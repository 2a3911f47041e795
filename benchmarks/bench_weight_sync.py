#!/usr/bin/env python
"""Weight sync, trainer to inference process on one host: the latency of one sync, three ways.

    python benchmarks/bench_weight_sync.py [--quick] [--device cuda|cpu] [--total-mib 1024]
        [--tensors 300] [--steps 40] [--slots 2] [--methods bridge,torch_tensors,torch_packed]
        [--json out.json]

A model of ``--tensors`` parameters, ``--total-mib`` MiB in all, of mixed shapes and dtypes
(bfloat16, float16, float32, int64: ``model_spec`` in examples/weight_sync.py), lives in a
trainer process. Every step the trainer writes the step's marker into every element of every
parameter (its "training step", untimed, finished on the device before the clock starts), then
hands the parameters to an inference process, which makes every one of them usable in its model
and checks that every element carries the step's marker (untimed), then answers; the trainer's
next step begins after the answer (lockstep: one sync at a time is measured, and the peers below
are then safe to read too).

Timed per step, one CLOCK_MONOTONIC for both processes: from "the trainer finished the step"
to "every parameter is usable in the inference process's model" (its views installed and its
current CUDA stream synchronised, so every producer write it must wait for has completed).
The first step is reported on its own (cold: handles opened, first imports); the median and p90
are over the steps after the first two (with two slots, both have been seen by then).

Methods, in the same run, each with a trainer and an inference process of its own (spawned):

- ``bridge``: ``WeightPublisher.publish`` (the parameters copied into a free slot, one fused copy
  on the current stream, published as one byte column with ``aib.from_cuda_arrays``) and
  ``WeightFollower.next`` (``session.get_next``, ``aib.column_arrays(..., "torch")``, a view per
  parameter) with ``InferenceModel.swap``; the version a consumer reads is never written while it
  holds it (docs/weight-sync.md).
- ``torch_tensors``: the trainer puts its parameters (the same tensors, a list of (name, tensor))
  on a ``torch.multiprocessing`` Queue; the inference process takes them as they come (torch
  shares each storage by CUDA IPC with an event). Nothing stops the trainer writing them while
  they are read: only the lockstep makes this safe here.
- ``torch_packed``: the trainer copies its parameters into one of two packed buffers (the same
  layout and fused copy as the bridge's slots) and puts that one tensor on the Queue; the
  inference process makes the same views of it as the bridge's consumer.

``--device cpu`` runs the bridge alone on host memory with NumPy (to try the harness without a
GPU); the peers are measured on the GPU only. ``--quick``: 12 steps (the model keeps its size).
The bridge's trainer also reports how many publishes waited for a free slot.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import platform
import queue as queue_module
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))  # weight_sync (spawned children get this path too)
sys.path.insert(0, str(REPO))

import weight_sync as ws  # noqa: E402

import arrow_ipc_bridge as aib  # noqa: E402

METHODS = ("bridge", "torch_tensors", "torch_packed")
METHOD_LIMIT_S = 300  # one method, both processes, start to end
WARMUP = 2  # steps left out of the median and p90 (the first is reported as the cold sync)


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _parameters(spec: list[Any], device: str) -> dict[str, Any]:
    if device == "cpu":
        return ws.host_parameters(spec)
    import torch

    return {
        name: torch.zeros(shape, dtype=getattr(torch, dtype), device="cuda:0") for name, dtype, shape in spec
    }


def _synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.current_stream().synchronize()


def trainer(options: dict[str, Any], queue: Any, link: Any, results: Any) -> None:
    """Train (write markers), hand over, wait for the answer; report every step's clock."""
    method, path = options["method"], options["path"]
    try:
        device = options["device"]
        spec = ws.model_spec(options["total_bytes"], options["tensors"])
        dtypes = {name: dtype for name, dtype, _ in spec}
        layout = ws.Layout.plan(spec)
        parameters = _parameters(spec, device)
        facts: dict[str, Any] = {}
        if device == "cuda":
            import torch
            import torch.multiprocessing  # registers the CUDA tensor reductions

            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["torch"] = torch.__version__
        started: list[float] = []
        handed: list[float] = []
        publisher = None
        weights = None
        packed: list[Any] = []
        packed_views: list[dict[str, Any]] = []
        if method == "bridge":
            publisher = aib.Publisher(path)
            weights = ws.WeightPublisher(publisher, "weights", layout, device=device, slots=options["slots"])
        elif method == "torch_packed":
            import torch

            packed = [torch.empty(layout.total_bytes, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
            packed_views = [ws.parameter_views(flat, layout) for flat in packed]
        names = [spec_.name for spec_ in layout.specs]
        before = aib.stats()  # after the layout's publish (a small host table, copied once)
        link.send("ready")
        assert link.recv() == "ready"
        for step in range(options["steps"]):
            ws.fill_marker(parameters, dtypes, step)
            _synchronize(device)
            t0 = now()
            if weights is not None:
                weights.publish(parameters, timeout=120)
            elif method == "torch_tensors":
                queue.put([(name, parameters[name]) for name in names])
            else:
                import torch

                views = packed_views[step % 2]
                ws.copy_all(torch, [views[n] for n in names], [parameters[n] for n in names])
                queue.put(packed[step % 2])
            handed.append(now())
            started.append(t0)
            answer = link.recv()
            if answer != step:
                raise RuntimeError(f"the inference process answered {answer!r} to step {step}")
        if weights is not None:
            facts["slot_waits"] = weights.slot_waits
            after = aib.stats()  # bytes the bridge copied while publishing the weights
            facts["copied_bytes"] = (
                after.cuda.copied_bytes
                - before.cuda.copied_bytes
                + after.host.copied_bytes
                - before.host.copied_bytes
            )
        link.send("done")
        link.recv()  # the consumer let go of everything: now the producer may go
        if weights is not None and publisher is not None:
            weights.close()
            publisher.close()
        results.put(("trainer", method, {"started": started, "handed": handed, **facts}))
    except BaseException as exc:
        results.put(("trainer", method, {"error": f"{type(exc).__name__}: {exc}"}))
        raise


def inference(options: dict[str, Any], queue: Any, link: Any, results: Any) -> None:
    """Take each version, install it, check it; report when each became usable."""
    method, path = options["method"], options["path"]
    try:
        device = options["device"]
        spec = ws.model_spec(options["total_bytes"], options["tensors"])
        layout = ws.Layout.plan(spec)
        if device == "cuda":
            import torch
            import torch.multiprocessing  # registers the CUDA tensor reductions

            torch.zeros(1, device="cuda:0")  # CUDA initialised before the clock, as in a serving process
        usable: list[float] = []
        session = None
        follower = None
        model = ws.InferenceModel()
        if method == "bridge":
            session = aib.connect(path, timeout=60.0, wait_for_publisher=True)
            follower = ws.WeightFollower(session, "weights", like="torch" if device == "cuda" else "numpy")
        assert link.recv() == "ready"
        link.send("ready")
        parameters: dict[str, Any] = {}
        for step in range(options["steps"]):
            if follower is not None:
                version = follower.next(timeout=120)
                model.swap(version)
                checked = model.parameters
            elif method == "torch_tensors":
                parameters = dict(queue.get())  # the old mapping goes with this assignment
                checked = parameters
            else:
                parameters = ws.parameter_views(queue.get(), layout)
                checked = parameters
            _synchronize(device)
            usable.append(now())
            found = ws.version_marker(checked, layout)
            if found != ws.marker(step):
                raise AssertionError(
                    f"step {step}: the version carries marker {found}, not {ws.marker(step)}"
                )
            model.settle()  # the old version goes back before the answer, as before a wait
            link.send(step)
        assert link.recv() == "done"
        model.close()
        parameters = {}
        checked = {}
        if session is not None:
            session.close()
        link.send("released")
        results.put(("inference", method, {"usable": usable}))
    except BaseException as exc:
        results.put(("inference", method, {"error": f"{type(exc).__name__}: {exc}"}))
        raise


def run_method(method: str, options: dict[str, Any]) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")  # CUDA never crosses a fork
    results = context.Queue()
    queue = context.Queue() if method != "bridge" else None
    trainer_end, inference_end = context.Pipe()
    with tempfile.TemporaryDirectory(prefix="aib-bench-ws-") as directory:
        job = {**options, "method": method, "path": os.path.join(directory, "trainer.sock")}
        processes = [
            context.Process(target=trainer, args=(job, queue, trainer_end, results)),
            context.Process(target=inference, args=(job, queue, inference_end, results)),
        ]
        for process in processes:
            process.start()
        got: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + METHOD_LIMIT_S
        try:
            while len(got) < 2:
                try:
                    side, _, data = results.get(timeout=1.0)
                except queue_module.Empty:
                    # A process that died without a word (a crash in CUDA or the driver) ends the wait.
                    dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                    if dead or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{method}: a process exited with {dead}"
                            if dead
                            else f"{method}: no result in time"
                        ) from None
                    continue
                got[side] = data
                if "error" in data:
                    break
        finally:
            for process in processes:
                process.join(30)
                if process.is_alive():
                    process.terminate()
                    process.join()
    for side, data in got.items():
        if "error" in data:
            raise RuntimeError(f"{method}: the {side} process failed: {data['error']}")
    started, handed, usable = got["trainer"]["started"], got["trainer"]["handed"], got["inference"]["usable"]
    latency = [(u - s) * 1e3 for s, u in zip(started, usable, strict=True)]
    handing = [(h - s) * 1e3 for s, h in zip(started, handed, strict=True)]
    steady = latency[WARMUP:] or latency
    row: dict[str, Any] = {
        "method": method,
        "cold_ms": latency[0],
        "median_ms": statistics.median(steady),
        "p90_ms": _quantile(steady, 0.9),
        "trainer_handing_median_ms": statistics.median(handing[WARMUP:] or handing),
        "samples_ms": latency,
    }
    for key in ("slot_waits", "copied_bytes", "gpu", "torch"):
        if key in got["trainer"]:
            row[key] = got["trainer"][key]
    return row


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--total-mib", type=float, default=1024.0)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--steps", type=int, default=None, help="default 40, 12 with --quick")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (12 if args.quick else 40)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if not 1 <= steps < ws.MARKERS or args.tensors < 1 or args.total_mib <= 0 or args.slots < 2:
        parser.error(f"--steps 1..{ws.MARKERS - 1}, --tensors >= 1, --total-mib > 0, --slots >= 2")
    if args.device == "cuda" and importlib.util.find_spec("torch") is None:
        parser.error("--device cuda needs PyTorch with CUDA (pip install torch); --device cpu runs without")
    skipped: list[dict[str, str]] = []
    if args.device == "cpu":
        for method in methods:
            if method != "bridge":
                skipped.append(
                    {"method": method, "reason": "the peers are measured on the GPU (--device cuda)"}
                )
        methods = [m for m in methods if m == "bridge"]
    options = {
        "device": args.device,
        "total_bytes": int(args.total_mib * (1 << 20)),
        "tensors": args.tensors,
        "steps": steps,
        "slots": args.slots,
    }
    layout = ws.Layout.plan(ws.model_spec(options["total_bytes"], args.tensors))
    print(
        f"bench_weight_sync: {len(layout.specs)} parameters, {layout.total_bytes / (1 << 20):.1f} MiB, "
        f"{args.device}, {steps} steps, {args.slots} slots",
        file=sys.stderr,
        flush=True,
    )
    rows = []
    for method in methods:
        row = run_method(method, options)
        rows.append(row)
        print(
            f"bench_weight_sync: {method}: cold {row['cold_ms']:.2f} ms, median {row['median_ms']:.2f} ms, "
            f"p90 {row['p90_ms']:.2f} ms (trainer's hand-over {row['trainer_handing_median_ms']:.2f} ms)"
            + (f", {row['slot_waits']} slot waits" if "slot_waits" in row else ""),
            file=sys.stderr,
            flush=True,
        )
    print(f"{'method':<14} {'cold ms':>9} {'median ms':>10} {'p90 ms':>9} {'vs bridge':>10}")
    base = next((row["median_ms"] for row in rows if row["method"] == "bridge"), None)
    for row in rows:
        ratio = f"{row['median_ms'] / base:.2f}x" if base else "-"
        figures = f"{row['cold_ms']:>9.2f} {row['median_ms']:>10.2f} {row['p90_ms']:>9.2f}"
        print(f"{row['method']:<14} {figures} {ratio:>10}")
    for skip in skipped:
        print(f"skipped {skip['method']}: {skip['reason']}")
    if args.json is not None:
        report = {
            "schema": "arrow_ipc_bridge.bench_weight_sync/1",
            "machine": {
                "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "arrow_ipc_bridge": aib.__version__,
                "commit": os.environ.get("AIB_SOURCE_COMMIT"),
            },
            "settings": {**options, "parameters": len(layout.specs), "layout_bytes": layout.total_bytes},
            "results": rows,
            "skipped": skipped,
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
