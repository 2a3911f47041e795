"""Child-process entry points for the fault-injection, load and frame-fuzz tests.

They live in an importable module so that ``multiprocessing``'s "spawn" start method can find them.
A consumer child is driven over a control pipe: it does the work of one protocol *phase*, sends
``("reached", phase)`` and then waits to be SIGKILLed by the test, so the kill lands at a known
point of the protocol (not a racy sleep). A producer child publishes what it is told and reports
``("ready", pid)``; the test kills it while its consumers still hold data.

Phases that need to stop *inside* the protocol (a GET sent but its answer not read, half a RELEASE
frame written) speak the frames by hand over a raw socket: the session never leaves the protocol
in such a state on its own, but a process killed at the wrong instant does.
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
from arrow_ipc_bridge.transport import protocol
from helpers.child_exit import leave

_HEADER = struct.Struct("<4sHHIHH")  # magic, version, kind, payload length, fd count, reserved

# The phases at which the consumer-kill test SIGKILLs a consumer, in protocol order.
CONSUMER_PHASES = (
    "connected",  # socket connected, nothing sent
    "hello_sent",  # HELLO sent, WELCOME not read
    "handshaken",  # a Session after the handshake, nothing got
    "partial_header",  # half a frame header written
    "mid_get",  # GET sent, the ITEM (with its fds) not read
    "holding_lease",  # an imported object held (one lease)
    "holding_capsule",  # the import released, a pyarrow table built from it still held
    "holding_raw_capsule",  # the import released, an ArrowArrayStream PyCapsule nobody consumed held
    "mid_release",  # ITEM read by hand, half a RELEASE frame written
    "remembered",  # a re-got message remembered by the session, its leases released
    "many_leases",  # dozens of leases over several names held at once
)


def table_for(rows: int, seed: int) -> pa.Table:
    """The table the tests publish: deterministic contents so any consumer can check what it read."""
    base = seed * 1_000_003
    return pa.table(
        {
            "i": pa.array(range(base, base + rows), pa.int64()),
            "s": pa.array([f"row-{seed}-{k}" for k in range(rows)], pa.string()),
        }
    )


def frame(kind: int, payload: bytes = b"") -> bytes:
    """One transport frame (no descriptors) as bytes."""
    return _HEADER.pack(b"AIBT", 1, kind, len(payload), 0, 0) + payload


def recv_frame(sock: socket.socket, max_fds: int = 253) -> tuple[int, bytes, list[int]]:
    """Read one frame by hand: ``(kind, payload, fds)``; the caller owns the fds. Raises EOFError."""
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, max_fds)
    while len(head) < _HEADER.size:
        more, more_fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size - len(head), max_fds)
        fds += more_fds
        if not more:
            for fd in fds:
                os.close(fd)
            raise EOFError("peer closed mid-header")
        head += more
    magic, _version, kind, size, _nfds, _reserved = _HEADER.unpack(head)
    if magic != b"AIBT":
        raise ValueError(f"bad magic {magic!r}")
    payload = b""
    while len(payload) < size:
        chunk, more_fds, _flags, _addr = socket.recv_fds(sock, size - len(payload), max_fds)
        fds += more_fds
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise EOFError("peer closed mid-frame")
        payload += chunk
    return kind, payload, fds


def raw_handshake(path: str) -> socket.socket:
    """A raw socket that did HELLO/WELCOME with the publisher at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(frame(protocol.HELLO, protocol.encode_hello()))
    kind, _payload, fds = recv_frame(sock)
    for fd in fds:
        os.close(fd)
    if kind != protocol.WELCOME:
        raise RuntimeError(f"expected WELCOME, got frame kind {kind}")
    return sock


def _reach(conn: Any, phase: str, keep: list[object]) -> None:
    """Tell the test the phase is reached, then wait for the SIGKILL (``keep`` stays referenced)."""
    conn.send(("reached", phase))
    time.sleep(120)
    del keep
    sys.exit(3)  # only reached if nobody killed us


