#!/usr/bin/env python
"""Sustained throughput of live streams (docs/streams.md) between two spawned processes.

    python benchmarks/bench_stream.py [--mode host|cuda|all] [--quick] [--batches N]
                                      [--sizes 1MiB,64MiB] [--json out.json]

Every case spawns a fresh producer and a fresh consumer (``multiprocessing`` spawn context). The
producer opens a stream, waits for the consumer's subscription, then commits warm-up + measured
batches as fast as the stream's credit allows (policy "block", ``max_in_flight`` 8); the consumer
times from the first measured batch to the last and reports batches per second. Each process shuts
down cleanly (the stream ends, the consumer sees the end, both exit 0).

Host cases (run anywhere):
    host slots      reserved slots of 4 float32 columns x 64 rows, filled in place (one value per
                    batch) and committed: no copy, the same message per slot; the consumer reads one
                    value through pyarrow and releases the batch
    host write      the same batch built by pyarrow and written (default writer.write)
    mp queue        the same pyarrow batch through a multiprocessing (spawn) Queue (pickle), for scale
    write_small     default writer.write of 100-row batches of 2 columns (int64, float64) built by
                    pyarrow; the consumer reads one value through pyarrow and releases the batch
    socket_small    the peer: the same batches as a pyarrow IPC stream over a Unix socket
                    (RecordBatchStreamWriter / open_stream), the consumer reading the same value
    write_large     64 MiB batches (2 int64 columns) in allocate_shared memory, written: shared as they
                    are (no copy); the consumer reads one value through pyarrow
    socket_large    the peer: the same 64 MiB batches as a pyarrow IPC stream over a Unix socket

CUDA cases (16 float32 CuPy columns per batch, for each size in --sizes):
    cuda slots      reserved CUDA slots (slab allocator), the producer launches a kernel writing one
                    value, then commits; the consumer takes each batch's device capsule, waits on its
                    sync_event on its stream (cudaStreamWaitEvent) and releases it
    cuda slots+cupy the consumer makes each batch's 16 columns usable as CuPy arrays in one call,
                    aib.column_arrays(batch, "cupy", stream=s.ptr) (which orders its stream after the
                    batch's event, no host wait), instead of taking the device capsule; it reads
                    column c0's first value back (a stream sync) on every warm-up batch and every
                    CHECK_EVERY-th measured one, and fails on a wrong value
    torch queue     the same 16 tensors through a torch.multiprocessing (spawn) Queue, from a ring of 8
                    batches the producer refills (one kernel per batch) after the consumer acknowledged
                    the batch that last used the ring slot; the consumer rebuilds each batch's
                    tensors (torch orders its stream after the producer's event) and drops them
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

SPAWN_TIMEOUT = 300.0
NCOLS = 16
WINDOW = 8
CHECK_EVERY = 1024  # measured CUDA batches between two value read-backs (each syncs the stream)


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def fmt_size(n: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:g} {unit}"
    return f"{n} B"


# ---------- bridge producer / consumer (children) -----------------------------------------------------
def bridge_producer(case: dict[str, Any], path: str, ready: Any, results: Any) -> None:
    try:
        import pyarrow as pa

        import arrow_ipc_bridge as aib

        total = case["warmup"] + case["batches"]
        with aib.Publisher(path) as pub:
            if case["kind"] in ("host_write", "write_small", "write_large"):
                writer = pub.open_stream("bench", max_in_flight=WINDOW, block_timeout=120)
            else:
                cuda = case["kind"].startswith("cuda")
                ncols = NCOLS if cuda else 4
                rows = case["rows"]
                schema = pa.schema([(f"c{i}", pa.float32()) for i in range(ncols)])
                layout = aib.SlotLayout(schema, rows=rows, count=2 * WINDOW, device="cuda" if cuda else "cpu")
                writer = pub.open_stream("bench", max_in_flight=WINDOW, block_timeout=120, slots=layout)
            ready.set()
            deadline = time.monotonic() + 120
            while writer.subscribers == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError("no subscriber in 120 s")
                time.sleep(0.001)
            started = time.perf_counter()
            if case["kind"] == "host_write":
                column = pa.array([0.0] * 64, pa.float32())
                for i in range(total):
                    first = pa.array([float(i)] * 64, pa.float32())
                    writer.write(pa.record_batch({"c0": first, "c1": column, "c2": column, "c3": column}))
            elif case["kind"] == "write_small":
                b = pa.array([0.5] * SMALL_ROWS, pa.float64())
                for i in range(total):
                    writer.write(pa.record_batch({"a": pa.array([i] * SMALL_ROWS, pa.int64()), "b": b}))
            elif case["kind"] == "write_large":
                batch = _large_shared_batch(case["size"])
                for _ in range(total):
                    writer.write(batch)  # in shared memory already: shared as it is, no copy
            else:
                for i in range(total):
                    slot = writer.reserve(timeout=120)
                    # host: a store into shared memory; CUDA: a kernel on the current stream, which
                    # the commit's event records
                    slot.columns[0][0:1] = i
                    slot.commit()
            elapsed = time.perf_counter() - started
            writer.close()
            # Let the consumer read the end and release what it holds before the publisher goes.
            deadline = time.monotonic() + 60
            while writer.leases and time.monotonic() < deadline:
                time.sleep(0.005)
        results.put(("producer", {"seconds": elapsed, "batches": total}))
    except BaseException:
        results.put(("error", "producer: " + traceback.format_exc()))


def bridge_consumer(case: dict[str, Any], path: str, results: Any) -> None:
    try:
        import pyarrow as pa

        import arrow_ipc_bridge as aib

        cuda = case["kind"].startswith("cuda")
        if cuda:
            import cupy

            from arrow_ipc_bridge.cuda import event_value
            from arrow_ipc_bridge.wire.capsules import capsule_struct

            stream = cupy.cuda.Stream(non_blocking=True)
        make_arrays = case["kind"] == "cuda_cupy"
        warmup, batches = case["warmup"], case["batches"]
        live = aib.subscribe(path, "bench", max_in_flight=WINDOW, timeout=120)
        n = 0
        started = 0.0
        with_event = 0
        checked = 0
        for imported in live:
            if n == warmup:
                started = time.perf_counter()
            if make_arrays:
                # The 16 columns as CuPy arrays in one call, ordered on our stream (no host wait).
                arrays = aib.column_arrays(imported, "cupy", stream=stream.ptr)
                if len(arrays) != NCOLS:
                    raise AssertionError(f"batch {n}: {len(arrays)} arrays, expected {NCOLS}")
                if n < warmup or n % CHECK_EVERY == 0:
                    value = float(arrays["c0"][0:1].get(stream=stream)[0])  # waits for the batch
                    if value != n:
                        raise AssertionError(f"batch {n} holds {value}")
                    checked += 1
                del arrays
            elif cuda:
                capsules = imported.__arrow_c_device_array__()
                sync = capsule_struct(capsules[1], "device_array").sync_event
                if sync:
                    with_event += 1
                    cupy.cuda.runtime.streamWaitEvent(stream.ptr, event_value(sync), 0)
                del capsules
            else:
                value = pa.record_batch(imported).column(0)[0].as_py()
                expected = LARGE_VALUE if case["kind"] == "write_large" else n
                if value != expected:
                    raise AssertionError(f"batch {n} holds {value}")
            imported.release()
            n += 1
        elapsed = time.perf_counter() - started
        live.close()
        if n != warmup + batches:
            raise AssertionError(f"received {n} batches, expected {warmup + batches}")
        results.put(
            (
                "consumer",
                {
                    "seconds": elapsed,
                    "batches": batches,
                    "dropped": live.dropped,
                    "with_event": with_event,
                    "values_checked": checked,
                },
            )
        )
    except BaseException:
        results.put(("error", "consumer: " + traceback.format_exc()))


# ---------- peers ---------------------------------------------------------------------------------------
SMALL_ROWS = 100
LARGE_VALUE = 7


def _large_shared_batch(size: int) -> Any:
    """A record batch of two int64 columns, ``size`` bytes in all, in ``allocate_shared`` memory."""
    import numpy as np
    import pyarrow as pa

    import arrow_ipc_bridge as aib

    rows = size // 16
    buffer = aib.allocate_shared(size, name="bench-large")
    values = np.frombuffer(buffer.view(), dtype=np.int64)
    values[:] = LARGE_VALUE
    whole = buffer.as_pyarrow()
    columns = [
        pa.Array.from_buffers(pa.int64(), rows, [None, whole.slice(i * rows * 8, rows * 8)]) for i in range(2)
    ]
    return pa.RecordBatch.from_arrays(columns, names=["a", "b"])


def _peer_batch(case: dict[str, Any], i: int) -> Any:
    import pyarrow as pa

    if case["kind"] == "socket_small":
        return pa.record_batch(
            {"a": pa.array([i] * SMALL_ROWS, pa.int64()), "b": pa.array([0.5] * SMALL_ROWS, pa.float64())}
        )
    rows = case["size"] // 16
    column = pa.array([LARGE_VALUE] * rows, pa.int64())
    return pa.record_batch({"a": column, "b": column})


def socket_producer(case: dict[str, Any], path: str, ready: Any, results: Any) -> None:
    """The peer: a plain pyarrow IPC stream written to a Unix socket."""
    try:
        import socket

        import pyarrow as pa

        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        ready.set()
        conn, _ = server.accept()
        total = case["warmup"] + case["batches"]
        large = _peer_batch(case, 0) if case["kind"] == "socket_large" else None
        with conn, conn.makefile("wb") as sink:
            first = large if large is not None else _peer_batch(case, 0)
            with pa.ipc.new_stream(sink, first.schema) as stream:
                for i in range(total):
                    stream.write_batch(large if large is not None else _peer_batch(case, i))
        server.close()
        results.put(("producer", {}))
    except BaseException:
        results.put(("error", "socket producer: " + traceback.format_exc()))


def socket_consumer(case: dict[str, Any], path: str, results: Any) -> None:
    try:
        import socket

        import pyarrow as pa

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        n, started = 0, 0.0
        with sock, sock.makefile("rb") as source:
            reader = pa.ipc.open_stream(source)
            for batch in reader:
                if n == case["warmup"]:
                    started = time.perf_counter()
                expected = LARGE_VALUE if case["kind"] == "socket_large" else n
                if batch.column(0)[0].as_py() != expected:
                    raise AssertionError(f"batch {n} out of order")
                del batch
                n += 1
        results.put(("consumer", {"seconds": time.perf_counter() - started, "batches": case["batches"]}))
    except BaseException:
        results.put(("error", "socket consumer: " + traceback.format_exc()))


def mp_queue_producer(case: dict[str, Any], q: Any, acks: Any, results: Any) -> None:
    try:
        import pyarrow as pa

        total = case["warmup"] + case["batches"]
        column = pa.array([0.0] * 64, pa.float32())
        for i in range(total):
            if i >= WINDOW:
                acks.get(timeout=120)  # at most WINDOW in flight, like the stream
            q.put(
                pa.record_batch(
                    [pa.array([float(i)] * 64, pa.float32()), column, column, column],
                    names=["c0", "c1", "c2", "c3"],
                )
            )
        q.put(None)
        results.put(("producer", {}))
    except BaseException:
        results.put(("error", "mp producer: " + traceback.format_exc()))


def mp_queue_consumer(case: dict[str, Any], q: Any, acks: Any, results: Any) -> None:
    try:
        n, started = 0, 0.0
        while True:
            item = q.get(timeout=120)
            if item is None:
                break
            if n == case["warmup"]:
                started = time.perf_counter()
            if item.column(0)[0].as_py() != n:
                raise AssertionError("out of order")
            n += 1
            acks.put(1)
        results.put(("consumer", {"seconds": time.perf_counter() - started, "batches": case["batches"]}))
    except BaseException:
        results.put(("error", "mp consumer: " + traceback.format_exc()))


def torch_producer(case: dict[str, Any], q: Any, acks: Any, results: Any) -> None:
    try:
        import torch
        import torch.multiprocessing  # registers the CUDA tensor reductions

        rows = case["rows"]
        ring = [
            [torch.zeros(rows, dtype=torch.float32, device="cuda") for _ in range(NCOLS)]
            for _ in range(WINDOW)
        ]
        torch.cuda.synchronize()
        total = case["warmup"] + case["batches"]
        for i in range(total):
            if i >= WINDOW:
                acks.get(timeout=120)  # the batch that last used this ring slot was read
            tensors = ring[i % WINDOW]
            tensors[0][0:1].fill_(float(i))
            q.put(tensors)
        q.put(None)
        results.put(("producer", {}))
        # The acks of the last batches, then the consumer's "done": it dropped every tensor before
        # the producer frees them.
        for _ in range(min(total, WINDOW) + 1):
            acks.get(timeout=120)
    except BaseException:
        results.put(("error", "torch producer: " + traceback.format_exc()))


def torch_consumer(case: dict[str, Any], q: Any, acks: Any, results: Any) -> None:
    try:
        import torch
        import torch.multiprocessing  # rebuilds CUDA tensors

        n, started = 0, 0.0
        while True:
            tensors = q.get(timeout=120)
            if tensors is None:
                break
            if n == case["warmup"]:
                started = time.perf_counter()
            # Rebuilt by torch (handles opened once, the producer's event waited on by our stream):
            # usable, as the bridge's consumer after its event wait.
            del tensors
            n += 1
            acks.put(1)
        torch.cuda.synchronize()
        results.put(("consumer", {"seconds": time.perf_counter() - started, "batches": case["batches"]}))
        acks.put(1)
    except BaseException:
        results.put(("error", "torch consumer: " + traceback.format_exc()))


# ---------- driver ------------------------------------------------------------------------------------
def run_case(ctx: Any, case: dict[str, Any]) -> dict[str, Any]:
    results = ctx.Queue()
    if case["kind"] in ("mp_queue", "torch_queue"):
        q, acks = ctx.Queue(), ctx.Queue()
        prod, cons = (
            (mp_queue_producer, mp_queue_consumer)
            if case["kind"] == "mp_queue"
            else (torch_producer, torch_consumer)
        )
        procs = [
            ctx.Process(target=prod, args=(case, q, acks, results)),
            ctx.Process(target=cons, args=(case, q, acks, results)),
        ]
        directory = None
    else:
        directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-bench-")
        path = os.path.join(directory, "s.sock")
        ready = ctx.Event()
        socket_peer = case["kind"].startswith("socket_")
        producer = socket_producer if socket_peer else bridge_producer
        consumer = socket_consumer if socket_peer else bridge_consumer
        procs = [ctx.Process(target=producer, args=(case, path, ready, results))]
        procs[0].start()
        if not ready.wait(SPAWN_TIMEOUT):
            procs[0].kill()
            raise RuntimeError("the producer did not start")
        procs.append(ctx.Process(target=consumer, args=(case, path, results)))
    for p in procs:
        if not p.is_alive() and p.exitcode is None:
            p.start()
    got: dict[str, Any] = {}
    try:
        while len(got) < 2:
            who, payload = results.get(timeout=SPAWN_TIMEOUT)
            if who == "error":
                raise RuntimeError(payload)
            got[who] = payload
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
    consumer = got["consumer"]
    rate = consumer["batches"] / consumer["seconds"]
    return {
        **case,
        "batches_per_s": rate,
        "us_per_batch": 1e6 / rate,
        **{k: v for k, v in consumer.items() if k not in ("seconds",)},
    }


def summarize(results: list[dict[str, Any]]) -> None:
    """Median, lowest and highest rate of each case over the rounds, and each round's ratio of
    ``write_small`` to ``socket_small`` (issue 29's pair, measured back to back in one round)."""
    import statistics

    print(f"{'case':<14s} {'rounds':>6s} {'median/s':>11s} {'min/s':>11s} {'max/s':>11s}")
    kinds = list(dict.fromkeys(r["kind"] for r in results))
    for kind in kinds:
        rates = [r["batches_per_s"] for r in results if r["kind"] == kind and "error" not in r]
        if rates:
            print(
                f"{kind:<14s} {len(rates):>6d} {statistics.median(rates):>11,.0f} "
                f"{min(rates):>11,.0f} {max(rates):>11,.0f}"
            )
    for ours, peer in (("write_small", "socket_small"), ("write_large", "socket_large")):
        by_round: dict[int, dict[str, float]] = {}
        for r in results:
            if r["kind"] in (ours, peer) and "error" not in r:
                by_round.setdefault(r["round"], {})[r["kind"]] = r["batches_per_s"]
        ratios = [v[ours] / v[peer] for v in by_round.values() if ours in v and peer in v]
        if ratios:
            print(
                f"{ours} / {peer} per round: median {statistics.median(ratios):.2f}x "
                f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x, {len(ratios)} rounds)"
            )


