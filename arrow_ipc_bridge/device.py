"""Moving Arrow data to and from the GPU, and wrapping GPU arrays as Arrow columns.

- :func:`to_device` uploads host Arrow data into the bridge's IPC-enabled memory pool, so what it
  returns is shared with other processes at pool-import cost;
- :func:`from_cuda_array` / :func:`from_cuda_arrays` wrap CuPy / PyTorch / Numba arrays
  (``__cuda_array_interface__``) or DLPack producers as Arrow columns without copying.

Copying imported data back to the host is :func:`arrow_ipc_bridge.imported.to_host`; showing
imported columns to array libraries is :mod:`arrow_ipc_bridge.columns`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import pyarrow as pa

from arrow_ipc_bridge import _reaper
from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.capsules import (
    DEVICE_CPU,
    DEVICE_CUDA,
    ArrowInput,
    CapturedArray,
    capture,
    export_captured,
)
from arrow_ipc_bridge.errors import BridgeError, RegionError
from arrow_ipc_bridge.imported import ImportedArray, ImportedStream, imported_from
from arrow_ipc_bridge.metadata import (
    SLOT_FIRST_REGION,
    SLOT_UNPLACED,
    Decoded,
    Described,
    DeviceInfo,
    process_region,
)

__all__ = ["to_device", "from_cuda_array", "from_cuda_arrays"]

_ALIGN = 256  # cudaMalloc's alignment; columns placed at this alignment suit every consumer
# The numeric types a plain array (``__cuda_array_interface__``, DLPack) can show:
# (Arrow format, array-interface typestr, pyarrow type). Both lookups below come from this table.
_NUMERIC_TYPES = [
    ("c", "|i1", pa.int8()),
    ("s", "<i2", pa.int16()),
    ("i", "<i4", pa.int32()),
    ("l", "<i8", pa.int64()),
    ("C", "|u1", pa.uint8()),
    ("S", "<u2", pa.uint16()),
    ("I", "<u4", pa.uint32()),
    ("L", "<u8", pa.uint64()),
    ("e", "<f2", pa.float16()),
    ("f", "<f4", pa.float32()),
    ("g", "<f8", pa.float64()),
]
_TYPESTRS = {typestr[1:]: arrow_type for _, typestr, arrow_type in _NUMERIC_TYPES}  # "f4" -> float32


def to_device(
    obj: ArrowInput, device: int = 0, *, allocation: Literal["pool", "legacy"] = "pool"
) -> ImportedArray | ImportedStream:
    """Upload host Arrow data to GPU ``device``; returns an object exporting ``__arrow_c_device_array__``.

    All buffers go into one allocation (one host-to-device copy per buffer), so publishing the
    result shares it without another copy. ``allocation`` picks its kind, which decides what a
    consumer pays per get:

    - ``"pool"`` (default): the bridge's IPC-enabled memory pool. A new upload costs a consumer one
      pointer import (~5-60 µs, growing with the allocation, plus the Python import path); a
      publication got twice is then kept by the session with a lease (``Session(pool_linger=...)``)
      and re-gets are the steady state (~30 µs on the H200). Suits data that changes often.
    - ``"legacy"``: ``cuMemAlloc`` memory, shared by a legacy IPC handle. A consumer opens it once
      (~20-90 µs) and remembers the message from the first get, without holding a lease: for data
      published once and fetched often.

    Examples
    --------
    >>> gpu = aib.to_device(pa.table({"x": [1.0, 2.0]}))  # doctest: +SKIP
    >>> pub.publish("x", gpu)                              # doctest: +SKIP
    """
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import placer

    if allocation not in ("pool", "legacy"):
        raise ValueError(f"allocation must be 'pool' or 'legacy', not {allocation!r}")
    captured = capture(obj)
    try:
        if captured.device_type != DEVICE_CPU:
            raise BridgeError(f"to_device needs host data; this is on device type {captured.device_type}")
        described = Described(captured)
        slots = described.slots()
        layout: list[tuple[int, int]] = []
        total = 0
        for i in range(0, len(slots), 4):
            if slots[i + 2] == SLOT_UNPLACED:
                layout.append((i, total))
                total += (slots[i + 1] + _ALIGN - 1) // _ALIGN * _ALIGN
        nbytes = max(total, _ALIGN)
        if allocation == "pool":
            pool = placer.bridge_pool(device)
            base = pool.allocate(nbytes)
            owner = lib.aib_owner_new(_reaper.register(lambda: pool.free(base)))
        else:
            base = cuda.mem_alloc(nbytes, device)
            owner = lib.aib_owner_new(_reaper.register(lambda: cuda.mem_free(base, device=device)))
        try:
            for i, offset in layout:
                cuda.memcpy_htod(base + offset, slots[i], slots[i + 1], device=device)
                # same-process region at address 0: the slot offset is the device address itself
                slots[i + 2] = SLOT_FIRST_REGION
                slots[i + 3] = base + offset
            info = DeviceInfo(device_type=DEVICE_CUDA, identity=cuda.device_uuid(device))
            decoded = Decoded(described.encode(info, [process_region()]), allow_process_regions=True)
            decoded.depend_on(owner)
        finally:
            lib.aib_owner_unref(owner)  # the decoded message holds it now (or nobody, on error)
    finally:
        captured.close()
    return imported_from(decoded, [0], device_type=DEVICE_CUDA, device_id=device)


def _column(obj: Any) -> tuple[pa.Array, int, int | None]:
    """A pyarrow array whose data buffer is the GPU array's memory (never read on the host), the
    device it lives on, and the stream its producer announced (``__cuda_array_interface__`` v3)."""
    from arrow_ipc_bridge import cuda

    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None and hasattr(obj, "__dlpack__"):
        import cupy

        obj = cupy.from_dlpack(obj)  # zero-copy view; keeps the producer alive
        cai = obj.__cuda_array_interface__
    if cai is None:
        raise BridgeError(f"{type(obj).__name__} has neither __cuda_array_interface__ nor __dlpack__")
    shape = tuple(cai["shape"])
    typestr = str(cai["typestr"])
    if len(shape) != 1:
        raise BridgeError(f"only 1-D arrays become Arrow columns (got shape {shape})")
    arrow_type = _TYPESTRS.get(typestr[1:])
    if arrow_type is None or typestr[0] not in "<|":
        raise BridgeError(
            f"array type {typestr!r} has no zero-copy Arrow equivalent (little-endian numbers only)"
        )
    itemsize = arrow_type.bit_width // 8
    strides = cai.get("strides")
    if strides is not None and tuple(strides) != (itemsize,):
        raise BridgeError("the array is not contiguous: make it so (e.g. cupy.ascontiguousarray) first")
    if cai.get("mask") is not None:
        raise BridgeError("masked GPU arrays are not supported; build the validity bitmap yourself")
    ptr = int(cai["data"][0])
    length = shape[0]
    device = 0
    if length:
        info = cuda.pointer_info(ptr)
        if info is None or info.memory_type == "host":
            raise RegionError(f"{type(obj).__name__} data at {ptr:#x} is not CUDA device memory")
        device = info.device
    stream = cai.get("stream")
    buffer = pa.foreign_buffer(ptr, length * itemsize, base=obj)
    return pa.Array.from_buffers(arrow_type, length, [None, buffer]), device, stream


def _as_device(captured_array: CapturedArray, device: int, streams: set[int]) -> CapturedArray:
    """Mark captured structs as CUDA data and attach a sync event for the producer's stream(s)."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import placer

    captured = captured_array._captured
    sync = ffi.NULL
    # CAI v3 stream values 1 and 2 mean the legacy and per-thread default streams; None/0: no
    # synchronisation needed. Work pending on a real stream becomes an event consumers wait on.
    pending = {s for s in streams if s not in (None, 0)}
    if pending:
        for stream in sorted(pending)[1:]:
            cuda.stream_synchronize(stream, device=device)  # one event per batch: settle the others
        events = placer.event_pool(device)
        event = events.acquire()
        event.record(sorted(pending)[0])
        holder = lib.aib_owner_new(_reaper.register(lambda: events.release(event)))
        lib.aib_owner_add_dependency(captured.owner, holder)
        lib.aib_owner_unref(holder)
        slot = lib.aib_owner_slot(captured.owner)
        slot[0] = event.handle
        sync = slot
    for array in captured.arrays:
        array.device_type = DEVICE_CUDA
        array.device_id = device
        array.sync_event = sync
    return captured_array


