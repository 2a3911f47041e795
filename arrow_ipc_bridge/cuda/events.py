"""Interprocess CUDA events: the producer's reusable events, the consumer's cache of opened ones.

Creating an event is a driver call, so interprocess events come from an :class:`EventPool` and are reused;
their IPC handles are fetched once per event. Opening an IPC event is a driver call the first time and a
lookup after, so :func:`open_ipc_event` keeps a per-process cache keyed by the handle bytes.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from arrow_ipc_bridge._ffi import ffi as _core_ffi
from arrow_ipc_bridge._ffi import lib as _core
from arrow_ipc_bridge.cuda._declarations import (
    CU_EVENT_DISABLE_TIMING,
    CU_EVENT_INTERPROCESS,
    CUDA_ERROR_NOT_READY,
    IPC_HANDLE_SIZE,
)
from arrow_ipc_bridge.cuda._driver import (
    _DRIVER,
    _address,
    _api,
    _check,
    _DriverResource,
    _ffi,
    _handle_bytes,
    _lib,
    _stream_value,
    _usable_in_this_process,
)
from arrow_ipc_bridge.cuda.devices import _ctx, _device, _primary_context, device_context
from arrow_ipc_bridge.errors import BridgeError, CudaError

__all__ = [
    "Event",
    "EventPool",
    "clear_ipc_event_cache",
    "close_ipc_event",
    "event_query",
    "event_synchronize",
    "event_value",
    "ipc_event_cache_size",
    "open_ipc_event",
    "stream_synchronize",
    "stream_wait_event",
]


def _as_event(event: int | Event) -> Any:
    ffi = _ffi()
    if isinstance(event, Event):
        event._check_open()
        return event._event
    return ffi.cast("CUevent", _address(event, "event"))


class Event(_DriverResource):
    """An interprocess, timing-disabled CUDA event owned by this process (get one from :class:`EventPool`).

    The exporter records it after the writes a hand-off depends on and sends :meth:`ipc_handle`; the consumer
    opens the handle (:func:`open_ipc_event`) and makes its stream wait on it. A recorded event may be
    recorded again only after the consumer finished with the previous hand-off: the exporter returns it to the
    pool when the lease ends, never earlier.
    """

    def __init__(self, device: int, *, _pool: EventPool | None = None) -> None:
        lib, ffi = _api()
        out = ffi.new("CUevent *")
        with device_context(device):
            _check(
                "cuEventCreate",
                lib.cuEventCreate(out, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING),
                "interprocess events need CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED",
            )
        self._event: Any = out[0]
        self._value: int | None = None  # the CUevent as an integer, once asked for
        self._device = device
        self._ipc: bytes | None = None
        self._pool = _pool
        self._closed = False

    @property
    def device(self) -> int:
        """Device ordinal the event belongs to."""
        return self._device

    @property
    def handle(self) -> int:
        """The ``CUevent`` as an integer (for CuPy/PyTorch interop)."""
        self._check_open()
        return int(_ffi().cast("uintptr_t", self._event))

    def record(self, stream: object = 0) -> None:
        """Record the event on a stream (``cuEventRecord``).

        Parameters
        ----------
        stream : int or stream object
            ``CUstream`` of the device's primary context (0: legacy default stream), or a CuPy/PyTorch stream.
        """
        self._check_open()
        lib, ffi = _api()
        s = ffi.cast("CUstream", _stream_value(stream))
        with device_context(self._device):
            _check("cuEventRecord", lib.cuEventRecord(self._event, s))

    def _record_on_legacy_stream(self, after: int) -> None:
        """Make the legacy default stream wait for ``after`` (a ``CUevent``; 0: nothing) and record
        the event there: what :func:`stream_wait_event` ``(0, after, device=self.device)`` then
        :meth:`record` ``(0)`` do (the device's primary context made current for them when another
        one is), in one C call (``aib_cuda_record_after``) instead of five driver calls through
        cffi: the hot path of a publisher's shared event (``cuda/shared_event.py``)."""
        context, event = self.legacy_record_values()
        result = _core.aib_cuda_record_after(context, _address(after, "event") if after else 0, event)
        if result:
            call = _RECORD_CALLS.get(result >> 16, "aib_cuda_record_after")
            raise _DRIVER.error(call, result & 0xFFFF)

    def legacy_record_values(self) -> tuple[int, int]:
        """``(primary context, CUevent)`` as numbers: what ``aib_cuda_record_after`` takes for a
        record of this event on the legacy default stream (:meth:`_record_on_legacy_stream`).
        CudaError when the event is
        closed or the driver is not loaded by this process."""
        self._check_open()
        _api()  # the driver loaded by this process (the C core has its functions): else CudaError
        context = _context_values.get(self._device)
        if context is None:
            context = int(_ffi().cast("uintptr_t", _primary_context(self._device)))
            _context_values[self._device] = context
        event = self._value
        if event is None:
            event = self._value = self.handle
        return context, event

    def ipc_handle(self) -> bytes:
        """Return the 64-byte interprocess handle (``cuIpcGetEventHandle`` once per event, then cached)."""
        self._check_open()
        if self._ipc is None:
            lib, ffi = _api()
            out = ffi.new("CUipcEventHandle *")
            with device_context(self._device):
                _check("cuIpcGetEventHandle", lib.cuIpcGetEventHandle(out, self._event))
            self._ipc = bytes(ffi.buffer(out))
        return self._ipc

    def query(self) -> bool:
        """True when the recorded work has completed (or the event was never recorded)."""
        return event_query(self)

    def synchronize(self) -> None:
        """Block the calling thread until the recorded work has completed."""
        event_synchronize(self)

    def _release(self) -> None:
        lib = _lib()
        with device_context(self._device):
            _check("cuEventDestroy_v2", lib.cuEventDestroy_v2(self._event))

    def __enter__(self) -> Event:
        return self


