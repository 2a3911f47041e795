#!/usr/bin/env python
"""Lockstep step loop on the GPU: the cost of handing fresh device data to another process each step.

    python benchmarks/bench_step.py [--sizes 1MiB,64MiB,1GiB] [--steps 400] [--cupy] [--spin]
        [--json out.json] [--profile]

Every step, for 16 float32 CUDA columns of the given total size:

- the producer updates its columns in place (a CuPy kernel per column; synchronised, untimed: the
  producer's kernels are not the hand-off) and hands them over;
- the consumer takes them, makes its work ordered after the producer's (event wait), reads one value
  (a 4-byte copy to the host) and checks it, gives them back, and answers the producer.

Bridge: ``pub.publish("t", aib.from_cuda_arrays(columns))`` (timed on the producer: "publish"), a
4-byte "go" to the consumer, ``session.get("t")`` -> ``__arrow_c_device_array__`` -> the struct's
sync_event waited on (timed on the consumer: "get+capsule", and ``session.get`` alone: "get"), read,
release, a 4-byte answer.
``handoff`` = publish + get+capsule of the same step; ``step`` = the producer's time from before the
publish to the answer (two notifications included).

Peer, in the same run: torch.multiprocessing — the producer puts the same 16 tensors on a
``torch.multiprocessing`` Queue (spawn context; torch shares the CUDA storages and their event),
the consumer gets them, reads one value the same way and answers: ``step`` as above.

``--cupy``: the consumer's "get+capsule" becomes ``session.get("t")`` ->
``aib.column_arrays(imported, "cupy", stream=0)`` (16 CuPy arrays, the stream ordered after the
producer's event), and the value is read from the last array's memory. With standing leases the
session hands out the arrays it made the step before again when nothing holds them
(docs/lifetime.md, "Kept CuPy arrays"); the line says how many steps did.

The bridge's consumer connects with the default options, which keep standing leases
(docs/lifetime.md, "Standing leases"): from the second step on its get reads the publisher's
version board instead of asking, and imports the message it remembers. ``--no-standing-leases``:
the consumer connects with ``pool_linger=0``, so every get asks the publisher and IPC-pool data
keeps no lease either (each get imports its pointers and frees them on release; figures in
docs/benchmarks.md measured before standing leases were the default kept the pool lease there).

``--get-next``: the consumer waits with ``session.get_next("t", after=<the last version>)``
instead of the "go" message (with standing leases it sleeps on the publisher's version board, which
the publish wakes: no message from the producer). ``handoff`` is then the whole hand-off across
processes: from the producer's publish beginning to the consumer holding the waited-on capsule (or
the CuPy arrays), one ``CLOCK_MONOTONIC`` for both; "get+capsule" is its part after ``publish``
returned (the wake-up included) and "get" that part up to ``get_next`` returning. The "go" message
still carries the producer's timestamps, read after the timed part.

With ``--spin`` too, ``get_next`` polls the board for up to 50 ms before it sleeps (``spin=``).

``--cpu-time`` also reports the consumer thread's CPU time in ``session.get`` (``time.thread_time``;
not with ``--get-next``): CPU time near the wall time means work on a slow core, far under it means
the thread was not running (preempted, or waiting in the kernel).

``--spin`` makes both sides of both methods wait for each other by polling instead of sleeping (a
sleeping side wakes on a cold core, which slows the Python that follows it).
``--producer-idle-us N``: the bridge's producer sleeps N µs after its kernels' sync, before the
timed publish: both sides then sit idle longer between steps, as they do when larger data's
kernels take longer, with no more data (a way to tell the two apart).
``--profile`` adds a cProfile of the producer's ``from_cuda_arrays`` + ``publish`` at each size.
Producer and consumer are separate processes started with *spawn* (CUDA never crosses a fork).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import statistics
import struct
import sys
import tempfile
import time
from typing import Any

_CTX = mp.get_context("spawn")
_COLUMNS = 16
_WARMUP = 50
_NEXT_SPIN = 0.05  # --get-next --spin: get_next polls the board this long before it sleeps


def _parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _receive(connection: Any, spin: bool) -> bytes:
    """The next message; with ``spin``, polled without sleeping (the waiting side keeps its core
    awake, as a busy step loop does), else a blocking read."""
    if spin:
        while not connection.poll(0):
            pass
    data: bytes = connection.recv_bytes()
    return data


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p10_us": ordered[len(ordered) // 10] * 1e6,
        "p90_us": ordered[len(ordered) * 9 // 10] * 1e6,
    }


# ---------- bridge ------------------------------------------------------------------------------
def bridge_producer(cfg: dict[str, Any], out: Any) -> None:
    import cupy

    import arrow_ipc_bridge as aib

    path, size, steps, go, answers = cfg["path"], cfg["size"], cfg["steps"], cfg["go"], cfg["answers"]
    profile, spin, idle = cfg["profile"], cfg["spin"], cfg["idle"]
    n = size // _COLUMNS // 4
    columns = {f"c{i}": cupy.zeros(n, dtype=cupy.float32) for i in range(_COLUMNS)}
    cupy.cuda.runtime.deviceSynchronize()
    publish_times: list[float] = []
    step_times: list[float] = []
    profiler = cProfile.Profile() if profile else None
    with aib.Publisher(path) as pub:
        pub.publish("t", aib.from_cuda_arrays(columns))
        out.send("ready")
        if cfg["get_next"]:
            _receive(answers, spin)  # the consumer got the first version: the steps may begin
        for step in range(1, steps + _WARMUP + 1):
            for column in columns.values():
                cupy.add(column, 1, out=column)  # in place
            cupy.cuda.runtime.deviceSynchronize()  # the producer's kernels are not the hand-off
            if idle:  # a longer quiet gap before the hand-off, as larger data's kernels make
                time.sleep(idle)
            if profiler is not None and step > _WARMUP:
                profiler.enable()
            t0 = time.perf_counter()
            pub.publish("t", aib.from_cuda_arrays(columns))
            t1 = time.perf_counter()
            if profiler is not None:
                profiler.disable()
            go.send_bytes(struct.pack("<idd", step, t1 - t0, t0))
            answer = _receive(answers, spin)
            t2 = time.perf_counter()
            if struct.unpack("<i", answer)[0] != step:
                raise RuntimeError(f"step {step}: the consumer saw {answer!r}")
            if step > _WARMUP:
                publish_times.append(t1 - t0)
                step_times.append(t2 - t0)
        go.send_bytes(struct.pack("<idd", -1, 0.0, 0.0))
        result: dict[str, Any] = {
            "publish": _summary(publish_times),
            "step": _summary(step_times),
            # every publish after the first should renew the publication in place (the fast path)
            "in_place_publishes": aib.stats().cuda.in_place_publishes,
        }
        if profiler is not None:
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(45)
            result["profile"] = text.getvalue()
        out.send(result)


def bridge_consumer(path: str, go: Any, answers: Any, options: dict[str, Any], out: Any) -> None:
    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge._ffi import ffi
    from arrow_ipc_bridge.wire.capsules import capsule_struct

    spin, as_cupy, standing = options["spin"], options["cupy"], options["standing_leases"]
    get_next, total = options["get_next"], options["total_steps"]
    cpu_time = options["cpu_time"]
    get_cpu_times: list[float] = []  # the consumer thread's CPU time in session.get (--cpu-time)
    value = ffi.new("float *")
    get_times: list[float] = []
    get_only_times: list[float] = []  # session.get alone, to split get+capsule
    handoffs: list[float] = []
    # The default options keep standing leases; pool_linger=0 keeps no lease (every get asks).
    with aib.connect(path, timeout=60.0, **({} if standing else {"pool_linger": 0.0})) as session:
        after = 0
        if get_next:
            with session.get("t", wait=0) as first:  # wait=0 answers with the version
                after = first.version or 0
            answers.send_bytes(struct.pack("<i", 0))
        for _ in range(total if get_next else 1 << 62):
            if get_next:  # woken by the publish itself; the producer's stamps are read afterwards
                imported = session.get_next("t", after=after, timeout=60.0, spin=_NEXT_SPIN if spin else 0.0)
                t_got = time.perf_counter()
                after = imported.version or 0
            else:
                step, publish_s, _ = struct.unpack("<idd", _receive(go, spin))
                if step < 0:
                    break
                c0 = time.thread_time() if cpu_time else 0.0
                t0 = time.perf_counter()
                imported = session.get("t")
                t_got = time.perf_counter()
                if cpu_time:
                    get_cpu_times.append(time.thread_time() - c0)
            if as_cupy:  # the 16 columns as CuPy arrays, the legacy default stream ordered after the event
                arrays = list(aib.column_arrays(imported, "cupy", stream=0).values())
                t1 = time.perf_counter()
                pointer = arrays[_COLUMNS - 1].data.ptr
            else:
                schema_capsule, array_capsule = imported.__arrow_c_device_array__()
                device_array = capsule_struct(array_capsule, "device_array")
                if device_array.sync_event != ffi.NULL:
                    cuda.stream_wait_event(0, cuda.event_value(device_array.sync_event))
                t1 = time.perf_counter()
                column = device_array.array.children[_COLUMNS - 1]
                pointer = int(ffi.cast("uintptr_t", column.buffers[1]))
            if get_next:
                step, publish_s, published_at = struct.unpack("<idd", _receive(go, spin))
                t0 = published_at + publish_s  # the part after publish returned
            cuda.memcpy_dtoh(int(ffi.cast("uintptr_t", value)), pointer, 4)  # after the event wait
            if value[0] != float(step):
                raise RuntimeError(f"step {step}: read {value[0]}")
            if as_cupy:
                del arrays
            else:
                del schema_capsule, array_capsule, device_array
            imported.release()
            answers.send_bytes(struct.pack("<i", step))
            if step > _WARMUP:
                get_times.append(t1 - t0)
                get_only_times.append(t_got - t0)
                handoffs.append(t1 - t0 + publish_s)
        if get_next:
            _receive(go, spin)  # the producer's end
        counts = aib.stats().session  # this child process's: its one session
        local_gets, reused = counts.local_gets, counts.reused_cupy_arrays
    out.send(
        {
            "get_capsule": _summary(get_times),
            "get": _summary(get_only_times),
            "get_cpu": _summary(get_cpu_times[_WARMUP:]) if get_cpu_times else None,
            "handoff": _summary(handoffs),
            "local_gets": local_gets,
            "reused_cupy_arrays": reused,
            "board_waits": aib.stats().waits.board_waits,
            "board_spins": aib.stats().waits.board_spins,
            "waits_sent": aib.stats().waits.waits_sent,
        }
    )


# ---------- torch.multiprocessing -----------------------------------------------------------------
def torch_producer(run: tuple[int, int], queue: Any, answers: Any, spin: bool, out: Any) -> None:
    import torch

    size, steps = run

    n = size // _COLUMNS // 4
    tensors = [torch.zeros(n, dtype=torch.float32, device="cuda") for _ in range(_COLUMNS)]
    torch.cuda.synchronize()
    step_times: list[float] = []
    out.send("ready")
    for step in range(1, steps + _WARMUP + 1):
        for tensor in tensors:
            tensor.add_(1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        queue.put((step, tensors))
        answer = _receive(answers, spin)
        t1 = time.perf_counter()
        if struct.unpack("<i", answer)[0] != step:
            raise RuntimeError(f"step {step}: the consumer saw {answer!r}")
        if step > _WARMUP:
            step_times.append(t1 - t0)
    queue.put((-1, None))
    out.send({"step": _summary(step_times)})
    answers.recv_bytes()  # the consumer is done with every tensor: they may go now


def torch_consumer(queue: Any, answers: Any, spin: bool, out: Any) -> None:
    import queue as queues

    import torch

    torch.cuda.init()
    while True:
        if spin:
            while True:
                try:
                    step, tensors = queue.get_nowait()
                    break
                except queues.Empty:
                    pass
        else:
            step, tensors = queue.get()
        if step < 0:
            break
        value = float(tensors[_COLUMNS - 1][0].item())
        if value != float(step):
            raise RuntimeError(f"step {step}: read {value}")
        del tensors
        answers.send_bytes(struct.pack("<i", step))
    out.send("done")
    answers.send_bytes(struct.pack("<i", -1))


# ---------- driver ---------------------------------------------------------------------------------
def _run_pair(
    producer: Any,
    consumer: Any,
    producer_args: tuple[Any, ...],
    consumer_args: tuple[Any, ...],
    timeout: float,
) -> tuple[Any, Any]:
    p_out, p_in = _CTX.Pipe()
    c_out, c_in = _CTX.Pipe()
    prod = _CTX.Process(target=producer, args=(*producer_args, p_in))
    cons = _CTX.Process(target=consumer, args=(*consumer_args, c_in))
    prod.start()
    try:
        deadline = time.monotonic() + 120
        while not p_out.poll(0.5):
            if prod.exitcode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the producer did not start (exit code {prod.exitcode})")
        if p_out.recv() != "ready":
            raise RuntimeError("the producer did not start")
        cons.start()
        deadline = time.monotonic() + timeout
        while not p_out.poll(0.5):
            if prod.exitcode is not None or cons.exitcode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run did not finish (exit codes {prod.exitcode}, {cons.exitcode})")
        produced = p_out.recv()
        if not c_out.poll(60):
            raise RuntimeError("the consumer did not finish")
        consumed = c_out.recv()
        return produced, consumed
    finally:
        for process in (prod, cons):
            if process.pid is None:  # never started
                continue
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()


def run_bridge(
    size: int,
    steps: int,
    profile: bool,
    spin: bool,
    timeout: float,
    *,
    as_cupy: bool = False,
    standing_leases: bool = True,
    idle: float = 0.0,
    get_next: bool = False,
    cpu_time: bool = False,
) -> dict[str, Any]:
    path = os.path.join(tempfile.mkdtemp(dir="/tmp"), "step.sock")
    go_recv, go_send = _CTX.Pipe(duplex=False)
    ans_recv, ans_send = _CTX.Pipe(duplex=False)
    produced, consumed = _run_pair(
        bridge_producer,
        bridge_consumer,
        (
            {
                "path": path,
                "size": size,
                "steps": steps,
                "go": go_send,
                "answers": ans_recv,
                "profile": profile,
                "spin": spin,
                "idle": idle,
                "get_next": get_next,
            },
        ),
        (
            path,
            go_recv,
            ans_send,
            {
                "spin": spin,
                "cupy": as_cupy,
                "standing_leases": standing_leases,
                "get_next": get_next,
                "total_steps": steps + _WARMUP,
                "cpu_time": cpu_time,
            },
        ),
        timeout,
    )
    return {**produced, **consumed}


def run_torch(size: int, steps: int, spin: bool, timeout: float) -> dict[str, Any]:
    import torch.multiprocessing as tmp

    queue = tmp.get_context("spawn").Queue()
    ans_recv, ans_send = _CTX.Pipe(duplex=False)
    produced, _ = _run_pair(
        torch_producer,
        torch_consumer,
        ((size, steps), queue, ans_recv, spin),
        (queue, ans_send, spin),
        timeout,
    )
    return produced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1MiB,64MiB,1GiB", help="total sizes of the 16 float32 columns")
    parser.add_argument(
        "--steps", type=int, default=400, help="timed steps per size (after 50 warm-up steps)"
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--profile", action="store_true", help="cProfile the producer's publish")
    parser.add_argument(
        "--cupy",
        action="store_true",
        help="the consumer makes the 16 columns CuPy arrays (column_arrays) instead of taking the capsule",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.multiprocessing peer")
    parser.add_argument(
        "--no-standing-leases",
        action="store_true",
        help="the consumer connects with pool_linger=0: every get asks the publisher (no version board)",
    )
    parser.add_argument(
        "--spin", action="store_true", help="both sides of both methods wait by polling, not sleeping"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="also measure the consumer thread's CPU time in session.get (tells CPU work from waiting)",
    )
    parser.add_argument(
        "--get-next",
        action="store_true",
        help="the consumer waits with session.get_next (woken by the publish) instead of a message",
    )
    parser.add_argument(
        "--producer-idle-us",
        type=float,
        default=0.0,
        help="the bridge's producer sleeps this long after its kernels, before publishing (untimed)",
    )
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for text in args.sizes.split(","):
        size = _parse_size(text)
        bridge = run_bridge(
            size,
            args.steps,
            args.profile,
            args.spin,
            args.timeout,
            as_cupy=args.cupy,
            standing_leases=not args.no_standing_leases,
            idle=args.producer_idle_us / 1e6,
            get_next=args.get_next,
            cpu_time=args.cpu_time,
        )
        torch_result = None if args.no_torch else run_torch(size, args.steps, args.spin, args.timeout)
        results[text] = {"bridge": bridge, "torch": torch_result}
        line = (
            f"{text:>7}: bridge publish {bridge['publish']['median_us']:7.1f} us, get+capsule "
            f"{bridge['get_capsule']['median_us']:6.1f} us (get {bridge['get']['median_us']:.1f}), "
            f"handoff {bridge['handoff']['median_us']:7.1f} us "
            f"(p90 {bridge['handoff']['p90_us']:.1f}), step {bridge['step']['median_us']:7.1f} us, "
            f"{bridge['in_place_publishes']} in-place publishes, {bridge['local_gets']} gets from the board"
        )
        if args.cupy:
            line += f", {bridge['reused_cupy_arrays']} kept CuPy array sets handed out again"
        if bridge.get("get_cpu"):
            line += f", get's CPU time {bridge['get_cpu']['median_us']:.1f} us"
        if args.get_next:
            line += (
                f", {bridge['board_waits']} sleeps and {bridge['board_spins']} polls on the board, "
                f"{bridge['waits_sent']} WAITs sent"
            )
        if torch_result is not None:
            torch_step = torch_result["step"]["median_us"]
            line += (
                f" | torch.multiprocessing step {torch_step:8.1f} us: "
                f"{torch_step / bridge['handoff']['median_us']:.1f}x the bridge's handoff, "
                f"{torch_step / bridge['step']['median_us']:.1f}x its step"
            )
        print(line, flush=True)
        if args.profile:
            print(bridge["profile"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
