"""Moving Arrow data to and from the GPU, and wrapping GPU arrays as Arrow columns.

- :func:`to_device` uploads host Arrow data into the bridge's IPC-enabled memory pool, so what it
  returns is shared with other processes at pool-import cost;
- :func:`from_cuda_array` / :func:`from_cuda_arrays` wrap CuPy / PyTorch / Numba arrays
  (``__cuda_array_interface__``) or DLPack producers as Arrow columns without copying.

Copying imported data back to the host is :func:`arrow_ipc_bridge.consumer.imported.to_host`; showing
imported columns to array libraries is :mod:`arrow_ipc_bridge.arrays.columns`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

import pyarrow as pa

from arrow_ipc_bridge._ffi import ffi, lib, new_error, raise_for, read_cuda_columns
from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream, imported_from
from arrow_ipc_bridge.errors import BridgeError, InvalidArgumentError
from arrow_ipc_bridge.runtime import arguments, reaper
from arrow_ipc_bridge.wire.capsules import (
    DEVICE_CPU,
    DEVICE_CUDA,
    ArrowInput,
    CapturedArray,
    CapturedData,
    capture,
)
from arrow_ipc_bridge.wire.metadata import (
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
      pointer import (a driver call that maps the allocation, so it grows with its size, plus the
      Python import path); a publication got twice is then kept by the session with a lease
      (``Session(pool_linger=...)``) and re-gets are the steady state, which opens nothing. Suits
      data that changes often.
    - ``"legacy"``: ``cuMemAlloc`` memory, shared by a legacy IPC handle. A consumer opens it once
      (one driver call that maps it) and remembers the message from the first get, without holding a
      lease: for data published once and fetched often.

    ``docs/benchmarks.md`` has the measured costs of both.

    Examples
    --------
    >>> gpu = aib.to_device(pa.table({"x": [1.0, 2.0]}))  # doctest: +SKIP
    >>> pub.publish("x", gpu)                              # doctest: +SKIP
    """
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import placer

    device = arguments.device_ordinal(device)
    arguments.choice(allocation, "allocation", ("pool", "legacy"))
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
            owner = lib.aib_owner_new(reaper.register(lambda: pool.free(base)))
        else:
            base = cuda.mem_alloc(nbytes, device)
            owner = lib.aib_owner_new(reaper.register(lambda: cuda.mem_free(base, device=device)))
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


# Column names as C strings, per tuple of names: a step loop publishes the same columns each step.
_C_NAMES: dict[tuple[str, ...], Any] = {}
_C_NAMES_MAX = 64


# Why read_cuda_columns stopped before a column (py_columns.c's READ_* codes).
_READ_OK, _NO_INTERFACE, _SHAPE, _TYPE, _STRIDES, _MASK, _LENGTH, _MALFORMED = range(8)

# type -> whether it is CuPy's ndarray (a step loop wraps arrays of the same type each step)
_IS_CUPY: dict[type, bool] = {}


def _read_columns(values: list[Any]) -> tuple[bytes, list[Any]]:
    """Every column's facts as the bytes of an ``aib_cuda_column[]`` (zero-filled: deterministic),
    and the objects to keep alive: read in one C call (``read_cuda_columns``, the one reader of
    ``__cuda_array_interface__``). A DLPack-only producer is viewed through CuPy and the columns
    read again; any other column the call could not take raises the documented error."""
    n = len(values)
    first_type = type(values[0])
    # CuPy arrays after the first are read from their own attributes (py_columns.c says why).
    is_cupy = _IS_CUPY.get(first_type)
    if is_cupy is None:
        is_cupy = first_type.__name__ == "ndarray" and first_type.__module__.partition(".")[0] == "cupy"
        if len(_IS_CUPY) < 64:
            _IS_CUPY[first_type] = is_cupy
    while True:
        done, facts, reason, detail = read_cuda_columns(values, n, first_type if is_cupy else None)
        if reason == _READ_OK:
            return facts, values
        obj = values[done]
        if reason == _NO_INTERFACE and hasattr(obj, "__dlpack__"):
            import cupy

            values = list(values)
            values[done] = cupy.from_dlpack(obj)  # zero-copy view; keeps the producer alive
            continue
        raise _refusal(reason, obj, detail, _facts_array(facts))


