"""Several GPUs: the cost of getting data that lives on the other GPU, and the bandwidth of using it.

Needs two GPUs and CuPy; prints a message and exits 0 otherwise. Cases, all in one run:

- ``get_same`` / ``get_cross``: steady-state gets of 16 columns (1 MiB each, legacy memory) that a
  producer process publishes on GPU 0; the same-GPU consumer asks for them plainly, the cross-GPU
  one through ``Session(reader_device=1)`` (peer access, in place). Target: cross within 1.5x of same.
- ``peer_memcpy``: ``cuMemcpyPeerAsync`` of 1 GiB from GPU 0 to GPU 1, GPU time by events: the pair's
  bandwidth, measured in the same run as what follows.
- ``read_in_place``: a kernel on GPU 1 summing an imported 1 GiB column living on GPU 0.
- ``to_device``: ``imported.to_device(1, stream=s)`` of that column, GPU time by events around the
  copies (the stream is held busy while the host queues them, so allocation and queueing are
  not counted; ``to_device_wall`` is the whole call with its synchronisation).
  Targets: both at >= 90% of ``peer_memcpy``.
- ``nccl_sendrecv``: torch.distributed with NCCL, one process per GPU, the same 16 x 1 MiB tensors
  sent from GPU 0 and received on GPU 1, per round (skipped without PyTorch). Compared with
  ``get_cross`` (hand-off, data read in place) and ``get_cross_copy`` (hand-off plus a copy of
  the 16 columns to GPU 1 on a stream, synchronised).

``--quick`` runs fewer rounds; ``--json PATH`` writes the results.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

_COLUMNS = 16
_COLUMN_BYTES = 1 << 20
_BIG_BYTES = 1 << 30
_CTX = mp.get_context("spawn")

_SUM_KERNEL = r"""
extern "C" __global__ void sum_int64(const long long* x, unsigned long long n, unsigned long long* out) {
    unsigned long long acc = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        acc += (unsigned long long)x[i];
    }
    atomicAdd(out, acc);
}
extern "C" __global__ void spin(unsigned long long cycles) {
    unsigned long long start = clock64();
    while ((unsigned long long)(clock64() - start) < cycles) { }
}
"""


def _two_gpus() -> str | None:
    """None when the benchmark can run, else why not."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA GPU ({exc})"
    if count < 2:
        return f"needs two GPUs; this machine shows {count}"
    return None


