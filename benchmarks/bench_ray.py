"""Ray actor to actor: Arrow data through the bridge's Ray transport against Ray's own paths, in one run.

One producer actor and one consumer actor on a local Ray cluster (this machine). Each sample is
timed in the driver from the producer's method call to the consumer's answer:
``ray.get(consumer.take.remote(producer.make.remote()))``, so every case pays the same two Ray
tasks. Two floors say how much of a figure is Ray's own: ``ray task floor``, the same two tasks
passing ``None``; ``ray RDT floor``, the same through a Ray transport that moves nothing (a
no-op ``TensorTransportManager`` defined here): the owner learning the metadata and the receive
task it sends the consumer, which every Ray transport pays (``CUDA_IPC`` too) before it moves a
byte. The producer makes its data once, before the samples; each
sample returns that same data again as a new object, and the consumer reads one value of the last
column (for the GPU cases a ``.item()``, which waits for the data), so a case that moved nothing
usable cannot finish. The refs of a sample are dropped before the next, so Ray frees each object
(for the bridge: unpublishes it) as it would in a pipeline.

GPU cases (``--columns`` float32 columns on GPU 0 of ``size`` bytes in all; needs torch with
CUDA, and a Ray cluster that sees the GPU; both actors take ``num_gpus=0.5``):

- ``bridge transport``: the producer returns ``ArrowPayload(aib.from_cuda_arrays(tensors))``
  (torch tensors, published without a copy), the consumer reads the columns as torch tensors with
  ``aib.column_arrays(payload.data, "torch")``.
- ``ray CUDA_IPC``: Ray's ``tensor_transport="cuda_ipc"`` with the same tensors as a list.
- ``ray object store``: the same list returned by a plain method: Ray pickles it (a device-to-host
  copy), keeps it in its object store, and the consumer's unpickling copies it back to the GPU.

Host cases (a pyarrow table of ``--columns`` float64 columns of ``size`` bytes in all):

- ``bridge transport, shared``: the table lies in ``aib.allocate_shared`` memory and is published
  with ``copy="never"``: no copy anywhere; the consumer maps the producer's memory.
- ``bridge transport, heap``: a table on the ordinary heap: each publish copies it once into a
  sealed memfd (``copy="if_needed"``), which the consumer maps.
- ``ray object store``: the heap table returned by a plain method: Ray serializes it into its
  object store (a copy) and the consumer reads it from there (zero-copy from the store).

    python benchmarks/bench_ray.py                       # 1MiB,64MiB,1GiB; GPU cases where possible
    python benchmarks/bench_ray.py --quick               # 1MiB,64MiB, 5 samples
    python benchmarks/bench_ray.py --host-only --sizes 1MiB,64MiB --repeat 20 --json ray.json

Needs ray>=2.60 (``pip install 'arrow_ipc_bridge[ray]'``) and numpy; torch for the GPU cases.
Prints a line per case as it ends (stderr) and a table at the end (stdout).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import ray

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.integrations import ray as aib_ray

_rdt: Any = __import__("ray.experimental.rdt", fromlist=["rdt"])

_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}

# Before the actor classes: @ray.method checks a transport's name when it decorates.
aib_ray.register()


class Nothing:
    """What the floor transport carries: nothing but the fact that it was returned."""


class FloorTransport(_rdt.TensorTransportManager):  # type: ignore[misc]
    """A Ray transport that moves nothing: the cost of Ray's transport machinery itself (the owner
    learning the metadata, the receive task it sends the consumer), which every transport pays
    (Ray's CUDA_IPC too) before it moves a byte."""

    @property
    def tensor_transport_backend(self) -> str:
        return FLOOR

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        return True

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> Any:
        return _rdt.TensorTransportMetadata(
            tensor_meta=[((), "nothing") for _ in rdt_object], tensor_device="cpu"
        )

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any, backend: str | None = None) -> Any:
        return _rdt.CommunicatorMetadata()

    def recv_multiple_tensors(
        self, obj_id: str, meta: Any, communicator: Any, target_buffers: Any = None
    ) -> Any:
        return [Nothing() for _ in meta.tensor_meta]

    def send_multiple_tensors(self, tensors: Any, meta: Any, communicator: Any) -> None:
        raise NotImplementedError

    def garbage_collect(self, obj_id: str, meta: Any, tensors: Any) -> None:
        return None

    def abort_transport(self, obj_id: str, communicator: Any) -> None:
        return None