def _refusal(reason: int, obj: Any, detail: Any, columns: Any) -> BridgeError:
    """The error for a column ``read_cuda_columns`` stopped at."""
    name = type(obj).__name__
    if reason == _NO_INTERFACE:
        return BridgeError(f"{name} has neither __cuda_array_interface__ nor __dlpack__")
    if reason == _SHAPE:
        return BridgeError(f"only 1-D arrays become Arrow columns (got shape {tuple(detail)})")
    if reason == _TYPE:
        return BridgeError(
            f"array type {detail!r} has no zero-copy Arrow equivalent (little-endian numbers only)"
        )
    if reason == _STRIDES:
        return BridgeError("the array is not contiguous: make it so (e.g. cupy.ascontiguousarray) first")
    if reason == _MASK:
        return BridgeError("masked GPU arrays are not supported; build the validity bitmap yourself")
    if reason == _LENGTH:
        return BridgeError(
            f"columns have different lengths ({columns[0].length} and {detail}); a batch has one"
        )
    return BridgeError(f"{name}'s __cuda_array_interface__ does not follow the protocol (version 3)")


def _facts_array(facts: bytes) -> Any:
    """The ``aib_cuda_column[]`` whose bytes ``facts`` are (read-only, over ``facts`` itself)."""
    return ffi.from_buffer("aib_cuda_column[]", facts)


def _device_of(columns: Any, n: int, objects: list[Any]) -> int:
    """The one device all columns live on, in one C loop of attribute queries; raises
    :class:`InvalidArgumentError` for memory that is not CUDA device or managed memory (pinned host
    memory, addresses unknown to the driver), :class:`BridgeError` for columns on several devices and
    :class:`CudaError` for a query the driver refused."""
    from arrow_ipc_bridge.cuda._driver import _DRIVER, _api
    from arrow_ipc_bridge.cuda.devices import _ctx

    if columns[0].length == 0:
        return 0  # no memory to ask about (a zero-length column's pointer may be anything)
    device = ffi.new("int32_t *")
    other = ffi.new("int32_t *")
    failed = ffi.new("size_t *")
    _api()  # loads the driver, which hands its functions to the C core
    with _ctx(None):
        rc = lib.aib_cuda_devices_of(columns, n, device, other, failed)
    if rc == 0:
        return int(device[0])
    index = int(failed[0])
    if rc == -2:
        devices = sorted({int(device[0]), int(other[0])})
        raise BridgeError(f"columns live on several devices {devices}; a batch has one device")
    if rc == -1:
        raise InvalidArgumentError(
            f"{type(objects[index]).__name__} data at {int(columns[index].data):#x} is not CUDA device memory"
        )
    raise _DRIVER.error("cuPointerGetAttributes", int(rc))


def _c_names(names: tuple[str, ...]) -> Any:
    c_names = _C_NAMES.get(names)
    if c_names is None:
        encoded = [ffi.new("char[]", name.encode()) for name in names]
        c_names = (ffi.new("char *[]", encoded), encoded)  # the array and what it points to
        if len(_C_NAMES) >= _C_NAMES_MAX:
            _C_NAMES.clear()
        _C_NAMES[names] = c_names
    return c_names[0]


def _captured_columns(names: tuple[str, ...] | None, values: list[Any]) -> CapturedArray:
    """Columns read and checked in C calls over all columns (facts, one device), their Arrow structs
    built when first asked for (:class:`_CudaColumns`). Columns whose facts are those of columns a
    live publication holds (:func:`hold_checked_columns`) are on that publication's device: no
    driver query."""
    facts, objects = _read_columns(values)
    held = _HELD_FACTS.get(facts)
    device = held[0] if held is not None else _device_of(_facts_array(facts), len(objects), objects)
    return _CudaColumns(names, facts, objects, device)


