"""The producer's fast path for fresh device data (marker: gpu): from_cuda_array(s) built in C and
messages placed from the export region table must say exactly what a placement that made the
regions says, keep the copy policy and the refusals, carry the producer's event, and leak nothing
over many publishes."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.counting import SessionCounts

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.wire.metadata import REGION_CUDA_POOL, Decoded

pytestmark = pytest.mark.gpu
_CTX = mp.get_context("spawn")


@pytest.fixture
def cupy(cuda_device: int) -> Any:
    return pytest.importorskip("cupy")


@pytest.fixture
def publisher(cuda_device: int) -> Iterator[aib.Publisher]:
    with aib.Publisher(os.path.join(tempfile.mkdtemp(dir="/tmp"), "fast.sock")) as pub:
        yield pub


def _table_stats() -> dict[str, int]:
    from arrow_ipc_bridge.cuda import placer

    return placer.export_region_stats()


def _forget_regions() -> None:
    """Empty the export table: the next export of any allocation makes its region again."""
    from arrow_ipc_bridge._ffi import lib
    from arrow_ipc_bridge.cuda import placer

    lib.aib_export_regions_clear(placer._export_regions)


def _normalized(exported: aib.Exported) -> tuple[bytes, list[Any], list[Any]]:
    """The message with its sync handle (which event carries it differs per export) zeroed, its
    regions and buffer references as decoded."""
    decoded = Decoded(exported.message, len(exported.fds))
    try:
        sync = decoded.device().sync
        assert len(sync) == 64, "a CUDA message always carries an interprocess event"
        return exported.message.replace(sync, bytes(64)), decoded.regions(), decoded.buffer_refs()
    finally:
        decoded.close()


def _export_twice(make: Any, *, pool_fds: bool = False) -> tuple[Any, Any, dict[str, int], dict[str, int]]:
    """Export the same arrays with an empty table (their regions made), then again (the regions
    from the table)."""
    _forget_regions()
    before = _table_stats()
    with aib.export(make(), pool_fds=pool_fds) as first:
        full = _normalized(first)
    middle = _table_stats()
    with aib.export(make(), pool_fds=pool_fds) as second:
        fast = _normalized(second)
    after = _table_stats()
    return full, fast, {k: middle[k] - before[k] for k in before}, {k: after[k] - middle[k] for k in after}


def test_the_table_path_writes_the_full_paths_message(cupy: Any) -> None:
    """Legacy (cudaMalloc) allocations: the second export of the same arrays is placed from the
    export table and its message is byte for byte the first's, whose regions were made (the event
    handle aside)."""
    columns = {
        "f32": cupy.arange(1000, dtype=cupy.float32),
        "i64": cupy.arange(1000, dtype=cupy.int64),
        "u8": cupy.ones(1000, dtype=cupy.uint8),
    }
    cupy.cuda.runtime.deviceSynchronize()
    full, fast, first, second = _export_twice(lambda: aib.from_cuda_arrays(columns))
    assert first["hits"] == 0
    assert first["misses"] >= 1
    assert second["hits"] == len(full[1])  # one look-up per allocation (CuPy may carve two from one)
    assert second["misses"] == 0
    assert fast == full


def test_the_table_path_numbers_regions_as_the_full_path_does(cupy: Any) -> None:
    """Columns named in another order than their addresses (as after CuPy's pool reused freed
    blocks): the regions are numbered by address whether they came from the table or were made,
    so the two messages are the same bytes."""
    arrays = [cupy.arange(1 << 12, dtype=cupy.float32) + k for k in range(4)]
    columns = {f"c{k}": a for k, a in enumerate(sorted(arrays, key=lambda a: -a.data.ptr))}
    cupy.cuda.runtime.deviceSynchronize()
    full, fast, _, second = _export_twice(lambda: aib.from_cuda_arrays(columns))
    assert second["misses"] == 0
    assert fast == full


def test_pool_regions_come_from_the_table_only_without_pool_fds(cupy: Any) -> None:
    """IPC-pool allocations: placed by the table when the pool's fd stays out of the message (as a
    publisher sends it); a message that must carry the fd has its region made every time."""
    from arrow_ipc_bridge import cuda

    allocator = cuda.cupy_allocator(0)
    with cupy.cuda.using_allocator(allocator):
        values = cupy.arange(1 << 14, dtype=cupy.int32)
    cupy.cuda.runtime.deviceSynchronize()
    full, fast, _, second = _export_twice(lambda: aib.from_cuda_arrays({"v": values}))
    assert second["hits"] == 1
    assert fast == full
    assert full[1][0].kind == REGION_CUDA_POOL
    assert full[1][0].fd_index == -1
    full, fast, _, second = _export_twice(lambda: aib.from_cuda_arrays({"v": values}), pool_fds=True)
    assert second["hits"] == 0
    assert second["misses"] == 1
    assert fast == full


def test_columns_in_one_allocation_are_one_region(cupy: Any) -> None:
    block = cupy.arange(3000, dtype=cupy.float32)
    columns = {"a": block[:1000], "b": block[1000:2000], "c": block[2000:]}
    cupy.cuda.runtime.deviceSynchronize()
    full, fast, _, second = _export_twice(lambda: aib.from_cuda_arrays(columns))
    assert len(full[1]) == 1
    assert second["hits"] == 1
    assert fast == full


def test_memory_ipc_cannot_share_is_refused_every_time(publisher: aib.Publisher, cupy: Any) -> None:
    """Managed memory never enters the table: copy='never' refuses it each time, 'if_needed'
    copies it each time (counted); pinned host memory is no column at all."""
    memory = cupy.cuda.malloc_managed(1024 * 4)
    values = cupy.ndarray((1024,), cupy.float32, memory)
    values[:] = 1.0
    cupy.cuda.runtime.deviceSynchronize()
    for _ in range(3):
        with pytest.raises(aib.CopyRequiredError):
            publisher.publish("m", aib.from_cuda_arrays({"v": values}), copy="never")
        assert publisher.publish("m", aib.from_cuda_arrays({"v": values})).copied_bytes == 1024 * 4
    pinned = cupy.cuda.alloc_pinned_memory(4096)

    class _Pinned:
        __cuda_array_interface__ = {  # noqa: RUF012
            "shape": (1024,),
            "typestr": "<f4",
            "data": (pinned.ptr, False),
            "version": 3,
            "strides": None,
        }

    with pytest.raises(aib.InvalidArgumentError, match="not CUDA device memory"):
        aib.from_cuda_arrays({"v": _Pinned()})


def test_copy_always_copies_every_device_buffer(publisher: aib.Publisher, cupy: Any) -> None:
    """copy="always" on CUDA data copies every buffer into the bridge's pool (counted), also memory
    that could be shared as it is and allocations placed before: the message names the copies
    alone (pool regions), and the consumer reads the published values after the producer changed
    its arrays."""
    a = cupy.arange(1000, dtype=cupy.float32)
    block = cupy.arange(3000, dtype=cupy.int64)
    columns = {"a": a, "b": block[:1000], "c": block[1000:2000]}  # b and c share one allocation
    cupy.cuda.runtime.deviceSynchronize()
    with aib.export(aib.from_cuda_arrays(columns)) as shared:  # zero copy: regions in the table now
        assert shared.stats.copied_bytes == 0
    copies = aib.stats().cuda.copies
    with aib.export(aib.from_cuda_arrays(columns), copy="always") as copied:
        assert copied.stats.copied_bytes == 1000 * 4 + 2 * 1000 * 8
        assert copied.stats.zero_copy_regions == 0
        assert aib.stats().cuda.copies - copies == 3  # one per buffer
        decoded = Decoded(copied.message, len(copied.fds))
        kinds = {region.kind for region in decoded.regions()}
        decoded.close()
        assert kinds == {REGION_CUDA_POOL}
    stats = publisher.publish("copied", aib.from_cuda_arrays(columns), copy="always")
    assert stats.copied_bytes == 1000 * 4 + 2 * 1000 * 8
    a[:] = -1.0  # the published copies keep the values of publish time
    block[:] = -1
    cupy.cuda.runtime.deviceSynchronize()
    with aib.connect(publisher.path, timeout=30.0) as session, session.get("copied") as imported:
        table = imported.to_host()
    assert table.column("a").to_pylist() == list(range(1000))
    assert table.column("b").to_pylist() == list(range(1000))
    assert table.column("c").to_pylist() == list(range(1000, 2000))


def test_torch_tensors_and_a_device_capsule_producer(publisher: aib.Publisher, cupy: Any) -> None:
    """Torch tensors through from_cuda_arrays, and any ``__arrow_c_device_array__`` producer, read
    right by a session (here in the same process)."""
    torch = pytest.importorskip("torch")
    tensors = {f"t{i}": torch.full((500,), float(i), device="cuda") for i in range(4)}
    torch.cuda.synchronize()
    inner = aib.from_cuda_arrays(tensors)

    class _Producer:
        def __arrow_c_device_array__(self, requested_schema: object = None, **kwargs: object) -> Any:
            return inner.__arrow_c_device_array__(requested_schema, **kwargs)

    with aib.connect(publisher.path, timeout=30.0) as session:
        for round_ in range(3):
            publisher.publish("torch", aib.from_cuda_arrays(tensors))
            publisher.publish("capsule", _Producer())
            for name in ("torch", "capsule"):
                with session.get(name) as imported:
                    table = imported.to_host()
                assert table.column("t3").to_pylist() == [3.0] * 500, (name, round_)
    assert _table_stats()["hits"] > 0


def test_the_producers_event_is_honoured_on_the_table_path(publisher: aib.Publisher, cupy: Any) -> None:
    """Publish once (the allocation enters the table), then publish while a kernel still writes
    the column: the consumer waits on the event and reads the final values."""
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
    publisher.publish("slow", aib.from_cuda_arrays({"v": data}))
    parent, child = _CTX.Pipe()
    process = _CTX.Process(target=gpu_children.cudf_style_reader, args=(str(publisher.path), "slow", child))
    process.start()
    try:
        assert parent.poll(120), "reader did not start"
        assert parent.recv() == "ready"
        hits = _table_stats()["hits"]
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            spin((n // 256,), (256,), (data, cupy.int32(n), cupy.int64(2_000_000_000)))  # ~1 s
            publisher.publish("slow", aib.from_cuda_arrays({"v": data}))
        assert _table_stats()["hits"] == hits + 1
        parent.send("go")
        assert parent.poll(120), "reader did not answer"
        values, had_event = parent.recv()
        assert had_event
        assert values == [7.0] * n
    finally:
        parent.send("stop")
        process.join(60)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0


def _opens() -> int:
    cuda = aib.stats().cuda
    return cuda.legacy_opens + cuda.pool_imports + cuda.pool_pointer_imports


def test_many_publishes_leak_no_event_handle_or_struct(publisher: aib.Publisher, cupy: Any) -> None:
    """Thousands of publishes of in-place-updated columns (on a stream: each batch has its own
    recorded event), each got once: the event pool stops growing, no event stays leased, no handle
    is opened again, every struct and owner is freed."""
    from arrow_ipc_bridge._ffi import lib
    from arrow_ipc_bridge.cuda import placer

    columns = {f"c{i}": cupy.zeros(256, dtype=cupy.float32) for i in range(16)}
    events = placer.event_pool(0)
    reaper.settle()
    # What earlier tests' publications still hold:
    leased, recorded = events.leased, len(placer._recorded_events)
    callbacks, nodes = reaper.pending_callbacks(), lib.aib_live_nodes()

    stream = cupy.cuda.Stream(non_blocking=True)  # announced: each batch carries a pooled event

    def step(session: Any, i: int) -> None:
        with stream:
            for column in columns.values():
                column += 1  # noqa: PLW2901 (in place: the same arrays each step)
            publisher.publish("t", aib.from_cuda_arrays(columns))
        with session.get("t") as imported:
            schema_capsule, array_capsule = imported.__arrow_c_device_array__()
            del schema_capsule, array_capsule

    with aib.connect(publisher.path, timeout=30.0) as session:
        for i in range(50):
            step(session, i)
        created, opens = events.created, _opens()
        for i in range(2000):
            step(session, i)
        assert events.created - created <= 2
        assert _opens() == opens
        last = session.get("t")
        assert last.to_host().column("c15").to_pylist() == [2050.0] * 256
        last.release()
    publisher.unpublish("t")
    reaper.settle()
    assert events.leased <= leased
    assert len(placer._recorded_events) <= recorded
    assert publisher.active_leases == 0
    assert reaper.pending_callbacks() <= callbacks + 5
    assert lib.aib_live_nodes() <= nodes + 50


# ---------- the same arrays published again: the same message, its event re-recorded ------------
_SPIN_THEN_FILL = r"""
extern "C" __global__ void spin_then_fill(float *out, int n, float value, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) out[i] = value;
}
"""


def test_republished_arrays_keep_their_message_in_lockstep(publisher: aib.Publisher, cupy: Any) -> None:
    """16 columns updated in place (on a stream) and published each step, got and read each step:
    every version after the first sends the first's message bytes (one event, re-recorded), the
    consumer imports it from its remembered message, and reads each version's values."""
    counts = SessionCounts()
    from arrow_ipc_bridge.cuda import placer

    columns = {f"c{i}": cupy.zeros(1 << 12, dtype=cupy.float32) for i in range(16)}
    stream = cupy.cuda.Stream(non_blocking=True)
    events = placer.event_pool(0)
    messages: set[bytes] = set()
    with aib.connect(publisher.path, timeout=30.0) as session:
        for step in range(1, 201):
            with stream:
                for column in columns.values():
                    column += 1  # noqa: PLW2901 (in place)
                publisher.publish("t", aib.from_cuda_arrays(columns))
            messages.add(publisher._current["t"].message)
            with session.get("t") as imported:
                table = imported.to_host()  # waits on the message's event
            assert table.column("c15").to_pylist() == [float(step)] * (1 << 12)
            assert table.column("c0").to_pylist() == [float(step)] * (1 << 12)
            if step == 3:
                created, gets = events.created, counts.remembered_gets
        assert len(messages) == 1
        assert counts.remembered_gets - gets >= 190  # the consumer's steady state, not new imports
        assert events.created - created <= 2
    leased = events.leased
    publisher.unpublish("t")
    # The closed session's last releases reach the publisher asynchronously: the export (and its
    # event) closes when the last lease on it has ended.
    deadline = time.monotonic() + 10.0
    reaper.settle()
    while events.leased >= leased and time.monotonic() < deadline:
        time.sleep(0.01)
        reaper.settle()
    assert events.leased < leased  # the shared event went back to the pool with the last version