# Each device's primary context as an integer, for aib_cuda_record_after (retained for the life of
# the process: devices._primary_context; a forked child never gets past _api() to use one).
_context_values: dict[int, int] = {}
# aib_cuda_record_after's failing calls (AIB_CUDA_RECORD_CALL_*), by number.
_RECORD_CALLS = {
    _core.AIB_CUDA_RECORD_CALL_GET_CURRENT: "cuCtxGetCurrent",
    _core.AIB_CUDA_RECORD_CALL_PUSH: "cuCtxPushCurrent_v2",
    _core.AIB_CUDA_RECORD_CALL_WAIT: "cuStreamWaitEvent",
    _core.AIB_CUDA_RECORD_CALL_RECORD: "cuEventRecord",
    _core.AIB_CUDA_RECORD_CALL_POP: "cuCtxPopCurrent_v2",
}


class EventPool(_DriverResource):
    """Reusable interprocess events for one device: each new one is a ``cuEventCreate``, a pooled one none.

    Lease protocol: :meth:`acquire` an event per hand-off, record it after the producing work, send its
    :meth:`Event.ipc_handle`; when the consumer ends the lease (it has waited on the event and no longer needs
    it), :meth:`release` the event back. An event is never re-recorded while a consumer may still be waiting
    on its previous recording. Thread-safe.

    Parameters
    ----------
    device : int
        Device ordinal.
    max_idle : int
        Idle events kept for reuse; events released beyond that are destroyed.
    """

    def __init__(self, device: int, *, max_idle: int = 64) -> None:
        _device(device)
        self._device = device
        self._max_idle = max_idle
        self._idle: list[Event] = []
        self._leased: weakref.WeakSet[Event] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.created = 0
        self._closed = False

    @property
    def device(self) -> int:
        """Device ordinal of the pool's events."""
        return self._device

    @property
    def idle(self) -> int:
        """Number of events waiting for reuse."""
        with self._lock:
            return len(self._idle)

    @property
    def leased(self) -> int:
        """Number of events handed out and not yet released."""
        with self._lock:
            return len(self._leased)

    def prefill(self, count: int) -> None:
        """Create ``count`` idle events now, to pay their creation cost before the first hand-off.

        Parameters
        ----------
        count : int
            How many events to create (bounded by ``max_idle``).
        """
        self._check_open()
        for _ in range(max(0, min(count, self._max_idle) - self.idle)):
            event = Event(self._device, _pool=self)
            with self._lock:
                self.created += 1
                self._idle.append(event)

    def acquire(self) -> Event:
        """Lease an event: an idle one when available, else a new one."""
        self._check_open()
        with self._lock:
            event = self._idle.pop() if self._idle else None
            if event is not None:
                self._leased.add(event)
                return event
        event = Event(self._device, _pool=self)  # created outside the lock: cuEventCreate is a driver call
        with self._lock:
            self.created += 1
            self._leased.add(event)
        return event

    def release(self, event: Event) -> None:
        """Return a leased event once the consumer has finished with its hand-off.

        Parameters
        ----------
        event : Event
            An event from :meth:`acquire` of this pool.
        """
        if event._pool is not self:
            raise BridgeError("event does not belong to this pool", field="event")
        with self._lock:
            self._leased.discard(event)
            keep = not self._closed and not event.closed and len(self._idle) < self._max_idle
            if keep:
                self._idle.append(event)
        if not keep:
            event.close()

    def _release(self) -> None:
        with self._lock:
            events = [*self._idle, *self._leased]
            self._idle.clear()
            self._leased = weakref.WeakSet()
        errors = []
        for event in events:
            try:
                event.close()
            except CudaError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> EventPool:
        return self