# ---------- the producer ------------------------------------------------------------------------------
def _producer(socket_path: str, conn: Any) -> None:
    """Publish 16 columns of 1 MiB ("small") and one 1 GiB int64 column ("big"), both on GPU 0."""
    try:
        import cupy

        import arrow_ipc_bridge as aib

        with cupy.cuda.Device(0):
            small = {f"c{i}": cupy.arange(_COLUMN_BYTES // 8, dtype=cupy.int64) + i for i in range(_COLUMNS)}
            big = cupy.arange(_BIG_BYTES // 8, dtype=cupy.int64)
            cupy.cuda.Device(0).synchronize()
        with aib.Publisher(socket_path) as pub:
            pub.publish("small", aib.from_cuda_arrays(small))
            pub.publish("big", aib.from_cuda_arrays({"x": big}))
            conn.send(("ready", None))
            conn.recv()
    except Exception:
        conn.send(("error", traceback.format_exc()))


# ---------- consumer-side measurements ------------------------------------------------------------------
def _time_gets(session: Any, name: str, rounds: int, after: Any = None) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        imported = session.get(name)
        if after is not None:
            after(imported)
        times.append(time.perf_counter() - started)
        imported.release()
    return times


def _us(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p10_us": ordered[len(ordered) // 10] * 1e6,
        "p90_us": ordered[(len(ordered) * 9) // 10] * 1e6,
    }


def _gpu_seconds(stream: Any, work: Any, spin: Any = None) -> float:
    """GPU time of ``work()``'s queued work on ``stream`` (events around it). With ``spin``, the
    stream is kept busy first so that the host queues everything before the start event fires."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    with stream:
        if spin is not None:
            spin((1,), (1,), (cupy.uint64(40_000_000),))  # ~20 ms at 2 GHz, on one thread
        start.record(stream)
        result = work()
        end.record(stream)
    end.synchronize()
    del result
    return float(cupy.cuda.get_elapsed_time(start, end)) / 1e3


def _bandwidths(session_cross: Any, repeats: int) -> dict[str, Any]:
    import cupy

    from arrow_ipc_bridge.cuda import peer

    results: dict[str, Any] = {}
    peer.enable_peer_access(1, 0)
    peer.enable_peer_access(0, 1)
    with cupy.cuda.Device(0):
        source = cupy.ones(_BIG_BYTES, dtype=cupy.uint8)
    with cupy.cuda.Device(1):
        target = cupy.empty(_BIG_BYTES, dtype=cupy.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)
        module = cupy.RawModule(code=_SUM_KERNEL)
        sum_kernel, spin = module.get_function("sum_int64"), module.get_function("spin")
        total = cupy.zeros(1, dtype=cupy.uint64)

    def peer_copy() -> None:
        peer.copy_peer_async(target.data.ptr, 1, source.data.ptr, 0, _BIG_BYTES, stream=stream.ptr)

    with cupy.cuda.Device(1):
        seconds = [_gpu_seconds(stream, peer_copy) for _ in range(repeats)]
    results["peer_memcpy"] = {"gb_per_s": _BIG_BYTES / min(seconds) / 1e9, "seconds": seconds}

    with session_cross.get("big") as imported:
        import arrow_ipc_bridge as aib

        column = aib.column_view(imported, "x").__cuda_array_interface__
        pointer, n = column["data"][0], column["shape"][0]
        expected = n * (n - 1) // 2

        def read() -> None:
            total.fill(0)
            sum_kernel((1024,), (512,), (cupy.uint64(pointer), cupy.uint64(n), total))

        with cupy.cuda.Device(1):
            seconds = [_gpu_seconds(stream, read) for _ in range(repeats)]
            if int(total.get()[0]) != expected % (1 << 64):
                raise RuntimeError(f"the in-place sum is {int(total.get()[0])}, expected {expected}")
        results["read_in_place"] = {"gb_per_s": _BIG_BYTES / min(seconds) / 1e9, "seconds": seconds}

        copies: list[Any] = []

        def copy() -> None:
            copies.append(imported.to_device(1, stream=stream.ptr))

        with cupy.cuda.Device(1):
            seconds = []
            for _ in range(repeats):
                seconds.append(_gpu_seconds(stream, copy, spin))
                copies.pop().release()  # one 1 GiB copy alive at a time
            walls = []
            for _ in range(repeats):
                started = time.perf_counter()
                made = imported.to_device(1, stream=stream.ptr)
                stream.synchronize()
                walls.append(time.perf_counter() - started)
                made.release()
        results["to_device"] = {"gb_per_s": _BIG_BYTES / min(seconds) / 1e9, "seconds": seconds}
        results["to_device_wall"] = {"gb_per_s": _BIG_BYTES / min(walls) / 1e9, "seconds": walls}
    base = results["peer_memcpy"]["gb_per_s"]
    for key in ("read_in_place", "to_device", "to_device_wall"):
        results[key]["of_peer_memcpy"] = results[key]["gb_per_s"] / base
    return results


# ---------- torch.distributed with NCCL -----------------------------------------------------------------
def _nccl_rank(rank: int, port: int, rounds: int, conn: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=2)
        tensors = [
            torch.full(
                (_COLUMN_BYTES // 8,), i if rank == 0 else -1, dtype=torch.int64, device=f"cuda:{rank}"
            )
            for i in range(_COLUMNS)
        ]
        times = []
        for _ in range(rounds):
            dist.barrier()
            torch.cuda.synchronize()
            started = time.perf_counter()
            ops = [
                dist.P2POp(dist.isend if rank == 0 else dist.irecv, tensor, 1 - rank) for tensor in tensors
            ]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        if rank == 1 and int(tensors[-1][0].item()) != _COLUMNS - 1:
            raise RuntimeError("NCCL received wrong values")
        dist.destroy_process_group()
        conn.send(("done", times))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _nccl(rounds: int) -> dict[str, Any]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"skipped": "PyTorch is not installed"}
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pipes = [_CTX.Pipe() for _ in range(2)]
    ranks = [_CTX.Process(target=_nccl_rank, args=(rank, port, rounds, pipes[rank][1])) for rank in range(2)]
    for process in ranks:
        process.start()
    answers = []
    for parent, _ in pipes:
        if not parent.poll(300):
            answers.append(("error", "no answer in 300 s"))
        else:
            answers.append(parent.recv())
    for process in ranks:
        process.join(30)
        if process.is_alive():
            process.kill()
    for status, value in answers:
        if status != "done":
            return {"error": value}
    return _us(answers[1][1][len(answers[1][1]) // 10 :])  # the receiver's rounds, warm-up left out


# ---------- the run -------------------------------------------------------------------------------------
def run(quick: bool) -> dict[str, Any]:
    import cupy

    import arrow_ipc_bridge as aib

    rounds = 200 if quick else 2000
    repeats = 3 if quick else 10
    results: dict[str, Any] = {"quick": quick, "columns": _COLUMNS, "column_bytes": _COLUMN_BYTES}
    path = os.path.join(tempfile.mkdtemp(dir="/tmp"), "bench-multigpu.sock")
    parent, child = _CTX.Pipe()
    producer = _CTX.Process(target=_producer, args=(path, child), daemon=True)
    producer.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the producer did not start")
        status, detail = parent.recv()
        if status != "ready":
            raise RuntimeError(f"the producer failed:\n{detail}")
        with (
            aib.connect(path, timeout=60.0) as same,
            aib.connect(path, timeout=60.0, reader_device=1) as cross,
        ):
            warm = max(20, rounds // 10)
            _time_gets(same, "small", warm)
            _time_gets(cross, "small", warm)
            results["get_same"] = _us(_time_gets(same, "small", rounds))
            results["get_cross"] = _us(_time_gets(cross, "small", rounds))
            results["get_cross"]["of_get_same"] = (
                results["get_cross"]["median_us"] / results["get_same"]["median_us"]
            )
            with cupy.cuda.Device(1):
                stream = cupy.cuda.Stream(non_blocking=True)

                def copy_and_wait(imported: Any) -> None:
                    with imported.to_device(1, stream=stream.ptr):
                        stream.synchronize()

                _time_gets(cross, "small", warm, copy_and_wait)
                results["get_cross_copy"] = _us(_time_gets(cross, "small", rounds // 4, copy_and_wait))
            results.update(_bandwidths(cross, repeats))
    finally:
        parent.send("stop")
        producer.join(60)
        if producer.is_alive():
            producer.kill()
    results["nccl_sendrecv"] = _nccl(max(50, rounds // 4))
    return results


def _print(results: dict[str, Any]) -> None:
    print(f"{'case':18s} {'median':>12s} {'p10':>12s} {'p90':>12s}  note")
    for key in ("get_same", "get_cross", "get_cross_copy", "nccl_sendrecv"):
        row = results.get(key, {})
        if "median_us" not in row:
            print(f"{key:18s} {'-':>12s} {'-':>12s} {'-':>12s}  {row.get('skipped') or row.get('error', '')}")
            continue
        note = f"{row['of_get_same']:.2f}x same-GPU get (target <= 1.5x)" if "of_get_same" in row else ""
        print(f"{key:18s} {row['median_us']:10.1f}us {row['p10_us']:10.1f}us {row['p90_us']:10.1f}us  {note}")
    print(f"{'case (1 GiB)':18s} {'GB/s':>12s}  of cuMemcpyPeer (target >= 0.90)")
    for key in ("peer_memcpy", "read_in_place", "to_device", "to_device_wall"):
        row = results[key]
        ratio = f"{row['of_peer_memcpy']:.2f}" if "of_peer_memcpy" in row else "1.00 (reference)"
        print(f"{key:18s} {row['gb_per_s']:12.1f}  {ratio}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    why_not = _two_gpus()
    if why_not is not None:
        print(f"bench_multigpu: skipped: {why_not}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump({"skipped": why_not}, out, indent=2)
        return 0
    results = run(args.quick)
    _print(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
