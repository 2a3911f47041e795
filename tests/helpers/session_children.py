"""Child-process entry points for the publisher/session tests (``tests/test_*.py`` using ``session_rig``).

They live in an importable module so that ``multiprocessing``'s "spawn" start method (and plain
``subprocess`` runs with ``tests/`` on ``PYTHONPATH``) can find them as ``helpers.session_children``.
Each child talks to the test process over a simple channel (a ``multiprocessing`` pipe, a socketpair
or stdout) and exits 0 when it was asked to stop cleanly.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from typing import Any

import pyarrow as pa

import arrow_ipc_bridge as aib
from helpers.child_exit import leave

_LEN = struct.Struct("<Q")


# --- Arrow IPC helpers (shared with the tests) -------------------------------------------------------------
def to_ipc(obj: pa.Array | pa.RecordBatch | pa.Table) -> tuple[str, bytes]:
    """``(kind, bytes)``: ``obj`` as an Arrow IPC stream; arrays travel as a one-column batch."""
    if isinstance(obj, pa.Array):
        kind, schema, batches = (
            "array",
            pa.schema([pa.field("", obj.type)]),
            [pa.record_batch([obj], names=[""])],
        )
    elif isinstance(obj, pa.RecordBatch):
        kind, schema, batches = "batch", obj.schema, [obj]
    else:
        kind, schema, batches = "table", obj.schema, obj.to_batches()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return kind, sink.getvalue().to_pybytes()


def from_ipc(kind: str, data: bytes) -> pa.Array | pa.RecordBatch | pa.Table:
    """The inverse of :func:`to_ipc`."""
    reader = pa.ipc.open_stream(data)
    batches = list(reader)
    if kind == "table":
        return pa.Table.from_batches(batches, schema=reader.schema)
    (batch,) = batches
    return batch.column(0) if kind == "array" else batch


def _import_test_types() -> None:
    # The tests' extension type must be registered here too, so that IPC data carrying it is rebuilt
    # as that type (tests/ is on sys.path: spawn copies the parent's, subprocess gets PYTHONPATH).
    from helpers import arrow_types  # noqa: F401


# --- a long-lived producer, driven over a multiprocessing pipe ----------------------------------------------
def producer_main(conn: Any, own_path: str, upstream_path: str | None = None) -> None:
    """Serve objects the test process sends, on a Publisher at ``own_path``.

    Commands (tuples) and replies:

    * ``("ipc", name, kind, data, slice_or_None)``: rebuild an object from Arrow IPC bytes (optionally
      sliced ``(offset, length)``) and publish it -> ``("ok", stats_dict)``;
    * ``("relay", name)``: ``get`` ``name`` from the publisher at ``upstream_path`` and publish the
      imported object itself under ``name`` (no pyarrow in between) -> ``("ok", stats_dict)``;
    * ``("mmap", name, path, copy)``: publish the table of an Arrow IPC file memory-mapped from ``path``
      -> ``("ok", stats_dict)``;
    * ``("unpublish", name)`` -> ``("ok",)``;
    * ``("state",)`` -> ``("ok", active_leases, active_sessions, names)``;
    * ``("stop",)``: close everything -> ``("bye", active_leases)`` and exit 0.

    Any failure answers ``("error", type_name, message)`` and the loop goes on.
    """
    _import_test_types()
    publisher = aib.Publisher(own_path)
    upstream = aib.connect(upstream_path, timeout=10.0) if upstream_path else None
    conn.send(("ready", os.getpid()))
    keep: dict[str, Any] = {}  # memory-mapped tables stay referenced while published
    try:
        while True:
            command = conn.recv()
            op = command[0]
            try:
                if op == "ipc":
                    _, name, kind, data, window = command
                    obj = from_ipc(kind, data)
                    if window is not None:
                        obj = obj.slice(*window)
                    conn.send(("ok", vars(publisher.publish(name, obj))))
                elif op == "relay":
                    assert upstream is not None
                    with upstream.get(command[1]) as imported:
                        stats = publisher.publish(command[1], imported)
                    conn.send(("ok", vars(stats)))
                elif op == "mmap":
                    _, name, path, copy = command
                    table = pa.ipc.open_file(pa.memory_map(path)).read_all()
                    keep[name] = table
                    conn.send(("ok", vars(publisher.publish(name, table, copy=copy))))
                elif op == "unpublish":
                    publisher.unpublish(command[1])
                    keep.pop(command[1], None)
                    conn.send(("ok",))
                elif op == "state":
                    conn.send(("ok", publisher.active_leases, publisher.active_sessions, publisher.names()))
                elif op == "stop":
                    break
                else:
                    conn.send(("error", "ValueError", f"unknown command {op!r}"))
            except Exception as exc:
                conn.send(("error", type(exc).__name__, str(exc)))
    finally:
        if upstream is not None:
            upstream.close()
        publisher.close()
    conn.send(("bye", publisher.active_leases))
    conn.close()
    leave()


# --- export/import_message over a socketpair with SCM_RIGHTS ------------------------------------------------
def send_message(sock: socket.socket, message: bytes, fds: list[int]) -> None:
    """Send ``message`` (length-prefixed) with ``fds`` attached to its first bytes."""
    socket.send_fds(sock, [_LEN.pack(len(message))], fds)
    if message:
        sock.sendall(message)


def recv_message(sock: socket.socket, max_fds: int = 253) -> tuple[bytes, list[int]]:
    """Receive what :func:`send_message` sent; the caller owns the fds. ``(b"", [])`` at EOF."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, max_fds)
    if not head:
        return b"", fds
    while len(head) < _LEN.size:
        more = sock.recv(_LEN.size - len(head))
        if not more:
            raise EOFError("peer closed mid-header")
        head += more
    (size,) = _LEN.unpack(head)
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise EOFError("peer closed mid-message")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks), fds


