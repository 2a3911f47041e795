"""Imported CUDA columns as CuPy arrays and PyTorch tensors (marker: gpu): column_arrays in one
call, versioned and legacy DLPack through cupy.from_dlpack / torch.from_dlpack, the stream
argument, and the producer's event honoured before a consumer's stream reads.

Run by scripts/gpu-check.sh on a machine with an NVIDIA GPU; every test here skips with the reason
elsewhere. Producer and consumer share this process (the same-process CUDA path: regions and events
resolved from the producer's own export records).
"""

from __future__ import annotations

import ctypes
import gc
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import _ffi
from arrow_ipc_bridge.runtime import reaper

pytestmark = pytest.mark.gpu

DTYPES = [
    *("int8", "int16", "int32", "int64"),
    *("uint8", "uint16", "uint32", "uint64"),
    *("float16", "float32", "float64"),
]
# About 0.3 s of GPU time at the clock rates of current GPUs: long enough that a consumer stream
# which did not wait for the producer's event would certainly read before the writes.
_SPIN_CYCLES = 500_000_000


@pytest.fixture
def cupy(cuda_device: int) -> Any:
    return pytest.importorskip("cupy")


@pytest.fixture
def torch(cuda_device: int) -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch was built without CUDA")
    return torch


@pytest.fixture
def publisher(cuda_device: int) -> Iterator[aib.Publisher]:
    path = os.path.join(tempfile.mkdtemp(dir="/tmp"), "columns.sock")
    with aib.Publisher(path) as pub:
        yield pub


def _slow_fill(cupy: Any, out: Any, value: float, stream: Any) -> None:
    """On ``stream``: spin ~0.3 s, then write ``value`` into every element of the float32 ``out``."""
    kernel = cupy.RawKernel(
        r"""
        extern "C" __global__ void slow_fill(long long cycles, float *out, long long n, float value) {
            long long start = clock64();
            while (clock64() - start < cycles) {}
            for (long long i = threadIdx.x; i < n; i += blockDim.x) out[i] = value;
        }
        """,
        "slow_fill",
    )
    with stream:
        kernel((1,), (256,), (cupy.int64(_SPIN_CYCLES), out, cupy.int64(out.size), cupy.float32(value)))