# ---------- columns a live publication holds --------------------------------------------------------
# facts (an aib_cuda_column[] as bytes: every column's pointer, length, type and announced stream)
# -> [device, holders]. Each holder keeps a reference on captured columns of exactly those facts
# (the arrays stay alive as long as it is in the table), so a column read later with the same
# pointer lies in the same live allocation: device memory on that device, checked when those
# columns were wrapped (and placed by their export). A pointer freed and handed out again can never
# match: its entry leaves the table before the arrays it named can be let go.
_HELD_FACTS: dict[bytes, list[int]] = {}
_HELD_LOCK = threading.Lock()


def _forget_held_facts_in_child() -> None:
    """A forked child cannot use its parent's CUDA state: its columns are asked about (and refused)
    like any others. A lock held by another thread at fork time would stay locked: a new one."""
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()
    _HELD_FACTS.clear()


os.register_at_fork(after_in_child=_forget_held_facts_in_child)


def hold_checked_columns(facts: bytes, device: int, captured: CapturedData) -> Callable[[], None]:
    """Put ``facts`` (of the ``from_cuda_arrays`` columns ``captured`` holds, checked to be on
    ``device``) in the table :func:`from_cuda_arrays` looks up, holding a reference on
    ``captured`` meanwhile; returns the function (idempotent) that takes them out again and then
    lets go of that reference. A publication's export calls it first when it closes."""
    holder = CapturedData.sharing(captured)
    with _HELD_LOCK:
        entry = _HELD_FACTS.setdefault(facts, [device, 0])
        entry[1] += 1
    released = False

    def release() -> None:
        nonlocal released
        with _HELD_LOCK:
            if released:
                return
            released = True
            entry[1] -= 1
            if entry[1] == 0 and _HELD_FACTS.get(facts) is entry:  # (gone in a forked child)
                del _HELD_FACTS[facts]
        holder.close()  # only now may the arrays go

    return release


def held_column_facts() -> int:
    """How many distinct column facts live publications hold now (a diagnostic for tests)."""
    with _HELD_LOCK:
        return len(_HELD_FACTS)


# CAI v3 stream values: 0 (the key absent or None) asks no synchronisation, 1 is the legacy
# default stream; 2 (per-thread default) and real streams need an event recorded on them.
_NO_EVENT_STREAMS = frozenset({0, 1})


class _CudaColumns(CapturedArray):
    """What :func:`from_cuda_arrays` returns: columns read and checked at once (facts, device), the
    Arrow structs and the event on the announced stream made when they are first asked for (a
    capsule, an export). A publisher that finds the columns are the current version's, updated in
    place, never asks (``Publisher.publish``, ``exporter.record_in_place``): it re-records the
    publication's own event instead, and the columns cost it one C read and a signature.

    The event is recorded when the structs are made, so it covers the producer's work announced on
    the stream up to then: never less than at the call, possibly more (consumers may wait longer,
    never read earlier)."""

    def __init__(self, names: tuple[str, ...] | None, facts: bytes, objects: list[Any], device: int) -> None:
        self._names = names
        self._objects = objects
        self._device = device
        self._built: CapturedData | None = None
        self._build_lock = threading.Lock()
        # The columns' facts as read: an ``aib_cuda_column[]``'s bytes (_read_columns).
        self._facts = facts
        self.column_signature = (device, names, facts)

    @property
    def _columns(self) -> Any:
        """The facts as an ``aib_cuda_column[]`` (made when asked: a renewal in place never asks)."""
        return _facts_array(self._facts)

    @property
    def _captured(self) -> CapturedData:  # the base class's attribute, made on first use
        built = self._built
        if built is None:
            with self._build_lock:
                if self._built is None:
                    self._built = _build_columns(self._names, self._columns, self._objects, self._device)
                built = self._built
        return built

    @_captured.setter
    def _captured(self, captured: CapturedData) -> None:
        self._built = captured

    @property
    def streams_need_no_wait(self) -> bool:
        """Whether every column announced the legacy default stream or none: work recorded on the
        legacy default stream after now is ordered after the producer's, with no wait (an event the
        structs carry, if made, was recorded on that stream too). A fact of the columns' facts."""
        columns = self._columns
        return all(columns[i].stream in _NO_EVENT_STREAMS for i in range(len(self._objects)))


