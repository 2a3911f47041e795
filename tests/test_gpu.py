"""The GPU path across processes: CUDA regions, sync events, device-aware import (marker: gpu).

Run by scripts/gpu-check.sh on a machine with an NVIDIA GPU; every test here skips with the reason
elsewhere. Child processes are spawned (never forked after CUDA init), joined with timeouts, and
their exit codes asserted.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pyarrow as pa
import pytest
from helpers import cuda_helpers
from helpers.arrow_equality import assert_arrays_equal
from helpers.arrow_types import TYPE_KINDS
from helpers.arrow_values import arrow_arrays
from helpers.counting import SessionCounts
from hypothesis import HealthCheck, given, settings

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.gpu
_CTX = mp.get_context("spawn")
# IPC (how the child sends data back) cannot carry dictionaries of extension values; extension
# types are covered by the host-memory suites, and the device path does not look at types.
_GPU_KINDS = TYPE_KINDS - {"extension", "uuid", "opaque", "bool8", "json"}


def _socket_path() -> str:
    return os.path.join(tempfile.mkdtemp(dir="/tmp"), "gpu.sock")


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(data).read_all()


def _join(process: Any, timeout: float = 60) -> None:
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(5)
        pytest.fail("child process did not finish in time")
    assert process.exitcode == 0, f"child exited with {process.exitcode}"


@pytest.fixture
def cupy(cuda_device: int) -> Any:
    return pytest.importorskip("cupy")


@pytest.fixture
def gpu_publisher(cuda_device: int) -> Iterator[aib.Publisher]:
    """A publisher in this process, for tests that need a GPU (skips without one; conftest.py's
    ``publisher`` does not)."""
    with aib.Publisher(_socket_path()) as pub:
        yield pub


@pytest.fixture
def consumer(gpu_publisher: aib.Publisher) -> Iterator[Any]:
    """A consumer process serving get + to_host requests for names the test publishes."""
    from helpers import gpu_children

    parent, child = _CTX.Pipe()
    process = _CTX.Process(target=gpu_children.consumer_loop, args=(str(gpu_publisher.path), child))
    process.start()

    def fetch(name: str) -> tuple[pa.Table, int]:
        parent.send(name)
        assert parent.poll(60), "consumer did not answer"
        status, payload, device_id, remembered = parent.recv()
        assert status == "ok", payload
        fetch.remembered_gets = remembered  # type: ignore[attr-defined]
        return _from_ipc(payload), device_id

    yield fetch
    parent.send(None)
    _join(process)


def _start_cupy_producer(rows: int) -> tuple[str, Any, Any]:
    """A producer process publishing CuPy columns ("cupy") and a pool-backed batch ("pool"), ready."""
    from helpers import gpu_children

    path = _socket_path()
    parent, child = _CTX.Pipe()
    producer = _CTX.Process(target=gpu_children.cupy_producer, args=(path, child, rows))
    producer.start()
    assert parent.poll(120), "producer did not start"
    assert parent.recv()[0] == "ready"
    return path, parent, producer


def _as_table(obj: pa.Array | pa.RecordBatch | pa.Table) -> pa.Table:
    if isinstance(obj, pa.Table):
        return obj
    if isinstance(obj, pa.RecordBatch):
        return pa.Table.from_batches([obj])
    return pa.table({"value": obj})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrow_arrays(allow=_GPU_KINDS, max_depth=2))
def test_any_array_moves_across_processes_on_the_gpu(
    gpu_publisher: aib.Publisher, consumer: Any, arr: pa.Array
) -> None:
    """All Arrow types: uploaded with to_device (IPC pool regions), imported in another process
    on the same GPU (device_id from the UUID), copied back: equal to the original."""
    gpu_publisher.publish("x", aib.to_device(pa.record_batch({"value": arr})))
    table, device_id = consumer("x")
    assert device_id == 0
    assert_arrays_equal(table.column(0), arr)


def test_tables_with_many_batches(gpu_publisher: aib.Publisher, consumer: Any) -> None:
    """A table of 20 batches uploaded to the GPU comes back equal through a device stream."""
    batch = pa.record_batch({"s": pa.array(["a", None, "ccc"] * 10), "v": pa.array(range(30))})
    table = pa.Table.from_batches([batch] * 20)
    gpu_publisher.publish("t", aib.to_device(table))
    again, _ = consumer("t")
    assert again.equals(table)


def test_to_device_legacy_allocation_is_remembered(gpu_publisher: aib.Publisher, consumer: Any) -> None:
    """to_device(allocation="legacy") uploads into cuMemAlloc memory: one legacy-handle region, read
    right in another process, whose re-gets are remembered (imported by the C core) from the
    second get on; the default pool upload from the third (its second get keeps a lease, see
    test_pool_data_is_kept_with_a_lease_from_its_second_get). A bad allocation name is refused."""
    table = pa.table(
        {
            "s": pa.array(["a", None, "ccc"] * 10),
            "l": pa.array([[1, 2], None, [3]] * 10, pa.list_(pa.int32())),
            "v": pa.array(range(30)),
        }
    )
    stats = gpu_publisher.publish("legacy", aib.to_device(table, allocation="legacy"))
    assert stats.regions == 1
    assert stats.copied_bytes == 0
    gpu_publisher.publish("pool", aib.to_device(table))
    gets = (("legacy", 0), ("legacy", 1), ("legacy", 2), ("pool", 2), ("pool", 2), ("pool", 3))
    for name, remembered in gets:
        again, device_id = consumer(name)
        assert again.equals(table)
        assert device_id == 0
        assert consumer.remembered_gets == remembered
    with pytest.raises(ValueError, match="allocation"):
        aib.to_device(table, allocation="managed")  # type: ignore[arg-type]


def _wait_for(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(0.005)
    return True


class _LingerConsumer:
    """A consumer process (gpu_children.consumer_loop) with its own pool_linger."""

    def __init__(self, path: str, pool_linger: float) -> None:
        from helpers import gpu_children

        self.parent, child = _CTX.Pipe()
        self.process = _CTX.Process(target=gpu_children.consumer_loop, args=(path, child, pool_linger))
        self.process.start()

    def get(self, name: str) -> tuple[pa.Table, int]:
        """The table got as ``name`` and the session's remembered-get count after it."""
        self.parent.send(name)
        assert self.parent.poll(60), "consumer did not answer"
        status, payload, _, remembered = self.parent.recv()
        assert status == "ok", payload
        return _from_ipc(payload), remembered

    def forget(self, name: str | None) -> tuple[int, int]:
        """(messages forgotten, pool pointers still imported in the consumer)."""
        self.parent.send(("forget", name))
        assert self.parent.poll(60), "consumer did not answer"
        status, forgotten, pointers = self.parent.recv()
        assert status == "ok"
        return forgotten, pointers

    def stats(self) -> dict[str, int]:
        """The consumer process's cuda.cuda_stats()."""
        self.parent.send(("stats",))
        assert self.parent.poll(60), "consumer did not answer"
        status, stats = self.parent.recv()
        assert status == "ok"
        return dict(stats)

    def stop(self) -> None:
        self.parent.send(None)
        _join(self.process)


