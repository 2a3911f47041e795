#!/usr/bin/env python
"""Where a steady-state get's time goes, phase by phase, in one consumer process.

    python benchmarks/profile_get.py [--device cuda|cpu] [--table float|mixed] [--iterations 3000]
                                     [--cprofile] [--fresh legacy|pool|slab]

A producer process publishes 16 float32 columns (CuPy arrays with ``--device cuda``; all-null columns on
the CPU, whose message, like an all-legacy CUDA one, is remembered), or
with ``--table mixed`` the GPU benchmark's mixed table (strings, lists, nulls) uploaded with
``to_device`` (one IPC-pool region, kept with a lease from the second get on; on the CPU the same
table in host memory, remembered with its files). The
consumer times, per get: ``session.get`` alone, then ``__arrow_c_device_array__``, then reading the
struct and waiting on ``sync_event`` (the bench's "can launch work" end point), a bare 64-byte
socket round trip between the same two processes and a ``Session.ping`` on the session's own
connection, for scale. ``--fresh`` (CUDA, float table): the producer republishes 16 new columns
(``legacy``: CuPy's default allocator, ``pool``: the bridge's IPC-pool allocator, ``slab``: its
slab allocator) before each get
(untimed), so every get imports a new message: the first-get path. A development aid, not a benchmark of
record: benchmarks/bench_gpu.py is that.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import tempfile
import time
from typing import Any

ROWS = 1 << 18
NCOLS = 16


def producer(path: str, options: tuple[str, str, str], ready: Any, echo_sock: socket.socket) -> None:
    """Publish "t" (``options``: device, table, fresh mode) and echo the bench socket."""
    import pyarrow as pa

    device, table, fresh = options

    import arrow_ipc_bridge as aib

    allocators: list[Any] = []  # one pool allocator for the process, made on first use

    def new_columns(value: float) -> Any:
        import cupy as cp

        from arrow_ipc_bridge import cuda

        if not allocators:
            allocators.append(
                cuda.cupy_allocator(0)
                if fresh == "pool"
                else cuda.cupy_allocator(0, slab_size=256 << 20)
                if fresh == "slab"
                else cp.cuda.get_allocator()
            )
        with cp.cuda.using_allocator(allocators[0]):
            columns = {f"c{i}": cp.full(ROWS, value, dtype=cp.float32) for i in range(NCOLS)}
        cp.cuda.runtime.deviceSynchronize()
        return aib.from_cuda_arrays(columns)

    if table == "mixed":
        from gpu_bench_children import mixed_batch

        from arrow_ipc_bridge.arrays.device import to_device

        batch, _ = mixed_batch(1 << 20)
        obj: Any = to_device(batch) if device == "cuda" else batch
    elif fresh:
        obj = new_columns(0.0)
    elif device == "cuda":
        import cupy as cp

        columns = {f"c{i}": cp.full(ROWS, float(i), dtype=cp.float32) for i in range(NCOLS)}
        obj = aib.from_cuda_arrays(columns)
    else:
        obj = pa.record_batch({f"c{i}": pa.nulls(ROWS) for i in range(NCOLS)})
    with aib.Publisher(path) as pub:
        pub.publish("t", obj)
        ready.set()
        buf = bytearray(64)
        value = 0.0
        make_s: list[float] = []
        publish_s: list[float] = []
        profile = None
        if fresh and os.environ.get("AIB_PROFILE_PRODUCER"):
            import cProfile

            profile = cProfile.Profile()
        while True:
            n = echo_sock.recv_into(buf)
            if n == 0:
                break
            if fresh and buf[:1] == b"F":  # new data under the same name, then answer
                value += 1.0
                t0 = time.perf_counter()
                obj = new_columns(value)
                t1 = time.perf_counter()
                if profile is not None:
                    profile.enable()
                pub.publish("t", obj)
                if profile is not None:
                    profile.disable()
                make_s.append(t1 - t0)
                publish_s.append(time.perf_counter() - t1)
            echo_sock.sendall(buf[:n])
        if publish_s:
            print(
                f"producer: new columns median {median_us(make_s):.1f} µs, publish median "
                f"{median_us(publish_s):.1f} µs ({len(publish_s)} publishes)",
                flush=True,
            )
        if profile is not None:
            import pstats

            pstats.Stats(profile).sort_stats("cumulative").print_stats("arrow_ipc_bridge", 30)


def median_us(samples: list[float]) -> float:
    samples = sorted(samples)
    return samples[len(samples) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--table", choices=["float", "mixed"], default="float")
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--fresh", choices=["legacy", "pool", "slab"], default="")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    directory = tempfile.mkdtemp(prefix="aib-prof-")
    path = os.path.join(directory, "p.sock")
    mine, theirs = socket.socketpair()
    ready = ctx.Event()
    options = (args.device, args.table, args.fresh)
    child = ctx.Process(target=producer, args=(path, options, ready, theirs), daemon=True)
    child.start()
    while not ready.wait(0.2):
        if not child.is_alive():
            raise SystemExit(f"the producer process exited ({child.exitcode}) before publishing")

    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge._ffi import ffi
    from arrow_ipc_bridge.wire.capsules import capsule_struct

    wait: Any = None
    if args.device == "cuda":
        import cupy as cp

        from arrow_ipc_bridge import cuda

        stream = cp.cuda.Stream(non_blocking=True)
        stream_ptr = stream.ptr

        def wait(sync: Any) -> None:
            # What a CuPy consumer writes (cuDF does the same in C++).
            cp.cuda.runtime.streamWaitEvent(stream_ptr, cuda.event_value(sync))

    session = aib.connect(path, timeout=10.0)
    phases: dict[str, list[float]] = {"get": [], "capsules": [], "struct+wait": [], "total": [], "bare": []}
    msg = bytes(64)
    view = bytearray(64)

    def one(record: bool) -> None:
        if args.fresh:
            mine.sendall(b"F")
            mine.recv_into(view)
        t0 = time.perf_counter()
        imported = session.get("t")
        t1 = time.perf_counter()
        capsules = imported.__arrow_c_device_array__()
        t2 = time.perf_counter()
        device_array = capsule_struct(capsules[1], "device_array")
        sync = device_array.sync_event
        if sync and wait is not None:
            wait(sync)
        root = device_array.array
        column = root.children[root.n_children - 1]
        if column.n_buffers > 1:
            int(ffi.cast("uintptr_t", column.buffers[1]))
        t3 = time.perf_counter()
        del device_array, column, sync, capsules
        imported.release()
        t4 = time.perf_counter()
        mine.sendall(msg)
        mine.recv_into(view)
        t5 = time.perf_counter()
        ping = session.ping(msg)
        if record:
            for key, value in (
                ("get", t1 - t0),
                ("capsules", t2 - t1),
                ("struct+wait", t3 - t2),
                ("total", t3 - t0),
                ("release", t4 - t3),
                ("bare", t5 - t4),
                ("ping", ping),
            ):
                phases.setdefault(key, []).append(value)

    for _ in range(20 if args.fresh else 200):
        one(False)
    for _ in range(args.iterations):
        one(True)
    print(
        f"device {args.device}, {args.iterations} gets, "
        f"remembered (C path): {aib.stats().session.remembered_gets}, "
        f"new messages imported in C: {aib.stats().session.new_message_gets}"
    )
    for key, values in phases.items():
        print(f"  {key:12s} median {median_us(values):7.1f} µs")
    if args.cprofile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.iterations):
            one(False)
        profile.disable()
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats("arrow_ipc_bridge", 45)
    session.close()
    mine.close()
    child.join(10)


if __name__ == "__main__":
    main()