def fd_relay_main(sock_fd: int) -> None:
    """Import each message that arrives on the socket, re-export the imported object, send it back.

    The loop per message: receive message + fds, ``Session().import_message``, close the received fds,
    ``aib.export(imported)``, release the import, send the new message + fds back, wait for a one
    byte acknowledgement, close the export. An empty message ends the loop (exit 0); a failure is
    reported as a message starting with ``b"ERROR:"`` without fds.
    """
    _import_test_types()
    sock = socket.socket(fileno=sock_fd)
    session = aib.Session()
    try:
        while True:
            message, fds = recv_message(sock)
            if not message:
                for fd in fds:
                    os.close(fd)
                break
            try:
                try:
                    imported = session.import_message(message, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
                with imported:
                    exported = aib.export(imported)
            except Exception as exc:
                send_message(sock, f"ERROR:{type(exc).__name__}: {exc}".encode(), [])
                continue
            with exported:
                send_message(sock, exported.message, exported.fds)
                if sock.recv(1) != b"k":
                    break
    finally:
        session.close()
        sock.close()


# --- a consumer that holds a lease until it is killed ------------------------------------------------------
def hold_lease_main(path: str, name: str) -> None:
    """Connect, ``get`` ``name``, build a pyarrow table from it, print ``held``, then sleep (to be killed)."""
    session = aib.connect(path, timeout=10.0)
    imported = session.get(name)
    table = pa.table(imported)
    print(f"held {table.num_rows}", flush=True)
    time.sleep(120)
    sys.exit(3)  # only reached if nobody killed us


# --- repro of a leak, isolated in its own process -----------------------------------------------------------
def _live_counts() -> tuple[int, int, int]:
    """Live owners, struct nodes and mappings of the C core, after collecting garbage and running
    the pending release notices."""
    import gc

    from arrow_ipc_bridge._ffi import lib
    from arrow_ipc_bridge.runtime import reaper

    gc.collect()
    reaper.settle()
    return int(lib.aib_live_owners()), int(lib.aib_live_nodes()), int(lib.aib_live_mappings())


def cache_size_zero_main(ipc_path: str) -> None:
    """Import a zero-copy table twice through ``Session(mapping_cache_size=0)``: it must work, cache
    nothing and leave no owner, node or mapping behind. Prints ``ok``; any failure exits non-zero."""
    table = pa.ipc.open_file(pa.memory_map(ipc_path)).read_all()
    with aib.export(table, copy="never") as exported:
        before = _live_counts()
        with aib.Session(mapping_cache_size=0) as session:
            for _ in range(2):
                with session.import_message(exported.message, exported.fds) as imported:
                    assert pa.table(imported).equals(table)
            assert session.mapping_cache.hits == 0
            assert len(session.mapping_cache) == 0
        after = _live_counts()
    assert after == before, f"live owners/nodes/mappings before {before}, after {after}"
    print("ok", flush=True)


def concurrent_miss_main(ipc_path: str) -> None:
    """Two threads import the same zero-copy region through one session at the same moment, both missing
    the mapping cache (``map_host_region`` is slowed down to make the race certain). Both imports must be
    correct, the cache must hold one entry, and once the session is closed no owner, node or mapping may
    be left. Prints ``ok``; any failure exits non-zero."""
    import threading

    from arrow_ipc_bridge.host import mappings

    real_map = mappings.map_host_region

    def slow_map(fd: int, region: Any) -> Any:
        time.sleep(0.2)  # both threads are past the cache lookup before either inserts
        return real_map(fd, region)

    mappings.map_host_region = slow_map  # type: ignore[assignment]

    table = pa.ipc.open_file(pa.memory_map(ipc_path)).read_all()
    with aib.export(table, copy="never") as exported:
        before = _live_counts()
        results: list[object] = []
        with aib.Session() as session:
            barrier = threading.Barrier(2)

            def work() -> None:
                barrier.wait(timeout=30)
                try:
                    with session.import_message(exported.message, exported.fds) as imported:
                        results.append(pa.table(imported).equals(table))
                except Exception as exc:
                    results.append(exc)

            threads = [threading.Thread(target=work) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert results == [True, True], results
            assert len(session.mapping_cache) == 1
        after = _live_counts()
    assert after == before, f"live owners/nodes/mappings before {before}, after {after}"
    print("ok", flush=True)
