"""Stream-ordered memory pools whose allocations other processes import (POSIX file descriptor handles).

The producer allocates from an :class:`IpcMemoryPool` (its own pools are known here without asking the
driver); the consumer imports the pool once (:func:`import_pool`) and then each pointer from it.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from arrow_ipc_bridge._ffi import ffi as _core_ffi
from arrow_ipc_bridge._ffi import lib as _core
from arrow_ipc_bridge.cuda._declarations import (
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_ALLOCATION_TYPE_PINNED,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_DEVICE,
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
    CUDA_SUCCESS,
    IPC_HANDLE_SIZE,
)
from arrow_ipc_bridge.cuda._driver import (
    _DRIVER,
    _UINT64_MAX,
    _address,
    _api,
    _check,
    _DriverResource,
    _fd,
    _ffi,
    _handle_bytes,
    _lib,
    _nbytes,
    _set_non_inheritable,
    _stream_value,
)
from arrow_ipc_bridge.cuda.devices import _ctx, _device, device_context
from arrow_ipc_bridge.errors import InvalidArgumentError

__all__ = [
    "ImportedPool",
    "IpcMemoryPool",
    "import_pool",
    "own_pool",
    "pool_is_ipc_capable",
]


_CACHE_LOCK = threading.Lock()  # guards the table of this process's own pools below


def _after_fork_in_child() -> None:
    global _CACHE_LOCK
    _CACHE_LOCK = threading.Lock()  # a lock held by another thread at fork time would stay locked


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# Pools created by this process: handle -> pool. Exportability of these is known without asking the driver.
_OWN_POOLS: weakref.WeakValueDictionary[int, IpcMemoryPool] = weakref.WeakValueDictionary()
# Serial numbers of this process's pools: the driver reuses a destroyed pool's handle value, these
# are never reused, so consumers can cache imported pools by them (see IpcMemoryPool.serial).
_POOL_SERIALS = itertools.count(1)


class IpcMemoryPool(_DriverResource):
    """A stream-ordered memory pool whose allocations other processes can import (POSIX fd handle type).

    A consumer imports the pool once (:func:`import_pool`) and then each pointer with one driver call, which
    makes it the cheap path for many small or short-lived buffers. Thread-safe (the driver is).

    Parameters
    ----------
    device : int
        Device ordinal the memory lives on.
    release_threshold : int, optional
        Bytes of freed memory the pool keeps reserved instead of returning to the driver; default: keep
        everything (as cuda.core does), which avoids re-mapping costs in the importers. :meth:`trim_to` gives
        memory back explicitly.
    max_size : int
        Upper bound of the pool in bytes; 0 lets the driver choose.
    """

    def __init__(self, device: int, *, release_threshold: int | None = None, max_size: int = 0) -> None:
        _nbytes(max_size, "max_size")
        self._shared_once = False  # see export_pointers
        threshold = (
            _UINT64_MAX if release_threshold is None else _nbytes(release_threshold, "release_threshold")
        )
        lib, ffi = _api()
        _device(device)
        props = ffi.new("CUmemPoolProps *")  # zeroed, as the reserved tail must be
        props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        props.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = device
        props.maxSize = max_size
        out = ffi.new("CUmemoryPool *")
        with device_context(device):
            _check(
                "cuMemPoolCreate",
                lib.cuMemPoolCreate(out, props),
                "IPC memory pools need CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES to include POSIX "
                "file descriptors (see device_capabilities)",
            )
            self._pool: Any = out[0]
            try:
                value = ffi.new("cuuint64_t *", threshold)
                _check(
                    "cuMemPoolSetAttribute",
                    lib.cuMemPoolSetAttribute(self._pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, value),
                )
            except BaseException:
                lib.cuMemPoolDestroy(self._pool)
                raise
        self._device = device
        self._closed = False
        with _CACHE_LOCK:
            _OWN_POOLS[self.handle] = self
            self._serial = next(_POOL_SERIALS)

    @property
    def serial(self) -> int:
        """A number no other pool of this process has or will have (the driver may give a new pool
        the handle value of a destroyed one): what names the pool to other processes."""
        return self._serial

    @property
    def device(self) -> int:
        """Device ordinal of the pool."""
        return self._device

    @property
    def handle(self) -> int:
        """The ``CUmemoryPool`` as an integer (what ``PointerInfo.mempool`` reports for its allocations)."""
        return int(_ffi().cast("uintptr_t", self._pool))

    def allocate(self, nbytes: int, stream: object = 0) -> int:
        """Allocate from the pool, ordered on a stream (``cuMemAllocFromPoolAsync``).

        Parameters
        ----------
        nbytes : int
            Size in bytes (>= 1).
        stream : int or stream object
            Stream of this device the allocation is ordered on (0: legacy default stream).

        Returns
        -------
        int
            Device address; usable by work on ``stream`` at once, by other streams after synchronising.
        """
        self._check_open()
        nbytes = _nbytes(nbytes, allow_zero=False)
        lib, ffi = _api()
        out = ffi.new("CUdeviceptr *")
        s = ffi.cast("CUstream", _stream_value(stream))
        with device_context(self._device):
            _check("cuMemAllocFromPoolAsync", lib.cuMemAllocFromPoolAsync(out, nbytes, self._pool, s))
        return int(out[0])

    def free(self, ptr: int, stream: object = 0) -> None:
        """Return an allocation to the pool, ordered on a stream (``cuMemFreeAsync``).

        Every importer must have freed its imported copy first (:meth:`ImportedPool.free_imported`).

        Parameters
        ----------
        ptr : int
            Address from :meth:`allocate`.
        stream : int or stream object
            Stream the free is ordered on: after the last work that uses the memory.
        """
        ptr = _address(ptr, "ptr")
        lib, ffi = _api()
        s = ffi.cast("CUstream", _stream_value(stream))
        with device_context(self._device):
            _check("cuMemFreeAsync", lib.cuMemFreeAsync(ptr, s))

    def export_pool_fd(self) -> int:
        """Export the pool as a new POSIX file descriptor (``cuMemPoolExportToShareableHandle``).

        Returns
        -------
        int
            A new fd on every call; the caller owns it (send it with SCM_RIGHTS, then close it).
        """
        self._check_open()
        lib, ffi = _api()
        fd = ffi.new("int *", -1)
        with device_context(self._device):
            _check(
                "cuMemPoolExportToShareableHandle",
                lib.cuMemPoolExportToShareableHandle(
                    fd, self._pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
                ),
            )
        self._shared_once = True
        return _set_non_inheritable(int(fd[0]))

    def export_pointer(self, ptr: int) -> bytes:
        """Return the 64-byte export data of one allocation (``cuMemPoolExportPointer``).

        Parameters
        ----------
        ptr : int
            Address from :meth:`allocate` (the start of the allocation).
        """
        return self.export_pointers([ptr])[0]

    def export_pointers(self, pointers: Sequence[int]) -> list[bytes]:
        """:meth:`export_pointer` for several allocations: one context switch, the driver calls
        looped in C (a message's new pool buffers, on the producer's publish path)."""
        self._check_open()
        if not pointers:
            return []
        _lib()  # the driver loaded: the core has its functions (cuda_batch.c)
        if not self._shared_once:
            # Measured on the H200 (driver 580): cuMemPoolExportPointer answers INVALID_VALUE until
            # the pool itself was exported as a shareable handle once. Do that first (the fd is
            # closed again at once; consumers get theirs from export_pool_fd, which sets the flag).
            os.close(self.export_pool_fd())
        n = len(pointers)
        array = _core_ffi.new("uint64_t[]", [_address(ptr, "ptr") for ptr in pointers])
        out = _core_ffi.new("uint8_t[]", 64 * n)
        done = _core_ffi.new("size_t *")
        with device_context(self._device):
            rc = _core.aib_cuda_export_pool_pointers(array, n, out, done)
        if rc != CUDA_SUCCESS:
            raise _DRIVER.error("cuMemPoolExportPointer", rc, f"pointer {int(done[0]) + 1} of {n}")
        data = bytes(_core_ffi.buffer(out, 64 * n))
        return [data[64 * i : 64 * (i + 1)] for i in range(n)]

    def _attribute(self, attribute: int) -> int:
        self._check_open()
        lib, ffi = _api()
        value = ffi.new("cuuint64_t *")
        with device_context(self._device):
            _check("cuMemPoolGetAttribute", lib.cuMemPoolGetAttribute(self._pool, attribute, value))
        return int(value[0])

    @property
    def used_bytes(self) -> int:
        """Bytes currently allocated from the pool."""
        return self._attribute(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of device memory the pool currently holds."""
        return self._attribute(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)

    def trim_to(self, keep_bytes: int = 0) -> None:
        """Give reserved but unused memory back to the driver (``cuMemPoolTrimTo``).

        Parameters
        ----------
        keep_bytes : int
            Reserved bytes to keep.
        """
        self._check_open()
        keep_bytes = _nbytes(keep_bytes, "keep_bytes")
        lib = _lib()
        with device_context(self._device):
            _check("cuMemPoolTrimTo", lib.cuMemPoolTrimTo(self._pool, keep_bytes))

    def _release(self) -> None:
        # The driver defers the destruction until outstanding allocations are freed.
        lib = _lib()
        with _CACHE_LOCK:
            _OWN_POOLS.pop(int(_ffi().cast("uintptr_t", self._pool)), None)
        with device_context(self._device):
            _check("cuMemPoolDestroy", lib.cuMemPoolDestroy(self._pool))

    def __enter__(self) -> IpcMemoryPool:
        return self


