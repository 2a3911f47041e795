"""Virtual memory management: ``cuMemCreate`` allocations exported and imported as POSIX file descriptors.

A VMM allocation (PyTorch's expandable segments, or :func:`vmm_allocate`) travels as one fd per
allocation (:func:`vmm_export_fd`); the consumer maps it with :func:`vmm_import` and unmaps it with its last
array.
"""

from __future__ import annotations

from typing import Any

from arrow_ipc_bridge.cuda._declarations import (
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
    CU_MEM_ALLOCATION_TYPE_PINNED,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_DEVICE,
)
from arrow_ipc_bridge.cuda._driver import (
    _address,
    _api,
    _check,
    _DriverResource,
    _fd,
    _ffi,
    _lib,
    _nbytes,
    _set_non_inheritable,
)
from arrow_ipc_bridge.cuda.devices import _ctx, _device, device_context

__all__ = [
    "VmmAllocation",
    "VmmMapping",
    "vmm_allocate",
    "vmm_export_fd",
    "vmm_granularity",
    "vmm_import",
]


def _vmm_prop(device: int) -> Any:
    ffi = _ffi()
    prop = ffi.new("CUmemAllocationProp *")  # zeroed: allocFlags and win32HandleMetaData must be 0
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    return prop


def vmm_granularity(device: int, *, recommended: bool = False) -> int:
    """Return the allocation granularity of POSIX-fd-exportable VMM memory on a device (2 MiB on Hopper).

    Parameters
    ----------
    device : int
        Device ordinal.
    recommended : bool
        The recommended granularity instead of the minimum.
    """
    lib, ffi = _api()
    _device(device)
    out = ffi.new("size_t *")
    option = CU_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended else CU_MEM_ALLOC_GRANULARITY_MINIMUM
    with device_context(device):
        _check(
            "cuMemGetAllocationGranularity", lib.cuMemGetAllocationGranularity(out, _vmm_prop(device), option)
        )
    return int(out[0])


def _round_up(n: int, granularity: int) -> int:
    return (n + granularity - 1) // granularity * granularity


def _map_handle(handle: Any, size: int, granularity: int, device: int) -> int:
    """Reserve address space, map a physical allocation there and grant ``device`` read/write access."""
    lib, ffi = _api()
    va = ffi.new("CUdeviceptr *")
    _check("cuMemAddressReserve", lib.cuMemAddressReserve(va, size, granularity, 0, 0))
    ptr = int(va[0])
    try:
        _check(
            "cuMemMap",
            lib.cuMemMap(ptr, size, 0, handle, 0),
            "the size must be a multiple of the granularity and no larger than the allocation",
        )
        try:
            desc = ffi.new("CUmemAccessDesc *")
            desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = device
            desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _check("cuMemSetAccess", lib.cuMemSetAccess(ptr, size, desc, 1))
        except BaseException:
            lib.cuMemUnmap(ptr, size)
            raise
    except BaseException:
        lib.cuMemAddressFree(ptr, size)
        raise
    return ptr


class _VmmRegion(_DriverResource):
    """A physical allocation handle mapped at ``ptr`` for ``size`` bytes; close unmaps, frees VA, releases."""

    def __init__(self, handle: Any, ptr: int, size: int, device: int) -> None:
        self._handle: Any = handle
        self._ptr = ptr
        self._size = size
        self._device = device
        self._closed = False

    @property
    def ptr(self) -> int:
        """Device address of the mapping."""
        return self._ptr

    @property
    def size(self) -> int:
        """Mapped bytes (a multiple of the granularity)."""
        return self._size

    @property
    def device(self) -> int:
        """Device ordinal the memory is mapped for."""
        return self._device

    def _release(self) -> None:
        lib = _lib()
        with device_context(self._device):
            rc_unmap = int(lib.cuMemUnmap(self._ptr, self._size))
            rc_free = int(lib.cuMemAddressFree(self._ptr, self._size))
            rc_release = int(lib.cuMemRelease(self._handle))
        _check("cuMemUnmap", rc_unmap)
        _check("cuMemAddressFree", rc_free)
        _check("cuMemRelease", rc_release)