def test_pool_data_is_kept_with_a_lease_from_its_second_get(gpu_publisher: aib.Publisher) -> None:
    """IPC-pool data got twice in a row under one name is remembered with one lease of its own: the
    third get on is imported by the C core (no pointer imports), the producer sees that one lease
    after the consumer released its own, and gets it back on forget(), when the name is got with
    other data, and pool_linger seconds after the last get. pool_linger=0 keeps nothing."""
    table = pa.table({"s": pa.array(["x", None, "zz"] * 50), "v": pa.array(range(150), pa.float32())})
    gpu_publisher.publish("pool", aib.to_device(table))
    consumer = _LingerConsumer(str(gpu_publisher.path), pool_linger=60.0)
    try:
        for remembered in (0, 0, 1, 2):
            got, count = consumer.get("pool")
            assert got.equals(table)
            assert count == remembered
        # the consumer's own leases ended; the remembered message keeps exactly one
        assert _wait_for(lambda: gpu_publisher.active_leases == 1, 5.0)
        time.sleep(0.3)
        assert gpu_publisher.active_leases == 1
        assert consumer.forget("pool") == (1, 0)  # imports freed, then the lease given back
        assert _wait_for(lambda: gpu_publisher.active_leases == 0, 5.0)
        assert consumer.get("pool")[1] == 2  # forgotten: imported by Python again

        # kept again, then the name is republished with other data: the old lease goes
        consumer.get("pool")
        assert consumer.get("pool")[1] == 3
        other = pa.table({"s": pa.array(["new"] * 7), "v": pa.array(range(7), pa.float32())})
        gpu_publisher.publish("pool", aib.to_device(other))
        assert consumer.get("pool")[0].equals(other)
        assert _wait_for(lambda: gpu_publisher.active_leases == 0, 5.0)
        assert consumer.forget(None) == (0, 0)
    finally:
        consumer.stop()

    lingering = _LingerConsumer(str(gpu_publisher.path), pool_linger=0.3)
    try:
        lingering.get("pool")
        lingering.get("pool")
        assert lingering.get("pool")[1] == 1  # kept since the second get
        assert _wait_for(lambda: gpu_publisher.active_leases == 0, 5.0), "the kept lease outlived pool_linger"
        assert lingering.forget(None) == (0, 0)
    finally:
        lingering.stop()

    keeping_none = _LingerConsumer(str(gpu_publisher.path), pool_linger=0.0)
    try:
        for _ in range(3):
            got, count = keeping_none.get("pool")
            assert got.equals(other)
            assert count == 0
            assert _wait_for(lambda: gpu_publisher.active_leases == 0, 5.0)
    finally:
        keeping_none.stop()


