"""Child-process entry points and shared helpers for ``benchmarks/bench_gpu.py``.

Every entry point here runs in a process started with the multiprocessing *spawn* method (CUDA state
never survives a fork). Nothing at module level imports CUDA, CuPy or PyTorch: the parent imports this
module too, and ``--dry-run`` runs on machines with no GPU.

Two pairs of processes:

* the *bridge pair*: ``bridge_producer`` (CuPy columns, ``Publisher``, a control socket, the writing end
  of an ``os.pipe`` for the D2H peer) and ``bridge_consumer`` (``connect``, the timed loops);
* the *torch pair*: ``torch_producer`` / ``torch_consumer`` sharing CUDA tensors through a
  ``torch.multiprocessing`` spawn-context ``Queue``.

Each child reports to the parent over a one-way multiprocessing pipe: ``{"ready": ...}``,
``{"size_info": ...}``, ``{"result": ...}`` (one per method and size, as soon as it is measured),
``{"note": ...}``, ``{"error": ...}`` and finally ``{"done": ...}``.

The control socket between the bridge producer and consumer carries frames of a 1-byte opcode, a
u32 payload length and the payload; replies are ``b"k"`` (ok) or ``b"x"`` (error, traceback as payload).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from bench_stats import stats_us  # beside this module; bench_gpu.py puts the directory on sys.path

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
NCOLS = 16  # the float32 tables have 16 columns
F32 = 4
COLUMN_NAMES = [f"c{i:02d}" for i in range(NCOLS)]

# Method keys in the order they are run and printed, with their labels.
METHODS: dict[str, str] = {
    "bare_rtt": "bare round trip, 64 B over a Unix socket",
    "bridge_ping": "bridge PING, 64 B on the session's connection",
    "bridge_steady": "bridge, legacy handles already open (steady)",
    "bridge_pool_steady": "bridge, IPC-pool arrays published once",
    "bridge_fresh_legacy": "bridge, new cudaMalloc arrays every time",
    "bridge_fresh_pool": "bridge, new IPC-pool arrays every time",
    "bridge_fresh_slab": "bridge, new slab-allocator arrays every time",
    "bridge_mixed_steady": "bridge, mixed table (to_device), steady",
    "bridge_mixed_fresh": "bridge, mixed table, new to_device every time",
    "bridge_mixed_legacy_steady": "bridge, mixed table (to_device legacy), steady",
    "raw_cached": "raw legacy IPC, handles cached",
    "raw_fresh": "raw legacy IPC, 16 new allocations (open each)",
    "torch_steady": "torch.mp, same 16 tensors (consumer keeps them)",
    "torch_steady_drop": "torch.mp, same 16 tensors (consumer drops them)",
    "torch_fresh": "torch.mp, new tensors every time (first transfer)",
    "d2h_ipc": "D2H + Arrow IPC bytes over a pipe + H2D",
}
BRIDGE_METHODS = [k for k in METHODS if not k.startswith("torch_")]
TORCH_METHODS = [k for k in METHODS if k.startswith("torch_")]
STEADY = {
    "bridge_ping",
    "bridge_steady",
    "bridge_pool_steady",
    "bridge_mixed_steady",
    "bridge_mixed_legacy_steady",
    "raw_cached",
    "torch_steady",
    "torch_steady_drop",
}
FRESH = {
    "bridge_fresh_legacy",
    "bridge_fresh_pool",
    "bridge_fresh_slab",
    "bridge_mixed_fresh",
    "raw_fresh",
    "torch_fresh",
}
# The slab allocator's slab size for bridge_fresh_slab: four 64 MiB columns of the 1 GiB table.
SLAB_SIZE = 256 * MiB
CONTROL_BASE = 1 << 20  # iteration numbers of the control publications (bridge_fresh_slab)
MIXED = {"bridge_mixed_steady", "bridge_mixed_fresh", "bridge_mixed_legacy_steady"}

# The peer baselines the project's design goals were set against (NVIDIA H200, median round trip,
# microseconds), printed beside this run's figures for comparison.
DESIGN_BASELINES_US: dict[str, dict[int, float]] = {
    "d2h_ipc": {MiB: 3.6e3, 64 * MiB: 322e3, GiB: 4.7e6},
    "torch_steady": {MiB: 1.13e3, 64 * MiB: 1.31e3, GiB: 1.80e3},
    "torch_fresh": {MiB: 3.8e3, 64 * MiB: 6.0e3, GiB: 35.7e3},
    "raw_fresh": {MiB: 0.37e3, 64 * MiB: 1.27e3, GiB: 1.17e3},
    "raw_cached": {MiB: 0.10e3, 64 * MiB: 0.10e3, GiB: 0.07e3},
}
DESIGN_LABELS = {
    "d2h_ipc": "D2H + Arrow IPC bytes over a pipe + H2D",
    "torch_steady": "torch.multiprocessing (16 CUDA tensors, steady state)",
    "torch_fresh": "torch.multiprocessing, first transfer",
    "raw_fresh": "raw legacy IPC, 16 fresh allocations (open each)",
    "raw_cached": "raw legacy IPC, handles cached by the consumer",
}

_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB}


# ---------------------------------------------------------------------------------------------------------
# sizes, statistics, formatting
# ---------------------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    if unit not in _UNITS or not num:
        raise ValueError(f"bad size {text!r} (use e.g. 1MiB, 64MiB, 1GiB)")
    value = int(float(num) * _UNITS[unit])
    if value < NCOLS * F32:
        raise ValueError(f"size {text!r} is too small: at least {NCOLS * F32} bytes (one float per column)")
    return value


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def rows_per_column(size: int) -> int:
    return max(1, size // (NCOLS * F32))


def fmt_us(x: float | None) -> str:
    """A duration given in microseconds, with its unit."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f} s"
    if x >= 1e4:
        return f"{x / 1e3:.1f} ms"
    if x >= 1e3:
        return f"{x / 1e3:.2f} ms"
    if x >= 10:
        return f"{x:.0f} µs"
    return f"{x:.1f} µs"


# ---------------------------------------------------------------------------------------------------------
# host tables
# ---------------------------------------------------------------------------------------------------------
def float32_host_batch(size: int, value_of_column: Callable[[int], float] | None = None) -> Any:
    """The 16-column float32 table on the host (what the GPU producer builds on the device)."""
    import numpy as np
    import pyarrow as pa

    n = rows_per_column(size)
    fill = value_of_column or (lambda c: float(c + 1))
    return pa.record_batch(
        [pa.array(np.full(n, fill(c), dtype=np.float32)) for c in range(NCOLS)], names=COLUMN_NAMES
    )


