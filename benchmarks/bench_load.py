#!/usr/bin/env python
"""Load benchmark: many consumer processes doing get/read/release cycles against one publisher.

    python benchmarks/bench_load.py [--consumers 64] [--cycles 1000] [--rows 10000] [--rounds 1]
                                    [--json out.json]

The publisher runs in this process with ``--names`` tables published (heap data, copied once into
sealed memfds at publish time). ``--consumers`` processes (spawn start method) each connect one
session and run ``--cycles`` cycles: ``get`` a name (round robin), build a pyarrow table and compare
every value with the expected table, release. They start together once all are connected.

Reported: total gets, wall time from the start signal to the last consumer done, throughput (gets
per second over all consumers), per-get latency (p50, p99, max, from "get called" to "import
returned", measured in the consumers), wrong reads (must be 0), and the publisher's RSS and open fd
count before the load (after a warm-up round of 20 cycles per consumer) and after it (every session
gone, every lease ended): the publisher's memory and descriptors must stay flat however many cycles
ran.

``tests/test_load.py`` runs the same function in a small profile and asserts correctness and
flatness, not speed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import pyarrow as pa

import arrow_ipc_bridge as aib

SPAWN = multiprocessing.get_context("spawn")
START_TIMEOUT = 300.0  # seconds for all consumers to start (64 interpreters on 2 cores is slow)


def table_for(rows: int, seed: int) -> pa.Table:
    """The table published as name number ``seed``: contents every consumer can check."""
    base = seed * 1_000_003
    return pa.table(
        {
            "i": pa.array(range(base, base + rows), pa.int64()),
            "f": pa.array([float(k) / 3 for k in range(rows)], pa.float64()),
            "s": pa.array([f"v{seed}-{k}" for k in range(rows)], pa.string()),
        }
    )


def load_consumer_main(conn: Any, path: str, names: list[str], rows: int, cycles: int) -> None:
    """One consumer process: ``cycles`` x (get, read and check every value, release).

    Sends ``("ready", pid)`` once connected, waits for ``("start",)``, then sends
    ``("done", latencies_ns, wrong_reads)``.
    """
    expected = [table_for(rows, k) for k in range(len(names))]
    wrong: list[str] = []
    latencies: list[int] = []
    with aib.connect(path, timeout=60.0) as session:
        conn.send(("ready", os.getpid()))
        conn.recv()
        for cycle in range(cycles):
            k = cycle % len(names)
            start = time.perf_counter_ns()
            imported = session.get(names[k])
            latencies.append(time.perf_counter_ns() - start)
            try:
                if not pa.table(imported).equals(expected[k]):
                    wrong.append(f"cycle {cycle}: {names[k]} read wrong data")
            finally:
                imported.release()
    conn.send(("done", latencies, wrong))


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _machine() -> str:
    """The CPU model and count (``/proc/cpuinfo``), to say where figures were taken."""
    model = platform.machine()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}, pyarrow {pa.__version__}"


def _wait_idle(publisher: aib.Publisher, timeout: float = 60.0) -> None:
    """Until no session is connected and no lease is held (connection handlers end asynchronously)."""
    deadline = time.monotonic() + timeout
    while publisher.active_sessions or publisher.active_leases:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"publisher not idle after {timeout} s: {publisher.active_sessions} sessions, "
                f"{publisher.active_leases} leases"
            )
        time.sleep(0.01)


def _round(path: str, names: list[str], rows: int, consumers: int, cycles: int) -> dict[str, Any]:
    """Run one round of consumers; their latencies, wrong reads and the wall time of the cycles."""
    children = []
    try:
        for _ in range(consumers):
            parent_end, child_end = SPAWN.Pipe()
            process = SPAWN.Process(target=load_consumer_main, args=(child_end, path, names, rows, cycles))
            process.start()
            child_end.close()
            children.append((process, parent_end))
        for process, conn in children:
            if not conn.poll(START_TIMEOUT):
                raise RuntimeError(f"consumer {process.pid} did not start within {START_TIMEOUT} s")
            conn.recv()
        started = time.perf_counter()
        for _process, conn in children:
            conn.send(("start",))
        latencies: list[int] = []
        wrong: list[str] = []
        for process, conn in children:
            if not conn.poll(START_TIMEOUT + cycles):
                raise RuntimeError(f"consumer {process.pid} did not finish")
            _done, lat, bad = conn.recv()
            latencies += lat
            wrong += bad
        wall = time.perf_counter() - started
        for process, _conn in children:
            process.join(timeout=60)
            if process.exitcode != 0:
                raise RuntimeError(f"consumer {process.pid} exited with {process.exitcode}")
    finally:
        for process, conn in children:
            if process.is_alive():
                process.kill()
                process.join(timeout=30)
            conn.close()
    return {"latencies": latencies, "wrong": wrong, "wall": wall}


def run_load(
    consumers: int, cycles: int, rows: int = 10_000, names: int = 4, rounds: int = 1
) -> dict[str, Any]:
    """Run the load and return the figures (see the module docstring). Raises on a consumer failure.

    With ``rounds`` > 1 the measured round runs that many times (fresh consumers each time) and the
    publisher's RSS and fds are reported after each: a leak per get grows them round after round."""
    name_list = [f"table{k}" for k in range(names)]
    with tempfile.TemporaryDirectory() as tmp, aib.Publisher(os.path.join(tmp, "load.sock")) as publisher:
        for k, name in enumerate(name_list):
            publisher.publish(name, table_for(rows, k))
        # A warm-up round with as many consumers starts what lives for the process anyway (the reaper,
        # pyarrow's pools, malloc's arenas sized for that many connection threads), so what the
        # measured round adds is what the cycles cost: nothing, once every lease ended.
        _round(publisher.path, name_list, rows, consumers, min(cycles, 20))
        _wait_idle(publisher)
        rss_before, fds_before = _rss_bytes(), _fd_count()
        rss_after: list[int] = []
        fds_after: list[int] = []
        result: dict[str, Any] = {"latencies": [], "wrong": [], "wall": 0.0}
        for _ in range(rounds):
            one = _round(publisher.path, name_list, rows, consumers, cycles)
            for key in result:
                result[key] += one[key]
            _wait_idle(publisher)
            rss_after.append(_rss_bytes())
            fds_after.append(_fd_count())
    latencies = sorted(result["latencies"])
    gets = len(latencies)
    quantiles = statistics.quantiles(latencies, n=100) if gets > 1 else latencies * 99
    return {
        "consumers": consumers,
        "cycles_per_consumer": cycles,
        "rounds": rounds,
        "rows": rows,
        "names": names,
        "gets": gets,
        "wrong_reads": len(result["wrong"]),
        "wrong_examples": result["wrong"][:5],
        "wall_s": result["wall"],
        "gets_per_s": gets / result["wall"],
        "get_p50_us": quantiles[49] / 1000,
        "get_p99_us": quantiles[98] / 1000,
        "get_max_us": latencies[-1] / 1000,
        "publisher_rss_before_mib": rss_before / 2**20,
        "publisher_rss_after_mib": rss_after[-1] / 2**20,
        "publisher_rss_after_each_round_mib": [round(rss / 2**20, 2) for rss in rss_after],
        "publisher_fds_before": fds_before,
        "publisher_fds_after": fds_after[-1],
        "publisher_fds_after_each_round": fds_after,
        "machine": _machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--consumers", type=int, default=64)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--names", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="measured rounds (RSS and fds after each)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    figures = run_load(args.consumers, args.cycles, args.rows, args.names, args.rounds)
    for key, value in figures.items():
        print(f"{key:28} {value:.2f}" if isinstance(value, float) else f"{key:28} {value}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)
    return 1 if figures["wrong_reads"] else 0


if __name__ == "__main__":
    sys.exit(main())
