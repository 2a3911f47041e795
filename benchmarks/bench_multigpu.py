"""Several GPUs: the cost of getting data that lives on another GPU, and the bandwidth of using it.

Needs two GPUs or more and CuPy; prints a message and exits 0 otherwise. Every ordered pair of the
machine's GPUs (source, reader) is measured, in one run:

- ``get_same`` (per source GPU): steady-state gets of 16 columns (1 MiB each, legacy memory) that a
  producer process publishes on the source GPU, by a plain session (the reader is the source GPU).
- ``get_cross``: the same gets through ``Session(reader_device=reader)`` (peer access, read in
  place). Target: median and 90th percentile <= 1.2x ``get_same``'s.
- ``get_cross_copy``: the hand-off plus a copy of the 16 columns to the reader's GPU on a stream,
  synchronised.
- ``peer_memcpy``: ``cuMemcpyPeerAsync`` of 1 GiB from the source to the reader, GPU time by events:
  the pair's bandwidth, measured in the same run as what follows.
- ``read_in_place``: a kernel on the reader summing an imported 1 GiB column living on the source
  (four independent 16-byte loads per thread and step, two blocks of 256 threads per
  multiprocessor: the fastest of the shapes tried on H200s).
  Target: >= 0.95x ``peer_memcpy``. ``read_native``: the same kernel over an allocation the
  benchmark makes on the source GPU itself (peer access, no IPC), the kernel's own ceiling; the
  three run in turn in each repeat.
- ``to_device``: ``imported.to_device(reader, stream=s)`` of that column, GPU time by events around
  the copies (the stream is held busy while the host queues them, so allocation and queueing are
  not counted; ``to_device_wall`` is the whole call with its synchronisation).
- ``nccl_sendrecv``: torch.distributed with NCCL, one process on each GPU of the pair, the same
  16 x 1 MiB tensors sent from the source and received on the reader, per round (skipped without
  PyTorch).

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
extern "C" __global__ void sum_int64(const longlong2* x, unsigned long long n2, unsigned long long* out) {
    // four independent 16-byte loads in flight per thread per step: remote reads are latency-bound
    unsigned long long acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n2; i += 4 * stride) {
        longlong2 v[4];
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = x[i + k * stride];
#pragma unroll
        for (int k = 0; k < 4; k++) acc += (unsigned long long)v[k].x + (unsigned long long)v[k].y;
    }
    for (; i < n2; i += stride) {
        longlong2 v = x[i];
        acc += (unsigned long long)v.x + (unsigned long long)v.y;
    }
    atomicAdd(out, acc);
}
extern "C" __global__ void spin(unsigned long long cycles) {
    unsigned long long start = clock64();
    while ((unsigned long long)(clock64() - start) < cycles) { }
}
"""


def _gpu_count() -> tuple[int, str | None]:
    """(the GPUs this process sees, None) when the benchmark can run, else (0, why not)."""
    try:
        import cupy
    except ImportError:
        return 0, "CuPy is not installed"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return 0, f"no usable CUDA GPU ({exc})"
    if count < 2:
        return 0, f"needs two GPUs; this machine shows {count}"
    return count, None