def _publish_slowly_written(cupy: Any, publisher: aib.Publisher, n: int = 1 << 16) -> Any:
    """Publish column "x" (float32, all 7.0 once written) while the producer's kernel still runs: the
    arrays announce their stream (``__cuda_array_interface__`` v3), so the export carries an event.
    Returns a CuPy event recorded after the kernel (``.done`` says whether it still runs)."""
    producer_stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(n, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    _slow_fill(cupy, x, 7.0, producer_stream)
    kernel_done = cupy.cuda.Event()
    kernel_done.record(producer_stream)
    with producer_stream:
        publisher.publish("slow", aib.from_cuda_arrays({"x": x}))
    return kernel_done


def _versioned_flags(capsule: object) -> tuple[int, int, int]:
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address = get_pointer(capsule, b"dltensor_versioned")
    major, minor = (ctypes.c_uint32 * 2).from_address(address)
    flags = ctypes.c_uint64.from_address(address + 24).value  # after version, manager_ctx, deleter
    return int(major), int(minor), int(flags)


def test_cupy_arrays_of_every_numeric_type_in_one_call(publisher: aib.Publisher, cupy: Any) -> None:
    """column_arrays(like="cupy") gives every column at the producer's memory with its dtype and values."""
    columns = {name: cupy.arange(100).astype(name) for name in DTYPES}
    publisher.publish("all", aib.from_cuda_arrays(columns))
    with aib.connect(publisher.path, timeout=30.0) as session, session.get("all") as imported:
        arrays = aib.column_arrays(imported, "cupy")
        assert list(arrays) == DTYPES
        for name, array in arrays.items():
            assert array.dtype == cupy.dtype(name)
            assert array.data.ptr == columns[name].data.ptr  # zero-copy
            assert bool((array == columns[name]).all()), name
        del arrays


def test_cupy_arrays_hold_the_lease(publisher: aib.Publisher, cupy: Any) -> None:
    """The arrays keep the batch (and the producer's lease) after the imported object is released;
    the lease ends with the last array."""
    values = cupy.arange(1000, dtype=cupy.float64)
    publisher.publish("v", aib.from_cuda_arrays({"a": values, "b": values * 2}))
    with aib.connect(publisher.path, timeout=30.0) as session:
        imported = session.get("v")
        arrays = aib.column_arrays(imported, "cupy")
        imported.release()
        del imported
        gc.collect()
        reaper.settle()
        assert publisher.active_leases == 1
        assert float(arrays["b"].sum()) == 2 * float(values.sum())
        del arrays
        gc.collect()
        assert wait_for(lambda: (reaper.drain(), publisher.active_leases == 0)[1], 5.0)


def test_torch_tensors_in_one_call(publisher: aib.Publisher, cupy: Any, torch: Any) -> None:
    """column_arrays(like="torch") gives CUDA tensors over the producer's memory."""
    values = cupy.arange(512, dtype=cupy.float32)
    publisher.publish("t", aib.from_cuda_arrays({"x": values, "y": values.astype(cupy.int64)}))
    with aib.connect(publisher.path, timeout=30.0) as session, session.get("t") as imported:
        tensors = aib.column_arrays(imported, torch)
        assert tensors["x"].device.type == "cuda"
        assert tensors["x"].data_ptr() == values.data.ptr
        assert tensors["y"].dtype == torch.int64
        assert float(tensors["x"].sum()) == float(values.sum())
        del tensors


def test_tables_on_the_gpu_give_each_batch(cupy: Any) -> None:
    """An imported CUDA table (several batches) gives each batch's columns with batch=."""
    import pyarrow as pa

    table = pa.Table.from_batches([pa.record_batch({"x": pa.array([float(i)] * 4)}) for i in range(3)])
    gpu = aib.to_device(table)
    try:
        for i in range(3):
            assert aib.column_arrays(gpu, "cupy", batch=i)["x"].tolist() == [float(i)] * 4
            assert cupy.from_dlpack(aib.column_view(gpu, "x", batch=i)).tolist() == [float(i)] * 4
    finally:
        gpu.release()


def test_versioned_and_legacy_capsules_on_the_gpu(publisher: aib.Publisher, cupy: Any) -> None:
    """CUDA views give DLPack 1.0 capsules (not read-only: device memory is writable) or legacy ones;
    CuPy and PyTorch take them at the producer's memory; a foreign device or a copy is refused."""
    values = cupy.arange(256, dtype=cupy.float32)
    publisher.publish("d", aib.from_cuda_arrays({"x": values}))
    with aib.connect(publisher.path, timeout=30.0) as session, session.get("d") as imported:
        view = aib.column_view(imported, "x")
        assert view.__dlpack_device__() == (2, 0)
        versioned = view.__dlpack__(max_version=(1, 0), stream=-1)
        assert _ffi.capsule_name(versioned) == b"dltensor_versioned"
        assert _versioned_flags(versioned) == (1, 0, 0)
        assert _ffi.capsule_name(view.__dlpack__(stream=-1)) == b"dltensor"
        with pytest.raises(BufferError, match="never"):
            view.__dlpack__(dl_device=(1, 0))
        with pytest.raises(BufferError, match="never copy"):
            view.__dlpack__(copy=True)
        array = cupy.from_dlpack(view)
        assert array.data.ptr == values.data.ptr
        assert bool((array == values).all())
        torch = pytest.importorskip("torch")
        tensor = torch.from_dlpack(view)
        assert tensor.data_ptr() == values.data.ptr
        assert float(tensor.sum()) == float(values.sum())


def test_column_arrays_make_the_consumer_stream_wait(publisher: aib.Publisher, cupy: Any) -> None:
    """While the producer's kernel still writes, column_arrays(stream=s) makes s wait for the
    producer's event (no host wait): a copy made on s sees the finished values."""
    kernel_done = _publish_slowly_written(cupy, publisher)
    before = aib.stats().cuda.sync_events_pending
    consumer_stream = cupy.cuda.Stream(non_blocking=True)
    with aib.connect(publisher.path, timeout=30.0) as session, session.get("slow") as imported:
        running = not kernel_done.done
        arrays = aib.column_arrays(imported, "cupy", stream=consumer_stream.ptr)
        # compute-sanitizer serialises kernels: then nothing is pending and only the values are checked
        if running:
            assert aib.stats().cuda.sync_events_pending > before  # the event was pending when read
        with consumer_stream:
            seen = arrays["x"].copy()
        consumer_stream.synchronize()
        assert bool((seen == 7.0).all())
        del arrays


def test_column_arrays_wait_on_the_current_stream_by_default(publisher: aib.Publisher, cupy: Any) -> None:
    """Without stream=, the library's current stream is the one that waits."""
    _publish_slowly_written(cupy, publisher)
    consumer_stream = cupy.cuda.Stream(non_blocking=True)
    with (
        aib.connect(publisher.path, timeout=30.0) as session,
        session.get("slow") as imported,
        consumer_stream,
    ):
        arrays = aib.column_arrays(imported, "cupy")
        seen = arrays["x"].copy()
        consumer_stream.synchronize()
        assert bool((seen == 7.0).all())
        del arrays


def test_torch_tensors_wait_on_torch_current_stream(publisher: aib.Publisher, cupy: Any, torch: Any) -> None:
    """column_arrays(like="torch") makes PyTorch's current stream wait for the producer's event."""
    _publish_slowly_written(cupy, publisher)
    consumer_stream = torch.cuda.Stream()
    with (
        aib.connect(publisher.path, timeout=30.0) as session,
        session.get("slow") as imported,
        torch.cuda.stream(consumer_stream),
    ):
        tensors = aib.column_arrays(imported, "torch")
        seen = tensors["x"].clone()
        consumer_stream.synchronize()
        assert bool((seen == 7.0).all())
        del tensors


def test_dlpack_stream_argument_waits_for_the_producer(publisher: aib.Publisher, cupy: Any) -> None:
    """A view made without a host wait (column_view(stream=...)) hands its capsule to cupy.from_dlpack,
    which passes its current stream to __dlpack__: that stream waits for the producer's event too."""
    _publish_slowly_written(cupy, publisher)
    side = cupy.cuda.Stream(non_blocking=True)
    consumer_stream = cupy.cuda.Stream(non_blocking=True)
    with aib.connect(publisher.path, timeout=30.0) as session, session.get("slow") as imported:
        view = aib.column_view(imported, "x", stream=side.ptr)  # only `side` waits here
        with consumer_stream:
            seen = cupy.from_dlpack(view).copy()
        consumer_stream.synchronize()
        assert bool((seen == 7.0).all())


class _StepConsumer:
    """A step loop's consumer child (spawn), ``target(socket_path, conn, *args)``, talking over a
    pipe: :meth:`answer` is its next message, :meth:`stop` ends it and gives its exit code."""

    def __init__(self, target: Any, socket_path: str, *args: Any) -> None:
        import multiprocessing as mp

        context = mp.get_context("spawn")
        self.parent, child = context.Pipe()
        self.process = context.Process(target=target, args=(socket_path, child, *args))
        self.process.start()

    def answer(self) -> Any:
        deadline = time.monotonic() + 60
        while not self.parent.poll(0.2):
            assert self.process.is_alive(), (
                f"the consumer exited with {self.process.exitcode} (its traceback is above)"
            )
            assert time.monotonic() < deadline, "the consumer did not answer"
        return self.parent.recv()

    def stop(self) -> int | None:
        self.parent.close()  # a consumer still waiting for the parent reads the end of the pipe and exits
        self.process.join(60)
        if self.process.is_alive():
            self.process.kill()
        return self.process.exitcode


@pytest.mark.parametrize("hold_every", [0, 2])
def test_a_standing_lease_consumer_gets_its_cupy_arrays_again_with_each_step_values(
    publisher: aib.Publisher, cupy: Any, hold_every: int
) -> None:
    """A step loop across processes: the producer updates 16 columns in place and publishes each
    step; the consumer (standing leases) reads every step's values through column_arrays. Arrays it
    let go of are handed out again (consumer/array_cache.py), arrays it still holds are not, and every step
    reads that step's values either way."""
    from helpers import gpu_children

    steps, columns = 30, {f"c{i}": cupy.zeros(4096, dtype=cupy.float32) for i in range(16)}
    publisher.publish("t", aib.from_cuda_arrays(columns))
    consumer = _StepConsumer(gpu_children.cupy_step_consumer, str(publisher.path), steps, hold_every)
    try:
        for step in range(steps):
            for column in columns.values():
                cupy.add(column, 1, out=column)  # in place; the publish's event orders the reads
            publisher.publish("t", aib.from_cuda_arrays(columns))
            consumer.parent.send("go")
            assert consumer.answer() == step
        result = consumer.answer()
    finally:
        exitcode = consumer.stop()
    assert exitcode == 0
    assert result["read"] == [[float(step + 1)] * 16 for step in range(steps)]
    assert result["local_gets"] >= steps - 3
    if hold_every == 0:  # the first two gets are not remembered yet, the third makes the arrays
        assert result["reused"] >= steps - 4
    else:  # a held step's arrays are new, and the step after it makes new ones again
        assert 0 < result["reused"] < steps // 2 + 1


def test_a_get_next_step_loop_sleeps_on_the_board_and_gets_locally(
    publisher: aib.Publisher, cupy: Any
) -> None:
    """A step loop across processes where the consumer waits with get_next instead of a message:
    the producer updates 16 columns in place and publishes once the consumer took the last step;
    the consumer (standing leases) sleeps on the version board, is woken by the publish, gets the
    name locally and reads that step's values. It sends two WAITs only: its first get (wait=0) and
    its first get_next, whose answer, the same message again, makes the name a board candidate."""
    from helpers import gpu_children

    steps, columns = 40, {f"c{i}": cupy.zeros(4096, dtype=cupy.float32) for i in range(16)}
    publisher.publish("t", aib.from_cuda_arrays(columns))
    consumer = _StepConsumer(gpu_children.get_next_step_consumer, str(publisher.path), steps)
    try:
        assert consumer.answer() == "ready"
        for step in range(1, steps + 1):
            for column in columns.values():
                cupy.add(column, 1, out=column)  # in place; the publish's event orders the reads
            publisher.publish("t", aib.from_cuda_arrays(columns))
            assert consumer.answer() == float(step)
        counts = consumer.answer()
    finally:
        exitcode = consumer.stop()
    assert exitcode == 0
    assert counts["waits_sent"] == 2  # the first get's and the first get_next's; then the board
    assert counts["board_waits"] >= steps // 2  # (a publish may beat a get_next to its sleep)
    assert counts["local_gets"] >= steps - 3
