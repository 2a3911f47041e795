#!/usr/bin/env python
"""Host-memory benchmark of arrow_ipc_bridge against the usual ways of moving a pyarrow Table between
two processes on one machine.

    python benchmarks/bench_host.py [--sizes 1MiB,64MiB,1GiB] [--repeat N] [--json out.json]

For every (table kind, size) case a fresh *producer* process and a fresh *consumer* process are spawned
(``multiprocessing`` spawn context: nothing is inherited by fork). The producer builds the table, publishes
it and serves requests; the consumer times round trips, each from "consumer asks" to "consumer holds a
usable pyarrow Table whose last value it has read":

    tiny            1-byte request, 1-byte answer over a Unix socket (the floor of any round trip)
    bridge list()   Session.list(): one bridge frame each way, no data (the bridge's own floor)
    bridge zc       table memory-mapped from an Arrow IPC file in /dev/shm, published once (no copy);
                    per request: session.get + pa.table(imported), then released
    bridge copied   the same table in ordinary heap memory, published once (copied once into a sealed
                    memfd at publish time, reported separately); per request: get + pa.table, released
    bridge fresh    the producer publishes a fresh copy (copy="always") for every request: a control
                    byte asks for it, then get + pa.table (what a consumer waits for when the producer has
                    new heap data every time)
    peer ipc        Arrow IPC stream over a Unix socket: the producer serializes the table per request
                    (pa.ipc.new_stream into a BufferOutputStream), sends length-prefixed bytes; the consumer
                    receives them all into one buffer and reads pa.ipc.open_stream(buf).read_all()
    peer ipc cached the same, but the producer serialized once and resends the same bytes (the peer
                    analogue of "bridge copied": a one-time cost, then transfer only)
    pickle pipe     multiprocessing (spawn context) Pipe: conn.send(table) / conn.recv() (pickle)

Each method is run once (the "first" time, in a consumer that has connected but not used that method
yet), then warmed up, then measured ``--repeat`` times (fewer for size-proportional methods at large
sizes, see ``--big-repeat``). Process start-up and connection set-up are never inside a round trip.
See benchmarks/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import socket
import struct
import sys
import tempfile
import time
import traceback
from typing import Any

from bench_stats import stats_us  # the scripts' directory is on sys.path (run as a script)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_UNITS = {
    "": 1,
    "b": 1,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "k": KiB,
    "m": MiB,
    "g": GiB,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
}
KINDS = ("float16", "mixed")
KIND_TITLES = {
    "float16": "16 float64 columns",
    "mixed": "mixed: string (nulls), list<int32> (nulls), 4 x int64 (nulls), 4 x float64",
}

# (key, label, size-proportional?) in the order they are run.
METHODS: list[tuple[str, str, bool]] = [
    ("tiny", "tiny msg, Unix socket (floor)", False),
    ("bridge_list", "bridge list() (no data)", False),
    ("bridge_zc", "bridge zero-copy (/dev/shm mmap)", False),
    ("bridge_copied", "bridge copied (published once)", False),
    ("bridge_fresh", "bridge publish-per-request", True),
    ("peer_ipc", "peer IPC stream, Unix socket", True),
    ("peer_ipc_cached", "peer IPC stream, serialized once", True),
    ("pickle_pipe", "peer pickle, mp Pipe", True),
]
FLOORS = ("tiny", "bridge_list")
# Also measured after an idle gap (--gap-ms): the cheap per-request methods, where wake-up latency shows.
IDLE_METHODS = ("tiny", "bridge_list", "bridge_zc", "bridge_copied")
DATA_METHODS = {"bridge_zc", "bridge_copied", "bridge_fresh", "peer_ipc", "peer_ipc_cached", "pickle_pipe"}
# Methods whose per-request cost must not grow with the table (nothing is copied per request).
SIZE_INDEPENDENT = ("bridge_zc", "bridge_copied")
# The size-independence verdict: the largest size's median may exceed the smallest's by this factor or
# by this many µs (each size runs in a fresh pair of processes, whose level differs by +-30% run to run).
SIZE_GROWTH_LIMIT = 1.5
SIZE_GROWTH_SLACK_US = 50.0
# The interleaved A/B check (one process pair, requests for both sizes shuffled in every round) is not
# confounded by that, so its verdict is the stricter one and the one the final line reports.
AB_GROWTH_LIMIT = 1.25
AB_GROWTH_SLACK_US = 25.0
BIG = 256 * MiB  # at or above this size, size-proportional methods use --big-repeat / --big-warmup


def parse_size(text: str) -> int:
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    if unit not in _UNITS or not num:
        raise argparse.InvalidArgumentError(f"bad size {text!r} (use e.g. 1MiB, 64MiB, 1GiB)")
    return int(float(num) * _UNITS[unit])


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def machine_info() -> dict[str, Any]:
    import pyarrow as pa

    import arrow_ipc_bridge as aib

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    affinity: int | None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(aib.__file__)))
    git: dict[str, Any] = {}
    try:
        import subprocess

        def read_git(*cmd: str) -> str:
            out = subprocess.run(
                ["git", "-C", repo, *cmd], capture_output=True, text=True, timeout=10, check=False
            )
            return out.stdout.strip() if out.returncode == 0 else ""

        git["head"] = read_git("rev-parse", "--short", "HEAD")
        # read-only: plain git diff does not rewrite the index
        git["library_changes_vs_head"] = read_git(
            "diff", "--shortstat", "HEAD", "--", "arrow_ipc_bridge", "cffi_build"
        )
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "library_path": os.path.dirname(os.path.abspath(aib.__file__)),
        "git": git,
        "nproc": affinity,
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "mem_total_bytes": mem_total,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "pyarrow": pa.__version__,
        "arrow_ipc_bridge": aib.__version__,
        "loadavg_at_start": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ---------------------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------------------
def make_table(kind: str, nbytes: int, seed: int = 12345) -> Any:
    """A table of about ``nbytes`` (pyarrow's Table.nbytes) in ordinary heap memory, deterministic."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    if kind == "float16":
        rows = max(1, nbytes // (16 * 8))
        return pa.table({f"f{i:02d}": pa.array(rng.random(rows)) for i in range(16)})
    if kind != "mixed":
        raise ValueError(kind)
    # About 32 bytes per row per column type: string offsets 4 B + ~28 B of characters; list offsets 4 B
    # + ~6.75 int32 values; 4 int64 columns; 4 float64 columns. ~128 B/row, 10% nulls in the first three.
    rows = max(1, nbytes // 128)
    null_rate = 0.10

    def validity(n: int) -> tuple[Any, int, Any]:
        valid = rng.random(n) >= null_rate
        bits = np.packbits(valid, bitorder="little")
        return pa.py_buffer(bits), int(n - valid.sum()), valid

    # strings: non-null lengths uniform in [0, 62] (mean 31), nulls are empty
    sbits, s_nulls, s_valid = validity(rows)
    s_len = rng.integers(0, 63, rows, dtype=np.int64) * s_valid
    s_total = int(s_len.sum())
    large = s_total >= 2**31 - 1
    s_off = np.zeros(rows + 1, np.int64 if large else np.int32)
    np.cumsum(s_len, out=s_off[1:])
    chars = (np.frombuffer(rng.bytes(s_total), np.uint8) % 26 + 97).astype(np.uint8)
    strings = pa.Array.from_buffers(
        pa.large_string() if large else pa.string(),
        rows,
        [sbits, pa.py_buffer(s_off), pa.py_buffer(chars)],
        null_count=s_nulls,
    )
    # list<int32>: non-null lengths uniform in [0, 15] (mean 7.5)
    lbits, l_nulls, l_valid = validity(rows)
    l_len = rng.integers(0, 16, rows, dtype=np.int64) * l_valid
    l_total = int(l_len.sum())
    l_large = l_total >= 2**31 - 1
    l_off = np.zeros(rows + 1, np.int64 if l_large else np.int32)
    np.cumsum(l_len, out=l_off[1:])
    values = pa.array(rng.integers(-(2**31), 2**31 - 1, l_total, dtype=np.int32))
    lists = pa.Array.from_buffers(
        pa.large_list(pa.int32()) if l_large else pa.list_(pa.int32()),
        rows,
        [lbits, pa.py_buffer(l_off)],
        null_count=l_nulls,
        children=[values],
    )
    cols: dict[str, Any] = {"s": strings, "l": lists}
    for i in range(4):
        bits, nulls, _ = validity(rows)
        data = rng.integers(-(2**62), 2**62, rows, dtype=np.int64)
        cols[f"i{i}"] = pa.Array.from_buffers(pa.int64(), rows, [bits, pa.py_buffer(data)], null_count=nulls)
    for i in range(4):
        cols[f"f{i}"] = pa.array(rng.random(rows))
    return pa.table(cols)


def bytes_by_type(table: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for field, col in zip(table.schema, table.columns, strict=True):
        key = str(field.type)
        out[key] = out.get(key, 0) + col.nbytes
    return out


def table_summary(table: Any) -> dict[str, Any]:
    """A cheap fingerprint to check the consumer got the producer's data (computed outside timings)."""
    import pyarrow.compute as pc

    out: dict[str, Any] = {
        "rows": table.num_rows,
        "columns": table.num_columns,
        "nulls": [c.null_count for c in table.columns],
    }
    last = table.column(table.num_columns - 1)
    out["last_sum"] = pc.sum(last).as_py()
    if "s" in table.column_names:
        out["s_len"] = pc.sum(pc.utf8_length(table.column("s"))).as_py()
        out["l_sum"] = pc.sum(pc.list_flatten(table.column("l")).cast("int64")).as_py()
    return out


def last_value(table: Any) -> Any:
    """Read one value of the last column (its last row): the consumer really holds readable data."""
    col = table.column(table.num_columns - 1)
    chunk = col.chunk(col.num_chunks - 1)
    return chunk[len(chunk) - 1].as_py()


def table_buffers(table: Any) -> list[Any]:
    bufs: list[Any] = []

    def walk(arr: Any) -> None:
        bufs.extend(b for b in arr.buffers() if b is not None and b.size)

    for col in table.columns:
        for chunk in col.chunks:
            walk(chunk)
    # buffers() already includes the children's buffers (flattened), so no recursion is needed
    return bufs


def memcpy_reference(table: Any, repeat: int) -> dict[str, float]:
    """What copying the table's bytes costs on this machine, three ways (best of ``repeat``):

    * ``fresh``: numpy copies of every buffer into a new anonymous mapping (memcpy plus the page faults
      that allocate the destination: what any "copy into new memory" pays);
    * ``prefaulted``: the same copies again into that mapping (pure memcpy bandwidth);
    * ``memfd_pwrite``: one os.pwritev of every buffer into a new memfd (the kernel path the bridge's
      copy uses, without the bridge around it).
    """
    import mmap

    import numpy as np

    bufs = table_buffers(table)
    srcs = [np.frombuffer(b, np.uint8) for b in bufs]
    total = sum(s.size for s in srcs)

    def copy_into(dst: Any) -> float:
        t0 = time.perf_counter()
        off = 0
        for s in srcs:
            dst[off : off + s.size] = s
            off += s.size
        return time.perf_counter() - t0

    fresh, warm, pwrite = [], [], []
    for _ in range(repeat):
        m = mmap.mmap(-1, max(total, 1))
        dst = np.frombuffer(m, np.uint8)
        fresh.append(copy_into(dst))
        warm.append(copy_into(dst))
        del dst
        m.close()
        views = [memoryview(b) for b in bufs]
        t0 = time.perf_counter()
        fd = os.memfd_create("bench-ref", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
            done = 0
            for first in range(0, len(views), 512):
                batch = views[first : first + 512]
                want = sum(v.nbytes for v in batch)
                got = os.pwritev(fd, batch, done)
                if got != want:  # short write (over 2 GiB per call): finish buffer by buffer
                    for v in batch:
                        k = 0
                        while k < v.nbytes:
                            k += os.pwrite(fd, v[k:], done + k)
                        done += v.nbytes
                else:
                    done += got
            pwrite.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
    return {
        "bytes": total,
        "fresh_s": min(fresh),
        "prefaulted_s": min(warm),
        "memfd_pwrite_s": min(pwrite),
        "fresh_GBps": total / min(fresh) / 1e9,
        "prefaulted_GBps": total / min(warm) / 1e9,
        "memfd_pwrite_GBps": total / min(pwrite) / 1e9,
    }


# ---------------------------------------------------------------------------------------------------------
# socket helpers
# ---------------------------------------------------------------------------------------------------------
def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError when the peer closes first."""
    n = len(view)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


_LEN = struct.Struct("<Q")
_F64x2 = struct.Struct("<dd")


# ---------------------------------------------------------------------------------------------------------
# producer process
# ---------------------------------------------------------------------------------------------------------
def producer_main(cfg: dict[str, Any], report: Any, pickle_conn: Any) -> None:
    try:
        _producer(cfg, report, pickle_conn)
    except BaseException as exc:
        report.send({"error": f"producer: {exc!r}\n{traceback.format_exc()}"})
        raise


def _producer(cfg: dict[str, Any], report: Any, pickle_conn: Any) -> None:
    from multiprocessing.connection import wait

    import pyarrow as pa

    import arrow_ipc_bridge as aib

    if cfg.get("pin") is not None:
        os.sched_setaffinity(0, {cfg["pin"][0]})
    t0 = time.perf_counter()
    table = make_table(cfg["kind"], cfg["size"])
    build_s = time.perf_counter() - t0
    info: dict[str, Any] = {
        "rows": table.num_rows,
        "columns": table.num_columns,
        "nbytes": table.nbytes,
        "bytes_by_type": bytes_by_type(table),
        "build_s": build_s,
        "summary": table_summary(table),
        "memcpy": memcpy_reference(table, 1 if cfg["size"] >= BIG else 3),
    }

    # the zero-copy source: an Arrow IPC file in /dev/shm, memory-mapped back
    path = os.path.join(cfg["shm_dir"], f"{cfg['kind']}-{cfg['size']}.arrow")
    t0 = time.perf_counter()
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    source = pa.memory_map(path)
    mapped = pa.ipc.open_file(source).read_all()
    info["ipc_file_write_s"] = time.perf_counter() - t0

    pub = aib.Publisher(cfg["bridge_sock"])
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer_conn = None
    try:
        t0 = time.perf_counter()
        st = pub.publish("zc", mapped)
        info["publish_zc"] = {"s": time.perf_counter() - t0, **vars(st)}
        if st.copied_bytes:
            info["publish_zc"]["warning"] = "the memory-mapped table was copied, not shared"
        t0 = time.perf_counter()
        st = pub.publish("copied", table)
        info["publish_copied"] = {"s": time.perf_counter() - t0, **vars(st)}

        srv.bind(cfg["peer_sock"])
        srv.listen(1)
        report.send({"ready": info})
        peer_conn, _ = srv.accept()
        fresh_s: list[float] = []
        serialize_s: list[float] = []
        cached: Any = None
        while True:
            for ready in wait([peer_conn, pickle_conn]):
                if ready is not peer_conn:  # the multiprocessing Pipe: a pickle request
                    if pickle_conn.recv_bytes() == b"P":
                        pickle_conn.send(table)
                    continue
                cmd = peer_conn.recv(1)
                if cmd in (b"", b"Q"):
                    # the consumer closed its session first: every lease must come back (leak check)
                    deadline = time.monotonic() + 2.0
                    while pub.active_leases and time.monotonic() < deadline:
                        time.sleep(0.01)
                    leases_left = pub.active_leases
                    pub.close()
                    report.send(
                        {
                            "done": {
                                "fresh_publish_s": fresh_s,
                                "serialize_s": serialize_s,
                                "leases_left_after_session_close": leases_left,
                            }
                        }
                    )
                    return
                if cmd == b"T":
                    peer_conn.sendall(b"t")
                elif cmd == b"F":
                    # "publish again": drop the previous copy (its pages are freed once the consumer's
                    # lease on it ended too), then export + copy the heap table into a new sealed memfd
                    t0 = time.perf_counter()
                    if "fresh" in pub.names():
                        pub.unpublish("fresh")
                    t1 = time.perf_counter()
                    pub.publish("fresh", table, copy="always")
                    t2 = time.perf_counter()
                    fresh_s.append(t2 - t1)
                    peer_conn.sendall(_F64x2.pack(t1 - t0, t2 - t1))
                elif cmd in (b"I", b"C"):
                    if cmd == b"I" or cached is None:
                        t0 = time.perf_counter()
                        sink = pa.BufferOutputStream()
                        with pa.ipc.new_stream(sink, table.schema) as writer:
                            writer.write_table(table)
                        payload = sink.getvalue()
                        del sink
                        if cmd == b"I":
                            serialize_s.append(time.perf_counter() - t0)
                        else:
                            cached = payload
                    else:
                        payload = cached
                    peer_conn.sendall(_LEN.pack(payload.size))
                    peer_conn.sendall(memoryview(payload))
                    del payload
                elif cmd == b"U":  # end of a phase: drop what it left behind
                    if "fresh" in pub.names():
                        pub.unpublish("fresh")
                    cached = None
                    gc.collect()
                    peer_conn.sendall(b"u")
                else:
                    raise RuntimeError(f"unknown command {cmd!r}")
    finally:
        if peer_conn is not None:
            peer_conn.close()
        srv.close()
        pub.close()
        del mapped, source
        with_suppress_unlink(path)


def with_suppress_unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


# ---------------------------------------------------------------------------------------------------------
# consumer process
# ---------------------------------------------------------------------------------------------------------
def consumer_main(cfg: dict[str, Any], report: Any, pickle_conn: Any) -> None:
    try:
        report.send({"result": _consumer(cfg, pickle_conn)})
    except BaseException as exc:
        report.send({"error": f"consumer: {exc!r}\n{traceback.format_exc()}"})
        raise


def _consumer(cfg: dict[str, Any], pickle_conn: Any) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.compute as pc

    import arrow_ipc_bridge as aib

    expected = cfg["expected_summary"]
    if cfg.get("pin") is not None:
        os.sched_setaffinity(0, {cfg["pin"][1]})
    # pa.table(obj) checks "is it a pandas DataFrame?" before using __arrow_c_stream__, which imports
    # pandas the first time where it is installed (~0.2-0.3 s). Pay pyarrow's lazy imports here, with a
    # local stream producer, so that no method's "first" time includes them.
    t0 = time.perf_counter()
    warm_source = pa.table({"x": [1.0]})

    class _LocalStream:
        def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
            return warm_source.__arrow_c_stream__(requested_schema)

    pa.table(_LocalStream())
    pyarrow_warmup_s = time.perf_counter() - t0
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    t0 = time.perf_counter()
    sock.connect(cfg["peer_sock"])
    peer_connect_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    session = aib.connect(cfg["bridge_sock"], timeout=120.0)
    bridge_connect_s = time.perf_counter() - t0
    fresh_publish_seen: list[tuple[float, float]] = []

    # Each one() returns (seconds, table or None, release callable or None). The clock runs from the
    # request to the moment the consumer has a pyarrow Table and has read its last value.
    def tiny() -> tuple[float, Any, Any]:
        t0 = time.perf_counter()
        sock.sendall(b"T")
        if sock.recv(1) != b"t":
            raise RuntimeError("bad tiny reply")
        return time.perf_counter() - t0, None, None

    def bridge_list() -> tuple[float, Any, Any]:
        t0 = time.perf_counter()
        names = session.list()
        dt = time.perf_counter() - t0
        if "zc" not in names:
            raise RuntimeError(names)
        return dt, None, None

    def bridge_get(name: str) -> Any:
        def one() -> tuple[float, Any, Any]:
            t0 = time.perf_counter()
            imported = session.get(name)
            table = pa.table(imported)
            last_value(table)
            return time.perf_counter() - t0, table, imported.release

        return one

    def bridge_fresh() -> tuple[float, Any, Any]:
        t0 = time.perf_counter()
        sock.sendall(b"F")
        drop_s, publish_s = _F64x2.unpack(recv_exact(sock, 16))
        imported = session.get("fresh")
        table = pa.table(imported)
        last_value(table)
        dt = time.perf_counter() - t0
        fresh_publish_seen.append((drop_s, publish_s))
        return dt, table, imported.release

    def peer(cmd: bytes) -> Any:
        def one() -> tuple[float, Any, Any]:
            t0 = time.perf_counter()
            sock.sendall(cmd)
            (n,) = _LEN.unpack(recv_exact(sock, 8))
            buf = pa.allocate_buffer(n, resizable=False)
            with memoryview(buf) as view:
                recv_exact_into(sock, view)
            table = pa.ipc.open_stream(buf).read_all()
            last_value(table)
            return time.perf_counter() - t0, table, None

        return one

    def pickle_pipe() -> tuple[float, Any, Any]:
        t0 = time.perf_counter()
        pickle_conn.send_bytes(b"P")
        table = pickle_conn.recv()
        last_value(table)
        return time.perf_counter() - t0, table, None

    fns = {
        "tiny": tiny,
        "bridge_list": bridge_list,
        "bridge_zc": bridge_get("zc"),
        "bridge_copied": bridge_get("copied"),
        "bridge_fresh": bridge_fresh,
        "peer_ipc": peer(b"I"),
        "peer_ipc_cached": peer(b"C"),
        "pickle_pipe": pickle_pipe,
    }
    big = cfg["size"] >= BIG
    results: dict[str, Any] = {}
    for key, _label, proportional in METHODS:
        if key not in cfg["methods"]:
            continue
        gc.collect()
        fresh_publish_seen.clear()
        one = fns[key]
        repeat = cfg["big_repeat"] if (big and proportional) else cfg["repeat"]
        if key in FLOORS:
            repeat *= 5  # microseconds each: more samples for a stable floor
        warmup = cfg["big_warmup"] if (big and proportional) else cfg["warmup"]

        def scan_last_column(table: Any) -> float:
            t0 = time.perf_counter()
            pc.sum(table.column(table.num_columns - 1))
            return time.perf_counter() - t0

        def run_release(table: Any, release: Any) -> float:
            t0 = time.perf_counter()
            if release is not None:
                release()
            del table
            return time.perf_counter() - t0

        # first time this consumer uses the method (it also checks the data against the producer's)
        first_s, table, release = one()
        valid = None
        if table is not None:
            got = table_summary(table)
            valid = got == expected
            if not valid:
                raise RuntimeError(f"{key}: consumer's data differs: {got} != {expected}")
        run_release(table, release)
        table = None
        for _ in range(warmup):
            _, table, release = one()
            run_release(table, release)
            table = None
        # the measurement: back-to-back round trips, nothing else in between
        samples: list[float] = []
        releases: list[float] = []
        scans: list[float] = []
        fresh_publish_seen.clear()
        for i in range(repeat):
            dt, table, release = one()
            samples.append(dt)
            if i == repeat - 1 and table is not None and cfg["scan"]:
                # after the last timed round trip, so that it cannot disturb the next one
                scans.append(scan_last_column(table))
            releases.append(run_release(table, release))
            table = None
        measured_publish = list(fresh_publish_seen)
        entry: dict[str, Any] = {
            **stats_us(samples),
            "first_us": first_s * 1e6,
            "warmup": warmup,
            "samples_us": [x * 1e6 for x in samples],
            "validated": valid,
        }
        # the same round trip after the consumer was idle for a while (both processes' CPUs go idle)
        if key in IDLE_METHODS and cfg["gap_ms"] > 0:
            idle: list[float] = []
            for _ in range(cfg["repeat"]):
                time.sleep(cfg["gap_ms"] / 1e3)
                dt, table, release = one()
                idle.append(dt)
                run_release(table, release)
                table = None
            entry["after_idle"] = {**stats_us(idle), "gap_ms": cfg["gap_ms"]}
        # what the consumer pays when it first reads a whole column of what arrived: a few more
        # (untimed) round trips, except for the expensive methods at large sizes
        if scans and not (big and proportional):
            for _ in range(2):
                _, table, release = one()
                scans.append(scan_last_column(table))
                run_release(table, release)
                table = None
        if scans:
            entry["scan_last_column"] = stats_us(scans)
        if key.startswith("bridge_") and key != "bridge_list":
            entry["release"] = stats_us(releases)
        if key == "bridge_fresh":
            entry["producer_publish"] = stats_us([x[1] for x in measured_publish])
            entry["producer_drop_previous"] = stats_us([x[0] for x in measured_publish])
        results[key] = entry
        # end of the phase: the producer drops the fresh entry / cached bytes
        sock.sendall(b"U")
        if sock.recv(1) != b"u":
            raise RuntimeError("bad phase reply")
    mapping_cache = {"hits": session.mapping_cache.hits, "misses": session.mapping_cache.misses}
    session.close()
    sock.sendall(b"Q")
    sock.close()
    return {
        "methods": results,
        "bridge_connect_us": bridge_connect_s * 1e6,
        "pyarrow_warmup_us": pyarrow_warmup_s * 1e6,
        "peer_connect_us": peer_connect_s * 1e6,
        "mapping_cache": mapping_cache,
    }


# ---------------------------------------------------------------------------------------------------------
# size independence, interleaved: one process pair serves the smallest and the largest table
# ---------------------------------------------------------------------------------------------------------
def ab_producer_main(cfg: dict[str, Any], report: Any) -> None:
    try:
        _ab_producer(cfg, report)
    except BaseException as exc:
        report.send({"error": f"A/B producer: {exc!r}\n{traceback.format_exc()}"})
        raise


def _ab_producer(cfg: dict[str, Any], report: Any) -> None:
    import pyarrow as pa

    import arrow_ipc_bridge as aib

    if cfg.get("pin") is not None:
        os.sched_setaffinity(0, {cfg["pin"][0]})
    keep: list[Any] = []
    paths: list[str] = []
    pub = aib.Publisher(cfg["bridge_sock"])
    try:
        for size in cfg["ab_sizes"]:
            table = make_table(cfg["kind"], size)
            path = os.path.join(cfg["shm_dir"], f"ab-{cfg['kind']}-{size}.arrow")
            paths.append(path)
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
            mapped = pa.ipc.open_file(pa.memory_map(path)).read_all()
            if pub.publish(f"zc-{size}", mapped).copied_bytes:
                raise RuntimeError("the memory-mapped table was copied, not shared")
            pub.publish(f"copied-{size}", table)
            keep.append(mapped)
            del table  # the published copy lives in its memfd
        report.send({"ready": True})
        report.recv()  # the parent says when the consumer is done
    finally:
        pub.close()
        del keep
        for path in paths:
            with_suppress_unlink(path)
    report.send({"done": True})


def ab_consumer_main(cfg: dict[str, Any], report: Any) -> None:
    try:
        report.send({"result": _ab_consumer(cfg)})
    except BaseException as exc:
        report.send({"error": f"A/B consumer: {exc!r}\n{traceback.format_exc()}"})
        raise


def _ab_consumer(cfg: dict[str, Any]) -> dict[str, Any]:
    import random

    import pyarrow as pa

    import arrow_ipc_bridge as aib

    if cfg.get("pin") is not None:
        os.sched_setaffinity(0, {cfg["pin"][1]})
    names = [f"{method}-{size}" for method in ("zc", "copied") for size in cfg["ab_sizes"]]
    samples: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(7)
    with aib.connect(cfg["bridge_sock"], timeout=60.0) as session:

        def one(name: str) -> float:
            t0 = time.perf_counter()
            imported = session.get(name)
            table = pa.table(imported)
            last_value(table)
            dt = time.perf_counter() - t0
            imported.release()
            del table
            return dt

        for _ in range(5):
            for name in names:
                one(name)
        for _ in range(cfg["ab_rounds"]):
            order = names[:]
            rng.shuffle(order)  # each round visits every name once, in a random order
            for name in order:
                samples[name].append(one(name))
    return {name: {**stats_us(xs), "samples_us": [x * 1e6 for x in xs]} for name, xs in samples.items()}


def run_ab(ctx: Any, args: argparse.Namespace, *, sock_dir: str, shm_dir: str) -> dict[str, Any]:
    sizes = [min(args.sizes), max(args.sizes)]
    cfg = {
        "kind": args.kinds[0],
        "ab_sizes": sizes,
        "ab_rounds": max(args.repeat, 60),
        "shm_dir": shm_dir,
        "bridge_sock": os.path.join(sock_dir, "bridge-ab.sock"),
        "pin": args.pin,
    }
    prod_r, prod_w = ctx.Pipe()
    cons_r, cons_w = ctx.Pipe(duplex=False)
    producer = ctx.Process(target=ab_producer_main, args=(cfg, prod_w), name="ab-producer")
    consumer = None
    producer.start()
    try:
        _recv(prod_r, 600, "A/B producer", producer)
        consumer = ctx.Process(target=ab_consumer_main, args=(cfg, cons_w), name="ab-consumer")
        consumer.start()
        result = _recv(cons_r, 600, "A/B consumer", consumer)["result"]
        consumer.join(60)
        prod_r.send("done")
        _recv(prod_r, 120, "A/B producer", producer)
        producer.join(60)
    finally:
        for proc in (consumer, producer):
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join(10)
    verdicts = []
    for method in ("zc", "copied"):
        small = result[f"{method}-{sizes[0]}"]["median_us"]
        large = result[f"{method}-{sizes[1]}"]["median_us"]
        growth = large / small
        verdicts.append(
            {
                "method": {"zc": "bridge_zc", "copied": "bridge_copied"}[method],
                "small": fmt_size(sizes[0]),
                "large": fmt_size(sizes[1]),
                "median_small_us": small,
                "median_large_us": large,
                "large_over_small": growth,
                "size_independent": growth <= AB_GROWTH_LIMIT or large - small <= AB_GROWTH_SLACK_US,
            }
        )
    return {
        "kind": cfg["kind"],
        "sizes": sizes,
        "rounds": cfg["ab_rounds"],
        "results": result,
        "verdicts": verdicts,
    }


# ---------------------------------------------------------------------------------------------------------
# orchestration
# ---------------------------------------------------------------------------------------------------------
def _recv(conn: Any, timeout: float, who: str, proc: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not conn.poll(1.0):
        if not proc.is_alive():
            if conn.poll(0.5):
                break
            raise RuntimeError(f"{who} process exited with code {proc.exitcode} without reporting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{who} did not report within {timeout:.0f} s")
    msg: dict[str, Any] = conn.recv()
    if "error" in msg:
        raise RuntimeError(msg["error"])
    return msg


def run_case(
    ctx: Any, args: argparse.Namespace, kind: str, size: int, *, sock_dir: str, shm_dir: str
) -> dict[str, Any]:
    cfg = {
        "kind": kind,
        "size": size,
        "shm_dir": shm_dir,
        "bridge_sock": os.path.join(sock_dir, f"bridge-{kind}-{size}.sock"),
        "peer_sock": os.path.join(sock_dir, f"peer-{kind}-{size}.sock"),
        "repeat": args.repeat,
        "warmup": args.warmup,
        "big_repeat": args.big_repeat,
        "big_warmup": args.big_warmup,
        "methods": args.methods,
        "scan": not args.no_scan,
        "gap_ms": args.gap_ms,
        "pin": args.pin,
    }
    prod_report_r, prod_report_w = ctx.Pipe(duplex=False)
    cons_report_r, cons_report_w = ctx.Pipe(duplex=False)
    pickle_a, pickle_b = ctx.Pipe()  # duplex: a socketpair, like any multiprocessing Pipe on Linux
    producer = ctx.Process(target=producer_main, args=(cfg, prod_report_w, pickle_b), name="producer")
    consumer = None
    t_case = time.perf_counter()
    producer.start()
    try:
        ready = _recv(prod_report_r, 600, "producer", producer)["ready"]
        cfg["expected_summary"] = ready["summary"]
        consumer = ctx.Process(target=consumer_main, args=(cfg, cons_report_w, pickle_a), name="consumer")
        consumer.start()
        result = _recv(cons_report_r, 1800, "consumer", consumer)["result"]
        done = _recv(prod_report_r, 120, "producer", producer)["done"]
        consumer.join(60)
        producer.join(60)
    finally:
        for proc in (consumer, producer):
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join(10)
    ready.pop("summary", None)
    ready["leases_left_after_session_close"] = done["leases_left_after_session_close"]
    serialize = done["serialize_s"]
    if serialize:
        ready["ipc_serialize_per_request"] = stats_us(serialize)
    return {
        "kind": kind,
        "size": size,
        "size_label": fmt_size(size),
        "producer": ready,
        "consumer": result,
        "case_wall_s": time.perf_counter() - t_case,
    }


def cpu_snapshot() -> dict[str, float]:
    """Machine-wide busy/steal CPU seconds (/proc/stat) and the CPU seconds of this process tree."""
    import resource

    tick = os.sysconf("SC_CLK_TCK")
    busy = steal = 0.0
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal guest guest_nice (guest is inside user)
        busy = (sum(fields[:8]) - fields[3] - fields[4] - fields[7]) / tick
        steal = fields[7] / tick if len(fields) > 7 else 0.0
    except (OSError, ValueError, IndexError):
        pass
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        own += r.ru_utime + r.ru_stime
    return {"busy_s": busy, "steal_s": steal, "own_s": own, "wall": time.perf_counter()}


def machine_load(before: dict[str, float], after: dict[str, float], ncpu: int) -> dict[str, float]:
    wall = after["wall"] - before["wall"]
    others = max(0.0, (after["busy_s"] - before["busy_s"]) - (after["own_s"] - before["own_s"]))
    return {
        "wall_s": wall,
        "own_cpu_s": after["own_s"] - before["own_s"],
        "other_cpu_s": others,
        "other_cpu_fraction_of_machine": others / (wall * ncpu) if wall > 0 else 0.0,
        "steal_s": after["steal_s"] - before["steal_s"],
    }


def print_machine(info: dict[str, Any]) -> None:
    mem = info["mem_total_bytes"]
    mem_text = f", {mem / GiB:.1f} GiB RAM" if mem else ""
    print(
        f"machine: nproc {info['nproc']} (os.cpu_count {info['cpu_count']}), CPU model "
        f"'{info['cpu_model']}'{mem_text}, Linux {info['kernel']}"
    )
    print(
        f"software: Python {info['python']}, pyarrow {info['pyarrow']}, "
        f"arrow_ipc_bridge {info['arrow_ipc_bridge']}; load average at start "
        f"{' '.join(f'{x:.2f}' for x in info['loadavg_at_start'])}; {info['date_utc']}"
    )
    git = info.get("git") or {}
    if git.get("head"):
        dirty = git.get("library_changes_vs_head") or "no uncommitted library changes"
        print(f"library: {info['library_path']} at commit {git['head']} ({dirty})")


def fmt_us(x: float | None) -> str:
    """A duration given in microseconds, with its unit."""
    if x is None or math.isnan(x):
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f} s"
    if x >= 1e4:
        return f"{x / 1e3:.1f} ms"
    if x >= 999.5:
        return f"{x / 1e3:.2f} ms"
    return f"{x:.0f} µs"


def fmt_s(x: float) -> str:
    return fmt_us(x * 1e6)


LABELS = {k: label for k, label, _ in METHODS}


def print_report(cases: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []
    for kind in args.kinds:
        kc = sorted((c for c in cases if c["kind"] == kind), key=lambda c: c["size"])
        if not kc:
            continue
        print()
        print(f"=== {KIND_TITLES[kind]} ===")
        for c in kc:
            p = c["producer"]
            by_type = ", ".join(f"{t} {b / MiB:.1f}" for t, b in p["bytes_by_type"].items())
            print(
                f"  {c['size_label']}: {p['rows']:,} rows x {p['columns']} columns, "
                f"{p['nbytes'] / MiB:.1f} MiB (MiB by type: {by_type})"
            )
        print()
        header = (
            f"{'method':34s} {'size':>6s} {'n':>4s} {'median':>9s} {'p90':>9s} {'first':>9s} "
            f"{'x zc':>8s} {'idle':>9s} {'scan':>9s}"
        )
        print(header)
        print("-" * len(header))
        for key, label, _prop in METHODS:
            if key not in args.methods:
                continue
            for c in kc:
                m = c["consumer"]["methods"].get(key)
                if m is None:
                    continue
                zc = c["consumer"]["methods"].get("bridge_zc")
                ratio = f"{m['median_us'] / zc['median_us']:.2f}" if zc else "-"
                scan = fmt_us(m["scan_last_column"]["median_us"]) if "scan_last_column" in m else ""
                idle = fmt_us(m["after_idle"]["median_us"]) if "after_idle" in m else ""
                print(
                    f"{label:34s} {c['size_label']:>6s} {m['n']:>4d} {fmt_us(m['median_us']):>9s} "
                    f"{fmt_us(m['p90_us']):>9s} {fmt_us(m['first_us']):>9s} {ratio:>8s} {idle:>9s} {scan:>9s}"
                )
        print()
        print("one-time and producer-side costs:")
        for c in kc:
            p = c["producer"]
            mc = p["memcpy"]
            pz, pcpy = p["publish_zc"], p["publish_copied"]
            cons = c["consumer"]
            print(f"  {c['size_label']}:")
            print(
                f"    publish zero-copy    {fmt_s(pz['s']):>9s}  {pz['copied_bytes']} bytes copied, "
                f"{pz['zero_copy_regions']} zero-copy region, {pz['buffers']} buffers"
                + (f"  !! {pz['warning']}" if "warning" in pz else "")
            )
            bw = pcpy["copied_bytes"] / pcpy["s"] / 1e9 if pcpy["s"] else math.nan
            print(
                f"    publish copied       {fmt_s(pcpy['s']):>9s}  "
                f"{pcpy['copied_bytes'] / MiB:.1f} MiB copied "
                f"-> {bw:.2f} GB/s; {pcpy['s'] / mc['fresh_s']:.2f}x memcpy into fresh memory, "
                f"{pcpy['s'] / mc['memfd_pwrite_s']:.2f}x raw memfd pwritev (first export of the process)"
            )
            m_fresh = cons["methods"].get("bridge_fresh", {})
            fresh = m_fresh.get("producer_publish")
            if fresh:
                fs = fresh["median_us"] / 1e6
                print(
                    f"    publish per request  {fmt_us(fresh['median_us']):>9s}  "
                    "median publish(copy='always') "
                    f"-> {pcpy['copied_bytes'] / fs / 1e9:.2f} GB/s; {fs / mc['fresh_s']:.2f}x memcpy into "
                    f"fresh memory, {fs / mc['memfd_pwrite_s']:.2f}x raw memfd pwritev; "
                    "dropping the previous "
                    f"copy {fmt_us(m_fresh['producer_drop_previous']['median_us'])}"
                )
            ser = p.get("ipc_serialize_per_request")
            if ser:
                print(
                    f"    IPC serialize        {fmt_us(ser['median_us']):>9s}  "
                    "median pa.ipc.new_stream into a "
                    "BufferOutputStream (part of 'peer IPC stream')"
                )
            print(
                f"    copy references      {mc['bytes'] / MiB:.1f} MiB: memcpy into fresh memory "
                f"{fmt_s(mc['fresh_s'])} = {mc['fresh_GBps']:.2f} GB/s; into prefaulted memory "
                f"{fmt_s(mc['prefaulted_s'])} = {mc['prefaulted_GBps']:.2f} GB/s; pwritev into a new memfd "
                f"{fmt_s(mc['memfd_pwrite_s'])} = {mc['memfd_pwrite_GBps']:.2f} GB/s"
            )
            print(
                f"    set-up               connect: bridge {fmt_us(cons['bridge_connect_us'])}, plain socket "
                f"{fmt_us(cons['peer_connect_us'])}; pyarrow warm-up {fmt_us(cons['pyarrow_warmup_us'])}; "
                f"table build {p['build_s']:.2f} s, IPC file write + "
                f"mmap {p['ipc_file_write_s']:.2f} s; consumer mapping cache "
                f"{cons['mapping_cache']['hits']} hits / {cons['mapping_cache']['misses']} misses; "
                f"leases left after the session closed: {p['leases_left_after_session_close']}"
                + ("  !! LEAK" if p["leases_left_after_session_close"] else "")
            )
        # size-independence of the paths that copy nothing per request, across the cases above
        if len(kc) >= 2:
            print()
            print("  per-request medians of the paths that copy nothing, across sizes:")
            for key in SIZE_INDEPENDENT:
                ms = [(c["size_label"], c["consumer"]["methods"].get(key)) for c in kc]
                ms = [(label, m) for label, m in ms if m is not None]
                if len(ms) < 2:
                    continue
                base = ms[0][1]["median_us"]  # smallest size
                last = ms[-1][1]["median_us"]  # largest size
                growth = last / base
                ok = growth <= SIZE_GROWTH_LIMIT or last - base <= SIZE_GROWTH_SLACK_US
                checks.append(
                    {
                        "kind": kind,
                        "method": key,
                        "medians_us": {label: m["median_us"] for label, m in ms},
                        "largest_over_smallest": growth,
                        "size_independent": ok,
                    }
                )
                verdict = (
                    "within tolerance"
                    if ok
                    else "outside tolerance (separate process pairs: see the interleaved check below)"
                )
                medians = ", ".join(f"{label} {fmt_us(m['median_us'])}" for label, m in ms)
                print(f"    {LABELS[key]}: {medians} (largest / smallest {growth:.2f}): {verdict}")
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        default="1MiB,64MiB,1GiB",
        type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
        help="table sizes (Table.nbytes), comma separated (default 1MiB,64MiB,1GiB)",
    )
    parser.add_argument("--repeat", type=int, default=30, help="measured round trips per method (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up round trips per method (default 3)")
    parser.add_argument(
        "--big-repeat",
        type=int,
        default=3,
        help=f"repeats of size-proportional methods at sizes >= {fmt_size(BIG)} (default 3)",
    )
    parser.add_argument(
        "--big-warmup",
        type=int,
        default=0,
        help="their warm-ups (default 0: the separately reported first run is their warm-up)",
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=20.0,
        help="idle gap before each request of the 'after idle' column (default 20; 0 skips it)",
    )
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        type=lambda s: [k for k in s.split(",") if k],
        help="float16,mixed",
    )
    parser.add_argument(
        "--methods",
        default=",".join(k for k, _, _ in METHODS),
        type=lambda s: [k for k in s.split(",") if k],
        help="subset of " + ",".join(k for k, _, _ in METHODS),
    )
    parser.add_argument("--no-scan", action="store_true", help="skip the untimed scan of the last column")
    parser.add_argument(
        "--no-ab", action="store_true", help="skip the interleaved smallest-vs-largest size check"
    )
    parser.add_argument(
        "--pin",
        metavar="P,C",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=None,
        help="pin the producer to CPU P and the consumer to CPU C (default: no pinning)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every number (and raw samples) here")
    args = parser.parse_args(argv)
    for k in args.kinds:
        if k not in KINDS:
            parser.error(f"unknown kind {k!r}")
    for k in args.methods:
        if k not in {m: 1 for m, _, _ in METHODS}:
            parser.error(f"unknown method {k!r}")
    if "bridge_zc" not in args.methods:
        args.methods.append("bridge_zc")  # the reference of every ratio

    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    info = machine_info()
    print("arrow_ipc_bridge host benchmark: producer and consumer in separate spawned processes")
    print_machine(info)
    print(
        f"sizes {', '.join(fmt_size(s) for s in args.sizes)}; repeat {args.repeat} (warm-up {args.warmup}); "
        f"size-proportional methods at >= {fmt_size(BIG)}: repeat {args.big_repeat} "
        f"(warm-up {args.big_warmup})"
    )
    print(
        "round trip = from 'consumer asks' to 'consumer holds a pyarrow Table and has read its last value'\n"
        "  median, p90  back-to-back round trips (after the warm-ups)\n"
        "  first        the first request of that method in a fresh consumer process\n"
        "  x zc         median / bridge zero-copy median at the same size\n"
        f"  idle         median round trip after the consumer slept {args.gap_ms:g} ms (cheap methods only)\n"
        "  scan         pc.sum of the last column right after arrival, outside the round trip: pays\n"
        "               the page faults that a fresh mapping defers to first access"
    )
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if shm_root is None:
        print("WARNING: no /dev/shm: the zero-copy IPC file goes to the default temp dir", file=sys.stderr)
    shm_dir = tempfile.mkdtemp(prefix="aib-bench-", dir=shm_root)
    sock_dir = tempfile.mkdtemp(prefix="aib-bench-sock-")
    cases: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    cpu_before = cpu_snapshot()
    try:
        for size in args.sizes:
            for kind in args.kinds:
                print(f"... {kind} {fmt_size(size)}", file=sys.stderr, flush=True)
                case = run_case(ctx, args, kind, size, sock_dir=sock_dir, shm_dir=shm_dir)
                print(f"    done in {case['case_wall_s']:.1f} s", file=sys.stderr, flush=True)
                cases.append(case)
                gc.collect()
        ab = None
        if len(set(args.sizes)) >= 2 and not args.no_ab:
            print("... interleaved size check", file=sys.stderr, flush=True)
            ab = run_ab(ctx, args, sock_dir=sock_dir, shm_dir=shm_dir)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
    load = machine_load(cpu_before, cpu_snapshot(), info["cpu_count"] or 1)
    checks = print_report(cases, args)
    total = time.perf_counter() - t_all
    print()
    if ab is not None:
        small, large = (fmt_size(x) for x in ab["sizes"])
        print(
            f"size independence, interleaved: one process pair serves the {ab['kind']} table at {small} "
            f"and at {large}; {ab['rounds']} rounds, each getting every object once in a shuffled order"
        )
        for v in ab["verdicts"]:
            verdict = "size-independent: yes" if v["size_independent"] else "NOT SIZE-INDEPENDENT"
            print(
                f"  {LABELS[v['method']]}: median {small} {fmt_us(v['median_small_us'])}, "
                f"{large} {fmt_us(v['median_large_us'])} (x{v['large_over_small']:.2f}): {verdict}"
            )
        bad = [v for v in ab["verdicts"] if not v["size_independent"]]
        if bad:
            print(
                "WARNING: the zero-copy per-request time is NOT independent of size for: "
                + ", ".join(f"{v['method']} (x{v['large_over_small']:.2f})" for v in bad)
            )
        else:
            print(
                "zero-copy per-request times are independent of size "
                f"(the larger table's median within {AB_GROWTH_LIMIT}x or {AB_GROWTH_SLACK_US:.0f} µs "
                "of the smaller's)."
            )
    print(
        f"total wall time {total:.1f} s; this benchmark used {load['own_cpu_s']:.1f} CPU-s, other processes "
        f"{load['other_cpu_s']:.1f} CPU-s "
        f"({100 * load['other_cpu_fraction_of_machine']:.0f}% of the machine), "
        f"steal {load['steal_s']:.1f} s; load average at end " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    if load["other_cpu_fraction_of_machine"] > 0.10:
        print(
            "WARNING: other processes used a noticeable share of the CPUs during the run: "
            "the timings include that contention; re-run on a quiet machine for clean numbers."
        )
    if args.json:
        doc = {
            "machine": info,
            "args": dict(vars(args).items()),
            "methods": {k: label for k, label, _ in METHODS},
            "cases": cases,
            "size_independence_across_cases": checks,
            "size_independence_interleaved": ab,
            "total_wall_s": total,
            "machine_load": load,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