def gpu_present() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("host", "cuda", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="fewer batches, for a smoke run")
    parser.add_argument("--batches", type=int, default=None, help="measured batches per case")
    parser.add_argument("--sizes", default="1MiB,64MiB", help="CUDA batch sizes (16 float32 columns)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--cases", default=None, help="comma-separated case kinds to run (default: all of the mode's)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="run the chosen cases this many rounds")
    args = parser.parse_args()
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    batches = args.batches or (2_000 if args.quick else 50_000)
    warmup = min(1_000, batches // 5)
    cases: list[dict[str, Any]] = []
    if args.mode in ("host", "all"):
        cases += [
            {"kind": "host_slots", "rows": 64, "batches": batches, "warmup": warmup},
            {"kind": "host_write", "rows": 64, "batches": max(batches // 5, 200), "warmup": warmup // 5},
            {"kind": "mp_queue", "rows": 64, "batches": max(batches // 5, 200), "warmup": warmup // 5},
            # issue 29's pair: default write of 100-row, 2-column batches against the same batches
            # as a pyarrow IPC stream over a Unix socket, then 64 MiB batches (shared memory for
            # the bridge, so shared as they are; the socket carries the bytes)
            {"kind": "write_small", "rows": SMALL_ROWS, "batches": batches // 2, "warmup": warmup},
            {"kind": "socket_small", "rows": SMALL_ROWS, "batches": batches // 2, "warmup": warmup},
            {
                "kind": "write_large",
                "rows": 0,
                "size": 64 << 20,
                "batches": max(batches // 10, 200),
                "warmup": 20,
            },
            {
                "kind": "socket_large",
                "rows": 0,
                "size": 64 << 20,
                "batches": max(batches // 250, 40),
                "warmup": 5,
            },
        ]
    notes = []
    if args.mode in ("cuda", "all"):
        if not gpu_present():
            notes.append("CUDA cases skipped: no GPU (or no CuPy) here")
        else:
            for size in (parse_size(s) for s in args.sizes.split(",")):
                rows = size // (NCOLS * 4)
                for kind in ("cuda_slots", "cuda_cupy", "torch_queue"):
                    n = batches if kind != "torch_queue" else max(batches // 10, 200)
                    cases.append({"kind": kind, "rows": rows, "size": size, "batches": n, "warmup": warmup})
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {c["kind"] for c in cases}
        if unknown:
            parser.error(f"unknown case(s) for this mode: {', '.join(sorted(unknown))}")
        cases = [c for c in cases if c["kind"] in wanted]
    # Rounds alternate the cases, so a peer and the bridge see the same load on a shared machine.
    cases = [dict(c, round=r) for r in range(args.repeat) for c in cases]
    out: list[dict[str, Any]] = []
    print(f"# bench_stream on {platform.node()} ({os.cpu_count()} CPUs), python {sys.version.split()[0]}")
    for note in notes:
        print("#", note)
    print(f"{'case':<14s} {'size':>9s} {'batches':>8s} {'batches/s':>11s} {'us/batch':>9s}")
    for case in cases:
        try:
            result = run_case(ctx, case)
        except Exception as exc:
            print(f"{case['kind']:<14s} failed: {exc}")
            out.append({**case, "error": str(exc)})
            continue
        out.append(result)
        size = fmt_size(case["size"]) if "size" in case else f"{case['rows']} rows"
        print(
            f"{case['kind']:<14s} {size:>9s} {case['batches']:>8d} {result['batches_per_s']:>11,.0f} "
            f"{result['us_per_batch']:>9.1f}",
            flush=True,
        )
    if args.repeat > 1:
        summarize(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": out, "notes": notes, "host": platform.node()}, f, indent=1)
    return 1 if any("error" in r for r in out) else 0


if __name__ == "__main__":
    sys.exit(main())
