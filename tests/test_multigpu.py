"""Several GPUs on one host: producers on both GPUs, consumers on both, reads in place and copies.

Needs two GPUs (skips with the reason otherwise). Producers and consumers are spawned processes
that set ``CUDA_VISIBLE_DEVICES`` before CUDA starts, so the two sides number the GPUs differently;
the data names its GPU by UUID. An in-place read is a raw CUDA kernel on the reader's GPU copying the
producer's bytes (no library that might enable peer access on its own); a copy is
``imported.to_device(k)``. The child functions live here, at module level, so that ``spawn`` finds them.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pyarrow as pa
import pytest

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.gpu

_CTX = mp.get_context("spawn")
_ROWS = 4099  # not a multiple of any alignment: the last bytes of each buffer count
_NUMERIC = [
    pa.int8(),
    pa.int16(),
    pa.int32(),
    pa.int64(),
    pa.uint8(),
    pa.uint16(),
    pa.uint32(),
    pa.uint64(),
    pa.float16(),
    pa.float32(),
    pa.float64(),
]
_COPY_BYTES = r"""
extern "C" __global__ void copy_bytes(const unsigned char* src, unsigned char* dst, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}
"""


@pytest.fixture(scope="module", autouse=True)
def _two_gpus() -> None:
    try:
        import cupy
    except ImportError:
        pytest.skip("CuPy is not installed (the multi-GPU tests read through CuPy kernels)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        pytest.skip(f"no usable CUDA GPU: {exc}")
    if count < 2:
        pytest.skip(f"needs two GPUs; this machine shows {count}")


def numeric_table(seed: int) -> pa.Table:
    """One column per numeric type; values that differ per row, per column and per ``seed``."""
    import numpy as np

    columns = {}
    for index, arrow_type in enumerate(_NUMERIC):
        values = (np.arange(_ROWS, dtype=np.int64) * (index + 3) + seed) % 120
        columns[f"c_{arrow_type}"] = pa.array(values.astype(arrow_type.to_pandas_dtype()), arrow_type)
    return pa.table(columns)


def _socket_path() -> str:
    return os.path.join(tempfile.mkdtemp(dir="/tmp"), "multigpu.sock")


def _join(process: Any, timeout: float = 120) -> None:
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(5)
        pytest.fail("child process did not finish in time")
    assert process.exitcode == 0, f"child exited with {process.exitcode}"


# ---------- children ------------------------------------------------------------------------------
def producer_on_both_gpus(socket_path: str, visible: str, conn: Connection) -> None:
    """Publish a numeric table on each of its GPUs, in legacy and in pool memory ("legacy_on0",
    "pool_on1", ...: its own ordinals), and a record batch of one CuPy column ("batch_on0", values
    ``3 * i + device``), send the GPUs' UUIDs, serve until told to stop."""
    os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before CUDA initialises in this process
    from arrow_ipc_bridge import cuda

    try:
        with aib.Publisher(socket_path) as pub:
            batches = []  # the record batches' CuPy arrays (their publications hold them too)
            for device in (0, 1):
                for allocation in ("legacy", "pool"):
                    data = aib.to_device(numeric_table(device), device, allocation=allocation)
                    pub.publish(f"{allocation}_on{device}", data)
                # A record batch of CuPy (cudaMalloc) columns: an ImportedArray on the consumer's
                # side, whose capsules the C core builds from its owner's view
                import cupy

                with cupy.cuda.Device(device):
                    batches.append({"v": cupy.arange(_ROWS, dtype=cupy.int64) * 3 + device})
                    cupy.cuda.Device(device).synchronize()
                pub.publish(f"batch_on{device}", aib.from_cuda_arrays(batches[-1]))
            conn.send(("ready", [cuda.format_uuid(cuda.device_uuid(d)) for d in (0, 1)]))
            conn.recv()  # "stop"
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _read_in_place(imported: Any, reader: int, column: str) -> bytes:
    """The column's bytes as a kernel on GPU ``reader`` reads them from where they live."""
    import numpy as np

    interface = aib.column_view(imported, column).__cuda_array_interface__
    nbytes = int(np.prod(interface["shape"])) * np.dtype(interface["typestr"]).itemsize
    return _kernel_read(interface["data"][0], nbytes, reader)