def test_pool_fd_goes_once_per_consumer_process(gpu_publisher: aib.Publisher) -> None:
    """A publisher's messages name IPC pools without attaching their fds: each consumer process
    asks for a pool's fd once (POOL_FD) and imports all later data of that pool with no descriptor.
    A message exported by hand still attaches the pool fd (or leaves it out when asked to)."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.wire.metadata import REGION_CUDA_POOL, Decoded

    table = pa.table({"s": pa.array(["ab", None, "c"] * 40), "v": pa.array(range(120), pa.float32())})
    on_device = aib.to_device(table)
    for pool_fds, n_fds in ((True, 1), (False, 0)):
        with aib.export(on_device, pool_fds=pool_fds) as exported:
            assert len(exported.fds) == n_fds
            decoded = Decoded(exported.message, len(exported.fds))
            try:
                regions = decoded.regions()
            finally:
                decoded.close()
            assert {r.kind for r in regions} == {REGION_CUDA_POOL}
            assert {r.fd_index for r in regions} == ({0} if pool_fds else {-1})

    served = cuda.cuda_stats()["pool_fds_served"]
    for i in range(3):
        gpu_publisher.publish(f"t{i}", aib.to_device(table))
    first = _LingerConsumer(str(gpu_publisher.path), pool_linger=0.0)
    second = _LingerConsumer(str(gpu_publisher.path), pool_linger=0.0)
    try:
        for i in range(3):
            assert first.get(f"t{i}")[0].equals(table)
        stats = first.stats()
        assert (stats["pool_fd_requests"], stats["pool_imports"]) == (1, 1)
        assert cuda.cuda_stats()["pool_fds_served"] == served + 1
        assert second.get("t2")[0].equals(table)
        assert second.stats()["pool_fd_requests"] == 1
        assert cuda.cuda_stats()["pool_fds_served"] == served + 2
    finally:
        first.stop()
        second.stop()


def test_new_arrays_in_kept_slabs_cost_the_consumer_no_import(
    gpu_publisher: aib.Publisher, cupy: Any
) -> None:
    """A producer whose CuPy arrays come from the slab allocator publishes new arrays under a new
    name every time: the regions are its kept slabs (flagged), the consumer imports a slab once and
    finds it open for every later message, which the C core imports (new bytes: the C new-message
    path; the same bytes as an earlier message, when the new arrays landed where the old ones were
    with the same event: the remembered path); no pointer import and no lease kept (pool_linger is
    0); every table reads right. Freed space is carved again: one slab holds them all."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.wire.metadata import REGION_CUDA_POOL, REGION_FLAG_KEPT, Decoded

    allocator = cuda.cupy_allocator(0, slab_size=8 << 20)
    consumer = _LingerConsumer(str(gpu_publisher.path), pool_linger=0.0)
    try:
        for i in range(8):
            with cupy.cuda.using_allocator(allocator):
                columns = {f"c{j}": cupy.full(5000, float(i * 10 + j), dtype=cupy.float32) for j in range(4)}
            data = aib.from_cuda_arrays(columns)
            if i == 0:
                with aib.export(data) as exported:
                    decoded = Decoded(exported.message, len(exported.fds))
                    try:
                        regions = decoded.regions()
                    finally:
                        decoded.close()
                assert [(r.kind, r.flags & REGION_FLAG_KEPT) for r in regions] == [
                    (REGION_CUDA_POOL, REGION_FLAG_KEPT)
                ]
            gpu_publisher.publish(f"slab{i}", data)
            del data, columns
            got, remembered = consumer.get(f"slab{i}")
            assert [got.column(f"c{j}").to_pylist() for j in range(4)] == [
                [float(i * 10 + j)] * 5000 for j in range(4)
            ]
            if i >= 1:
                gpu_publisher.unpublish(f"slab{i - 1}")
        stats = consumer.stats()
        assert stats["pool_pointer_imports"] == 1, stats  # one 8 MiB slab holds every table
        # Python imported the first message and found the slab open at most for the next few (a
        # new event handle on the way); the C core imported the rest.
        assert stats["pool_kept_hits"] <= 3, stats
        assert stats["new_message_gets"] + remembered >= 4, (stats, remembered)
        # the slab's import is held open in the region table (what the C core found it in)
        assert stats["kept_held"] == 1, stats
        assert _wait_for(lambda: gpu_publisher.active_leases == 0, 5.0)
        assert allocator.slabs.stats()["slabs"] == 1
    finally:
        consumer.stop()


