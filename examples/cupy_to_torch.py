"""GPU: a CuPy producer to a PyTorch consumer, zero-copy, through CUDA IPC and DLPack.

The producer (this process) computes two columns with CuPy, wraps them as an Arrow record batch
with ``aib.from_cuda_arrays`` (no copy; the stream CuPy wrote on becomes the batch's sync event)
and publishes it. The consumer (a spawned child that imports PyTorch, not CuPy) gets it and turns
every numeric column into a ``torch.Tensor`` with ``aib.column_arrays(imported, "torch")``: the
tensors point at the producer's GPU memory, opened through a CUDA IPC handle; PyTorch's current
stream waits on the producer's event (a stream wait, never a host wait) before it reads.
``aib.column_view(imported, "x")`` does the same for one column (``torch.from_dlpack(view)``).

Needs a CUDA GPU, ``cupy`` (``pip install arrow_ipc_bridge[cuda12]``) and PyTorch with CUDA.

Run: ``python examples/cupy_to_torch.py``
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile

import arrow_ipc_bridge as aib

ROWS = 1 << 20


def consumer(path: str) -> None:
    """Get "features" and reduce its columns with PyTorch on the GPU."""
    import torch

    with aib.connect(path, timeout=30.0) as session, session.get("features") as imported:
        tensors = aib.column_arrays(imported, "torch")  # {"x": tensor, "y": tensor}, zero-copy
        x, y = tensors["x"], tensors["y"]
        print(
            f"consumer: tensors on {x.device}: x {x.dtype} {tuple(x.shape)}, y {y.dtype} {tuple(y.shape)}",
            flush=True,
        )
        x_sum = int(torch.sum(x).item())  # .item() waits for the GPU work
        y_sum = float(torch.sum(y).item())
        print(f"consumer: sum(x) {x_sum}, sum(y) {y_sum:.1f}", flush=True)
        del tensors, x, y  # each tensor holds the imported batch (and the producer's lease) alive


def main() -> int:
    import cupy

    directory = tempfile.mkdtemp(prefix="aib-example-")
    path = os.path.join(directory, "publisher.sock")
    x = cupy.arange(ROWS, dtype=cupy.int64)
    y = cupy.arange(ROWS, dtype=cupy.float64) * 0.5  # exact in float64: the sums can be compared
    try:
        with aib.Publisher(path) as publisher:
            stats = publisher.publish("features", aib.from_cuda_arrays({"x": x, "y": y}))
            print(
                f"producer: published {ROWS} rows on GPU {x.device.id}, {stats.copied_bytes} bytes copied",
                flush=True,
            )
            child = multiprocessing.get_context("spawn").Process(target=consumer, args=(path,), daemon=True)
            child.start()
            child.join(timeout=120)
            if child.is_alive():
                child.terminate()
                child.join()
            if child.exitcode != 0:
                print(f"producer: the consumer failed (exit code {child.exitcode})", file=sys.stderr)
                return 1
            print(
                f"producer: expected sum(x) {ROWS * (ROWS - 1) // 2}, sum(y) {ROWS * (ROWS - 1) / 4:.1f}",
                flush=True,
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