def mixed_batch(nbytes: int, seed: int = 20261121) -> tuple[Any, dict[str, Any]]:
    """A record batch of about ``nbytes``: string (10% nulls), list<int32> (10% nulls), int64 (10% nulls),
    float32 (no nulls, last: the column the consumer's kernel reads). ~80 bytes per row."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    rows = max(1, nbytes // 80)
    null_rate = 0.10

    def validity(n: int) -> tuple[Any, int, Any]:
        valid = rng.random(n) >= null_rate
        return pa.py_buffer(np.packbits(valid, bitorder="little")), int(n - valid.sum()), valid

    sbits, s_nulls, s_valid = validity(rows)
    s_len = rng.integers(0, 63, rows, dtype=np.int64) * s_valid  # mean ~28 characters
    s_off = np.zeros(rows + 1, np.int64)
    np.cumsum(s_len, out=s_off[1:])
    large_s = int(s_off[-1]) >= 2**31 - 1
    # characters and list values: a random pattern repeated (building 1 GiB of random bytes takes seconds)
    chars = np.resize(
        (np.frombuffer(rng.bytes(1 << 16), np.uint8) % 26 + 97).astype(np.uint8), int(s_off[-1])
    )
    strings = pa.Array.from_buffers(
        pa.large_string() if large_s else pa.string(),
        rows,
        [sbits, pa.py_buffer(s_off if large_s else s_off.astype(np.int32)), pa.py_buffer(chars)],
        null_count=s_nulls,
    )
    lbits, l_nulls, l_valid = validity(rows)
    l_len = rng.integers(0, 16, rows, dtype=np.int64) * l_valid  # mean ~6.75 values
    l_off = np.zeros(rows + 1, np.int64)
    np.cumsum(l_len, out=l_off[1:])
    large_l = int(l_off[-1]) >= 2**31 - 1
    values = pa.array(np.resize(rng.integers(-(2**31), 2**31 - 1, 1 << 16, dtype=np.int32), int(l_off[-1])))
    lists = pa.Array.from_buffers(
        pa.large_list(pa.int32()) if large_l else pa.list_(pa.int32()),
        rows,
        [lbits, pa.py_buffer(l_off if large_l else l_off.astype(np.int32))],
        null_count=l_nulls,
        children=[values],
    )
    ibits, i_nulls, _ = validity(rows)
    ints = pa.Array.from_buffers(
        pa.int64(),
        rows,
        [ibits, pa.py_buffer(rng.integers(-(2**62), 2**62, rows, dtype=np.int64))],
        null_count=i_nulls,
    )
    floats = rng.random(rows, dtype=np.float32)
    batch = pa.record_batch([strings, lists, ints, pa.array(floats)], names=["s", "l", "i64", "f32"])
    info = {
        "rows": rows,
        "nbytes": batch.nbytes,
        "types": [str(t) for t in batch.schema.types],
        "null_counts": [c.null_count for c in batch.columns],
        "bytes_by_column": {
            name: col.nbytes for name, col in zip(batch.schema.names, batch.columns, strict=True)
        },
        "expected_last": float(floats.astype(np.float64).sum()),
    }
    return batch, info


# ---------------------------------------------------------------------------------------------------------
# control channel
# ---------------------------------------------------------------------------------------------------------
_HDR = struct.Struct("<cI")
RAW_ENTRY = struct.Struct("<64sQQ")  # legacy handle, byte offset in the allocation, byte length
ECHO_BYTES = 64
# The consumer's session remembers the opened regions of up to 64 all-legacy messages and its opener keeps
# up to 256 legacy handles open: memory the producer has freed stays mapped until they let go. With new
# allocations every time that pins up to 64 tables; reconnecting the session (untimed) bounds it to this.
PINNED_BUDGET = 8 * GiB


class RemoteError(RuntimeError):
    """The other process reported an error (its traceback is the message)."""


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the control socket")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


class Ctl:
    """Framed control messages: opcode (1 byte), u32 length, payload."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, op: bytes, payload: bytes = b"") -> None:
        self.sock.sendall(_HDR.pack(op, len(payload)) + payload)

    def recv(self) -> tuple[bytes, bytes]:
        op, n = _HDR.unpack(recv_exact(self.sock, _HDR.size))
        return op, (recv_exact(self.sock, n) if n else b"")

    def reply(self) -> bytes:
        op, payload = self.recv()
        if op == b"x":
            raise RemoteError("producer: " + payload.decode(errors="replace"))
        if op != b"k":
            raise RemoteError(f"unexpected control reply {op!r}")
        return payload

    def call(self, op: bytes, payload: bytes = b"") -> bytes:
        self.send(op, payload)
        return self.reply()

    def call_json(self, op: bytes, obj: Any = None) -> Any:
        payload = self.call(op, b"" if obj is None else json.dumps(obj).encode())
        return json.loads(payload) if payload else None


class ParentGone(SystemExit):
    """The parent stopped listening (killed, or timed out): this child ends too."""


def _send_report(report: Any, msg: dict[str, Any]) -> None:
    try:
        report.send(msg)
    except (OSError, EOFError) as exc:
        raise ParentGone(3) from exc


def _perf() -> float:
    return time.perf_counter()


# ---------------------------------------------------------------------------------------------------------
# the timed loop shared by every method
# ---------------------------------------------------------------------------------------------------------
Iteration = Callable[[int], tuple[float, dict[str, float]]]


def run_loop(
    one: Iteration, *, warmup: int, n: int, budget_s: float, min_n: int = 5, first_is_sample: bool = False
) -> dict[str, Any]:
    """Run ``one(i)`` once (the "first" time), ``warmup`` times (discarded), then up to ``n`` measured
    times; measured iterations stop early once ``budget_s`` is spent and at least ``min_n`` ran.
    ``first_is_sample``: the first run also counts as the first measured one (for runs of seconds).

    ``one`` returns (seconds of the timed part, {extra name: value}); extras named ``*_s`` are durations
    (summarised in µs), others are plain numbers (summarised as mean). Returns samples and summaries."""
    first_s, first_extra = one(0)
    for i in range(1, warmup + 1):
        one(i)
    samples: list[float] = []
    extras: dict[str, list[float]] = {}
    if first_is_sample:
        samples.append(first_s)
        for key, value in first_extra.items():
            extras.setdefault(key, []).append(value)
    start = time.monotonic()
    for i in range(warmup + 1, warmup + 1 + n - len(samples)):
        dt, extra = one(i)
        samples.append(dt)
        for key, value in extra.items():
            extras.setdefault(key, []).append(value)
        if len(samples) >= min(min_n, n) and time.monotonic() - start > budget_s:
            break
    out: dict[str, Any] = {
        **stats_us(samples),
        "first_us": first_s * 1e6,
        "warmup": warmup,
        "planned_n": n,
        "budget_s": budget_s,
        "stopped_by_budget": len(samples) < n,
        "samples_us": [round(x * 1e6, 3) for x in samples],
        "first_extra": {k: (v * 1e6 if k.endswith("_s") else v) for k, v in first_extra.items()},
        "extra": {},
    }
    for key, values in extras.items():
        if key.endswith("_s"):
            out["extra"][key[:-2] + "_us"] = stats_us(values)
        else:
            out["extra"][key] = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
    return out