FLOOR = "BENCH_NOTHING"
_rdt.register_tensor_transport(FLOOR, ["cpu", "cuda"], FloorTransport, Nothing)


def parse_size(text: str) -> int:
    lowered = text.strip().lower()
    for unit, factor in _UNITS.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


def size_label(nbytes: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


# --- host ----------------------------------------------------------------------------------------------


def shared_table(nbytes: int, columns: int) -> tuple[pa.Table, list[Any]]:
    """``columns`` float64 columns in ``allocate_shared`` memory (kept alive by the returned list)."""
    rows = max(1, nbytes // (8 * columns))
    keep, arrays = [], []
    for i in range(columns):
        buffer = aib.allocate_shared(rows * 8, name=f"bench-ray-{i}")
        np.frombuffer(buffer.view(), dtype=np.float64)[:] = np.arange(rows, dtype=np.float64) + i
        arrays.append(pa.Array.from_buffers(pa.float64(), rows, [None, buffer.as_pyarrow()]))
        keep.append(buffer)
    return pa.table({f"c{i}": array for i, array in enumerate(arrays)}), keep


def heap_table(nbytes: int, columns: int) -> pa.Table:
    rows = max(1, nbytes // (8 * columns))
    return pa.table({f"c{i}": np.arange(rows, dtype=np.float64) + i for i in range(columns)})


@ray.remote(enable_tensor_transport=True)
class HostProducer:
    def __init__(self, nbytes: int, columns: int) -> None:
        self.shared, self._keep = shared_table(nbytes, columns)
        self.heap = heap_table(nbytes, columns)

    def nothing(self) -> None:
        return None

    @ray.method(tensor_transport=FLOOR)
    def floor(self) -> Nothing:
        return Nothing()

    @ray.method(tensor_transport=aib_ray.TRANSPORT)
    def bridge_shared(self) -> Any:
        return aib_ray.ArrowPayload(self.shared, copy="never")

    @ray.method(tensor_transport=aib_ray.TRANSPORT)
    def bridge_heap(self) -> Any:
        return aib_ray.ArrowPayload(self.heap)

    def object_store(self) -> pa.Table:
        return self.heap

    def transport_stats(self) -> Any:
        return aib_ray.stats()


@ray.remote(enable_tensor_transport=True)
class HostConsumer:
    def nothing(self, value: Any) -> None:
        return None

    def take(self, value: Any) -> float:
        table = pa.table(value)
        last = float(table.column(table.num_columns - 1)[table.num_rows - 1].as_py())
        if isinstance(value, aib_ray.ArrowPayload):
            value.release()
        return last

    def stats(self) -> dict[str, Any]:
        return {"transport": aib_ray.stats().__dict__, "session": aib.stats().session.__dict__}


# --- GPU -----------------------------------------------------------------------------------------------


@ray.remote(enable_tensor_transport=True)
class GpuProducer:
    def __init__(self, nbytes: int, columns: int) -> None:
        import torch

        rows = max(1, nbytes // (4 * columns))
        self.tensors = [torch.arange(rows, dtype=torch.float32, device="cuda") + i for i in range(columns)]
        self.names = {f"c{i}": tensor for i, tensor in enumerate(self.tensors)}
        torch.cuda.synchronize()

    def nothing(self) -> None:
        return None

    @ray.method(tensor_transport=FLOOR)
    def floor(self) -> Nothing:
        return Nothing()

    @ray.method(tensor_transport=aib_ray.TRANSPORT)
    def bridge(self) -> Any:
        return aib_ray.ArrowPayload(aib.from_cuda_arrays(self.names))

    def tensors_list(self) -> Any:
        # Ray's CUDA_IPC transport is chosen per call (.options): it exists only where torch imports.
        return self.tensors

    def transport_stats(self) -> Any:
        return aib_ray.stats()


@ray.remote(enable_tensor_transport=True)
class GpuConsumer:
    def nothing(self, value: Any) -> None:
        return None

    def take(self, value: Any) -> float:
        if isinstance(value, aib_ray.ArrowPayload):
            tensors = list(aib.column_arrays(value.data, "torch").values())
        else:
            tensors = value
        last = float(tensors[-1][-1].item())  # waits for the data (the producer's event included)
        del tensors
        if isinstance(value, aib_ray.ArrowPayload):
            value.release()
        return last

    def stats(self) -> dict[str, Any]:
        return {"transport": aib_ray.stats().__dict__, "session": aib.stats().session.__dict__}


# --- the run -------------------------------------------------------------------------------------------


def time_case(
    make: Callable[[], Any], consumer: Any, expected: float, warmup: int, repeat: int
) -> list[float]:
    samples = []
    for i in range(warmup + repeat):
        started = time.perf_counter()
        ref = make()
        got = ray.get(consumer.take.remote(ref) if expected is not None else consumer.nothing.remote(ref))
        elapsed = time.perf_counter() - started
        del ref
        if expected is not None and got != expected:
            raise SystemExit(f"wrong value read: {got} instead of {expected}")
        if i >= warmup:
            samples.append(elapsed)
    return samples


def summarize(device: str, nbytes: int, case: str, samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    row = {
        "device": device,
        "size": size_label(nbytes),
        "size_bytes": nbytes,
        "case": case,
        "n": len(samples),
        "median_s": statistics.median(samples),
        "p90_s": p90,
        "min_s": ordered[0],
        "samples_s": samples,
    }
    print(
        f"bench_ray: {device} {row['size']} {case}: median {fmt(row['median_s'])}, p90 {fmt(p90)}",
        file=sys.stderr,
    )
    return row


def run_pair(
    device: str,
    producer: Any,
    consumer: Any,
    cases: list[tuple[str, Any]],
    *,
    nbytes: int,
    expected: float,
    warmup: int,
    repeat: int,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The floors, then each case, between one producer and one consumer (killed at the end)."""
    try:
        results = []
        for case, make, value in (
            ("ray task floor", producer.nothing.remote, None),
            ("ray RDT floor", producer.floor.remote, None),
            *((case, make, expected) for case, make in cases),
        ):
            results.append(summarize(device, nbytes, case, time_case(make, consumer, value, warmup, repeat)))
        counters = {
            "producer": ray.get(producer.transport_stats.remote()).__dict__,
            "consumer": ray.get(consumer.stats.remote()),
        }
        return results, counters
    finally:
        ray.kill(producer)
        ray.kill(consumer)


def run_host(
    nbytes: int, columns: int, warmup: int, repeat: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    producer = HostProducer.remote(nbytes, columns)
    cases = [
        ("bridge transport, shared", producer.bridge_shared.remote),
        ("bridge transport, heap", producer.bridge_heap.remote),
        ("ray object store", producer.object_store.remote),
    ]
    rows = max(1, nbytes // (8 * columns))
    expected = float(rows - 1 + columns - 1)
    return run_pair(
        "host",
        producer,
        HostConsumer.remote(),
        cases,
        nbytes=nbytes,
        expected=expected,
        warmup=warmup,
        repeat=repeat,
    )


def run_gpu(
    nbytes: int, columns: int, warmup: int, repeat: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    producer = GpuProducer.options(num_gpus=0.5).remote(nbytes, columns)
    cases = [
        ("bridge transport", producer.bridge.remote),
        ("ray CUDA_IPC", producer.tensors_list.options(tensor_transport="CUDA_IPC").remote),
        ("ray object store", producer.tensors_list.remote),
    ]
    rows = max(1, nbytes // (4 * columns))
    expected = float(np.float32(rows - 1) + np.float32(columns - 1))  # as torch adds, in float32
    consumer = GpuConsumer.options(num_gpus=0.5).remote()
    return run_pair(
        "cuda", producer, consumer, cases, nbytes=nbytes, expected=expected, warmup=warmup, repeat=repeat
    )


def gpu_unavailable() -> str | None:
    """Why the GPU cases cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    if not ray.cluster_resources().get("GPU"):
        return "the Ray cluster sees no GPU"
    return None


def machine() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(__file__),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "gpu": gpu,
        "versions": {
            "arrow_ipc_bridge": aib.__version__,
            "ray": ray.__version__,
            "pyarrow": pa.__version__,
            "torch": torch_version,
            "python": platform.python_version(),
        },
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    bridge = {
        (row["device"], row["size"]): row["median_s"]
        for row in rows
        if row["case"] in ("bridge transport", "bridge transport, shared")
    }
    header = f"{'device':<6} {'size':>7}  {'case':<26} {'median':>10} {'p90':>10} {'min':>10}  vs bridge"
    print(header)
    print("-" * len(header))
    for row in rows:
        base = bridge.get((row["device"], row["size"]))
        ratio = f"{row['median_s'] / base:.2f}x" if base else ""
        print(
            f"{row['device']:<6} {row['size']:>7}  {row['case']:<26} {fmt(row['median_s']):>10} "
            f"{fmt(row['p90_s']):>10} {fmt(row['min_s']):>10}  {ratio}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=None, help="total bytes of all columns, e.g. 1MiB,64MiB,1GiB")
    parser.add_argument("--columns", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=None, help="timed samples per case (default 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="sizes 1MiB,64MiB and 5 samples")
    parser.add_argument("--host-only", action="store_true", help="skip the GPU cases")
    parser.add_argument("--json", metavar="PATH", help="also write every number and raw sample here")
    args = parser.parse_args()
    sizes = [
        parse_size(s) for s in (args.sizes or ("1MiB,64MiB" if args.quick else "1MiB,64MiB,1GiB")).split(",")
    ]
    repeat = args.repeat if args.repeat is not None else (5 if args.quick else 10)
    if args.columns < 1 or repeat < 1 or args.warmup < 0 or any(size < 8 * args.columns for size in sizes):
        parser.error(
            "--columns and --repeat must be >= 1, --warmup >= 0, every size at least 8 bytes a column"
        )

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        rows: list[dict[str, Any]] = []
        counters: dict[str, Any] = {}
        skipped: list[str] = []
        why_not_gpu = "--host-only" if args.host_only else gpu_unavailable()
        for nbytes in sizes:
            if why_not_gpu is None:
                found, counters[f"cuda {size_label(nbytes)}"] = run_gpu(
                    nbytes, args.columns, args.warmup, repeat
                )
                rows.extend(found)
            found, counters[f"host {size_label(nbytes)}"] = run_host(
                nbytes, args.columns, args.warmup, repeat
            )
            rows.extend(found)
        if why_not_gpu is not None:
            skipped.append(f"GPU cases: {why_not_gpu}")
        print_table(rows)
        for line in skipped:
            print(f"skipped {line}")
        if args.json:
            report = {
                "schema": "arrow_ipc_bridge.bench_ray/1",
                "machine": machine(),
                "settings": {
                    "sizes_bytes": sizes,
                    "columns": args.columns,
                    "repeat": repeat,
                    "warmup": args.warmup,
                },
                "results": rows,
                "counters": counters,
                "skipped": skipped,
            }
            with open(args.json, "w") as out:
                json.dump(report, out, indent=1)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
