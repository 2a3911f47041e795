"""Legacy CUDA IPC: ``cuIpc*MemHandle`` on ``cudaMalloc``-style memory, and the per-allocation handle cache.

``cuIpcGetMemHandle`` is a driver call per allocation, which a cached handle skips, so
:class:`LegacyHandleCache` keeps handles per allocation (``buffer_id``, never reused in a process).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from arrow_ipc_bridge.cuda._declarations import (
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
    IPC_HANDLE_SIZE,
)
from arrow_ipc_bridge.cuda._driver import (
    _address,
    _api,
    _check,
    _handle_bytes,
    _lib,
)
from arrow_ipc_bridge.cuda.devices import _ctx, device_context
from arrow_ipc_bridge.cuda.pointers import PointerInfo, _device_of, pointer_info
from arrow_ipc_bridge.errors import CopyRequiredError, InvalidArgumentError

__all__ = [
    "LegacyHandleCache",
    "ipc_close_mem_handle",
    "ipc_get_mem_handle",
    "ipc_open_mem_handle",
]


_IPC_OPEN_HINT: Final = (
    "the handle is stale (the exporter freed the allocation or exited before it was opened), corrupted, or "
    "was made by this same process (legacy handles open only in another process)"
)


def ipc_get_mem_handle(base: int, *, device: int | None = None) -> bytes:
    """Return the 64-byte legacy IPC handle of a ``cudaMalloc``-style allocation (``cuIpcGetMemHandle``).

    A driver call each time: cache it per allocation (:class:`LegacyHandleCache`, keyed by ``buffer_id``).

    Parameters
    ----------
    base : int
        Start of the allocation (``PointerInfo.base``); the handle always names the whole allocation and
        opens at its base.
    device : int, optional
        Device ordinal whose context makes the call; default: the caller's current context, else device 0.
    """
    base = _address(base, "base")
    lib, ffi = _api()
    out = ffi.new("CUipcMemHandle *")
    with _ctx(device):
        _check(
            "cuIpcGetMemHandle",
            lib.cuIpcGetMemHandle(out, base),
            "legacy IPC needs memory from cudaMalloc/cuMemAlloc (PointerInfo.legacy_ipc_capable): pool, VMM "
            "and managed memory need their own paths",
        )
    return bytes(ffi.buffer(out))


def ipc_open_mem_handle(handle: bytes | bytearray | memoryview, device: int) -> int:
    """Map another process's allocation from its legacy IPC handle (``cuIpcOpenMemHandle_v2``).

    Opened with ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``. The driver maps the allocation on every open, so
    callers keep it open (:mod:`~arrow_ipc_bridge.cuda.opener`); opening the same handle again in the same
    process succeeds and returns the same pointer (measured), but every open needs its own close.

    Parameters
    ----------
    handle : bytes
        The 64 bytes from :func:`ipc_get_mem_handle` in the exporting process.
    device : int
        Local ordinal of the device to map on (normally ``ordinal_for_uuid`` of the exporter's GPU).

    Returns
    -------
    int
        Device address of the allocation's base in this process.
    """
    data = _handle_bytes(handle, "handle")
    lib, ffi = _api()
    h = ffi.new("CUipcMemHandle *")
    ffi.memmove(h, data, IPC_HANDLE_SIZE)
    out = ffi.new("CUdeviceptr *")
    with device_context(device):
        _check(
            "cuIpcOpenMemHandle_v2",
            lib.cuIpcOpenMemHandle_v2(out, h[0], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            _IPC_OPEN_HINT,
        )
    return int(out[0])


def ipc_close_mem_handle(ptr: int, *, device: int | None = None) -> None:
    """Unmap memory opened with :func:`ipc_open_mem_handle` (``cuIpcCloseMemHandle``).

    Parameters
    ----------
    ptr : int
        The address :func:`ipc_open_mem_handle` returned.
    device : int, optional
        The ordinal it was opened on; default: looked up from the pointer.
    """
    ptr = _address(ptr, "ptr")
    lib = _lib()
    with device_context(_device_of(ptr) if device is None else device):
        _check("cuIpcCloseMemHandle", lib.cuIpcCloseMemHandle(ptr))


class LegacyHandleCache:
    """Legacy IPC handles of this process's allocations, keyed by ``buffer_id``.

    ``buffer_id`` is unique for the life of the process and never reused, so an entry can never name a
    different allocation; :meth:`invalidate` is for callers that know an allocation was freed and want the
    memory back. The least recently used entries are dropped beyond ``max_entries``. Thread-safe.

    Parameters
    ----------
    max_entries : int
        Bound on the number of cached handles.
    fetch : callable, optional
        ``fetch(base) -> bytes``; defaults to :func:`ipc_get_mem_handle` (injectable for tests).
    """

    def __init__(self, max_entries: int = 4096, *, fetch: Callable[[int], bytes] | None = None) -> None:
        if max_entries < 1:
            raise InvalidArgumentError(f"max_entries must be >= 1, got {max_entries}", argument="max_entries")
        self._max = max_entries
        self._fetch = fetch if fetch is not None else ipc_get_mem_handle
        self._entries: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, base: int, buffer_id: int) -> bytes:
        """Return the handle of the allocation ``buffer_id`` starting at ``base``, fetching it on a miss.

        Parameters
        ----------
        base : int
            ``PointerInfo.base`` of the allocation.
        buffer_id : int
            ``PointerInfo.buffer_id`` of the allocation.
        """
        with self._lock:
            handle = self._entries.get(buffer_id)
            if handle is not None:
                self._entries.move_to_end(buffer_id)
                self.hits += 1
                return handle
            self.misses += 1
        handle = self._fetch(base)  # outside the lock: a driver call must not serialise other threads
        with self._lock:
            self._entries[buffer_id] = handle
            self._entries.move_to_end(buffer_id)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)
        return handle

    def get_for_pointer(self, ptr: int) -> tuple[bytes, PointerInfo]:
        """Return ``(handle, info)`` for any pointer inside a legacy-IPC-capable allocation.

        Parameters
        ----------
        ptr : int
            A device address; the handle opens at ``info.base``, so the consumer adds ``ptr - info.base``.

        Raises
        ------
        CopyRequiredError
            The memory is not legacy-IPC capable (pool, VMM, managed or host memory).
        """
        info = pointer_info(ptr)
        if info is None or not info.legacy_ipc_capable:
            kind = "not CUDA memory" if info is None else f"{info.memory_type} memory, pool={info.mempool:#x}"
            raise CopyRequiredError(
                f"address {ptr:#x} cannot be shared with a legacy IPC handle ({kind})", field="ptr"
            )
        return self.get(info.base, info.buffer_id), info

    def invalidate(self, buffer_id: int) -> None:
        """Forget the handle of one allocation (no-op when absent).

        Parameters
        ----------
        buffer_id : int
            ``PointerInfo.buffer_id`` of the freed allocation.
        """
        with self._lock:
            self._entries.pop(buffer_id, None)

    def clear(self) -> None:
        """Forget every handle."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, buffer_id: object) -> bool:
        with self._lock:
            return buffer_id in self._entries