class ImportedPool(_DriverResource):
    """Another process's :class:`IpcMemoryPool`, imported into this one (see :func:`import_pool`).

    Imported pools cannot allocate; they map the exporter's allocations with :meth:`import_pointer`.
    :meth:`close` frees any pointer still imported, then destroys the imported pool.
    """

    def __init__(self, pool: Any, device: int) -> None:
        self._pool: Any = pool
        self._device = device
        self._imported: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def device(self) -> int:
        """Local device ordinal the pool was imported on."""
        return self._device

    @property
    def handle(self) -> int:
        """The imported ``CUmemoryPool`` as an integer."""
        return int(_ffi().cast("uintptr_t", self._pool))

    @property
    def imported_count(self) -> int:
        """Pointers imported and not yet freed."""
        with self._lock:
            return len(self._imported)

    def import_pointer(self, export_data: bytes | bytearray | memoryview) -> int:
        """Map one allocation of the exporter's pool (``cuMemPoolImportPointer``: the driver maps it).

        The allocation must be complete in the exporter before it is accessed here (wait on its event).

        Parameters
        ----------
        export_data : bytes
            The 64 bytes from :meth:`IpcMemoryPool.export_pointer`.

        Returns
        -------
        int
            Device address in this process; free it with :meth:`free_imported` before the exporter frees it.
        """
        return self.import_pointers([export_data])[0]

    def import_pointers(self, export_datas: Sequence[bytes | bytearray | memoryview]) -> list[int]:
        """Map several allocations at once: :meth:`import_pointer` for each, under one context switch
        and with the driver structs made once (a message's pool regions, the consumer's hot path when
        buffers are new). All or nothing: when one import fails, those done by this call are freed
        again before the error is raised."""
        self._check_open()
        # Per pointer only what must be: the message's hot path when its buffers are new.
        if set(map(len, export_datas)) - {IPC_HANDLE_SIZE}:
            for data in export_datas:
                _handle_bytes(data, "export_data")  # names the bad one
        blob = b"".join(export_datas)
        n = len(export_datas)
        lib, ffi = _api()
        out = _core_ffi.new("uint64_t[]", max(n, 1))
        done = _core_ffi.new("size_t *")
        # The loop runs in the C core (cffi_build/cuda_batch.c): per pointer only the driver's call.
        pool = int(ffi.cast("uintptr_t", self._pool))
        with device_context(self._device):
            rc = _core.aib_cuda_import_pool_pointers(pool, blob, n, out, done)
            pointers: list[int] = _core_ffi.unpack(out, int(done[0]))
            if rc != CUDA_SUCCESS:
                for ptr in pointers:
                    lib.cuMemFree_v2(ptr)
                _check(
                    "cuMemPoolImportPointer",
                    rc,
                    "the export data is corrupted, belongs to another pool, or its allocation was "
                    "already freed",
                )
        with self._lock:
            self._imported.update(pointers)
        return pointers

    def free_imported(self, ptr: int) -> None:
        """Unmap an imported pointer (``cuMemFree_v2``). Must happen before the exporter frees the allocation.

        Parameters
        ----------
        ptr : int
            Address from :meth:`import_pointer`.
        """
        self.free_imported_many([_address(ptr, "ptr")])

    def free_imported_many(self, pointers: Sequence[int]) -> None:
        """:meth:`free_imported` for several pointers: one context switch, the driver calls looped
        in C. Every pointer is checked before any is freed; all are freed even if one free fails
        (then the first failure is raised)."""
        with self._lock:
            unknown = [ptr for ptr in pointers if ptr not in self._imported]
            if unknown or len(set(pointers)) != len(pointers):
                what = f"address {unknown[0]:#x}" if unknown else "an address given twice"
                raise InvalidArgumentError(
                    f"{what} was not imported from this pool (or was freed)", argument="ptr"
                )
            self._imported.difference_update(pointers)
        _lib()  # the driver loaded: the core has its functions (cuda_batch.c)
        array = _core_ffi.new("uint64_t[]", list(pointers) or [0])
        with device_context(self._device):
            _check("cuMemFree_v2", _core.aib_cuda_free_pointers(array, len(pointers)))

    def _release(self) -> None:
        lib = _lib()
        with self._lock:
            leftovers = list(self._imported)
            self._imported.clear()
        with device_context(self._device):
            for ptr in leftovers:
                lib.cuMemFree_v2(ptr)
            _check("cuMemPoolDestroy", lib.cuMemPoolDestroy(self._pool))

    def __enter__(self) -> ImportedPool:
        return self