def test_other_arrays_get_a_message_and_an_event_of_their_own(publisher: aib.Publisher, cupy: Any) -> None:
    """A publish of other arrays (other regions), or of the same arrays under another name, does
    not send the current message again; the same arrays again after other ones neither."""
    a = {"x": cupy.arange(4096, dtype=cupy.float32)}
    b = {"x": cupy.arange(4096, dtype=cupy.float32) * 2}
    cupy.cuda.runtime.deviceSynchronize()

    def sync_of(message: bytes) -> bytes:
        decoded = Decoded(message, 0)
        try:
            return bytes(decoded.device().sync)
        finally:
            decoded.close()

    publisher.publish("n", aib.from_cuda_arrays(a))
    first = publisher._current["n"].message
    publisher.publish("n", aib.from_cuda_arrays(a))
    assert publisher._current["n"].message == first
    publisher.publish("n", aib.from_cuda_arrays(b))
    other = publisher._current["n"].message
    assert other != first
    assert sync_of(other) != sync_of(first)  # first's event still serves its holders
    publisher.publish("n", aib.from_cuda_arrays(a))
    assert publisher._current["n"].message != other
    publisher.publish("m", aib.from_cuda_arrays(a))
    assert sync_of(publisher._current["m"].message) != sync_of(publisher._current["n"].message)
    with aib.connect(publisher.path, timeout=30.0) as session:
        for name, expected in (("n", a), ("m", a)):
            with session.get(name) as imported:
                assert imported.to_host().column("x").to_pylist() == expected["x"].get().tolist()