def _kernel_read(pointer: int, nbytes: int, reader: int) -> bytes:
    """``nbytes`` at device address ``pointer`` as a kernel on GPU ``reader`` reads them (no library
    that might enable peer access on its own)."""
    import cupy
    import numpy as np

    with cupy.cuda.Device(reader):
        out = cupy.zeros(nbytes, dtype=cupy.uint8)
        cupy.RawKernel(_COPY_BYTES, "copy_bytes")((64,), (256,), (np.uint64(pointer), out, np.uint64(nbytes)))
        cupy.cuda.Device(reader).synchronize()
        return bytes(out.get())


@contextlib.contextmanager
def _serving_both_gpus() -> Iterator[tuple[str, int, int]]:
    """A ``producer_on_both_gpus`` process (its GPUs numbered as ours) serving until the block
    ends: ``(its socket path, our ordinal of its GPU 0, the other GPU: the reader)``."""
    from arrow_ipc_bridge import cuda

    path = _socket_path()
    parent, child = _CTX.Pipe()
    producer = _CTX.Process(target=producer_on_both_gpus, args=(path, "0,1", child))
    producer.start()
    try:
        assert parent.poll(120), "producer did not start"
        status, uuids = parent.recv()
        assert status == "ready", uuids
        source = cuda.ordinal_for_uuid(bytes.fromhex(uuids[0][4:].replace("-", "")))
        yield path, source, 1 - source
    finally:
        parent.send("stop")
        _join(producer)


def _check_on_reader(socket_path: str, name: str, reader: int, here: int, expected: pa.Table) -> list[str]:
    """Read publication ``name`` (on our GPU ``here``) from GPU ``reader``: in place, copied with
    to_device on a stream of the reader's GPU, and through Session(cross_device='copy')."""
    import cupy

    from arrow_ipc_bridge.cuda import peer

    problems = []
    with (
        aib.connect(socket_path, timeout=30.0, reader_device=reader) as session,
        session.get(name) as imported,
    ):
        if imported.device_id != here:
            problems.append(f"{name}: device_id {imported.device_id}, expected {here}")
        if reader != here and not peer.peer_access_enabled(reader, here):
            problems.append(f"{name}: peer access {reader} -> {here} not enabled")
        for field in expected.schema:
            want = expected.column(field.name).chunk(0).buffers()[1].to_pybytes()
            got = _read_in_place(imported, reader, field.name)
            if got[: len(want)] != want:
                problems.append(f"{name} read in place on GPU {reader}: {field.name}")
        counted = aib.stats().cuda
        with cupy.cuda.Device(reader):
            stream = cupy.cuda.Stream(non_blocking=True)  # a stream of the reader's GPU
            copy = imported.to_device(reader, stream=stream.ptr)
        after = aib.stats().cuda
        copies = after.device_copies - counted.device_copies
        copied = after.device_copied_bytes - counted.device_copied_bytes
        if copies != 1 or copied <= 0:
            problems.append(f"{name}: aib.stats().cuda counted {copies} copies, {copied} bytes for one copy")
        with copy:
            if copy.device_id != reader:
                problems.append(f"{name}: copy on {copy.device_id}, expected {reader}")
            if not pa.table(copy.to_host()).equals(expected):
                problems.append(f"{name} copied to GPU {reader}: values differ")
    # One object made readable by hand: a plain session's import, then readable_on
    with aib.connect(socket_path, timeout=30.0) as session, session.get(name) as imported:
        with imported.readable_on(reader) as readable:
            if readable.device_id != here:
                problems.append(f"{name}: readable_on({reader}) reports device {readable.device_id}")
            column = expected.schema.names[-1]
            want = expected.column(column).chunk(0).buffers()[1].to_pybytes()
            if _read_in_place(readable, reader, column)[: len(want)] != want:
                problems.append(f"{name} read in place on GPU {reader} through readable_on: {column}")
        if reader == here and readable is not imported:
            problems.append(f"{name}: readable_on its own GPU made a new object")
    with (
        aib.connect(socket_path, timeout=30.0, reader_device=reader, cross_device="copy") as session,
        session.get(name) as copied,
    ):
        if copied.device_id != reader or not pa.table(copied.to_host()).equals(expected):
            problems.append(f"{name} through cross_device='copy' on GPU {reader}")
    return problems