_CACHE_LOCK = threading.Lock()  # guards the caches of opened IPC events below


def _after_fork_in_child() -> None:
    global _CACHE_LOCK
    _CACHE_LOCK = threading.Lock()  # a lock held by another thread at fork time would stay locked


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# Opened IPC events, per process, live in the C core's region table (region_table.c), the one record
# of them, which its get path reads too: key (handle, device) -> CUevent as int. _CACHE_LOCK orders
# opens and closes (an open checks, opens, then records).


def _event_key(data: bytes, device: int) -> Any:
    """The table's key for an event opened from handle ``data`` on ``device``."""
    key = _core_ffi.new("uint8_t[]", _core.AIB_REGION_KEY_MAX)
    n = _core.aib_regions_event_key(data, len(data), device, key)
    if n == 0:
        raise ValueError(f"an IPC event handle of {len(data)} bytes cannot be a key")
    return _core_ffi.buffer(key, n)[:]


def _opened_event(key: bytes) -> int | None:
    value = _core_ffi.new("uint64_t *")
    if not _core.aib_regions_find(_core.AIB_REGION_KEY_EVENT, key, len(key), value, _core_ffi.NULL):
        return None
    return int(value[0])


def _event_device(event: int | Event) -> int | None:
    if isinstance(event, Event):
        return event.device
    key = _core_ffi.new("uint8_t[]", _core.AIB_REGION_KEY_MAX)
    length = _core_ffi.new("size_t *")
    if not _core.aib_regions_key_of(_core.AIB_REGION_KEY_EVENT, event, key, length):
        return None
    return _key_device(key, length[0])


def _key_device(key: Any, length: int) -> int:
    """The device ordinal an event key ends with: 8 bytes, little-endian (aib_regions_event_key)."""
    return int.from_bytes(_core_ffi.buffer(key + length - 8, 8)[:], "little", signed=True)


def open_ipc_event(handle: bytes | bytearray | memoryview, device: int) -> int:
    """Open an interprocess event from its 64-byte handle, cached per process.

    The first open of a handle is a driver call, a cache hit a lookup in the C core's region table. The
    exporter reuses pooled events, so the same handle arrives again and again; it stays open until
    :func:`close_ipc_event`.

    Parameters
    ----------
    handle : bytes
        64 bytes from :meth:`Event.ipc_handle` in the exporting process.
    device : int
        Local ordinal of the exporter's GPU.

    Returns
    -------
    int
        The ``CUevent`` (as an integer) for :func:`stream_wait_event`, or as an Arrow ``sync_event``.
    """
    data = _handle_bytes(handle, "handle")
    key = _event_key(data, device)
    with _CACHE_LOCK:
        cached = _opened_event(key)
    if cached is not None:
        return cached
    lib, ffi = _api()
    h = ffi.new("CUipcEventHandle *")
    ffi.memmove(h, data, IPC_HANDLE_SIZE)
    out = ffi.new("CUevent *")
    with device_context(device):
        _check(
            "cuIpcOpenEventHandle",
            lib.cuIpcOpenEventHandle(out, h[0]),
            "the handle is corrupted or its event was destroyed, or it was made by this same process",
        )
    value = int(ffi.cast("uintptr_t", out[0]))
    with _CACHE_LOCK:
        winner = _opened_event(key)
        recorded = winner is not None or not _core.aib_regions_put(
            _core.AIB_REGION_KEY_EVENT, key, len(key), value, _core_ffi.NULL, 0
        )  # the C core's get path finds it in the same table
        if winner is None:
            winner = value
    if not recorded:  # out of memory: an open nobody would ever close
        with device_context(device):
            lib.cuEventDestroy_v2(out[0])
        raise MemoryError("recording an opened IPC event")
    if winner != value:  # another thread opened it meanwhile: keep one, destroy ours
        with device_context(device):
            lib.cuEventDestroy_v2(out[0])
    return winner