def test_pools_that_come_and_go_are_imported_afresh(gpu_publisher: aib.Publisher, cupy: Any) -> None:
    """A producer that makes a new IPC pool for each publication and drops the old one (the driver
    may give the new pool the destroyed one's handle value): every publication reads right in the
    consumer, which imports each pool once (pools are named by a serial that is never reused) and
    keeps at most 16 imported pools."""
    from arrow_ipc_bridge import cuda

    consumer = _LingerConsumer(str(gpu_publisher.path), pool_linger=0.0)
    try:
        for i in range(24):
            allocator = cuda.cupy_allocator(0)  # a new pool every time
            with cupy.cuda.using_allocator(allocator):
                values = cupy.full(1000, float(i), dtype=cupy.float32)
            cupy.cuda.runtime.deviceSynchronize()
            gpu_publisher.publish("churn", aib.from_cuda_arrays({"v": values}))
            del values, allocator  # the publication holds the pool until it is replaced
            got = consumer.get("churn")[0]
            assert got.column("v").to_pylist() == [float(i)] * 1000
        stats = consumer.stats()
        assert stats["pool_imports"] == 24
        assert stats["pool_fd_requests"] == 24
        assert stats["pools_cached"] <= 16
    finally:
        consumer.stop()


def test_new_arrays_over_open_allocations_import_in_c(gpu_publisher: aib.Publisher, cupy: Any) -> None:
    """New CuPy arrays every round, which CuPy's pool carves out of allocations shared before:
    once those are open in the consumer, each new message is imported by its C core (no Python
    import path), reads right, and gives its lease back."""
    consumer = _LingerConsumer(str(gpu_publisher.path), pool_linger=0.0)
    try:
        for i in range(12):
            columns = {
                "a": cupy.full(1000, float(i), dtype=cupy.float32),
                "b": cupy.arange(i, 1000 + i, dtype=cupy.int64),
            }
            cupy.cuda.runtime.deviceSynchronize()
            gpu_publisher.publish("fresh", aib.from_cuda_arrays(columns))
            got = consumer.get("fresh")[0]
            assert got.column("a").to_pylist() == [float(i)] * 1000
            assert got.column("b").to_pylist() == list(range(i, 1000 + i))
            assert _wait_for(lambda: gpu_publisher.active_leases == 0, 5.0)
        stats = consumer.stats()
        assert stats["new_message_gets"] >= 6, stats
        # the allocations the C core found open are held in the region table, within its bound
        assert 1 <= stats["legacy_held"] <= 256, stats
    finally:
        consumer.stop()