def consumer_on_both_gpus(socket_path: str, visible: str, uuids: list[str], conn: Connection) -> None:
    """From a process numbering the GPUs as ``visible`` says, read every publication on each GPU
    from both GPUs and report every mismatch (an empty list: all good)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    from arrow_ipc_bridge import cuda

    problems: list[str] = []
    try:
        mine = [cuda.format_uuid(cuda.device_uuid(d)) for d in (0, 1)]
        for producer_ordinal, uuid in enumerate(uuids):
            here = mine.index(uuid)  # our ordinal of the producer's GPU
            expected = numeric_table(producer_ordinal)
            for allocation in ("legacy", "pool"):
                for reader in (0, 1):
                    name = f"{allocation}_on{producer_ordinal}"
                    problems += _check_on_reader(socket_path, name, reader, here, expected)
        conn.send(("done", problems))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def mixed_stream_producer(socket_path: str, conn: Connection) -> None:
    """A live stream whose batches come from GPU 0 and GPU 1 in turn (one publisher)."""
    import time

    import cupy

    try:
        with aib.Publisher(socket_path) as pub:
            writer = pub.open_stream("mixed")
            conn.send(("ready", None))
            deadline = time.monotonic() + 60
            while writer.subscribers < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            for sequence in range(6):
                device = sequence % 2
                with cupy.cuda.Device(device):
                    column = cupy.arange(_ROWS, dtype=cupy.int64) + sequence * 1000
                    writer.write(aib.from_cuda_arrays({"v": column}))
            writer.close()
            conn.recv()  # "stop"
    except Exception:
        conn.send(("error", traceback.format_exc()))


# ---------- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("producer_visible", "consumer_visible"), [("0,1", "1,0"), ("1,0", "0,1"), ("0,1", "0,1")]
)
def test_producers_and_consumers_on_both_gpus(producer_visible: str, consumer_visible: str) -> None:
    """One publisher with data on both GPUs (legacy and pool memory, every numeric type); a consumer
    numbering the GPUs otherwise reads each on both GPUs: in place through a kernel on the reader's
    GPU, copied with to_device on a stream of its own, and through Session(cross_device='copy')."""
    path = _socket_path()
    parent, child = _CTX.Pipe()
    producer = _CTX.Process(target=producer_on_both_gpus, args=(path, producer_visible, child))
    producer.start()
    try:
        assert parent.poll(120), "producer did not start"
        status, uuids = parent.recv()
        assert status == "ready", uuids
        c_parent, c_child = _CTX.Pipe()
        consumer = _CTX.Process(target=consumer_on_both_gpus, args=(path, consumer_visible, uuids, c_child))
        consumer.start()
        assert c_parent.poll(300), "consumer did not answer"
        status, problems = c_parent.recv()
        _join(consumer)
        assert status == "done", problems
        assert problems == []
    finally:
        parent.send("stop")
        _join(producer)


def test_a_record_batch_on_the_other_gpu_reads_in_place_through_its_capsule() -> None:
    """A record batch of cudaMalloc columns on the other GPU, got by a reader_device session: the
    ``ArrowDeviceArray`` the C core builds from the object's owner names the reader's mapping
    (what ``column_view`` names too), still reports the producer's GPU, and a kernel on the
    reader reads the values there."""
    import numpy as np

    from arrow_ipc_bridge._ffi import ffi
    from arrow_ipc_bridge.wire.capsules import capsule_struct

    with _serving_both_gpus() as (path, source, reader):
        want = (np.arange(_ROWS, dtype=np.int64) * 3).tobytes()
        with aib.connect(path, timeout=30.0) as plain, plain.get("batch_on0") as on_owner:
            owner_pointer = aib.column_view(on_owner, "v").__cuda_array_interface__["data"][0]
        with aib.connect(path, timeout=30.0, reader_device=reader) as session:
            for _ in range(3):  # the first get, then remembered ones
                with session.get("batch_on0") as imported:
                    assert imported.device_id == source
                    schema, array = imported.__arrow_c_device_array__()
                    device_array = capsule_struct(array, "device_array")
                    assert device_array.device_id == source
                    pointer = int(ffi.cast("uintptr_t", device_array.array.children[0].buffers[1]))
                    assert pointer != owner_pointer  # the reader's mapping, not the owner's
                    assert pointer == aib.column_view(imported, "v").__cuda_array_interface__["data"][0]
                    assert _kernel_read(pointer, len(want), reader) == want
                    del schema, array, device_array


def test_list_names_each_gpu_by_uuid_and_ordinal(capsys: pytest.CaptureFixture[str]) -> None:
    """``list --json`` says for each name the GPU: this process's ordinal and the UUID."""
    import json

    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cli import main

    path = _socket_path()
    parent, child = _CTX.Pipe()
    producer = _CTX.Process(target=producer_on_both_gpus, args=(path, "1,0", child))
    producer.start()
    try:
        assert parent.poll(120), "producer did not start"
        status, uuids = parent.recv()
        assert status == "ready", uuids
        assert main(["list", path, "--json"]) == 0
        rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
        for producer_ordinal, uuid in enumerate(uuids):
            ours = [cuda.format_uuid(cuda.device_uuid(d)) for d in range(cuda.device_count())].index(uuid)
            row = rows[f"legacy_on{producer_ordinal}"]
            assert row["gpu_uuid"] == uuid
            assert row["device"] == f"cuda:{ours}"
    finally:
        parent.send("stop")
        _join(producer)


