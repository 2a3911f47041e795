#!/usr/bin/env python
"""The re-get a user gets with no options, against an Arrow IPC file in /dev/shm, and against other
checkouts of the bridge in the same run.

    python benchmarks/bench_reget.py [--sizes 1MiB,64MiB] [--rounds 5] [--gets 400]
                                     [--tree LABEL=PATH ...] [--json out.json]

One row is what a newcomer's loop does each step with a host table of 16 float64 columns:
``session.get(name)`` on a session made by ``aib.connect(path)`` with no options, ``pa.table`` of
the import, one value of the last column read, the import released. The producer (a process of its
own) publishes the table once with the default options (copied once into a sealed memfd).

Peer, in the same consumer process, interleaved get by get: the same table written once as an Arrow
IPC file in ``/dev/shm``, read per step with ``pa.ipc.open_file(pa.memory_map(path)).read_all()``
and the same value read (the two values must agree). Both steps are the ``bench`` command's
(``arrow_ipc_bridge/cli/_bench_steps.py``, loaded by its path), so the script and the command time
them with the same code.

``--tree LABEL=PATH`` (repeatable) measures the bridge of another checkout too (a built one: its C
core compiled in place, e.g. ``python setup.py build_ext --inplace``), in the same run: each tree
gets its own producer and consumer processes with ``PYTHONPATH=PATH``, and the rounds visit the
trees in a shuffled order, so drift of the machine falls on all of them alike. The checkout this
script lives in is always measured, as ``this``; ``--opt-out`` adds it with ``pool_linger=0`` (no
standing lease: every get asks the publisher), as ``this, pool_linger=0``. Medians and 90th
percentiles of all rounds' samples.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 50


def _producer(sock: str, sizes: list[int]) -> None:
    from bench_host import make_table

    import arrow_ipc_bridge as aib

    with aib.Publisher(sock) as pub:
        for size in sizes:
            pub.publish(f"t{size}", make_table("float16", size))
        print(json.dumps({"ready": True, "bridge": os.path.dirname(aib.__file__)}), flush=True)
        sys.stdin.read()  # until the orchestrator closes it


def _steps() -> Any:
    """The timed steps of the ``bench`` command, from this checkout's file, loaded by its path: a
    consumer of another tree (``--tree``) imports that tree's ``arrow_ipc_bridge``, which may not
    have the file, and both trees must be timed by the same code."""
    path = os.path.join(os.path.dirname(HERE), "arrow_ipc_bridge", "cli", "_bench_steps.py")
    spec = importlib.util.spec_from_file_location("aib_bench_steps", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the timed steps from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _consumer(sock: str, sizes: list[int], files: list[str], gets: int, opt_out: bool) -> None:
    import arrow_ipc_bridge as aib

    steps = _steps()
    out: dict[str, Any] = {"bridge": os.path.dirname(aib.__file__)}
    # The default options (what a newcomer gets), or the opt-out of standing leases.
    with aib.connect(sock, **({"pool_linger": 0.0} if opt_out else {})) as session:

        def step(name: str, path: str) -> tuple[float, float]:
            """One get of each, the bridge first; both read the same table, so the same value."""
            bridge, value = steps.bridge_reget_host(session, name)
            peer, peer_value = steps.ipc_file_read(path)
            if value != peer_value:
                raise RuntimeError(f"{name}: the bridge read {value}, the IPC file {peer_value}")
            return bridge, peer

        for size, path in zip(sizes, files, strict=True):
            name = f"t{size}"
            for _ in range(WARMUP):
                step(name, path)
            bridge: list[float] = []
            peer: list[float] = []
            for _ in range(gets):
                b, p = step(name, path)
                bridge.append(b)
                peer.append(p)
            out[str(size)] = {"bridge": bridge, "ipc_file": peer}
        out["local_gets"] = aib.stats().session.local_gets  # this child process's, its one session
    print(json.dumps(out), flush=True)


def _child_env(tree: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree, HERE])
    return env


def main() -> int:
    from bench_host import fmt_size, make_table, parse_size
    from bench_stats import stats_us

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        default="1MiB,64MiB",
        type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
        help="table sizes (Table.nbytes), comma separated (default 1MiB,64MiB)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="consumer processes per tree (default 5)")
    parser.add_argument(
        "--gets", type=int, default=400, help="measured steps per size and round (default 400)"
    )
    parser.add_argument(
        "--tree", action="append", default=[], metavar="LABEL=PATH", help="another checkout to measure"
    )
    parser.add_argument(
        "--opt-out", action="store_true", help="also measure this checkout with pool_linger=0"
    )
    parser.add_argument("--json", metavar="PATH", help="also write every sample here")
    parser.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    parser.add_argument("--sock", help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    parser.add_argument("--no-linger", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "producer":
        _producer(args.sock, args.sizes)
        return 0
    if args.role == "consumer":
        _consumer(args.sock, args.sizes, args.files.split(","), args.gets, args.no_linger)
        return 0

    import pyarrow as pa

    trees = {"this": os.path.dirname(HERE)}
    for spec in args.tree:
        label, _, path = spec.partition("=")
        if not path:
            parser.error(f"--tree wants LABEL=PATH, got {spec!r}")
        trees[label] = os.path.abspath(path)
    # Consumers to run: (label, the tree whose producer and package they use, pool_linger=0).
    consumers = [(label, label, False) for label in trees]
    if args.opt_out:
        consumers.append(("this, pool_linger=0", "this", True))
    sizes_arg = ",".join(str(s) for s in args.sizes)
    shm = tempfile.mkdtemp(prefix="aib-reget-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    socks = tempfile.mkdtemp(prefix="aib-reget-sock-")
    producers: dict[str, subprocess.Popen[str]] = {}
    samples: dict[str, dict[int, list[float]]] = {c[0]: {s: [] for s in args.sizes} for c in consumers}
    peer: dict[int, list[float]] = {s: [] for s in args.sizes}
    where: dict[str, str] = {}
    try:
        files = []
        for size in args.sizes:
            table = make_table("float16", size)
            path = os.path.join(shm, f"t{size}.arrow")
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
            files.append(path)
        for label, tree in trees.items():
            sock = os.path.join(socks, f"{label}.sock")
            proc = subprocess.Popen(
                [sys.executable, __file__, "--role", "producer", "--sock", sock, "--sizes", sizes_arg],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=_child_env(tree),
            )
            producers[label] = proc
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())
            where[label] = ready["bridge"]
        rng = random.Random(29)
        order = list(consumers)
        for round_no in range(args.rounds):
            rng.shuffle(order)
            for label, tree_label, no_linger in order:
                sock = os.path.join(socks, f"{tree_label}.sock")
                done = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--role",
                        "consumer",
                        "--sock",
                        sock,
                        "--sizes",
                        sizes_arg,
                        "--files",
                        ",".join(files),
                        "--gets",
                        str(args.gets),
                        *(["--no-linger"] if no_linger else []),
                    ],
                    capture_output=True,
                    text=True,
                    env=_child_env(trees[tree_label]),
                    check=True,
                )
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if result["bridge"] != where[tree_label]:
                    raise RuntimeError(
                        f"{label}: the consumer imported {result['bridge']}, not {where[tree_label]}"
                    )
                for size in args.sizes:
                    samples[label][size] += result[str(size)]["bridge"]
                    peer[size] += result[str(size)]["ipc_file"]
                print(
                    f"round {round_no + 1}/{args.rounds} {label}: local gets {result['local_gets']}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for proc in producers.values():
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(socks, ignore_errors=True)

    print("re-get of a 16-column float64 host table + pa.table + one value read, default options")
    print(f"{args.rounds} rounds x {args.gets} steps per size and tree, after {WARMUP} warm-ups each")
    for label, path in where.items():
        print(f"  {label}: {path}")
    header = f"{'':34s}" + "".join(f"{fmt_size(s):>24s}" for s in args.sizes)
    print(header)
    summary: dict[str, Any] = {}

    def row(title: str, by_size: dict[int, list[float]]) -> dict[int, dict[str, Any]]:
        stats = {s: stats_us(v) for s, v in by_size.items()}
        cells = "".join(
            f"{stats[s]['median_us']:>12.1f} µs (p90 {stats[s]['p90_us']:>5.0f})" for s in args.sizes
        )
        print(f"{title:34s}{cells}")
        return stats

    peer_stats = row("Arrow IPC file, memory_map+read_all", peer)
    summary["ipc_file"] = peer_stats
    for label, _, _ in consumers:
        stats = row(f"bridge ({label})", samples[label])
        summary[label] = stats
        ratios = "".join(f"{peer_stats[s]['median_us'] / stats[s]['median_us']:>23.1f}x" for s in args.sizes)
        print(f"{'  IPC file / bridge':34s}{ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "trees": where,
                    "summary": {k: {str(s): v for s, v in d.items()} for k, d in summary.items()},
                    "samples_s": {k: {str(s): v for s, v in d.items()} for k, d in samples.items()},
                    "ipc_file_samples_s": {str(s): v for s, v in peer.items()},
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