def close_ipc_event(handle: bytes | bytearray | memoryview, device: int) -> bool:
    """Destroy this process's opened copy of an IPC event and drop it from the cache.

    Parameters
    ----------
    handle : bytes
        The 64-byte handle given to :func:`open_ipc_event`.
    device : int
        The ordinal given to :func:`open_ipc_event`.

    Returns
    -------
    bool
        False when the handle was not open.
    """
    data = _handle_bytes(handle, "handle")
    key = _event_key(data, device)
    with _CACHE_LOCK:
        value = _opened_event(key)
        if value is not None:
            _core.aib_regions_remove(_core.AIB_REGION_KEY_EVENT, key, len(key))
    if value is None:
        return False
    lib, ffi = _api()
    with device_context(device):
        _check("cuEventDestroy_v2", lib.cuEventDestroy_v2(ffi.cast("CUevent", value)))
    return True


def clear_ipc_event_cache() -> None:
    """Destroy every opened IPC event of this process (e.g. when a producer disconnects)."""
    items: list[tuple[int, int]] = []  # (device, event)
    key = _core_ffi.new("uint8_t[]", _core.AIB_REGION_KEY_MAX)
    length = _core_ffi.new("size_t *")
    value = _core_ffi.new("uint64_t *")
    with _CACHE_LOCK:
        while _core.aib_regions_take_oldest(_core.AIB_REGION_KEY_EVENT, key, length, value):
            items.append((_key_device(key, length[0]), int(value[0])))
    if not items or not _usable_in_this_process():
        return
    lib, ffi = _api()
    for device, event in items:
        with device_context(device):
            lib.cuEventDestroy_v2(ffi.cast("CUevent", event))


def ipc_event_cache_size() -> int:
    """Number of IPC events this process holds open."""
    return int(_core.aib_regions_count_kind(_core.AIB_REGION_KEY_EVENT))


def stream_wait_event(stream: object, event: int | Event, *, device: int | None = None) -> None:
    """Make future work on ``stream`` wait for the event's last recording (``cuStreamWaitEvent``).

    Parameters
    ----------
    stream : int or stream object
        ``CUstream`` (0: the legacy default stream of ``device``'s primary context) or a CuPy/PyTorch stream.
    event : int or Event
        An event from :func:`open_ipc_event` or an :class:`Event`.
    device : int, optional
        Whose context stream 0 means; default: the caller's current context, else device 0.
    """
    lib, ffi = _api()
    s = ffi.cast("CUstream", _stream_value(stream))
    ev = _as_event(event)
    with _ctx(device):
        _check("cuStreamWaitEvent", lib.cuStreamWaitEvent(s, ev, 0))


def event_synchronize(event: int | Event) -> None:
    """Block the calling thread (GIL released) until the event's last recording has completed.

    Parameters
    ----------
    event : int or Event
        An event from :func:`open_ipc_event` or an :class:`Event`.
    """
    lib = _lib()
    ev = _as_event(event)
    with _ctx(_event_device(event)):
        _check("cuEventSynchronize", lib.cuEventSynchronize(ev))


def event_query(event: int | Event) -> bool:
    """Return True when the event's last recording has completed, False while it is pending.

    Parameters
    ----------
    event : int or Event
        An event from :func:`open_ipc_event` or an :class:`Event`.
    """
    lib = _lib()
    ev = _as_event(event)
    with _ctx(_event_device(event)):
        rc = int(lib.cuEventQuery(ev))
    if rc == CUDA_ERROR_NOT_READY:
        return False
    _check("cuEventQuery", rc)
    return True


def stream_synchronize(stream: object, *, device: int | None = None) -> None:
    """Block until all work queued on a stream has completed (``cuStreamSynchronize``).

    Parameters
    ----------
    stream : int or stream object
        ``CUstream`` (0: legacy default stream of ``device``) or a CuPy/PyTorch stream.
    device : int, optional
        Whose context stream 0 means; default: the caller's current context, else device 0.
    """
    lib, ffi = _api()
    s = ffi.cast("CUstream", _stream_value(stream))
    with _ctx(device):
        _check("cuStreamSynchronize", lib.cuStreamSynchronize(s))


def event_value(sync_event: Any) -> int:
    """The CUevent a C Device interface ``sync_event`` points to (the spec's pointer-to-CUevent)."""
    return int(_core_ffi.cast("uintptr_t *", sync_event)[0])