def test_a_holder_of_an_older_version_waits_for_the_newer_record(publisher: aib.Publisher, cupy: Any) -> None:
    """A consumer holding version 1 while the producer writes version 2 in place (a slow kernel)
    and publishes it: waiting on version 1's event waits for version 2's record (the same event),
    so it reads version 2's finished values, never a half-written column (over-waits, never less)."""
    kernel = cupy.RawKernel(_SPIN_THEN_FILL, "spin_then_fill")
    n = 1 << 16
    values = cupy.zeros(n, dtype=cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    publisher.publish("h", aib.from_cuda_arrays({"v": values}))
    stream = cupy.cuda.Stream(non_blocking=True)
    with aib.connect(publisher.path, timeout=30.0) as session:
        older = session.get("h")
        message = publisher._current["h"].message
        with stream:
            kernel((64,), (256,), (values, cupy.int32(n), cupy.float32(2.0), cupy.int64(500_000_000)))
            publisher.publish("h", aib.from_cuda_arrays({"v": values}))
        assert publisher._current["h"].message == message  # the same event, recorded again
        seen = older.to_host().column("v").to_pylist()
        older.release()
        assert seen == [2.0] * n


# ---------- the in-place fast path: the same columns renew the current version ---------------------
def test_in_place_publishes_renew_the_version_and_keep_the_entry(publisher: aib.Publisher, cupy: Any) -> None:
    """Columns updated in place and published again renew the current publication: a new version
    each time (get_next sees every one), the same Exported and message, one count per renewal, and
    a lease on an older version stays valid (it names the same entry)."""
    columns = {f"c{i}": cupy.zeros(1024, dtype=cupy.float32) for i in range(4)}
    cupy.cuda.runtime.deviceSynchronize()
    publisher.publish("r", aib.from_cuda_arrays(columns))
    first = publisher._current["r"]
    version = publisher.version("r")
    renewals = aib.stats().cuda.in_place_publishes
    with aib.connect(publisher.path, timeout=30.0) as session:
        held = session.get("r")
        for step in range(1, 21):
            for column in columns.values():
                column += 1  # noqa: PLW2901 (in place)
            publisher.publish("r", aib.from_cuda_arrays(columns))
            assert publisher._current["r"] is first
            assert publisher.version("r") == version + step
            with session.get_next("r", after=version + step - 1, timeout=10.0) as imported:
                assert imported.version == version + step
                assert imported.to_host().column("c3").to_pylist() == [float(step)] * 1024
        assert aib.stats().cuda.in_place_publishes - renewals == 20
        assert held.to_host().column("c0").to_pylist() == [20.0] * 1024  # in place: the newest values
        held.release()


def test_what_is_not_the_same_columns_takes_the_full_path(publisher: aib.Publisher, cupy: Any) -> None:
    """No renewal for other names, another column order or set, a slice of the same memory, or
    copy="always" (which asks for the full placement); the same columns after those are renewed."""
    a = cupy.arange(4096, dtype=cupy.float32)
    b = cupy.arange(4096, dtype=cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    publisher.publish("p", aib.from_cuda_arrays({"a": a, "b": b}))
    renewals = aib.stats().cuda.in_place_publishes
    for other in (
        {"b": b, "a": a},  # another order: other names per column
        {"a": a},
        {"a": a[:100], "b": b[:100]},
        {"a": b, "b": a},
    ):
        current = publisher._current["p"]
        publisher.publish("p", aib.from_cuda_arrays(other))
        assert publisher._current["p"] is not current
    publisher.publish("p", aib.from_cuda_arrays({"a": a, "b": b}))
    current = publisher._current["p"]
    publisher.publish("p", aib.from_cuda_arrays({"a": a, "b": b}), copy="always")  # asks the full path
    assert publisher._current["p"] is not current
    assert aib.stats().cuda.in_place_publishes == renewals
    # That version names copies, not the columns' memory: renewing it in place would hand out the
    # copies' old values, so the same columns next are exported (naming their memory again) ...
    copied = publisher._current["p"]
    publisher.publish("p", aib.from_cuda_arrays({"a": a, "b": b}))
    assert publisher._current["p"] is not copied
    assert aib.stats().cuda.in_place_publishes == renewals
    publisher.publish("p", aib.from_cuda_arrays({"a": a, "b": b}))  # ... and renewed after that
    assert aib.stats().cuda.in_place_publishes == renewals + 1
    torch = pytest.importorskip("torch")
    t = torch.zeros(64, device="cuda")
    publisher.publish("q", aib.from_cuda_array(t))
    publisher.publish("q", aib.from_cuda_array(t))  # one column, no names: renewed as well
    assert aib.stats().cuda.in_place_publishes - renewals == 2
    with aib.connect(publisher.path, timeout=30.0) as session, session.get("p") as imported:
        assert imported.to_host().column("a").to_pylist() == a.get().tolist()


def test_held_columns_skip_the_device_query_until_their_publication_closes(
    publisher: aib.Publisher, cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """from_cuda_arrays asks the driver for the columns' device unless a live publication holds
    columns of exactly those facts: the step loop's columns after the first publish. Once the
    publication closed, the same columns are asked about again; new arrays always are."""
    from arrow_ipc_bridge.arrays import device

    asked: list[int] = []
    real = device._device_of

    def counted(columns: Any, n: int, objects: list[Any]) -> int:
        asked.append(n)
        return real(columns, n, objects)

    monkeypatch.setattr(device, "_device_of", counted)
    columns = {f"c{i}": cupy.zeros(2048, dtype=cupy.float32) for i in range(8)}
    cupy.cuda.runtime.deviceSynchronize()
    publisher.publish("h", aib.from_cuda_arrays(columns))
    assert asked == [8]
    renewals = aib.stats().cuda.in_place_publishes
    for _ in range(5):
        publisher.publish("h", aib.from_cuda_arrays(columns))
    assert asked == [8]
    assert aib.stats().cuda.in_place_publishes - renewals == 5
    assert aib.from_cuda_arrays({"x": cupy.zeros(2048, dtype=cupy.float32)}).column_signature[0] == 0
    assert asked == [8, 1]  # new memory: asked
    publisher.unpublish("h")
    reaper.settle()
    aib.from_cuda_arrays(columns)
    assert asked == [8, 1, 8]  # no live publication holds them now


def test_an_in_place_publish_from_a_thread_restores_its_context(publisher: aib.Publisher, cupy: Any) -> None:
    """The shared event's record (one C call) makes the device's primary context current for the
    wait and the record on a thread where none is, and the thread's context is as before after;
    the consumer reads the values written before the publish."""
    import threading

    from arrow_ipc_bridge.cuda._driver import _api

    column = cupy.zeros(4096, dtype=cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    publisher.publish("c", aib.from_cuda_arrays({"v": column}))
    renewals = aib.stats().cuda.in_place_publishes
    column += 7  # on the legacy default stream: the record there comes after it
    seen: dict[str, Any] = {}

    def publish_there() -> None:
        lib, ffi = _api()
        current = ffi.new("CUcontext *")
        batch = aib.from_cuda_arrays({"v": column})
        lib.cuCtxGetCurrent(current)
        seen["before"] = int(ffi.cast("uintptr_t", current[0]))
        publisher.publish("c", batch)
        lib.cuCtxGetCurrent(current)
        seen["after"] = int(ffi.cast("uintptr_t", current[0]))

    thread = threading.Thread(target=publish_there)
    thread.start()
    thread.join()
    assert seen["after"] == seen["before"]
    assert aib.stats().cuda.in_place_publishes == renewals + 1
    with aib.connect(publisher.path, timeout=30.0) as session, session.get("c") as imported:
        assert imported.to_host().column("v").to_pylist() == [7.0] * 4096


class _InterfaceOnly:
    """An array seen through its ``__cuda_array_interface__`` alone (the reader's general path)."""

    def __init__(self, array: Any) -> None:
        self._array = array

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return dict(self._array.__cuda_array_interface__)


@pytest.mark.parametrize(
    "dtype",
    [
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    ],
)
def test_cupy_columns_read_from_attributes_match_their_interface(cupy: Any, dtype: str) -> None:
    """CuPy arrays after the first are read from their attributes: the facts (pointer, length,
    type, stream) are those their interfaces give, on the default stream and on another one, for
    empty arrays too; a strided CuPy array is still refused as by the interface path."""
    arrays = [cupy.arange(100, dtype=dtype) + i for i in range(3)]
    for stream in (cupy.cuda.Stream.null, cupy.cuda.Stream(non_blocking=True)):
        with stream:
            fast = aib.from_cuda_arrays({f"c{i}": a for i, a in enumerate(arrays)})
            general = aib.from_cuda_arrays({f"c{i}": _InterfaceOnly(a) for i, a in enumerate(arrays)})
        assert fast.column_signature == general.column_signature
    empty = [cupy.zeros(0, dtype=dtype) for _ in range(2)]
    assert (
        aib.from_cuda_arrays({"a": empty[0], "b": empty[1]}).column_signature
        == aib.from_cuda_arrays(
            {"a": _InterfaceOnly(empty[0]), "b": _InterfaceOnly(empty[1])}
        ).column_signature
    )
    with pytest.raises(aib.BridgeError, match="not contiguous"):
        aib.from_cuda_arrays({"a": arrays[0][::2], "b": arrays[1][::2]})