class _OnlyDLPack:
    """A producer that speaks DLPack and nothing else (no ``__cuda_array_interface__``)."""

    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._tensor.__dlpack_device__()


def test_torch_and_dlpack_producers_are_columns(
    gpu_publisher: aib.Publisher, consumer: Any, cupy: Any
) -> None:
    """PyTorch tensors (``__cuda_array_interface__``) and a producer that only speaks DLPack are
    wrapped as Arrow columns without a copy and read right in another process."""
    torch = pytest.importorskip("torch")
    values = torch.arange(1000, dtype=torch.float32, device="cuda")
    doubled = values * 2
    torch.cuda.synchronize()
    batch = aib.from_cuda_arrays({"cai": values, "dlpack": _OnlyDLPack(doubled)})
    gpu_publisher.publish("torch", batch)
    table, _ = consumer("torch")
    assert table.column("cai").to_pylist() == [float(i) for i in range(1000)]
    assert table.column("dlpack").to_pylist() == [2.0 * i for i in range(1000)]


def test_cupy_columns_sliced_from_a_pool_block(
    gpu_publisher: aib.Publisher, consumer: Any, cupy: Any
) -> None:
    """CuPy arrays carved out of one allocation (offsets inside a shared block) travel as legacy IPC
    handles; one region per allocation, values intact."""
    block = cupy.arange(3000, dtype=cupy.float32)
    columns = {"a": block[1000:2000], "b": block[2000:3000]}
    stats = gpu_publisher.publish("c", aib.from_cuda_arrays(columns))
    assert stats.regions == 1
    assert stats.copied_bytes == 0
    table, _ = consumer("c")
    assert table.column("a").to_pylist() == [float(i) for i in range(1000, 2000)]
    assert table.column("b").to_pylist() == [float(i) for i in range(2000, 3000)]