# ---------- the producer ------------------------------------------------------------------------------
def _producer(socket_path: str, gpus: int, conn: Any) -> None:
    """Publish, on every GPU g, 16 columns of 1 MiB ("small_on{g}") and one 1 GiB int64 column
    ("big_on{g}")."""
    try:
        import cupy

        import arrow_ipc_bridge as aib

        held = []
        with aib.Publisher(socket_path) as pub:
            for gpu in range(gpus):
                with cupy.cuda.Device(gpu):
                    small = {
                        f"c{i}": cupy.arange(_COLUMN_BYTES // 8, dtype=cupy.int64) + i
                        for i in range(_COLUMNS)
                    }
                    big = cupy.arange(_BIG_BYTES // 8, dtype=cupy.int64)
                    cupy.cuda.Device(gpu).synchronize()
                held.append((small, big))
                pub.publish(f"small_on{gpu}", aib.from_cuda_arrays(small))
                pub.publish(f"big_on{gpu}", aib.from_cuda_arrays({"x": big}))
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


def _bandwidths(session_cross: Any, source_gpu: int, reader: int, repeats: int) -> dict[str, Any]:
    import cupy

    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge.cuda import peer

    results: dict[str, Any] = {}
    peer.enable_peer_access(reader, source_gpu)
    peer.enable_peer_access(source_gpu, reader)
    with cupy.cuda.Device(source_gpu):
        source = cupy.ones(_BIG_BYTES, dtype=cupy.uint8)
    with cupy.cuda.Device(reader):
        target = cupy.empty(_BIG_BYTES, dtype=cupy.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)
        module = cupy.RawModule(code=_SUM_KERNEL)
        sum_kernel, spin = module.get_function("sum_int64"), module.get_function("spin")
        total = cupy.zeros(1, dtype=cupy.uint64)
        blocks = 2 * cupy.cuda.Device(reader).attributes["MultiProcessorCount"]

    def peer_copy() -> None:
        peer.copy_peer_async(
            target.data.ptr, reader, source.data.ptr, source_gpu, _BIG_BYTES, stream=stream.ptr
        )

    def read_native() -> None:  # the same kernel over the source GPU's own allocation: its ceiling
        sum_kernel((blocks,), (256,), (cupy.uint64(source.data.ptr), cupy.uint64(_BIG_BYTES // 16), total))

    with session_cross.get(f"big_on{source_gpu}") as imported:
        column = aib.column_view(imported, "x").__cuda_array_interface__
        pointer, n = column["data"][0], column["shape"][0]
        expected = n * (n - 1) // 2

        def read() -> None:
            total.fill(0)
            sum_kernel((blocks,), (256,), (cupy.uint64(pointer), cupy.uint64(n // 2), total))

        # The three in turn, each repeat: a drift of the clocks or the link shows in all of them.
        times: dict[str, list[float]] = {"peer_memcpy": [], "read_native": [], "read_in_place": []}
        with cupy.cuda.Device(reader):
            for _ in range(repeats):
                times["peer_memcpy"].append(_gpu_seconds(stream, peer_copy))
                times["read_native"].append(_gpu_seconds(stream, read_native))
                times["read_in_place"].append(_gpu_seconds(stream, read))
                if int(total.get()[0]) != expected % (1 << 64):
                    raise RuntimeError(f"the in-place sum is {int(total.get()[0])}, expected {expected}")
        for key, seconds in times.items():
            results[key] = {"gb_per_s": _BIG_BYTES / min(seconds) / 1e9, "seconds": seconds}
        source = target = None  # 2 GiB back before the copies

        copies: list[Any] = []

        def copy() -> None:
            copies.append(imported.to_device(reader, stream=stream.ptr))

        with cupy.cuda.Device(reader):
            seconds = []
            for _ in range(repeats):
                seconds.append(_gpu_seconds(stream, copy, spin))
                copies.pop().release()  # one 1 GiB copy alive at a time
            walls = []
            for _ in range(repeats):
                started = time.perf_counter()
                made = imported.to_device(reader, stream=stream.ptr)
                stream.synchronize()
                walls.append(time.perf_counter() - started)
                made.release()
        results["to_device"] = {"gb_per_s": _BIG_BYTES / min(seconds) / 1e9, "seconds": seconds}
        results["to_device_wall"] = {"gb_per_s": _BIG_BYTES / min(walls) / 1e9, "seconds": walls}
    base = results["peer_memcpy"]["gb_per_s"]
    for key in ("read_native", "read_in_place", "to_device", "to_device_wall"):
        results[key]["of_peer_memcpy"] = results[key]["gb_per_s"] / base
    cupy.get_default_memory_pool().free_all_blocks()
    return results


# ---------- torch.distributed with NCCL -----------------------------------------------------------------
def _nccl_rank(rank: int, devices: tuple[int, int], port: int, rounds: int, conn: Any) -> None:
    """Rank 0 on ``devices[0]`` sends, rank 1 on ``devices[1]`` receives."""
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        device = devices[rank]
        torch.cuda.set_device(device)
        # device_id: without it NCCL guesses the GPU from the rank, which hangs for the pair (1, 0)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", device))
        tensors = [
            torch.full(
                (_COLUMN_BYTES // 8,), i if rank == 0 else -1, dtype=torch.int64, device=f"cuda:{device}"
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


def _nccl(devices: tuple[int, int], rounds: int) -> dict[str, Any]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"skipped": "PyTorch is not installed"}
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pipes = [_CTX.Pipe() for _ in range(2)]
    ranks = [
        _CTX.Process(target=_nccl_rank, args=(rank, devices, port, rounds, pipes[rank][1]))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    answers = []
    for parent, _ in pipes:
        if not parent.poll(120):
            answers.append(("error", "no answer in 120 s"))
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
def run(quick: bool, gpus: int) -> dict[str, Any]:
    import cupy

    import arrow_ipc_bridge as aib

    rounds = 200 if quick else 2000
    repeats = 3 if quick else 10
    warm = max(20, rounds // 10)
    results: dict[str, Any] = {
        "quick": quick,
        "gpus": gpus,
        "columns": _COLUMNS,
        "column_bytes": _COLUMN_BYTES,
        "get_same": {},
        "pairs": {},
    }
    path = os.path.join(tempfile.mkdtemp(dir="/tmp"), "bench-multigpu.sock")
    parent, child = _CTX.Pipe()
    producer = _CTX.Process(target=_producer, args=(path, gpus, child), daemon=True)
    producer.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the producer did not start")
        status, detail = parent.recv()
        if status != "ready":
            raise RuntimeError(f"the producer failed:\n{detail}")
        with aib.connect(path, timeout=60.0) as same:
            for gpu in range(gpus):
                _time_gets(same, f"small_on{gpu}", warm)
                results["get_same"][str(gpu)] = _us(_time_gets(same, f"small_on{gpu}", rounds))
            for reader in range(gpus):
                with aib.connect(path, timeout=60.0, reader_device=reader) as cross:
                    for source_gpu in range(gpus):
                        if source_gpu == reader:
                            continue
                        name = f"small_on{source_gpu}"
                        same_row = results["get_same"][str(source_gpu)]
                        # the same-GPU get again, interleaved, so both rows see the same machine state
                        _time_gets(same, name, warm)
                        same_now = _us(_time_gets(same, name, rounds))
                        _time_gets(cross, name, warm)
                        row = _us(_time_gets(cross, name, rounds))
                        row["same_median_us"] = same_now["median_us"]
                        row["same_p90_us"] = same_now["p90_us"]
                        row["of_get_same"] = row["median_us"] / same_now["median_us"]
                        row["p90_of_get_same"] = row["p90_us"] / same_now["p90_us"]
                        same_row.setdefault("again", []).append(same_now)
                        pair: dict[str, Any] = {"get_cross": row}
                        with cupy.cuda.Device(reader):
                            stream = cupy.cuda.Stream(non_blocking=True)

                            def copy_and_wait(
                                imported: Any, stream: Any = stream, reader: int = reader
                            ) -> None:
                                with imported.to_device(reader, stream=stream.ptr):
                                    stream.synchronize()

                            _time_gets(cross, name, warm, copy_and_wait)
                            pair["get_cross_copy"] = _us(_time_gets(cross, name, rounds // 4, copy_and_wait))
                        pair.update(_bandwidths(cross, source_gpu, reader, repeats))
                        results["pairs"][f"{source_gpu}->{reader}"] = pair
    finally:
        parent.send("stop")
        producer.join(60)
        if producer.is_alive():
            producer.kill()
    for key, pair in results["pairs"].items():
        source_gpu, reader = (int(x) for x in key.split("->"))
        pair["nccl_sendrecv"] = _nccl((source_gpu, reader), max(50, rounds // 4))
    return results


def _print(results: dict[str, Any]) -> None:
    print(f"16 x 1 MiB legacy columns; {results['gpus']} GPUs; medians / 90th percentiles in us")
    print(
        f"{'source->reader':15s} {'same-GPU get':>16s} {'cross get':>16s} {'ratio':>11s} "
        f"{'cross+copy':>16s} {'NCCL':>16s}   (target: ratio <= 1.2 at both)"
    )
    for key, pair in results["pairs"].items():
        row = pair["get_cross"]
        copy = pair["get_cross_copy"]
        nccl = pair.get("nccl_sendrecv", {})
        nccl_text = (
            f"{nccl['median_us']:7.1f}/{nccl['p90_us']:<8.1f}"
            if "median_us" in nccl
            else str(nccl.get("skipped") or nccl.get("error", "-"))[:16]
        )
        print(
            f"{key:15s} {row['same_median_us']:7.1f}/{row['same_p90_us']:<8.1f} "
            f"{row['median_us']:7.1f}/{row['p90_us']:<8.1f} "
            f"{row['of_get_same']:5.2f}/{row['p90_of_get_same']:<5.2f} "
            f"{copy['median_us']:7.1f}/{copy['p90_us']:<8.1f} {nccl_text}"
        )
    print(
        f"{'1 GiB':15s} {'cuMemcpyPeer GB/s':>18s} {'read native':>12s} {'read in place':>14s} "
        f"{'to_device':>10s} {'(wall)':>8s}"
    )
    print(f"{'':15s} {'':>18s} {'':>12s} {'(>= 0.95x)':>14s}")
    for key, pair in results["pairs"].items():
        print(
            f"{key:15s} {pair['peer_memcpy']['gb_per_s']:18.1f} "
            f"{pair['read_native']['of_peer_memcpy']:11.3f}x "
            f"{pair['read_in_place']['of_peer_memcpy']:13.3f}x "
            f"{pair['to_device']['of_peer_memcpy']:9.3f}x {pair['to_device_wall']['of_peer_memcpy']:7.3f}x"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    gpus, why_not = _gpu_count()
    if why_not is not None:
        print(f"bench_multigpu: skipped: {why_not}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                json.dump({"skipped": why_not}, out, indent=2)
        return 0
    results = run(args.quick, gpus)
    _print(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