def plan(cfg: dict[str, Any], key: str, size: int) -> tuple[int, int, float]:
    """(warmup, measured iterations, time budget in seconds) for one method at one size."""
    it = int(cfg["iterations"])
    budget = float(cfg["method_budget_s"])
    if key == "d2h_ipc":
        if size <= 4 * MiB:
            return 2, it, budget
        if size <= 64 * MiB:
            return 1, (5 if cfg["quick"] else 20), budget
        return 0, 1, budget
    if key == "bridge_fresh_slab":
        # Cheap rounds (no driver call once warm) with a small difference to measure: the full
        # count, after enough rounds for the producer's slabs to reach their peak number.
        return 6, it, budget
    if key in FRESH:
        return 2, max(5, it // 2), budget
    return max(2, it // 10), it, budget


def check_close(what: str, got: float, expected: float, rel: float = 1e-3) -> None:
    if not math.isfinite(got) or abs(got - expected) > rel * max(1.0, abs(expected)):
        raise AssertionError(f"{what}: the consumer's kernel read {got!r}, expected {expected!r}")


# ---------------------------------------------------------------------------------------------------------
# the bridge pair: producer
# ---------------------------------------------------------------------------------------------------------
def bridge_producer(cfg: dict[str, Any], report: Any, d2h_w: Any) -> None:
    try:
        _BridgeProducer(cfg, report, d2h_w).serve()
    except BaseException as exc:
        _send_report(report, {"error": f"bridge producer: {exc!r}\n{traceback.format_exc()}"})
        sys.exit(1)


class _BridgeProducer:
    def __init__(self, cfg: dict[str, Any], report: Any, d2h_w: Any) -> None:
        self.cfg = cfg
        self.report = report
        self.d2h_w = d2h_w
        self.host_only = bool(cfg.get("host_only"))
        self.names: set[str] = set()
        self.rings: dict[str, list[tuple[str, Any]]] = {}
        self.n = 0
        self.steady: list[Any] = []
        self.pool_steady: list[Any] = []
        self.raw_arrays: list[Any] = []
        self.raw_cached_blob = b""
        self.raw_fresh_blob = b""
        self.mixed: Any = None
        self.mixed_expected = math.nan
        self.pub: Any = None
        self.cp: Any = None
        self.pool_alloc: Any = None
        self.slab_alloc: Any = None

    # -- life --
    def serve(self) -> None:
        import pyarrow as pa

        import arrow_ipc_bridge as aib

        info: dict[str, Any] = {"pid": os.getpid(), "pyarrow": pa.__version__, "aib": aib.__version__}
        if not self.host_only:
            import cupy as cp

            from arrow_ipc_bridge import cuda
            from arrow_ipc_bridge.cuda import placer

            self.cp = cp
            cp.cuda.Device(0).use()
            info.update(
                device_name=cuda.device_name(0),
                device_uuid=cuda.format_uuid(cuda.device_uuid(0)),
                driver_version=cuda.driver_version(),
                device_count=cuda.device_count(),
                cupy=cp.__version__,
                cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
            )
            with contextlib.suppress(Exception):
                info["capabilities"] = vars(cuda.device_capabilities(0))
            # Pay the one-time costs (interprocess events ~225 µs each, the IPC pool) before any timing.
            # from_cuda_arrays takes one event per call (CuPy announces the legacy stream), every export
            # another: with the rings of fresh data alive that is ~10 at a time.
            placer.event_pool(0).prefill(16)
            self.pool_alloc = cuda.cupy_allocator(0)
            self.slab_alloc = cuda.cupy_allocator(0, slab_size=SLAB_SIZE)
        self.pub = aib.Publisher(self.cfg["bridge_sock"])
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn = None
        try:
            srv.bind(self.cfg["ctl_sock"])
            srv.listen(1)
            _send_report(self.report, {"ready": info})
            srv.settimeout(300)
            conn, _ = srv.accept()
            conn.settimeout(None)  # the consumer drives; EOF (consumer gone) ends the loop
            self._loop(Ctl(conn))
        finally:
            if conn is not None:
                conn.close()
            srv.close()
            self._drop_everything()
            self.pub.close()

    def _loop(self, ctl: Ctl) -> None:
        while True:
            try:
                op, payload = ctl.recv()
            except (ConnectionError, OSError):
                return
            if op == b"Q":
                ctl.send(b"k")
                return
            if op == b"E":
                (count,) = struct.unpack("<I", payload)
                ctl.send(b"k")
                self._echo(ctl.sock, count)
                continue
            try:
                if op == b"H":
                    ctl.send(b"k", self.raw_cached_blob if payload == b"c" else self.raw_fresh_blob)
                    continue
                if op == b"S":
                    out = self.setup(json.loads(payload))
                elif op == b"F":
                    out = self.fresh(json.loads(payload))
                elif op == b"U":
                    out = self.drop_ring(json.loads(payload)["kind"])
                elif op == b"D":
                    out = self.d2h()
                elif op == b"T":
                    out = self.teardown()
                else:
                    raise ValueError(f"unknown control opcode {op!r}")
                ctl.send(b"k", json.dumps(out).encode())
            except Exception:
                ctl.send(b"x", traceback.format_exc().encode())

    @staticmethod
    def _echo(sock: socket.socket, count: int) -> None:
        view = memoryview(bytearray(ECHO_BYTES))
        for _ in range(count):
            recv_exact_into(sock, view)
            sock.sendall(view)

    # -- data --
    def _full(self, value: float, allocator: Any = "default") -> list[Any]:
        """16 new float32 device arrays filled with ``value`` (allocator: "default" CuPy pool,
        None = plain cudaMalloc per array, or a CuPy allocator such as the bridge's IPC pool one)."""
        cp = self.cp
        if allocator == "default":
            return [cp.full(self.n, value, dtype=cp.float32) for _ in range(NCOLS)]
        with cp.cuda.using_allocator(allocator):
            return [cp.full(self.n, value, dtype=cp.float32) for _ in range(NCOLS)]

    def _publish(self, name: str, obj: Any) -> dict[str, Any]:
        t0 = _perf()
        stats = self.pub.publish(name, obj)
        publish_s = _perf() - t0
        self.names.add(name)
        return {"publish_us": publish_s * 1e6, **vars(stats)}

    def _publish_columns(self, name: str, arrays: list[Any]) -> dict[str, Any]:
        from arrow_ipc_bridge.arrays.device import from_cuda_arrays

        t0 = _perf()
        obj = from_cuda_arrays(dict(zip(COLUMN_NAMES, arrays, strict=True)))
        wrap_s = _perf() - t0
        out = self._publish(name, obj)
        out["from_cuda_arrays_us"] = wrap_s * 1e6
        return out

    def _raw_blob(self, arrays: list[Any]) -> bytes:
        from arrow_ipc_bridge import cuda

        parts = []
        for a in arrays:
            ptr = int(a.data.ptr)
            info = cuda.pointer_info(ptr)
            if info is None or not info.legacy_ipc_capable:
                raise RuntimeError(f"array at {ptr:#x} is not legacy-IPC capable: {info}")
            handle = cuda.ipc_get_mem_handle(info.base, device=0)
            parts.append(RAW_ENTRY.pack(handle, ptr - info.base, int(a.nbytes)))
        return b"".join(parts)

    def setup(self, req: dict[str, Any]) -> dict[str, Any]:
        self._drop_everything()
        size = int(req["size"])
        self.n = rows_per_column(size)
        out: dict[str, Any] = {"size": size, "rows_per_column": self.n, "columns": NCOLS}
        if self.host_only:
            import numpy as np

            self.steady = [np.full(self.n, float(c + 1), dtype=np.float32) for c in range(NCOLS)]
            out["expected_last"] = float(NCOLS * self.n)
            return out
        from arrow_ipc_bridge.arrays.device import to_device

        cp = self.cp
        t0 = _perf()
        self.steady = [cp.full(self.n, float(c + 1), dtype=cp.float32) for c in range(NCOLS)]
        with cp.cuda.using_allocator(self.pool_alloc):
            self.pool_steady = [cp.full(self.n, float(c + 1), dtype=cp.float32) for c in range(NCOLS)]
        with cp.cuda.using_allocator(None):
            self.raw_arrays = [cp.full(self.n, float(c + 1), dtype=cp.float32) for c in range(NCOLS)]
        cp.cuda.runtime.deviceSynchronize()  # the raw path has no event: its data is complete now
        out["alloc_us"] = (_perf() - t0) * 1e6
        out["expected_last"] = float(NCOLS * self.n)  # last column holds 16.0 everywhere
        out["publish"] = {
            "steady": self._publish_columns("steady", self.steady),
            "pool_steady": self._publish_columns("pool_steady", self.pool_steady),
        }
        t0 = _perf()
        self.raw_cached_blob = self._raw_blob(self.raw_arrays)
        out["raw_handles_us"] = (_perf() - t0) * 1e6
        if req.get("mixed"):
            t0 = _perf()
            batch, minfo = mixed_batch(size)
            build_s = _perf() - t0
            t0 = _perf()
            gpu = to_device(batch)
            upload_s = _perf() - t0
            minfo["host_build_us"] = build_s * 1e6
            minfo["to_device_us"] = upload_s * 1e6
            minfo["publish"] = self._publish("mixed", gpu)
            del gpu  # the export keeps it
            minfo["publish_legacy"] = self._publish("mixed_legacy", to_device(batch, allocation="legacy"))
            self.mixed = batch
            self.mixed_expected = minfo["expected_last"]
            out["mixed"] = minfo
        return out

    def fresh(self, req: dict[str, Any]) -> dict[str, Any]:
        """New data for iteration ``i`` of a "new allocations every time" method, published as
        ``{kind}-{i}``; what was published two iterations ago is unpublished (the consumer released it
        long before, so pool memory is never freed under an importer)."""
        from arrow_ipc_bridge.arrays.device import from_cuda_arrays, to_device

        cp = self.cp
        kind = req["kind"]
        i = int(req["i"])
        value = float(1 + i % 7)
        expected = value * self.n
        name = f"{kind}-{i}"
        out: dict[str, Any] = {"name": name}
        t0 = _perf()
        keep: Any = None
        if kind == "legacy":
            cols = self._full(value, None)  # plain cudaMalloc: a new allocation (buffer id) per array
        elif kind in ("pool", "raw"):
            cols = self._full(value, self.pool_alloc if kind == "pool" else None)
        elif kind == "slab":
            cols = self._full(value, self.slab_alloc)
        elif kind == "mixed":
            obj = to_device(self.mixed)
            expected = self.mixed_expected
        else:
            raise ValueError(f"unknown fresh kind {kind!r}")
        if kind == "raw":
            cp.cuda.runtime.deviceSynchronize()
        t1 = _perf()
        out["alloc_s"] = t1 - t0
        if kind == "raw":
            self.raw_fresh_blob = self._raw_blob(cols)
            keep = cols
            out["publish_s"] = _perf() - t1  # 16 x cuIpcGetMemHandle
        else:
            if kind != "mixed":
                obj = from_cuda_arrays(dict(zip(COLUMN_NAMES, cols, strict=True)))
                del cols  # the export keeps them alive until it is unpublished and released
            stats = self.pub.publish(name, obj)
            out["publish_s"] = _perf() - t1
            del obj
            self.names.add(name)
            out["regions"] = stats.regions
            out["buffers"] = stats.buffers
            out["copied_bytes"] = stats.copied_bytes
        ring = self.rings.setdefault(kind, [])
        ring.append((name, keep))
        t2 = _perf()
        while len(ring) > 2:
            old, _ = ring.pop(0)
            if kind != "raw":
                self.pub.unpublish(old)
                self.names.discard(old)
        out["unpublish_old_s"] = _perf() - t2
        out["expected"] = expected
        return out

    def drop_ring(self, kind: str) -> dict[str, Any]:
        ring = self.rings.pop(kind, [])
        for name, _ in ring:
            if kind != "raw" and name in self.names:
                self.pub.unpublish(name)
                self.names.discard(name)
        ring.clear()
        self.raw_fresh_blob = b"" if kind == "raw" else self.raw_fresh_blob
        gc.collect()
        return {"dropped": kind}

    def d2h(self) -> dict[str, Any]:
        """The copy peer, producer half: device -> host, Arrow IPC stream, bytes into the pipe."""
        import numpy as np
        import pyarrow as pa

        t0 = _perf()
        if self.host_only:
            host = [np.asarray(a) for a in self.steady]
        else:
            host = [self.cp.asnumpy(a) for a in self.steady]
        t1 = _perf()
        batch = pa.record_batch([pa.array(h) for h in host], names=COLUMN_NAMES)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        buf = sink.getvalue()
        t2 = _perf()
        self.d2h_w.send_bytes(buf)
        t3 = _perf()
        return {
            "d2h_us": (t1 - t0) * 1e6,
            "serialize_us": (t2 - t1) * 1e6,
            "send_us": (t3 - t2) * 1e6,
            "bytes": buf.size,
        }

    def teardown(self) -> dict[str, Any]:
        self._drop_everything()
        return {"torn_down": True}

    def _drop_everything(self) -> None:
        for kind in list(self.rings):
            with contextlib.suppress(Exception):
                self.drop_ring(kind)
        if self.pub is not None:
            for name in list(self.names):
                with contextlib.suppress(Exception):
                    self.pub.unpublish(name)
        self.names.clear()
        self.steady, self.pool_steady, self.raw_arrays = [], [], []
        self.raw_cached_blob = self.raw_fresh_blob = b""
        self.mixed = None
        gc.collect()
        if self.cp is not None:
            with contextlib.suppress(Exception):
                self.cp.cuda.runtime.deviceSynchronize()
                self.cp.get_default_memory_pool().free_all_blocks()
            # Unpublished entries whose leases already ended are closed: give pool memory back.
            from arrow_ipc_bridge.cuda import placer

            with contextlib.suppress(Exception):
                self.pool_alloc.pool.trim_to(0)
            with contextlib.suppress(Exception):
                placer.bridge_pool(0).trim_to(0)


# ---------------------------------------------------------------------------------------------------------
# the bridge pair: consumer
# ---------------------------------------------------------------------------------------------------------
def _connect_retry(path: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def bridge_consumer(cfg: dict[str, Any], report: Any, d2h_r: Any) -> None:
    consumer = None
    try:
        consumer = _BridgeConsumer(cfg, report, d2h_r)
        consumer.run()
    except BaseException as exc:
        _send_report(report, {"error": f"bridge consumer: {exc!r}\n{traceback.format_exc()}"})
        sys.exit(1)
    finally:
        if consumer is not None:
            consumer.close()


class _BridgeConsumer:
    def __init__(self, cfg: dict[str, Any], report: Any, d2h_r: Any) -> None:
        self.cfg = cfg
        self.report = report
        self.d2h_r = d2h_r
        self.host_only = bool(cfg.get("host_only"))
        self.ctl: Ctl | None = None
        self.session: Any = None
        self.cp: Any = None
        self.stream: Any = None
        self.stream_ptr = 0
        self.size = 0
        self.size_info: dict[str, Any] = {}
        self.session_resets = 0

    # -- plumbing --
    def note(self, text: str) -> None:
        _send_report(self.report, {"note": text})

    def close(self) -> None:
        if self.session is not None:
            with contextlib.suppress(Exception):
                self.session.close()
        if self.ctl is not None:
            with contextlib.suppress(Exception):
                self.ctl.sock.settimeout(10)
                self.ctl.call(b"Q")
            with contextlib.suppress(Exception):
                self.ctl.sock.close()

    def run(self) -> None:
        if not self.host_only:
            import cupy as cp

            self.cp = cp
            cp.cuda.Device(0).use()
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.stream_ptr = int(self.stream.ptr)
        sock = _connect_retry(self.cfg["ctl_sock"], 300)
        sock.settimeout(300)
        self.ctl = Ctl(sock)
        self._connect_session()
        warm = self._warm_op()
        methods = [m for m in self.cfg["methods"] if m in BRIDGE_METHODS]
        for size in self.cfg["sizes"]:
            if self._past_deadline():
                self.note(f"bridge: deadline reached, sizes from {fmt_size(size)} on skipped")
                break
            self.size = size
            want_mixed = any(m in MIXED for m in methods)
            self.size_info = self.ctl.call_json(b"S", {"size": size, "mixed": want_mixed})
            _send_report(self.report, {"size_info": {"pair": "bridge", **self.size_info}})
            for key in methods:
                if self._past_deadline():
                    self.note(f"bridge: deadline reached, {key} at {fmt_size(size)} skipped")
                    continue
                if self.host_only and key not in ("bare_rtt", "d2h_ipc"):
                    continue
                if key == "d2h_ipc" and size > 64 * MiB and self.cfg["quick"]:
                    self.note(f"d2h_ipc at {fmt_size(size)} skipped in --quick mode (takes seconds)")
                    continue
                self._run_method(key, size)
            self.ctl.call_json(b"T")
            self._drop_local_caches()
        _send_report(self.report, {"done": {"pair": "bridge", "local_op_launch": warm}})

    def _past_deadline(self) -> bool:
        return time.time() > float(self.cfg["deadline_epoch"])

    def _run_method(self, key: str, size: int) -> None:
        fn = getattr(self, "m_" + key)
        t0 = time.monotonic()
        try:
            result = fn(size)
        except Exception as exc:
            _send_report(
                self.report,
                {
                    "result": {
                        "pair": "bridge",
                        "method": key,
                        "size": size,
                        "error": f"{exc!r}\n{traceback.format_exc()}",
                    }
                },
            )
            # A half-finished method may leave fresh data published: drop it, keep going.
            with contextlib.suppress(Exception):
                for kind in ("legacy", "pool", "slab", "mixed", "raw"):
                    self.ctl.call_json(b"U", {"kind": kind})  # type: ignore[union-attr]
            return
        if result is None:
            return
        result.update(pair="bridge", method=key, size=size, wall_s=time.monotonic() - t0)
        _send_report(self.report, {"result": result})

    def _connect_session(self) -> None:
        import arrow_ipc_bridge as aib

        deadline = time.monotonic() + 60
        while True:
            try:
                self.session = aib.connect(self.cfg["bridge_sock"], timeout=120.0)
                return
            except aib.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _drop_local_caches(self) -> None:
        """Let go of every legacy handle this process holds open (the session's remembered messages and
        the opener's LRU) by closing the session and connecting a new one; untimed."""
        if self.host_only:
            return
        from arrow_ipc_bridge.cuda import opener as cuda_opener
        from arrow_ipc_bridge.runtime import reaper

        if self.session is not None:
            self.session.close()
            self.session = None
        cuda_opener.opener().close()  # legacy handles close once nothing uses them
        gc.collect()
        reaper.drain()
        with contextlib.suppress(Exception):
            self.cp.get_default_memory_pool().free_all_blocks()
        self._connect_session()
        self.session_resets += 1

    # -- the consumer's kernel --
    def _warm_op(self) -> dict[str, Any]:
        """Compile/warm the reduction used as "the work launched on the data", and time its launch on
        local memory (to subtract mentally from every round trip: all methods pay it)."""
        if self.host_only:
            return {}
        cp = self.cp
        local = cp.ones(1 << 20, dtype=cp.float32)
        with self.stream:
            local.sum()
        self.stream.synchronize()
        samples = []
        for _ in range(200):
            t0 = _perf()
            with self.stream:
                r = local.sum()
            samples.append(_perf() - t0)
            self.stream.synchronize()
            del r
        return stats_us(samples)

    def _launch_sum(self, ptr: int, nbytes: int, owner: Any) -> Any:
        cp = self.cp
        n = nbytes // F32
        memory = cp.cuda.UnownedMemory(ptr, nbytes, owner, 0)
        view = cp.ndarray((n,), cp.float32, cp.cuda.MemoryPointer(memory, 0))
        with self.stream:
            return view.sum()

    # -- methods --
    def m_bare_rtt(self, size: int) -> dict[str, Any]:
        assert self.ctl is not None
        count = max(200, int(self.cfg["iterations"]) * 10)
        warm = 50
        self.ctl.call(b"E", struct.pack("<I", count + warm))
        sock = self.ctl.sock
        sock.settimeout(None)  # plain blocking calls: the floor, no poll() before each recv
        msg = memoryview(bytes(range(ECHO_BYTES)))
        view = memoryview(bytearray(ECHO_BYTES))
        samples = []
        try:
            for i in range(count + warm):
                t0 = _perf()
                sock.sendall(msg)
                recv_exact_into(sock, view)
                dt = _perf() - t0
                if i >= warm:
                    samples.append(dt)
        finally:
            sock.settimeout(300)
        if bytes(view) != bytes(msg):
            raise AssertionError("echo payload differs")
        return {**stats_us(samples), "first_us": math.nan, "warmup": warm, "samples_us": []}

    def _bridge_get(self, name: str, expected: float) -> tuple[float, dict[str, float]]:
        """One hand-off: get -> device capsule -> wait sync_event on our stream: timed so far (the
        consumer can launch work); then the launch of a kernel on the last column (reported as
        "launched"), and (untimed) synchronise, check, release."""
        import arrow_ipc_bridge as aib
        from arrow_ipc_bridge import cuda
        from arrow_ipc_bridge._ffi import ffi
        from arrow_ipc_bridge.runtime import reaper
        from arrow_ipc_bridge.wire.capsules import capsule_struct

        assert self.session is not None
        before = aib.stats().session
        remembered, new_in_c = before.remembered_gets, before.new_message_gets
        t0 = _perf()
        imported = self.session.get(name)
        t_got = _perf()
        capsules = imported.__arrow_c_device_array__()
        t_capsules = _perf()
        device_array = capsule_struct(capsules[1], "device_array")
        sync = device_array.sync_event
        if sync:
            # What a CuPy consumer writes (cuDF does the same in C++): the runtime's cudaStreamWaitEvent.
            self.cp.cuda.runtime.streamWaitEvent(self.stream_ptr, cuda.event_value(sync))
        root = device_array.array
        column = root.children[root.n_children - 1]
        ptr = int(ffi.cast("uintptr_t", column.buffers[1])) + int(column.offset) * F32
        t_ready = _perf()  # the consumer can launch work: device pointer in hand, stream ordered
        result = self._launch_sum(ptr, int(column.length) * F32, imported)
        t1 = _perf()
        self.stream.synchronize()
        got = float(result)
        has_sync = bool(sync)
        del result, column, root, device_array, sync
        t2 = _perf()
        del capsules  # the capsule destructors release the structs
        imported.release()
        reaper.drain()  # lease release + handle/pointer frees now, not during the next timed get
        t3 = _perf()
        # Which path the get took, read after the timed part (aib.stats() builds a whole record).
        after = aib.stats().session
        remembered = after.remembered_gets - remembered
        new_in_c = after.new_message_gets - new_in_c
        check_close(name, got, expected)
        return t_ready - t0, {
            "launched_s": t1 - t0,
            "release_s": t3 - t2,
            "sync_event": float(has_sync),
            # how the get was imported: a remembered message, or a new one by the C core (else Python)
            "remembered": float(remembered),
            "new_in_c": float(new_in_c),
            # where the round trip goes: the get, the capsule pair, the consumer's struct reads + wait
            "get_s": t_got - t0,
            "capsules_s": t_capsules - t_got,
            "consumer_s": t_ready - t_capsules,
        }

    @contextlib.contextmanager
    def _count_opens(self) -> Iterator[dict[str, Any]]:
        """cuda_stats() deltas (legacy opens/hits, pool imports) over a block."""
        from arrow_ipc_bridge import cuda

        out: dict[str, Any] = {}
        before = cuda.cuda_stats()
        try:
            yield out
        finally:
            after = cuda.cuda_stats()
            out.update({k: after[k] - before.get(k, 0) for k in after})

    def _instrumented_opens(self, one: Iteration, iterations: int, start: int) -> dict[str, Any]:
        """Time every region open of a few extra iterations (CudaOpener.open per region kind; a
        message's pool regions, opened in one batch, as the batch's time per region)."""
        from arrow_ipc_bridge import cuda
        from arrow_ipc_bridge.cuda import opener as cuda_opener
        from arrow_ipc_bridge.wire.metadata import REGION_CUDA_LEGACY, REGION_CUDA_POOL, REGION_CUDA_VMM

        kinds = {REGION_CUDA_LEGACY: "legacy", REGION_CUDA_POOL: "pool", REGION_CUDA_VMM: "vmm"}
        opener = cuda_opener.opener()
        original = opener.open
        times: dict[str, list[float]] = {}

        def timed_open(region: Any, fds: Any, device: int) -> Any:
            t0 = _perf()
            try:
                return original(region, fds, device)
            finally:
                times.setdefault(kinds.get(region.kind, str(region.kind)), []).append(_perf() - t0)

        def per_item(kind: str, batch: Callable[..., Any], items_at: int = 0) -> Callable[..., Any]:
            # A batch opens together (a message's pool or legacy regions, the driver's pointer
            # imports): per item = the batch's time / its size; items are argument ``items_at``.
            def timed(*args: Any) -> Any:
                t0 = _perf()
                try:
                    return batch(*args)
                finally:
                    times.setdefault(kind, []).append((_perf() - t0) / max(1, len(args[items_at])))

            return timed

        original_import = cuda.ImportedPool.import_pointers
        # instance attributes: shadow the methods for this process only
        opener.open = timed_open
        opener.open_pool_regions = per_item("pool", opener.open_pool_regions)
        opener.open_legacy_regions = per_item("legacy", opener.open_legacy_regions)
        # the part of a pool open that is the driver's: its import calls, looped in C
        cuda.ImportedPool.import_pointers = per_item("pool_driver", original_import, 1)  # type: ignore[method-assign]
        try:
            for i in range(iterations):
                one(start + i)
        finally:
            del opener.open
            del opener.open_pool_regions
            del opener.open_legacy_regions
            cuda.ImportedPool.import_pointers = original_import  # type: ignore[method-assign]
        return {kind: stats_us(values) for kind, values in times.items()}

    def _steady(self, key: str, size: int, name: str, expected: float) -> dict[str, Any]:
        warmup, n, budget = plan(self.cfg, key, size)

        def one(i: int) -> tuple[float, dict[str, float]]:
            return self._bridge_get(name, expected)

        with self._count_opens() as opens:
            result = run_loop(one, warmup=warmup, n=n, budget_s=budget)
        result["cuda_stats_delta"] = opens
        result["iterations_total"] = 1 + warmup + result["n"]
        mixed = self.size_info.get("mixed", {})
        result["publish"] = self.size_info.get("publish", {}).get(name) or (
            mixed.get("publish_legacy") if name == "mixed_legacy" else mixed.get("publish")
        )
        if key not in MIXED:
            result["open_us_by_region_kind"] = self._instrumented_opens(one, min(20, n), 0)
        return result

    def _fresh(self, key: str, size: int, kind: str) -> dict[str, Any]:
        assert self.ctl is not None
        warmup, n, budget = plan(self.cfg, key, size)
        # legacy: bound what stays mapped after the producer freed it (see PINNED_BUDGET)
        reset_every = max(4, PINNED_BUDGET // size) if kind == "legacy" else 0
        resets_before = self.session_resets

        def one(i: int) -> tuple[float, dict[str, float]]:
            if reset_every and i and i % reset_every == 0:
                self._drop_local_caches()
            prep = self.ctl.call_json(b"F", {"kind": kind, "i": i})  # type: ignore[union-attr]
            dt, extra = self._bridge_get(prep["name"], prep["expected"])
            extra.update(
                producer_alloc_s=prep["alloc_s"],
                producer_publish_s=prep["publish_s"],
                publish_plus_get_s=prep["publish_s"] + dt,
                regions=float(prep.get("regions", 0)),
                buffers=float(prep.get("buffers", 0)),
                copied_bytes=float(prep.get("copied_bytes", 0)),
            )
            if kind == "slab":
                # The control: the same producer work before the get (which leaves both processes
                # idle for a millisecond or two: cold caches, deeper sleeps), then a get of the
                # steady message. What the new message adds is the difference.
                self.ctl.call_json(b"F", {"kind": kind, "i": CONTROL_BASE + i})  # type: ignore[union-attr]
                extra["control_get_s"] = self._bridge_get("steady", self.size_info["expected_last"])[0]
            return dt, extra

        try:
            with self._count_opens() as opens:
                result = run_loop(one, warmup=warmup, n=n, budget_s=budget)
            result["cuda_stats_delta"] = opens
            total = 1 + warmup + result["n"]
            result["iterations_total"] = total
            result["per_iteration"] = {k: v / total for k, v in opens.items()}
            if kind in ("pool", "slab", "legacy"):
                k = min(20, n)
                result["open_us_by_region_kind"] = self._instrumented_opens(one, k, 1 + warmup + n)
        finally:
            self.ctl.call_json(b"U", {"kind": kind})
            if kind == "legacy":
                self._drop_local_caches()
        result["session_reconnects"] = self.session_resets - resets_before
        return result

    def m_bridge_ping(self, size: int) -> dict[str, Any]:
        """The bare round trip on the bridge's own connection (``Session.ping``: 64 bytes echoed by
        the publisher's C loop), in the steady loop's rhythm: each timed ping is followed by an
        untimed steady-state get (get, capsule, wait, launch, synchronise, release), so the ping
        meets the same gaps and the same idle threads as the gets of ``bridge_steady`` do.

        Then one more steady get, timed ("interleaved_get"), and a get of each mixed table when
        they are published ("interleaved_mixed_get", "interleaved_mixed_legacy_get"): each follows
        a full get cycle just as the ping does, and runs within a few hundred microseconds of that
        ping, so the medians compare like with like even on a machine whose speed drifts between
        the separate loops of bridge_ping and the steady methods."""
        warmup, n, budget = plan(self.cfg, "bridge_steady", size)
        assert self.session is not None
        session = self.session
        payload = bytes(range(64))
        expected = self.size_info["expected_last"]
        mixed = self.size_info.get("mixed") or {}
        interleaved = [("interleaved_get_s", "steady", expected)]
        if mixed.get("expected_last") is not None:
            interleaved += [
                ("interleaved_mixed_get_s", "mixed", mixed["expected_last"]),
                ("interleaved_mixed_legacy_get_s", "mixed_legacy", mixed["expected_last"]),
            ]

        def one(i: int) -> tuple[float, dict[str, float]]:
            dt = session.ping(payload)
            self._bridge_get("steady", expected)
            return dt, {key: self._bridge_get(name, value)[0] for key, name, value in interleaved}

        return run_loop(one, warmup=warmup, n=n, budget_s=budget)

    def m_bridge_steady(self, size: int) -> dict[str, Any]:
        return self._steady("bridge_steady", size, "steady", self.size_info["expected_last"])

    def m_bridge_pool_steady(self, size: int) -> dict[str, Any]:
        return self._steady("bridge_pool_steady", size, "pool_steady", self.size_info["expected_last"])

    def m_bridge_mixed_steady(self, size: int) -> dict[str, Any]:
        result = self._steady("bridge_mixed_steady", size, "mixed", self.size_info["mixed"]["expected_last"])
        result["table"] = {k: v for k, v in self.size_info["mixed"].items() if k != "publish"}
        return result

    def m_bridge_mixed_legacy_steady(self, size: int) -> dict[str, Any]:
        key = "bridge_mixed_legacy_steady"
        result = self._steady(key, size, "mixed_legacy", self.size_info["mixed"]["expected_last"])
        result["table"] = {k: v for k, v in self.size_info["mixed"].items() if not k.startswith("publish")}
        return result

    def m_bridge_fresh_legacy(self, size: int) -> dict[str, Any]:
        return self._fresh("bridge_fresh_legacy", size, "legacy")

    def m_bridge_fresh_pool(self, size: int) -> dict[str, Any]:
        return self._fresh("bridge_fresh_pool", size, "pool")

    def m_bridge_fresh_slab(self, size: int) -> dict[str, Any]:
        return self._fresh("bridge_fresh_slab", size, "slab")

    def m_bridge_mixed_fresh(self, size: int) -> dict[str, Any]:
        result = self._fresh("bridge_mixed_fresh", size, "mixed")
        result["table"] = {k: v for k, v in self.size_info["mixed"].items() if k != "publish"}
        return result

    def _raw(self, key: str, size: int, cached: bool) -> dict[str, Any]:
        """Raw legacy IPC, no bridge: the producer sends 16 (handle, offset, length) entries over the
        control socket; the consumer opens each handle (or finds it in its own cache) and launches the
        same kernel. The producer synchronised its device before, so no event is involved."""
        from arrow_ipc_bridge import cuda

        assert self.ctl is not None
        ctl = self.ctl
        warmup, n, budget = plan(self.cfg, key, size)
        cache: dict[bytes, int] = {}
        expected_now = [self.size_info["expected_last"]]

        def one(i: int) -> tuple[float, dict[str, float]]:
            extra: dict[str, float] = {}
            if not cached:
                prep = ctl.call_json(b"F", {"kind": "raw", "i": i})
                expected_now[0] = prep["expected"]
                extra["producer_alloc_s"] = prep["alloc_s"]
                extra["producer_get_handles_s"] = prep["publish_s"]
            opened: list[int] = []
            t0 = _perf()
            ctl.send(b"H", b"c" if cached else b"f")
            blob = ctl.reply()
            last = (0, 0)
            for k in range(len(blob) // RAW_ENTRY.size):
                handle, offset, nbytes = RAW_ENTRY.unpack_from(blob, k * RAW_ENTRY.size)
                base = cache.get(handle) if cached else None
                if base is None:
                    base = cuda.ipc_open_mem_handle(handle, 0)
                    opened.append(base)
                    if cached:
                        cache[handle] = base
                last = (base + offset, nbytes)
            t_ready = _perf()
            result = self._launch_sum(last[0], last[1], None)
            t1 = _perf()
            self.stream.synchronize()
            got = float(result)
            del result
            if not cached:
                t2 = _perf()
                for base in opened:
                    cuda.ipc_close_mem_handle(base, device=0)
                extra["close_s"] = _perf() - t2
            extra["opens"] = float(len(opened))
            extra["launched_s"] = t1 - t0
            check_close(key, got, expected_now[0])
            return t_ready - t0, extra

        try:
            result = run_loop(one, warmup=warmup, n=n, budget_s=budget)
        finally:
            for base in cache.values():
                with contextlib.suppress(Exception):
                    cuda.ipc_close_mem_handle(base, device=0)
            if not cached:
                ctl.call_json(b"U", {"kind": "raw"})
        return result

    def m_raw_cached(self, size: int) -> dict[str, Any]:
        return self._raw("raw_cached", size, True)

    def m_raw_fresh(self, size: int) -> dict[str, Any]:
        return self._raw("raw_fresh", size, False)

    def m_d2h_ipc(self, size: int) -> dict[str, Any]:
        """The copy peer: the producer copies the 16 columns to the host, writes an Arrow IPC stream
        into a pipe; the consumer reads it, copies every column to its GPU, launches the same kernel."""
        from multiprocessing.connection import wait

        import numpy as np
        import pyarrow as pa

        assert self.ctl is not None
        ctl = self.ctl
        warmup, n, budget = plan(self.cfg, "d2h_ipc", size)
        expected = self.size_info["expected_last"]

        def one(i: int) -> tuple[float, dict[str, float]]:
            t0 = _perf()
            ctl.send(b"D")
            info: Any = None
            ready = wait([self.d2h_r, ctl.sock], timeout=600)
            if not ready:
                raise TimeoutError("no D2H data from the producer in 600 s")
            if self.d2h_r not in ready:  # the control reply came first: an error, most likely
                info = json.loads(ctl.reply())
            if not self.d2h_r.poll(600):
                raise TimeoutError("no D2H data from the producer in 600 s")
            data = self.d2h_r.recv_bytes()
            batch = pa.ipc.open_stream(data).read_next_batch()
            if self.host_only:
                cols = [np.asarray(batch.column(c).to_numpy(zero_copy_only=True)) for c in range(NCOLS)]
                t_ready = _perf()
                result: Any = cols[-1].sum(dtype=np.float64)
            else:
                cp = self.cp
                with self.stream:
                    cols = [cp.asarray(batch.column(c).to_numpy(zero_copy_only=True)) for c in range(NCOLS)]
                    t_ready = _perf()
                    result = cols[-1].sum()
            t1 = _perf()
            if not self.host_only:
                self.stream.synchronize()
            got = float(result)
            if info is None:
                info = json.loads(ctl.reply())
            del cols, batch, data, result
            check_close("d2h_ipc", got, expected)
            return t_ready - t0, {
                "launched_s": t1 - t0,
                "producer_d2h_s": info["d2h_us"] / 1e6,
                "producer_serialize_s": info["serialize_us"] / 1e6,
                "producer_send_s": info["send_us"] / 1e6,
                "ipc_bytes": float(info["bytes"]),
            }

        return run_loop(
            one, warmup=warmup, n=n, budget_s=budget, min_n=min(3, n), first_is_sample=warmup == 0
        )


# ---------------------------------------------------------------------------------------------------------
# the torch pair
# ---------------------------------------------------------------------------------------------------------
def torch_producer(cfg: dict[str, Any], conn: Any, queue: Any, report: Any) -> None:
    """Serves ("setup", size) / ("steady",) / ("prep", i) / ("fresh",) / ("teardown",) / ("quit",)."""
    try:
        import torch
        import torch.multiprocessing  # registers the reductions that share CUDA tensors

        device = torch.device(cfg.get("torch_device", "cuda:0"))
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        tensors: list[Any] = []
        ring: list[list[Any]] = []
        n = 0
        info: dict[str, Any] = {"torch": torch.__version__}
        if cuda:
            info["device_name"] = torch.cuda.get_device_name(device)
        conn.send(("ready", info))
        while True:
            if not conn.poll(600):
                return
            msg = conn.recv()
            op = msg[0]
            try:
                if op == "quit":
                    break
                if op == "steady":
                    queue.put(tensors)
                elif op == "fresh":
                    queue.put(ring[-1])
                elif op == "setup":
                    tensors, ring = [], []
                    n = rows_per_column(int(msg[1]))
                    tensors = [
                        torch.full((n,), float(c + 1), dtype=torch.float32, device=device)
                        for c in range(NCOLS)
                    ]
                    if cuda:
                        torch.cuda.synchronize()
                    conn.send(("ok", {"rows_per_column": n, "expected_last": float(NCOLS * n)}))
                elif op == "prep":
                    value = float(1 + int(msg[1]) % 7)
                    t0 = _perf()
                    new = [torch.full((n,), value, dtype=torch.float32, device=device) for _ in range(NCOLS)]
                    alloc_s = _perf() - t0
                    ring.append(new)
                    del ring[:-2]  # keep the one in flight and the one before
                    conn.send(("ok", {"alloc_s": alloc_s, "expected": value * n}))
                elif op == "teardown":
                    tensors, ring = [], []
                    gc.collect()
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.ipc_collect()
                        torch.cuda.empty_cache()
                    conn.send(("ok", {}))
                else:
                    raise ValueError(f"unknown op {op!r}")
            except Exception:
                text = traceback.format_exc()
                if op in ("steady", "fresh"):
                    queue.put(("error", text))
                else:
                    conn.send(("error", text))
        tensors, ring = [], []
        gc.collect()
        queue.close()
        queue.join_thread()
    except BaseException as exc:
        _send_report(report, {"error": f"torch producer: {exc!r}\n{traceback.format_exc()}"})
        sys.exit(1)


def torch_consumer(cfg: dict[str, Any], conn: Any, queue: Any, report: Any) -> None:
    consumer = None
    try:
        consumer = _TorchConsumer(cfg, conn, queue, report)
        consumer.run()
    except BaseException as exc:
        _send_report(report, {"error": f"torch consumer: {exc!r}\n{traceback.format_exc()}"})
        if consumer is not None:
            consumer.held = None
        with contextlib.suppress(Exception):
            conn.send(("quit",))
        sys.exit(1)


class _TorchConsumer:
    def __init__(self, cfg: dict[str, Any], conn: Any, queue: Any, report: Any) -> None:
        import torch
        import torch.multiprocessing  # the reductions that rebuild CUDA tensors

        self.torch = torch
        self.cfg = cfg
        self.conn = conn
        self.queue = queue
        self.report = report
        self.device = torch.device(cfg.get("torch_device", "cuda:0"))
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.held: Any = None
        self.expected = math.nan

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def answer(self, timeout: float = 600) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"torch producer did not answer in {timeout:.0f} s")
        status, payload = self.conn.recv()
        if status == "error":
            raise RemoteError("torch producer: " + str(payload))
        return payload

    def receive(self) -> Any:
        try:
            got = self.queue.get(timeout=600)
        except Exception as exc:  # queue.Empty
            raise TimeoutError("no tensors from the torch producer in 600 s") from exc
        if isinstance(got, tuple) and got and got[0] == "error":
            raise RemoteError("torch producer: " + str(got[1]))
        return got

    def warm(self) -> dict[str, Any]:
        torch = self.torch
        local = torch.ones(1 << 20, dtype=torch.float32, device=self.device)
        local.sum()
        self.sync()
        launch = []
        for _ in range(200):
            t0 = _perf()
            r = local.sum()
            launch.append(_perf() - t0)
            self.sync()
            del r
        return stats_us(launch)

    def _transfer(self, request: str) -> tuple[Any, float, float, float]:
        """One timed hand-off: ask, receive the tensors (rebuilt: handles open, the producer's event
        waited on), launch the sum of the last one; then (untimed) synchronise. Returns the tensors,
        the seconds to "can launch work" and to "launched", and the sum."""
        t0 = _perf()
        self.conn.send((request,))
        tensors = self.receive()
        t_ready = _perf()
        r = tensors[-1].sum()
        t1 = _perf()
        self.sync()
        return tensors, t_ready - t0, t1 - t0, float(r)

    def one_fresh(self, i: int) -> tuple[float, dict[str, float]]:
        self.conn.send(("prep", i))
        prep = self.answer()
        tensors, ready_s, launched_s, got = self._transfer("fresh")
        del tensors  # dropped: the next transfer has to open its handles again
        check_close("torch_fresh", got, prep["expected"])
        return ready_s, {"producer_alloc_s": prep["alloc_s"], "launched_s": launched_s}

    def one_steady(self, i: int, keep: bool) -> tuple[float, dict[str, float]]:
        tensors, ready_s, launched_s, got = self._transfer("steady")
        # keep: hold this transfer until the next one has arrived, so torch's receiving-side cache of
        # opened storages hits (its best case); drop: release it now, the next transfer reopens.
        self.held = tensors if keep else None
        del tensors
        check_close("torch_steady", got, self.expected)
        return ready_s, {"launched_s": launched_s}

    def past_deadline(self) -> bool:
        return time.time() > float(self.cfg["deadline_epoch"])

    def run(self) -> None:
        ready = self.answer()
        where = ready.get("device_name", str(self.device))
        _send_report(self.report, {"note": f"torch peer: torch {ready.get('torch')} on {where}"})
        launch = self.warm()
        methods = [m for m in self.cfg["methods"] if m in TORCH_METHODS]
        for size in self.cfg["sizes"]:
            if self.past_deadline():
                _send_report(self.report, {"note": f"torch: deadline reached, {fmt_size(size)} on skipped"})
                break
            self.conn.send(("setup", size))
            info = self.answer()
            self.expected = info["expected_last"]
            _send_report(self.report, {"size_info": {"pair": "torch", "size": size, **info}})
            for key in methods:
                if self.past_deadline():
                    _send_report(
                        self.report, {"note": f"torch: deadline reached, {key} at {fmt_size(size)} skipped"}
                    )
                    continue
                self.run_method(key, size)
            self.held = None
            gc.collect()
            self.sync()
            self.conn.send(("teardown",))
            self.answer()
        self.held = None
        gc.collect()
        self.sync()
        self.conn.send(("quit",))
        _send_report(self.report, {"done": {"pair": "torch", "local_op_launch": launch}})

    def run_method(self, key: str, size: int) -> None:
        warmup, n, budget = plan(self.cfg, key, size)
        t_start = time.monotonic()
        try:
            if key == "torch_fresh":
                result = run_loop(self.one_fresh, warmup=warmup, n=n, budget_s=budget)
            else:
                keep = key == "torch_steady"
                result = run_loop(
                    functools.partial(self.one_steady, keep=keep), warmup=warmup, n=n, budget_s=budget
                )
        except Exception as exc:
            self.held = None
            error = f"{exc!r}\n{traceback.format_exc()}"
            _send_report(
                self.report, {"result": {"pair": "torch", "method": key, "size": size, "error": error}}
            )
            return
        self.held = None
        gc.collect()
        result.update(pair="torch", method=key, size=size, wall_s=time.monotonic() - t_start)
        _send_report(self.report, {"result": result})