def test_stream_with_batches_from_both_gpus() -> None:
    """A live stream's batches come from GPU 0 and GPU 1 in turn; each arrives on its own GPU."""
    path = _socket_path()
    parent, child = _CTX.Pipe()
    producer = _CTX.Process(target=mixed_stream_producer, args=(path, child))
    producer.start()
    try:
        assert parent.poll(120), "producer did not start"
        status, detail = parent.recv()
        assert status == "ready", detail
        seen = []
        with aib.connect(path, timeout=30.0) as session, session.subscribe("mixed", timeout=60) as live:
            for batch in live:
                with batch:
                    values = pa.record_batch(batch.to_host()).column(0).to_pylist()
                    seen.append((batch.device_id, values[0], len(values)))
        assert [device for device, _, _ in seen] == [0, 1, 0, 1, 0, 1]
        assert [first for _, first, _ in seen] == [0, 1000, 2000, 3000, 4000, 5000]
        assert all(rows == _ROWS for _, _, rows in seen)
    finally:
        parent.send("stop")
        _join(producer)


def test_producer_exits_while_a_consumer_on_the_other_gpu_holds_its_data() -> None:
    """Data got on GPU 1 from a producer on GPU 0, held in place and copied; the producer exits. The
    copy stays intact, releasing what is held raises nothing, the session reports the publisher gone."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.errors import TransportError

    path = _socket_path()
    parent, child = _CTX.Pipe()
    producer = _CTX.Process(target=producer_on_both_gpus, args=(path, "0,1", child))
    producer.start()
    stopped = False
    try:
        assert parent.poll(120), "producer did not start"
        status, uuids = parent.recv()
        assert status == "ready", uuids
        source = cuda.ordinal_for_uuid(bytes.fromhex(uuids[0][4:].replace("-", "")))
        reader = 1 - source
        session = aib.connect(path, timeout=30.0, reader_device=reader)
        held = [session.get("legacy_on0"), session.get("pool_on0")]
        copies = [imported.to_device(reader) for imported in held]
        parent.send("stop")
        stopped = True
        _join(producer)
        expected = numeric_table(0)
        for copy in copies:
            assert pa.table(copy.to_host()).equals(expected)
        for imported in held:
            imported.release()
        with pytest.raises(TransportError):  # PeerClosedError, or a refused reconnect
            session.get("legacy_on0")
        session.close()
        for copy in copies:
            copy.release()
    finally:
        if not stopped:
            parent.send("stop")
            _join(producer)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_thousand_cross_gpu_imports_hold_nothing() -> None:
    """1,000 gets of data on the other GPU, each read in place and copied, then released: open
    descriptors, IPC events, handles (those opened for the reader too), pending callbacks and free
    GPU memory stay flat after warm-up."""
    import cupy

    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import cross_gpu
    from arrow_ipc_bridge.cuda.opener import opener
    from arrow_ipc_bridge.runtime import reaper

    with _serving_both_gpus() as (path, _source, reader):
        want = numeric_table(0).column("c_int64").chunk(0).buffers()[1].to_pybytes()

        def snapshot() -> dict[str, int]:
            gc.collect()
            reaper.settle()
            for device in (0, 1):
                cupy.cuda.Device(device).synchronize()
            stats = aib.stats().cuda
            return {
                "fds": _open_fds(),
                "ipc_events": cuda.ipc_event_cache_size(),
                "legacy_opens": stats.legacy_opens,
                "pool_imports": stats.pool_imports,
                "pending_callbacks": reaper.pending_callbacks(),
                "pending_copies": len(cross_gpu._pending),
                "reader_opens": len(opener()._reader_legacy_live),
                "free_0": cupy.cuda.Device(0).mem_info[0],
                "free_1": cupy.cuda.Device(1).mem_info[0],
            }

        with aib.connect(path, timeout=30.0, reader_device=reader) as session:

            def one_round(name: str) -> None:
                with session.get(name) as imported, imported.to_device(reader) as copy:
                    assert _read_in_place(imported, reader, "c_int64")[: len(want)] == want, name
                    copy.to_host()

            for _ in range(50):
                for name in ("legacy_on0", "pool_on0"):
                    one_round(name)
            before = snapshot()
            for _ in range(500):
                for name in ("legacy_on0", "pool_on0"):
                    one_round(name)
            after = snapshot()
        assert before["reader_opens"] >= 1  # the legacy data was read through the reader's mapping
        for key in ("fds", "ipc_events", "legacy_opens", "pool_imports", "pending_callbacks", "reader_opens"):
            assert after[key] <= before[key], (key, before, after)
        assert after["pending_copies"] <= 1
        for key in ("free_0", "free_1"):
            assert before[key] - after[key] < 64 << 20, (key, before, after)


def test_re_gets_on_another_gpu_are_remembered_as_the_reader_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session reading another GPU's data in place remembers each message as its reader reads it:
    from the third get of a name on (the message remembered on its second, with its standing lease),
    a re-get hands out the object the get made, already readable on the reader, with no placement
    work (no reader_mappings call, no second import) and no copy; the bytes a kernel on the reader
    reads are the producer's, for legacy (reopened in the reader's context) and pool memory."""
    import numpy as np

    from arrow_ipc_bridge.cuda import cross_gpu

    calls = []
    real = cross_gpu.reader_mappings

    def counting(imported: Any, reader: int) -> Any:
        calls.append(imported.name)
        return real(imported, reader)

    monkeypatch.setattr(cross_gpu, "reader_mappings", counting)
    with _serving_both_gpus() as (path, source, reader):
        want = numeric_table(0).column("c_int64").chunk(0).buffers()[1].to_pybytes()
        with aib.connect(path, timeout=30.0, reader_device=reader) as session:
            for name in ("legacy_on0", "pool_on0", "batch_on0"):
                for _ in range(3):  # the first gets: imported, remembered, standing lease
                    with session.get(name):
                        pass
                calls.clear()
                before = aib.stats()
                for _ in range(20):
                    with session.get(name) as imported:
                        assert imported.device_id == source, name
                        assert imported._mapped_on is not None, name
                        assert imported._mapped_on[0] == reader, name
                        if name != "batch_on0":
                            assert _read_in_place(imported, reader, "c_int64")[: len(want)] == want, name
                        else:
                            got = _read_in_place(imported, reader, "v")
                            expected = (np.arange(_ROWS, dtype=np.int64) * 3).tobytes()
                            assert got == expected, name
                after = aib.stats()
                assert calls == [], (name, calls)
                assert after.session.local_gets - before.session.local_gets == 20, name
                assert after.cuda.device_copies == before.cuda.device_copies, name