def test_consumer_sees_final_data_of_a_running_kernel(gpu_publisher: aib.Publisher, cupy: Any) -> None:
    """The producer's kernel is still running when the message is sent; a cuDF-style consumer waits
    on sync_event on its own stream and reads the final values, never the stale ones. Once that
    kernel is done, a re-get's struct carries no event (nothing to wait for), same values."""
    from helpers import gpu_children

    spin = cupy.RawKernel(
        r"""
        extern "C" __global__ void spin_then_fill(float *out, int n, long long cycles) {
            long long start = clock64();
            while (clock64() - start < cycles) { }
            int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) out[i] = 7.0f;
        }
        """,
        "spin_then_fill",
    )
    n = 4096
    data = cupy.zeros(n, dtype=cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    parent, child = _CTX.Pipe()
    process = _CTX.Process(
        target=gpu_children.cudf_style_reader, args=(str(gpu_publisher.path), "slow", child)
    )
    process.start()
    try:
        assert parent.poll(120), "reader did not start"
        assert parent.recv() == "ready"
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            spin((n // 256,), (256,), (data, cupy.int32(n), cupy.int64(2_000_000_000)))  # ~1 s
            gpu_publisher.publish("slow", aib.from_cuda_arrays({"v": data}))  # records an event on `stream`
        parent.send("go")
        assert parent.poll(120), "reader did not answer"
        values, had_event = parent.recv()
        assert had_event, "the kernel was still running: the struct must carry the producer's event"
        assert values == [7.0] * n
        stream.synchronize()
        parent.send("go")
        assert parent.poll(120), "reader did not answer"
        values, had_event = parent.recv()
        assert not had_event, "the producer's work is complete: the struct needs no event"
        assert values == [7.0] * n
    finally:
        parent.send("stop")
        _join(process)


def test_producer_exit_leaves_consumer_data_valid(cuda_device: int, cupy: Any) -> None:
    """The producer process is killed while the consumer holds its data: the data stays readable."""

    path, _parent, producer = _start_cupy_producer(1000)
    session = aib.connect(path, timeout=30.0)
    imported = session.get("cupy")
    os.kill(producer.pid, signal.SIGKILL)
    producer.join(30)
    host = imported.to_host()
    assert host.column("a").to_pylist() == [float(i) for i in range(1000, 2000)]
    assert host.column("b").to_pylist() == [2 * i for i in range(1000)]
    imported.release()
    with pytest.raises(aib.TransportError):
        session.get("cupy")
    session.close()


def test_killed_consumer_gives_its_leases_back(cuda_device: int, cupy: Any) -> None:
    """A consumer holding a device lease is SIGKILLed: the producer's lease count returns to 0."""
    from helpers import gpu_children

    path, parent, producer = _start_cupy_producer(100)
    holder_parent, holder_child = _CTX.Pipe()
    holder = _CTX.Process(target=gpu_children.holding_consumer, args=(path, "cupy", holder_child))
    holder.start()
    assert holder_parent.poll(120), "consumer did not start"
    assert holder_parent.recv() == "held"
    parent.send("leases")
    assert parent.recv() == 1
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(30)
    deadline = time.monotonic() + 1.0
    leases = 1
    while time.monotonic() < deadline:
        parent.send("leases")
        leases = parent.recv()
        if leases == 0:
            break
        time.sleep(0.02)
    assert leases == 0
    parent.send("stop")
    _join(producer)


def test_ten_thousand_imports_do_not_grow(cuda_device: int, cupy: Any) -> None:
    """10,000 get/release cycles from another process's publisher (legacy handles and IPC-pool
    pointers): open handles, fds, owners and GPU memory stay flat; the legacy handle is opened once."""
    counts = SessionCounts()

    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge._ffi import lib
    from arrow_ipc_bridge.cuda import opener as cuda_opener
    from arrow_ipc_bridge.runtime import reaper

    path, parent, producer = _start_cupy_producer(1 << 16)
    try:
        with aib.connect(path, timeout=30.0) as session:
            counts.reset()  # this session's gets

            def cycle(name: str) -> None:
                with session.get(name) as imported:
                    capsules = imported.__arrow_c_device_array__()
                    del capsules

            for name in ("cupy", "pool", "pool"):  # the second pool get keeps it (and a lease)
                cycle(name)
            gc.collect()
            reaper.settle()
            free_before = cuda_helpers.mem_get_info(0)[0]
            fds_before = len(os.listdir("/proc/self/fd"))
            owners_before = lib.aib_live_owners()
            hits_before = cuda.cuda_stats()["legacy_hits"]
            opens_before = cuda.cuda_stats()["legacy_opens"]
            for i in range(10_000):
                cycle("cupy" if i % 2 else "pool")
            gc.collect()
            time.sleep(0.2)
            reaper.settle()
            assert len(os.listdir("/proc/self/fd")) <= fds_before + 2
            assert lib.aib_live_owners() <= owners_before + 2
            assert cuda_helpers.mem_get_info(0)[0] >= free_before - (64 << 20)
            stats = cuda.cuda_stats()
            # opened once, before the loop; the session then reuses the opened regions
            assert stats["legacy_opens"] == opens_before
            assert stats["legacy_hits"] >= hits_before
            assert counts.remembered_gets == 10_000  # both imported by the C core every time
        parent.send("leases")
        assert parent.recv() == 0
        # Without a kept lease every pool get imports and frees its pointer: that churn leaks nothing.
        with aib.connect(path, timeout=30.0, pool_linger=0.0) as session:
            counts.reset()  # this session's gets
            cycle("pool")
            gc.collect()
            reaper.settle()
            free_before = cuda_helpers.mem_get_info(0)[0]
            fds_before = len(os.listdir("/proc/self/fd"))
            owners_before = lib.aib_live_owners()
            for _ in range(2_000):
                cycle("pool")
            gc.collect()
            time.sleep(0.2)
            reaper.settle()
            assert counts.remembered_gets == 0
            assert len(os.listdir("/proc/self/fd")) <= fds_before + 2
            assert lib.aib_live_owners() <= owners_before + 2
            assert cuda_helpers.mem_get_info(0)[0] >= free_before - (64 << 20)
            assert cuda_opener.opener()._pool_pointers == {}  # every import freed again
        parent.send("leases")
        assert parent.recv() == 0
    finally:
        parent.send("stop")
        _join(producer)


def test_same_process_publisher_and_session(gpu_publisher: aib.Publisher, cupy: Any) -> None:
    """CUDA will not open a legacy handle in the process that made it: a session in the producer's
    own process resolves its regions from the producer's records instead, and reads the data."""
    from arrow_ipc_bridge import cuda

    gpu_publisher.publish("legacy", aib.from_cuda_arrays({"v": cupy.arange(100, dtype=cupy.float32)}))
    gpu_publisher.publish("pool", aib.to_device(pa.table({"v": pa.array(range(100))})))
    before = cuda.cuda_stats()["same_process"]
    with aib.connect(gpu_publisher.path, timeout=30.0) as session:
        with session.get("legacy") as imported:
            assert imported.to_host().column("v").to_pylist() == [float(i) for i in range(100)]
        with session.get("pool") as imported:
            assert imported.to_host().column("v").to_pylist() == list(range(100))
    assert cuda.cuda_stats()["same_process"] - before == 2


def test_managed_memory_needs_the_copy_policy(gpu_publisher: aib.Publisher, consumer: Any, cupy: Any) -> None:
    """Managed memory cannot travel through CUDA IPC: copy='never' refuses with CopyRequiredError,
    'if_needed' copies it into the bridge pool (counted) and the consumer reads the right values."""
    memory = cupy.cuda.malloc_managed(1024 * 4)
    values = cupy.ndarray((1024,), cupy.float32, memory)
    values[:] = cupy.arange(1024, dtype=cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    with pytest.raises(aib.CopyRequiredError):
        gpu_publisher.publish("m", aib.from_cuda_arrays({"v": values}), copy="never")
    stats = gpu_publisher.publish("m", aib.from_cuda_arrays({"v": values}), copy="if_needed")
    assert stats.copied_bytes == 1024 * 4
    table, _ = consumer("m")
    assert table.column("v").to_pylist() == [float(i) for i in range(1024)]


def test_vmm_allocation_travels_as_an_fd(gpu_publisher: aib.Publisher, consumer: Any, cupy: Any) -> None:
    """A VMM allocation (cuMemCreate) is exported as a POSIX fd region and read in another process."""
    from arrow_ipc_bridge import cuda

    allocation = cuda.vmm_allocate(1 << 21, 0)
    n = 1000
    cuda_helpers.write_device(allocation.ptr, pa.array(range(n), pa.int64()).buffers()[1].to_pybytes())

    class VmmColumn:
        __cuda_array_interface__: ClassVar[dict[str, Any]] = {
            "shape": (n,),
            "typestr": "<i8",
            "data": (allocation.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }

    stats = gpu_publisher.publish("vmm", aib.from_cuda_arrays({"v": VmmColumn()}))
    assert stats.regions == 1
    table, _ = consumer("vmm")
    assert table.column("v").to_pylist() == list(range(n))


def test_to_host_round_trip_in_process(cuda_device: int) -> None:
    """to_device then to_host in one process returns the same data (pool memory, no IPC)."""
    table = pa.table({"x": pa.array([1.5, None, 3.0]), "s": pa.array(["a", None, "bcd"])})
    gpu = aib.to_device(table)
    assert gpu.device_type == 2
    assert gpu.to_host().equals(table)


def test_column_view_is_zero_copy_on_the_gpu(gpu_publisher: aib.Publisher, cupy: Any) -> None:
    """column_view gives __cuda_array_interface__ and DLPack views at the producer's memory: CuPy and
    PyTorch read the same values with no copy, ordered after the producer's event on their stream."""
    values = cupy.arange(2048, dtype=cupy.float64)
    gpu_publisher.publish("v", aib.from_cuda_arrays({"a": values[1024:], "b": values[:1024]}))
    with aib.connect(gpu_publisher.path, timeout=30.0) as session, session.get("v") as imported:
        stream = cupy.cuda.Stream(non_blocking=True)
        view = aib.column_view(imported, "a", stream=stream.ptr)
        assert view.__cuda_array_interface__["data"][0] == values[1024:].data.ptr
        assert view.__dlpack_device__() == (2, 0)
        with stream:
            seen = cupy.asarray(view) * 1
            via_dlpack = cupy.from_dlpack(aib.column_view(imported, "b", stream=stream.ptr))
            assert via_dlpack.data.ptr == values[:1024].data.ptr
        stream.synchronize()
        assert bool((seen == values[1024:]).all())
        assert bool((via_dlpack == values[:1024]).all())
        torch = pytest.importorskip("torch")
        tensor = torch.from_dlpack(aib.column_view(imported, "a"))
        assert tensor.device.type == "cuda"
        assert float(tensor.sum()) == float(values[1024:].sum())
        with pytest.raises(aib.BridgeError, match="no column"):
            aib.column_view(imported, "missing")


def test_cupy_pool_allocator_arrays_travel_as_pool_regions(
    gpu_publisher: aib.Publisher, consumer: Any, cupy: Any
) -> None:
    """With the bridge's IPC-pool allocator installed, new CuPy arrays are shared as pool regions
    (pool fd once, then per-pointer export data) and read correctly in another process."""
    from arrow_ipc_bridge import cuda

    allocator = cuda.cupy_allocator(0)
    with cupy.cuda.using_allocator(allocator):
        values = cupy.arange(1 << 16, dtype=cupy.int32)
    cupy.cuda.runtime.deviceSynchronize()
    stats = gpu_publisher.publish("pooled", aib.from_cuda_arrays({"v": values}))
    assert stats.regions == 1
    table, _ = consumer("pooled")
    assert table.column("v").to_pylist() == list(range(1 << 16))


def test_evicted_legacy_handle_stays_open_for_its_arrays(cuda_device: int, cupy: Any) -> None:
    """With a one-entry handle cache, a handle evicted while its arrays live is reused (not opened
    twice) by the next get, stays valid, and is closed once when the last array goes."""

    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import opener as cuda_opener
    from arrow_ipc_bridge.runtime import reaper

    path, parent, producer = _start_cupy_producer(1000)
    saved = cuda_opener._opener
    cuda_opener._opener = opener = cuda_opener.CudaOpener(max_legacy=1)
    try:
        # two sessions, so the session-level message cache does not hide the opener
        with aib.connect(path, timeout=30.0) as first, aib.connect(path, timeout=30.0) as second:
            held = first.get("cupy")
            capsules = held.__arrow_c_device_array__()
            opens = cuda.cuda_stats()["legacy_opens"]
            other = second.get("cupy")  # same handles: hits the LRU or reuses the live ones
            assert cuda.cuda_stats()["legacy_opens"] == opens
            assert other.to_host().column("a").to_pylist() == [float(i) for i in range(1000, 2000)]
            other.release()
            assert held.to_host().column("b").to_pylist() == [2 * i for i in range(1000)]
            del capsules
            held.release()
        opener.close()
        gc.collect()
        time.sleep(0.1)
        reaper.settle()
        assert opener._legacy_live == {}  # every handle closed exactly once
    finally:
        cuda_opener._opener = saved
        parent.send("stop")
        _join(producer)


def test_gpu_is_named_by_uuid_not_ordinal(cuda_device: int) -> None:
    """A producer that numbers the GPUs differently (CUDA_VISIBLE_DEVICES swapped) publishes from its
    device 0; the consumer maps the UUID to its own ordinal (1), opens the data there, and reads it."""
    from helpers import gpu_children

    from arrow_ipc_bridge import cuda

    if cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path = _socket_path()
    parent, child = _CTX.Pipe()
    producer = _CTX.Process(target=gpu_children.swapped_gpu_producer, args=(path, child))
    producer.start()
    try:
        assert parent.poll(120), "producer did not start"
        status, producer_uuid = parent.recv()
        assert status == "ready"
        assert producer_uuid == cuda.device_uuid(1).hex()  # its device 0 is our device 1
        with aib.connect(path, timeout=30.0) as session, session.get("t") as imported:
            assert imported.device_id == 1
            assert imported.to_host().column("v").to_pylist() == list(range(1000))
    finally:
        parent.send("stop")
        _join(producer)