def _build_columns(
    names: tuple[str, ...] | None, columns: Any, objects: list[Any], device: int
) -> CapturedData:
    """The columns' Arrow structs, built in one C call, and the event on their announced stream;
    the arrays (and the event) kept until the last consumer of the structs lets go."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import placer

    n = len(objects)
    # Work pending on a real stream becomes an event consumers wait on: a pooled interprocess
    # event, which the exporter sends as it is (no second event).
    first = columns[0].stream
    pending = [first] if first and all(columns[i].stream == first for i in range(1, n)) else None
    if pending is None:  # several streams (rare): one event per batch, the others settled first
        pending = sorted({int(columns[i].stream) for i in range(n)} - {0})
        for stream in pending[1:]:
            cuda.stream_synchronize(stream, device=device)
    event, release_event = placer.recorded_export_event(device, pending[0]) if pending else (None, None)

    def release() -> None:  # the structs' owner died: nobody reads the arrays or waits on the event
        objects.clear()
        if release_event is not None:
            release_event()

    token = reaper.register(release)
    try:
        schema = lib.aib_schema_alloc()
        array = lib.aib_device_array_alloc()
        err = new_error()
        c_names = ffi.NULL if names is None else _c_names(names)
        rc = lib.aib_columns_build(
            n, c_names, columns, int(names is not None), schema, ffi.addressof(array, "array"), err
        )
        if rc:
            lib.aib_schema_free(schema)
            lib.aib_device_array_free(array)
            raise_for(rc, err, "building the columns' Arrow structs")
        array.device_type = DEVICE_CUDA
        array.device_id = device
        captured = CapturedData(schema, [array], is_stream=False, token=token)
    except BaseException:
        if reaper.unregister(token):
            release()
        raise
    if event is not None:
        slot = lib.aib_owner_slot(captured.owner)  # lives as long as the structs
        slot[0] = event.handle
        array.sync_event = slot
    return captured


def from_cuda_arrays_type() -> type:
    """The type :func:`from_cuda_arrays` returns (the C core's in-place renewal takes exactly it)."""
    return _CudaColumns


def from_cuda_array(obj: Any) -> CapturedArray:
    """Wrap a 1-D GPU array (CuPy, PyTorch, Numba, or any DLPack producer) as an Arrow column.

    No copy: the column's data buffer is the array's memory, kept alive as long as any consumer holds
    it. If the array announces a stream (``__cuda_array_interface__`` v3), an event recorded on that
    stream becomes the column's ``sync_event``: consumers wait for the producer's pending work. The
    array is read and checked now; the Arrow structs and the event are made when first asked for (a
    capsule, an export), so the event covers the stream's work up to then.
    """
    return _captured_columns(None, [obj])


def from_cuda_arrays(columns: Mapping[str, Any]) -> CapturedArray:
    """Wrap several 1-D GPU arrays of one length, on one device, as an Arrow record batch.

    No copy, and no per-column Python: each array's ``__cuda_array_interface__`` is read, the
    pointers checked and the structs built in C calls over all columns. As for
    :func:`from_cuda_array`, one event recorded on the announced stream (others are synchronised
    first) is the batch's ``sync_event``.

    Every call checks its columns before it returns (:class:`~arrow_ipc_bridge.errors.RegionError`,
    :class:`~arrow_ipc_bridge.errors.BridgeError`: see the API reference). The pointers' device is
    known without asking the driver when the columns' facts (every pointer, length, type and
    announced stream) are exactly those of columns a live publication holds, as a step loop's
    columns updated in place are: the publication keeps those arrays alive, so the same pointers
    are in the same allocations, checked when they were first wrapped and published.
    """
    if type(columns) is not dict and not isinstance(columns, Mapping):  # a dict without the ABC check
        arguments.fail_type("columns", "a mapping of column names (str) to 1-D GPU arrays", columns)
    names = tuple(columns)
    if not names:
        arguments.fail_value("columns", "a mapping with at least one column", columns)
    try:
        "".join(names)  # every name a str: one C loop (TypeError at the first that is not)
    except TypeError:
        for name in names:
            if not isinstance(name, str):
                arguments.fail_type("columns", "a mapping whose keys, the column names, are str", name)
        raise
    return _captured_columns(names, list(columns.values()))