def test_columns_on_two_gpus_are_refused_naming_both() -> None:
    """A batch has one device: columns on both GPUs are refused by the C query over all columns,
    naming both ordinals; the same columns one GPU at a time are accepted."""
    import cupy

    with cupy.cuda.Device(0):
        on0 = cupy.arange(16, dtype=cupy.int64)
    with cupy.cuda.Device(1):
        on1 = cupy.arange(16, dtype=cupy.int64)
    with pytest.raises(aib.BridgeError, match=r"several devices \[0, 1\]"):
        aib.from_cuda_arrays({"a": on0, "b": on1})
    from arrow_ipc_bridge.wire.capsules import capsule_struct

    _, array = aib.from_cuda_arrays({"a": on1, "b": on1}).__arrow_c_device_array__()
    assert capsule_struct(array, "device_array").device_id == 1


def grant_imported_pool_child(socket_path: str, conn: Connection) -> None:
    """In a fresh process (a failed read must not poison the test process's contexts): get
    "pool_on0" on a plain session (nothing granted), read the imported pool's access for the other
    GPU, grant it with ``cuMemPoolSetAccess`` on the imported pool, read the access again, and copy
    the column's bytes with a kernel on the other GPU. Sends what it saw."""
    try:
        import numpy as np

        from arrow_ipc_bridge import cuda
        from arrow_ipc_bridge.cuda._declarations import (
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            CU_MEM_LOCATION_TYPE_DEVICE,
        )
        from arrow_ipc_bridge.cuda._driver import _api
        from arrow_ipc_bridge.cuda.opener import opener
        from arrow_ipc_bridge.wire.metadata import REGION_CUDA_POOL

        seen: dict[str, Any] = {}
        with aib.connect(socket_path, timeout=30.0) as session, session.get("pool_on0") as imported:
            owner_gpu = imported.device_id
            reader = 1 - owner_gpu
            pools = [r for r in imported._decoded.regions() if r.kind == REGION_CUDA_POOL]
            pool = opener().imported_pool(pools[0].handle[:24])
            assert pool is not None, "the pool is imported by this process"
            lib, driver_ffi = _api()
            location = driver_ffi.new("CUmemLocation *")
            location.type = CU_MEM_LOCATION_TYPE_DEVICE
            location.id = reader
            flags = driver_ffi.new("CUmemAccess_flags *")
            handle = driver_ffi.cast("CUmemoryPool", pool.handle)
            seen["get_before"] = int(lib.cuMemPoolGetAccess(flags, handle, location))
            seen["access_before"] = int(flags[0])
            desc = driver_ffi.new("CUmemAccessDesc *")
            desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = reader
            desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            with cuda.device_context(owner_gpu):
                seen["set"] = int(lib.cuMemPoolSetAccess(handle, desc, 1))
            seen["get_after"] = int(lib.cuMemPoolGetAccess(flags, handle, location))
            seen["access_after"] = int(flags[0])
            want = np.asarray(numeric_table(0).column("c_int64").to_numpy()).tobytes()
            seen["read_ok"] = _read_in_place(imported, reader, "c_int64") == want
        conn.send(("done", seen))
    except Exception:
        conn.send(("error", traceback.format_exc()))


def test_a_consumer_may_grant_its_own_gpu_access_to_an_imported_pool() -> None:
    """The question of issue 31, answered: a consumer may give its own GPU access to an IPC memory
    pool it imported from a producer on another GPU. ``cuMemPoolSetAccess`` on the imported pool
    succeeds in the consumer's process, ``cuMemPoolGetAccess`` then reports read-write for that GPU,
    and a kernel there reads the producer's bytes in place (what ``grant_in_place`` relies on)."""
    from arrow_ipc_bridge.cuda._declarations import CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    with _serving_both_gpus() as (path, _source, _reader):
        parent, child = _CTX.Pipe()
        process = _CTX.Process(target=grant_imported_pool_child, args=(path, child))
        process.start()
        assert parent.poll(120), "the consumer did not answer"
        status, seen = parent.recv()
        _join(process)
    assert status == "done", seen
    assert seen["get_before"] == 0
    assert seen["set"] == 0, f"cuMemPoolSetAccess on the imported pool: CUresult {seen['set']}"
    assert seen["get_after"] == 0
    assert seen["access_after"] == CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert seen["read_ok"]