# --- a consumer killed at one protocol phase -----------------------------------------------------------
def consumer_phase_main(conn: Any, path: str, names: list[str]) -> None:
    """Report ``("ready", pid)``, wait for ``("go", phase)``, drive the protocol with the publisher at
    ``path`` up to ``phase`` and wait to be killed.

    The wait for "go" lets the test start children ahead (start-up is most of a trial's cost) while
    only one of them at a time talks to the publisher.
    """
    conn.send(("ready", os.getpid()))
    command = conn.recv()
    if command[0] != "go":
        sys.exit(0)
    phase = command[1]
    name = names[0]
    keep: list[object] = []
    try:
        if phase == "connected":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            keep.append(sock)
        elif phase == "hello_sent":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            sock.sendall(frame(protocol.HELLO, protocol.encode_hello()))
            keep.append(sock)
        elif phase == "handshaken":
            keep.append(aib.connect(path, timeout=10.0))
        elif phase == "partial_header":
            sock = raw_handshake(path)
            sock.sendall(frame(protocol.GET, name.encode())[:7])
            keep.append(sock)
        elif phase == "mid_get":
            sock = raw_handshake(path)
            sock.sendall(frame(protocol.GET, name.encode()))
            # Wait until the answer sits in our receive queue (the publisher took the lease and sent
            # the fds), without reading it: the kill then drops in-flight descriptors with the socket.
            deadline = time.monotonic() + 10
            while len(sock.recv(1, socket.MSG_PEEK)) == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            keep.append(sock)
        elif phase == "holding_lease":
            session = aib.connect(path, timeout=10.0)
            imported = session.get(name)
            keep += [session, imported]
        elif phase == "holding_capsule":
            session = aib.connect(path, timeout=10.0)
            imported = session.get(name)
            table = pa.table(imported)  # structs built from the import; they hold it alive
            imported.release()
            keep += [session, table]
        elif phase == "holding_raw_capsule":
            session = aib.connect(path, timeout=10.0)
            imported = session.get(name)
            capsule = imported.__arrow_c_stream__()  # its destructor would release the structs
            imported.release()
            keep += [session, capsule]
        elif phase == "mid_release":
            sock = raw_handshake(path)
            sock.sendall(frame(protocol.GET, name.encode()))
            kind, payload, fds = recv_frame(sock)
            if kind != protocol.ITEM:
                raise RuntimeError(f"expected ITEM, got frame kind {kind}: {payload[:200]!r}")
            lease_id, _message = protocol.decode_item(payload)
            release = frame(protocol.RELEASE, protocol.encode_lease(lease_id))
            sock.sendall(release[: _HEADER.size + 3])  # the header and 3 of the lease id's 8 bytes
            keep += [sock, fds]  # the region fds stay open in this process until it dies
        elif phase == "remembered":
            session = aib.connect(path, timeout=10.0)
            for _ in range(3):
                with session.get(name) as imported:
                    pa.table(imported)
            keep.append(session)
        elif phase == "many_leases":
            session = aib.connect(path, timeout=10.0)
            imports = [session.get(names[k % len(names)]) for k in range(48)]
            keep += [session, imports]
        else:
            raise ValueError(f"unknown phase {phase!r}")
    except Exception as exc:
        conn.send(("error", type(exc).__name__, str(exc)))
        sys.exit(2)
    _reach(conn, phase, keep)


# --- a producer killed while its consumers hold data ----------------------------------------------------
def producer_main(conn: Any, path: str, names: list[str], rows: int) -> None:
    """Publish ``table_for(rows, k)`` as ``names[k]`` (copied into sealed memfds) and wait to be killed.

    Sends ``("ready", pid)`` once everything is published. The command ``("stop",)`` closes the
    publisher and exits 0 (used only when a test ends early).
    """
    publisher = aib.Publisher(path)
    for k, name in enumerate(names):
        publisher.publish(name, table_for(rows, k))
    conn.send(("ready", os.getpid()))
    while True:
        command = conn.recv()
        if command[0] == "stop":
            break
    publisher.close()
    leave()


# --- what a surviving process holds (used by the tests in the process that survives) -------------------
def resource_counts() -> dict[str, int]:
    """Open fds, threads (Python's and the kernel's) and mappings of bridge memfds in this process.

    The bridge's copied regions are memfds named ``aib-*`` (``host/sealed_copy.py``); a mapping of one that
    outlives every lease on it is a leak, as is a descriptor or a thread.
    """
    import threading

    with open("/proc/self/maps") as maps:
        memfd_maps = sum(1 for line in maps if "/memfd:aib" in line)
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "memfd_maps": memfd_maps,
    }


def settled(read: Any, baseline: Any, timeout: float = 10.0) -> Any:
    """Poll ``read()`` until it equals ``baseline`` or ``timeout`` passes; the last reading.

    Leases end and connection threads exit asynchronously (the publisher's handler sees the socket
    close, the reaper closes the export), so a bounded wait is part of the guarantee, not a race.
    """
    deadline = time.monotonic() + timeout
    while True:
        now = read()
        if now == baseline or time.monotonic() > deadline:
            return now
        time.sleep(0.005)


def quiet_counts(publisher: Any, sessions: int = 0, timeout: float = 10.0) -> dict[str, int]:
    """:func:`resource_counts` once ``publisher`` serves ``sessions`` connections, holds no lease and
    the counts stopped moving.

    What a connection leaves ends a moment after it: its handler thread exits, and the export of an
    entry unpublished under a lease is closed by the reaper once that lease ended. A baseline taken
    in that moment would count them. Garbage earlier tests left (pipes of multiprocessing objects
    in reference cycles) is collected first, so that a collection during the test does not lower
    the counts under the baseline.
    """
    import gc
    import threading

    gc.collect()
    deadline = time.monotonic() + timeout
    last: dict[str, int] | None = None
    while time.monotonic() < deadline:
        # A connection's handler thread is named "<server>-fd<N>-pid<P>"; a session silent for the
        # publisher's park_after holds none (it is parked), so at most one per open session.
        handlers = sum("-fd" in thread.name and "-pid" in thread.name for thread in threading.enumerate())
        idle = publisher.active_sessions == sessions and handlers <= sessions and not publisher.active_leases
        now = resource_counts()
        if idle and now == last:
            return now
        last = now if idle else None
        time.sleep(0.02)
    return resource_counts()