def from_cuda_array(obj: Any) -> CapturedArray:
    """Wrap a 1-D GPU array (CuPy, PyTorch, Numba, or any DLPack producer) as an Arrow column.

    No copy: the column's data buffer is the array's memory, kept alive as long as any consumer holds
    it. If the array announces a stream (``__cuda_array_interface__`` v3), an event recorded on that
    stream becomes the column's ``sync_event``: consumers wait for the producer's pending work.
    """
    column, device, stream = _column(obj)
    return _as_device(export_captured(capture(column)), device, {stream} if stream else set())  # type: ignore[arg-type]


def from_cuda_arrays(columns: Mapping[str, Any]) -> CapturedArray:
    """Wrap several 1-D GPU arrays of one length, on one device, as an Arrow record batch."""
    arrays: list[pa.Array] = []
    devices: set[int] = set()
    streams: set[int] = set()
    for value in columns.values():
        column, device, stream = _column(value)
        arrays.append(column)
        devices.add(device)
        if stream:
            streams.add(stream)
    if len(devices) > 1:
        raise BridgeError(f"columns live on several devices {sorted(devices)}; a batch has one device")
    batch = pa.RecordBatch.from_arrays(arrays, names=list(columns))
    return _as_device(export_captured(capture(batch)), devices.pop() if devices else 0, streams)  # type: ignore[arg-type]