def import_pool(fd: int, device: int) -> ImportedPool:
    """Import another process's IPC memory pool from its file descriptor (once per pool per process).

    Read/write access for ``device`` is granted if the pool does not give it already.

    Parameters
    ----------
    fd : int
        File descriptor from :meth:`IpcMemoryPool.export_pool_fd`, received over SCM_RIGHTS. It stays open:
        the caller closes it (the driver keeps its own reference).
    device : int
        Local ordinal of the exporter's GPU.
    """
    fd = _fd(fd)
    lib, ffi = _api()
    out = ffi.new("CUmemoryPool *")
    with device_context(device):
        _check(
            "cuMemPoolImportFromShareableHandle",
            lib.cuMemPoolImportFromShareableHandle(
                out, ffi.cast("void *", fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            ),
            "the fd must come from cuMemPoolExportToShareableHandle of an IPC-enabled pool",
        )
        pool = out[0]
        try:
            location = ffi.new("CUmemLocation *")
            location.type = CU_MEM_LOCATION_TYPE_DEVICE
            location.id = device
            flags = ffi.new("CUmemAccess_flags *")
            rc = int(lib.cuMemPoolGetAccess(flags, pool, location))
            if rc == CUDA_SUCCESS and int(flags[0]) != CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
                desc = ffi.new("CUmemAccessDesc *")
                desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = device
                desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                _check("cuMemPoolSetAccess", lib.cuMemPoolSetAccess(pool, desc, 1))
        except BaseException:
            lib.cuMemPoolDestroy(pool)
            raise
    return ImportedPool(pool, device)


def own_pool(handle: int) -> IpcMemoryPool | None:
    """The :class:`IpcMemoryPool` of this process with that ``CUmemoryPool`` handle, if it is alive."""
    return _OWN_POOLS.get(handle)


def pool_is_ipc_capable(pool: int) -> bool:
    """Whether allocations of a pool can be shared by exporting the pool as a POSIX file descriptor.

    Pools created by :class:`IpcMemoryPool` answer at once. For any other pool (CuPy's or PyTorch's async
    allocator, the device default pool, an imported pool) the driver is asked to export it: the probe fd is
    closed again, and a refusal means no. Cache the answer per pool where it matters (a probe costs a
    syscall).

    Parameters
    ----------
    pool : int
        ``PointerInfo.mempool`` / :func:`pool_of_pointer`.
    """
    pool = _address(pool, "pool")
    if pool == 0:
        return False
    with _CACHE_LOCK:
        own = _OWN_POOLS.get(pool)
    if own is not None and not own.closed:
        return True
    return _export_probe(pool)


def _export_probe(pool: int) -> bool:
    """Ask the driver to export a pool as a POSIX fd; close the fd again. True when it agrees."""
    lib, ffi = _api()
    fd = ffi.new("int *", -1)
    with _ctx(None):
        rc = int(
            lib.cuMemPoolExportToShareableHandle(
                fd, ffi.cast("CUmemoryPool", pool), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            )
        )
    if rc != CUDA_SUCCESS:
        return False
    if int(fd[0]) >= 0:
        os.close(int(fd[0]))
    return True