class VmmAllocation(_VmmRegion):
    """Device memory made with ``cuMemCreate`` (exportable as a POSIX fd) and mapped in this process.

    Made by :func:`vmm_allocate`; export it with :func:`vmm_export_fd`.
    """

    def __enter__(self) -> VmmAllocation:
        return self


class VmmMapping(_VmmRegion):
    """Another process's VMM allocation, imported and mapped here (made by :func:`vmm_import`)."""

    def __enter__(self) -> VmmMapping:
        return self


def vmm_allocate(nbytes: int, device: int) -> VmmAllocation:
    """Allocate device memory with the VMM API, exportable as a POSIX file descriptor.

    Used by the tests and as the bridge's own copy target when memory must be copied into a shareable region.

    Parameters
    ----------
    nbytes : int
        Requested size; rounded up to the allocation granularity (see ``.size``).
    device : int
        Device ordinal.
    """
    nbytes = _nbytes(nbytes, allow_zero=False)
    lib, ffi = _api()
    granularity = vmm_granularity(device)
    size = _round_up(nbytes, granularity)
    handle = ffi.new("CUmemGenericAllocationHandle *")
    with device_context(device):
        _check(
            "cuMemCreate",
            lib.cuMemCreate(handle, size, _vmm_prop(device), 0),
            "VMM with POSIX fd export needs CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
        )
        try:
            ptr = _map_handle(handle[0], size, granularity, device)
        except BaseException:
            lib.cuMemRelease(handle[0])
            raise
    return VmmAllocation(handle[0], ptr, size, device)


def vmm_export_fd(ptr: int, *, device: int | None = None) -> int:
    """Export the VMM allocation mapped at ``ptr`` as a new POSIX file descriptor.

    ``cuMemRetainAllocationHandle`` finds the allocation, ``cuMemExportToShareableHandle`` exports it and the
    retained handle is released again.

    Parameters
    ----------
    ptr : int
        Any address inside a range mapped with ``cuMemMap``.
    device : int, optional
        Device ordinal whose context makes the calls; default: the caller's current context, else device 0.

    Returns
    -------
    int
        A new fd the caller owns (send it with SCM_RIGHTS, then close it).
    """
    ptr = _address(ptr, "ptr")
    lib, ffi = _api()
    handle = ffi.new("CUmemGenericAllocationHandle *")
    fd = ffi.new("int *", -1)
    with _ctx(device):
        _check(
            "cuMemRetainAllocationHandle",
            lib.cuMemRetainAllocationHandle(handle, ffi.cast("void *", ptr)),
            "the address must lie in memory mapped with cuMemMap (VMM), not cudaMalloc or pool memory",
        )
        try:
            _check(
                "cuMemExportToShareableHandle",
                lib.cuMemExportToShareableHandle(fd, handle[0], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                "the allocation must be created with requestedHandleTypes including POSIX file descriptors",
            )
        finally:
            lib.cuMemRelease(handle[0])
    return _set_non_inheritable(int(fd[0]))


def vmm_import(fd: int, size: int, device: int) -> VmmMapping:
    """Import a VMM allocation from its POSIX fd and map it read/write for ``device`` (several driver calls).

    Parameters
    ----------
    fd : int
        File descriptor from :func:`vmm_export_fd`, received over SCM_RIGHTS. It stays open: the caller closes
        it.
    size : int
        Bytes to map from the start of the allocation; rounded up to the granularity, which must not exceed
        the allocation's size (send the exporter's ``VmmAllocation.size``).
    device : int
        Local ordinal of the exporter's GPU.
    """
    fd = _fd(fd)
    size = _nbytes(size, "size", allow_zero=False)
    lib, ffi = _api()
    granularity = vmm_granularity(device)
    mapped = _round_up(size, granularity)
    handle = ffi.new("CUmemGenericAllocationHandle *")
    with device_context(device):
        _check(
            "cuMemImportFromShareableHandle",
            lib.cuMemImportFromShareableHandle(
                handle, ffi.cast("void *", fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            ),
            "the fd must come from cuMemExportToShareableHandle (vmm_export_fd)",
        )
        try:
            ptr = _map_handle(handle[0], mapped, granularity, device)
        except BaseException:
            lib.cuMemRelease(handle[0])
            raise
    return VmmMapping(handle[0], ptr, mapped, device)
