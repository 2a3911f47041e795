"""Child-process entry points for the GPU tests (spawned: CUDA must never be initialised before a fork).

Every entry point takes plain picklable arguments, talks to the parent over a multiprocessing
connection, and exits 0 on success, non-zero (with the traceback printed) on failure.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import pyarrow as pa

from helpers.counting import SessionCounts


def _ipc_bytes(obj: Any) -> bytes:
    """Arrow IPC stream bytes of an array (as a one-column table), batch or table."""
    if isinstance(obj, pa.Table):
        table = obj
    elif isinstance(obj, pa.RecordBatch):
        table = pa.Table.from_batches([obj])
    else:  # an array (a struct array with top-level nulls, for instance)
        table = pa.table({"value": obj})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def consumer_loop(socket_path: str, conn: Connection, pool_linger: float = 1.0) -> None:
    """Serve the parent: for each name received, get it, copy to host, send Arrow IPC bytes back (with
    the device id and the session's remembered-get count). ``("forget", name)`` forgets ``name``
    and answers ``("ok", forgotten, pool pointers still imported in this process)``; ``("stats",)``
    answers ``("ok", cuda.cuda_stats() + {"pools_cached", "new_message_gets", "legacy_held",
    "kept_held"})``: the last two are what the process's region table holds open beyond their arrays
    (legacy handles, kept slabs)."""
    counts = SessionCounts()
    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import opener as cuda_opener

    try:
        with aib.connect(socket_path, timeout=30.0, pool_linger=pool_linger) as session:
            while True:
                name = conn.recv()
                if name is None:
                    break
                if isinstance(name, tuple) and name[0] == "forget":
                    forgotten = session.forget(name[1])
                    conn.send(("ok", forgotten, len(cuda_opener.opener()._pool_pointers)))
                    continue
                if name == ("stats",):
                    stats = cuda.cuda_stats()
                    stats["pools_cached"] = len(cuda_opener.opener()._pools)
                    stats["new_message_gets"] = counts.new_message_gets
                    stats["legacy_held"] = len(list(cuda_opener.opener()._legacy))
                    stats["kept_held"] = len(list(cuda_opener.opener()._kept))
                    conn.send(("ok", stats))
                    continue
                try:
                    with session.get(name) as imported:
                        host = imported.to_host()
                        conn.send(("ok", _ipc_bytes(host), imported.device_id, counts.remembered_gets))
                except Exception as exc:  # report, keep serving
                    conn.send(("error", f"{type(exc).__name__}: {exc}", -1, counts.remembered_gets))
    except Exception:
        traceback.print_exc()
        sys.exit(1)


def cudf_style_reader(socket_path: str, name: str, conn: Connection) -> None:
    """Like cuDF: take the device array capsule, wait on its sync_event (if any) on a stream, then
    read a buffer with a kernel on that stream. Connects, says "ready", then for every "go" gets
    ``name`` and sends back (values of the first column, whether the struct carried an event)."""
    import cupy

    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge._ffi import ffi
    from arrow_ipc_bridge.wire.capsules import capsule_struct

    try:
        with aib.connect(socket_path, timeout=30.0) as session:
            conn.send("ready")
            while conn.recv() == "go":
                with session.get(name) as imported:
                    schema_capsule, array_capsule = imported.__arrow_c_device_array__()
                    device_array = capsule_struct(array_capsule, "device_array")
                    cupy.cuda.Device(int(device_array.device_id)).use()
                    stream = cupy.cuda.Stream(non_blocking=True)
                    had_event = bool(device_array.sync_event)
                    if had_event:
                        cuda.stream_wait_event(stream.ptr, cuda.event_value(device_array.sync_event))
                    column = device_array.array.children[0]
                    length = int(column.length)
                    ptr = int(ffi.cast("uintptr_t", column.buffers[1]))
                    memory = cupy.cuda.UnownedMemory(ptr, length * 4, owner=imported)
                    values = cupy.ndarray((length,), cupy.float32, cupy.cuda.MemoryPointer(memory, 0))
                    with stream:
                        copy = values * 1  # a kernel on the stream that waited on the producer's event
                    stream.synchronize()
                    conn.send((cupy.asnumpy(copy).tolist(), had_event))
                    del schema_capsule, array_capsule, device_array, column, values, memory
    except Exception:
        traceback.print_exc()
        sys.exit(1)


def cupy_producer(socket_path: str, conn: Connection, rows: int) -> None:
    """Publish CuPy columns (legacy IPC memory), carved from one bigger allocation at an offset,
    tell the parent, then wait to be killed or told to stop."""
    import cupy

    import arrow_ipc_bridge as aib

    try:
        block = cupy.arange(rows * 3, dtype=cupy.float32)
        columns = {"a": block[rows : 2 * rows], "b": cupy.arange(rows, dtype=cupy.int64) * 2}
        cupy.cuda.runtime.deviceSynchronize()
        with aib.Publisher(socket_path) as pub:
            pub.publish("cupy", aib.from_cuda_arrays(columns))
            pub.publish("pool", aib.to_device(pa.record_batch({"v": pa.array(range(rows))})))
            conn.send(("ready", os.getpid()))
            while True:
                if conn.poll(0.1):
                    message = conn.recv()
                    if message == "stop":
                        break
                    if message == "leases":
                        conn.send(pub.active_leases)
    except Exception:
        traceback.print_exc()
        sys.exit(1)


def holding_consumer(socket_path: str, name: str, conn: Connection) -> None:
    """Get ``name``, build a device array capsule from it, tell the parent, then sleep until killed."""
    import arrow_ipc_bridge as aib

    session = aib.connect(socket_path, timeout=30.0)
    imported = session.get(name)
    capsules = imported.__arrow_c_device_array__()
    conn.send("held")
    time.sleep(600)
    del capsules


def swapped_gpu_producer(socket_path: str, conn: Connection) -> None:
    """Publish a table from a process that sees the GPUs in the opposite order (CUDA_VISIBLE_DEVICES
    "1,0"), so its device 0 is the consumer's device 1: the message must name the GPU by UUID."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"  # before CUDA initialises in this process
    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge import cuda

    try:
        with aib.Publisher(socket_path) as pub:
            pub.publish("t", aib.to_device(pa.table({"v": pa.array(range(1000))}), device=0))
            conn.send(("ready", cuda.device_uuid(0).hex()))
            conn.recv()  # "stop"
    except Exception:
        traceback.print_exc()
        sys.exit(1)


def cupy_step_consumer(socket_path: str, conn: Connection, steps: int, hold_every: int) -> None:
    """A step loop's consumer with standing leases: per parent "go", get "t", take every column as
    CuPy arrays (column_arrays), read the first value of each, release the import; with
    ``hold_every`` > 0, keep the arrays of every such step until the next step (so the kept arrays
    are held then). Sends the values read per step, then the session's counts."""
    counts = SessionCounts()
    try:
        import cupy

        import arrow_ipc_bridge as aib

        read: list[list[float]] = []
        held: dict[str, Any] | None = None
        with aib.connect(socket_path, timeout=30.0, pool_linger=5.0) as session:
            for step in range(steps):
                conn.recv()
                with session.get("t") as imported:
                    arrays = aib.column_arrays(imported, "cupy")
                firsts = cupy.concatenate([array[:1] for array in arrays.values()])  # on the current stream
                read.append([float(value) for value in firsts.get()])
                held = arrays if hold_every and step % hold_every == 0 else None
                del arrays, firsts
                conn.send(step)
            del held
            conn.send({"read": read, "reused": counts.reused_cupy_arrays, "local_gets": counts.local_gets})
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def get_next_step_consumer(socket_path: str, conn: Connection, steps: int) -> None:
    """A step loop's consumer that waits with get_next (standing leases: on the version board)
    instead of a "go": gets "t" once (sends "ready"), then per step waits for the version after the
    last one, waits on its event on the legacy default stream, reads the last column's first value
    and sends it. Sends the session's and the process's counts at the end."""
    counts = SessionCounts()
    try:
        import arrow_ipc_bridge as aib

        with aib.connect(socket_path, timeout=30.0, pool_linger=5.0) as session:
            with session.get("t", wait=0) as first:
                after = first.version or 0
            conn.send("ready")
            for _ in range(steps):
                with session.get_next("t", after=after, timeout=30.0) as imported:
                    after = imported.version or 0
                    arrays = aib.column_arrays(imported, "cupy", stream=0)
                    value = float(list(arrays.values())[-1][:1].get()[0])
                    del arrays
                conn.send(value)
            waits = aib.stats().waits
            conn.send(
                {
                    "local_gets": counts.local_gets,
                    "board_waits": waits.board_waits,
                    "waits_sent": waits.waits_sent,
                }
            )
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
