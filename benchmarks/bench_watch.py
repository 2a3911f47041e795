#!/usr/bin/env python
"""Latency of waiting for a new version: from the producer's ``publish`` to the consumer's
``get_next`` returning the imported object, across two processes.

    python benchmarks/bench_watch.py [--steps N] [--rows R] [--json out.json]

A *producer* process (``multiprocessing`` spawn context) publishes a host table of ``--rows`` int64
rows (copied once into a sealed memfd by ``publish``, as a producer with fresh heap data does) each
time the consumer's wait is held; this process, the *consumer*, loops
``item = session.get_next(name, after=item.version, timeout=...)``, reads one value and releases
the item. Per step:

    publish -> get_next returned   the headline: perf_counter_ns (CLOCK_MONOTONIC, one clock for both
                                   processes) when publish() began in the producer, to when get_next
                                   returned here with a usable import
    publish                        what publish() itself took in the producer (export + put + answering
                                   the held wait)

The producer publishes only once the publisher reports the wait as held (``Publisher.held_waits``,
checked every 50 µs: a benchmark-only loop), so every step measures a held wait answered by a
publish, never an already-answered request. Medians, 90th and 99th percentiles in µs.

The consumer connects with the default options, which keep standing leases: its ``get_next`` may
sleep on the publisher's version board instead of sending a WAIT (docs/lifetime.md, "Waiting on
the version board"), and wake into a get of the new message. The publisher cannot see such a
sleeper, so the producer publishes 2 ms after being asked; the line says how many steps the
consumer was asleep on the board when the publish came. ``--no-standing-leases``: the consumer
connects with ``pool_linger=0`` (no board), every wait is a held WAIT, and the producer publishes
as soon as the publisher holds it (what runs before standing leases were the default measured
with no option).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

import pyarrow as pa

import arrow_ipc_bridge as aib


def producer_main(conn: Any, path: str, rows: int, board: bool = False) -> None:
    """Publish "step" each time ("publish", i) is asked, once the consumer's wait is held (with
    ``board``: 2 ms later, the consumer asleep on the board by then); answers ("published", ns when
    publish began, ns when it returned)."""
    with aib.Publisher(path) as pub:
        pub.publish("step", pa.table({"v": pa.array(range(rows), pa.int64())}))
        conn.send(("ready",))
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            table = pa.table({"v": pa.array(range(command[1], command[1] + rows), pa.int64())})
            asked = time.monotonic()
            # With the board: 2 ms, in the same 50 µs naps as the held-wait check (a core idle for
            # 2 ms at once would run the publish slower, which is not the bridge's doing).
            while (time.monotonic() - asked < 0.002) if board else pub.held_waits < 1:
                time.sleep(50e-6)
            started = time.perf_counter_ns()
            pub.publish("step", table)
            ended = time.perf_counter_ns()
            conn.send(("published", started, ended))
    conn.send(("bye",))


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"median": statistics.median(ordered), "p90": pick(0.90), "p99": pick(0.99), "min": ordered[0]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000, help="measured steps (after 100 warm-up steps)")
    parser.add_argument("--rows", type=int, default=1024, help="int64 rows per published table")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--no-standing-leases",
        action="store_true",
        help="the consumer connects with pool_linger=0: every wait is a WAIT the publisher holds",
    )
    args = parser.parse_args()
    standing = not args.no_standing_leases

    ctx = mp.get_context("spawn")
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-bench-")
    path = os.path.join(directory, "watch.sock")
    parent, child = ctx.Pipe()
    producer = ctx.Process(target=producer_main, args=(child, path, args.rows, standing), daemon=True)
    producer.start()
    child.close()
    assert parent.recv() == ("ready",)
    latencies: list[float] = []
    publishes: list[float] = []
    try:
        # The default options keep standing leases; pool_linger=0 keeps none (no board).
        linger = {} if standing else {"pool_linger": 0.0}
        with aib.connect(path, timeout=10.0, wait_for_publisher=True, **linger) as session:
            item = session.get("step", wait=10.0)
            assert item.version is not None  # got by waiting: it knows its version
            seen = item.version
            item.release()
            asleep = 0
            for step in range(100 + args.steps):
                parent.send(("publish", step))
                sleeps = aib.stats().waits.board_waits
                item = session.get_next("step", after=seen, timeout=10.0)
                returned = time.perf_counter_ns()
                value = pa.table(item).column(0)[0].as_py()
                assert value == step, (value, step)
                assert item.version is not None
                seen = item.version
                item.release()
                _, started, ended = parent.recv()
                if step >= 100:
                    asleep += aib.stats().waits.board_waits > sleeps
                    latencies.append((returned - started) / 1000)
                    publishes.append((ended - started) / 1000)
        parent.send(("stop",))
        assert parent.recv() == ("bye",)
    finally:
        producer.join(10)
        if producer.is_alive():
            producer.kill()
    results = {
        "rows": args.rows,
        "steps": args.steps,
        "publish_to_get_next_us": percentiles(latencies),
        "publish_us": percentiles(publishes),
        "cpus": os.cpu_count(),
        "standing_leases": standing,
        "steps_asleep_on_the_board": asleep,
    }
    for key in ("publish_to_get_next_us", "publish_us"):
        p = results[key]
        line = f"median {p['median']:8.1f}  p90 {p['p90']:8.1f}  p99 {p['p99']:8.1f}  min {p['min']:8.1f}"
        print(f"{key:24s} {line}")
    if standing:
        print(f"steps asleep on the board when the publish came: {asleep} of {args.steps}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
