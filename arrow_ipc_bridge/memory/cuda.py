"""The CUDA driver, reached through cffi in ABI mode: devices, pointer facts, IPC handles, events, pools, VMM.

This is the one module that talks to ``libcuda.so.1``. Nothing is compiled against CUDA: the declarations
below are parsed by cffi and the library is opened with ``dlopen`` on first use, so importing this module
works on a machine with no GPU and no driver (invariant 7). Every driver call is checked; a failure raises
:class:`~arrow_ipc_bridge.errors.CudaError` naming the call, the numeric ``CUresult``, the driver's own name
and description of it, and a hint where one helps.

Design notes, driven by the costs measured on an H200 (``shared/DESIGN.md``):

* Contexts: the bridge only ever uses each device's *primary* context -- the one the CUDA runtime, CuPy and
  PyTorch use -- retained once per device and cached. :func:`device_context` pushes it for the calling thread
  and pops it afterwards, so the caller's current context is always restored.
* Events cost ~225 us to create, so interprocess events come from an :class:`EventPool` and are reused; their
  IPC handles are fetched once per event. Opening an IPC event costs ~185 us the first time and 1-3 us after,
  so :func:`open_ipc_event` keeps a per-process cache keyed by the handle bytes.
* ``cuIpcGetMemHandle`` costs 10-23 us: :class:`LegacyHandleCache` keeps handles per allocation
  (``buffer_id``).
* :func:`pointer_info` asks for every attribute in one ``cuPointerGetAttributes`` call.

Enum values and struct layouts are those of ``cuda.h`` (CUDA 13.0, as generated into NVIDIA/cuda-python's
``cydriver.pxd``); ``tests/test_cuda_driver.py`` pins each of them. Where the driver exports versioned symbols
(``_v2``) the versioned one is declared, since that is what ``cuda.h`` maps the plain name to.

Process model: CUDA state does not survive ``fork``. A child forked after this module initialised the driver
gets a :class:`CudaError` telling it to use the ``spawn`` start method instead of undefined behaviour.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal

from .._ffi import ffi as _core_ffi
from .._ffi import lib as _core
from ..errors import BridgeError, CopyRequiredError, CudaError, RegionError, ReleasedError

if TYPE_CHECKING:  # slab.py imports this module
    from arrow_ipc_bridge.memory.slab import CupySlabAllocator

__all__ = [
    # driver and devices
    "driver_available",
    "load_driver",
    "driver_version",
    "device_count",
    "device_name",
    "device_uuid",
    "format_uuid",
    "ordinal_for_uuid",
    "device_attribute",
    "device_capabilities",
    "DeviceCapabilities",
    "device_context",
    "synchronize",
    "mem_get_info",
    # pointers
    "PointerInfo",
    "pointer_info",
    # legacy IPC
    "ipc_get_mem_handle",
    "ipc_open_mem_handle",
    "ipc_close_mem_handle",
    "LegacyHandleCache",
    # events
    "Event",
    "EventPool",
    "open_ipc_event",
    "close_ipc_event",
    "clear_ipc_event_cache",
    "ipc_event_cache_size",
    "stream_wait_event",
    "event_synchronize",
    "event_query",
    "stream_synchronize",
    # memory pools
    "IpcMemoryPool",
    "ImportedPool",
    "import_pool",
    "pool_of_pointer",
    "pool_is_ipc_capable",
    "cupy_allocator",
    "CupyPoolAllocator",
    # VMM
    "VmmAllocation",
    "VmmMapping",
    "vmm_allocate",
    "vmm_export_fd",
    "vmm_import",
    "vmm_granularity",
    # copies
    "memcpy_dtoh",
    "memcpy_htod",
    "read_device",
    "write_device",
    "memset_d8",
    # declarations
    "IPC_HANDLE_SIZE",
    "build_ffi",
    "cdef_source",
]

# ----------------------------------------------------------------------------------------------------------
# cuda.h values (CUDA 13.0). Each group below becomes a C enum in the cdef, so Python and C share one source.
# ----------------------------------------------------------------------------------------------------------

IPC_HANDLE_SIZE: Final = 64  # CU_IPC_HANDLE_SIZE: CUipcMemHandle, CUipcEventHandle, CUmemPoolPtrExportData
UUID_SIZE: Final = 16  # CUuuid

# CUresult (enum cudaError_enum): the codes this module names; any other code still reports the driver's name.
CUDA_SUCCESS: Final = 0
CUDA_ERROR_INVALID_VALUE: Final = 1
CUDA_ERROR_OUT_OF_MEMORY: Final = 2
CUDA_ERROR_NOT_INITIALIZED: Final = 3
CUDA_ERROR_DEINITIALIZED: Final = 4
CUDA_ERROR_STUB_LIBRARY: Final = 34
CUDA_ERROR_NO_DEVICE: Final = 100
CUDA_ERROR_INVALID_DEVICE: Final = 101
CUDA_ERROR_INVALID_CONTEXT: Final = 201
CUDA_ERROR_MAP_FAILED: Final = 205
CUDA_ERROR_ALREADY_MAPPED: Final = 208
CUDA_ERROR_NOT_MAPPED: Final = 211
CUDA_ERROR_OPERATING_SYSTEM: Final = 304
CUDA_ERROR_INVALID_HANDLE: Final = 400
CUDA_ERROR_NOT_FOUND: Final = 500
CUDA_ERROR_NOT_READY: Final = 600
CUDA_ERROR_ILLEGAL_ADDRESS: Final = 700
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: Final = 704
CUDA_ERROR_CONTEXT_IS_DESTROYED: Final = 709
CUDA_ERROR_NOT_PERMITTED: Final = 800
CUDA_ERROR_NOT_SUPPORTED: Final = 801
CUDA_ERROR_UNKNOWN: Final = 999

# CUpointer_attribute
CU_POINTER_ATTRIBUTE_CONTEXT: Final = 1
CU_POINTER_ATTRIBUTE_MEMORY_TYPE: Final = 2
CU_POINTER_ATTRIBUTE_BUFFER_ID: Final = 7
CU_POINTER_ATTRIBUTE_IS_MANAGED: Final = 8
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: Final = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: Final = 10
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: Final = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE: Final = 12
CU_POINTER_ATTRIBUTE_MAPPED: Final = 13
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: Final = 14
CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: Final = 17

# CUmemorytype
CU_MEMORYTYPE_HOST: Final = 1
CU_MEMORYTYPE_DEVICE: Final = 2
CU_MEMORYTYPE_ARRAY: Final = 3
CU_MEMORYTYPE_UNIFIED: Final = 4

# CUipcMem_flags
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: Final = 1

# CUevent_flags
CU_EVENT_DEFAULT: Final = 0
CU_EVENT_BLOCKING_SYNC: Final = 1
CU_EVENT_DISABLE_TIMING: Final = 2
CU_EVENT_INTERPROCESS: Final = 4

# CUmemAllocationHandleType (a bitmask in pool props and pointer attributes)
CU_MEM_HANDLE_TYPE_NONE: Final = 0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: Final = 1
CU_MEM_HANDLE_TYPE_WIN32: Final = 2
CU_MEM_HANDLE_TYPE_WIN32_KMT: Final = 4
CU_MEM_HANDLE_TYPE_FABRIC: Final = 8

# CUmemAccess_flags
CU_MEM_ACCESS_FLAGS_PROT_NONE: Final = 0
CU_MEM_ACCESS_FLAGS_PROT_READ: Final = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE: Final = 3

# CUmemLocationType
CU_MEM_LOCATION_TYPE_INVALID: Final = 0
CU_MEM_LOCATION_TYPE_DEVICE: Final = 1
CU_MEM_LOCATION_TYPE_HOST: Final = 2
CU_MEM_LOCATION_TYPE_HOST_NUMA: Final = 3
CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: Final = 4

# CUmemAllocationType
CU_MEM_ALLOCATION_TYPE_INVALID: Final = 0
CU_MEM_ALLOCATION_TYPE_PINNED: Final = 1
CU_MEM_ALLOCATION_TYPE_MANAGED: Final = 2

# CUmemAllocationGranularity_flags
CU_MEM_ALLOC_GRANULARITY_MINIMUM: Final = 0
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: Final = 1

# CUmemPool_attribute (the CUDA 13.0 set; 13.1 adds more, which this module does not rely on)
CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES: Final = 1
CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC: Final = 2
CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES: Final = 3
CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: Final = 4
CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: Final = 5
CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: Final = 6
CU_MEMPOOL_ATTR_USED_MEM_CURRENT: Final = 7
CU_MEMPOOL_ATTR_USED_MEM_HIGH: Final = 8

# CUdevice_attribute (the ones the bridge reports)
CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: Final = 33
CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: Final = 34
CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: Final = 41
CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: Final = 50
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: Final = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: Final = 76
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: Final = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: Final = 103
CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: Final = 115
CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES: Final = 119
CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED: Final = 125

# typedef name -> (C enum tag, member names). The values come from the constants above.
_ENUMS: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "CUresult": (
        "cudaError_enum",
        (
            "CUDA_SUCCESS",
            "CUDA_ERROR_INVALID_VALUE",
            "CUDA_ERROR_OUT_OF_MEMORY",
            "CUDA_ERROR_NOT_INITIALIZED",
            "CUDA_ERROR_DEINITIALIZED",
            "CUDA_ERROR_STUB_LIBRARY",
            "CUDA_ERROR_NO_DEVICE",
            "CUDA_ERROR_INVALID_DEVICE",
            "CUDA_ERROR_INVALID_CONTEXT",
            "CUDA_ERROR_MAP_FAILED",
            "CUDA_ERROR_ALREADY_MAPPED",
            "CUDA_ERROR_NOT_MAPPED",
            "CUDA_ERROR_OPERATING_SYSTEM",
            "CUDA_ERROR_INVALID_HANDLE",
            "CUDA_ERROR_NOT_FOUND",
            "CUDA_ERROR_NOT_READY",
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
            "CUDA_ERROR_CONTEXT_IS_DESTROYED",
            "CUDA_ERROR_NOT_PERMITTED",
            "CUDA_ERROR_NOT_SUPPORTED",
            "CUDA_ERROR_UNKNOWN",
        ),
    ),
    "CUpointer_attribute": (
        "CUpointer_attribute_enum",
        (
            "CU_POINTER_ATTRIBUTE_CONTEXT",
            "CU_POINTER_ATTRIBUTE_MEMORY_TYPE",
            "CU_POINTER_ATTRIBUTE_BUFFER_ID",
            "CU_POINTER_ATTRIBUTE_IS_MANAGED",
            "CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL",
            "CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE",
            "CU_POINTER_ATTRIBUTE_RANGE_START_ADDR",
            "CU_POINTER_ATTRIBUTE_RANGE_SIZE",
            "CU_POINTER_ATTRIBUTE_MAPPED",
            "CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES",
            "CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE",
        ),
    ),
    "CUmemorytype": (
        "CUmemorytype_enum",
        ("CU_MEMORYTYPE_HOST", "CU_MEMORYTYPE_DEVICE", "CU_MEMORYTYPE_ARRAY", "CU_MEMORYTYPE_UNIFIED"),
    ),
    "CUipcMem_flags": ("CUipcMem_flags_enum", ("CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS",)),
    "CUevent_flags": (
        "CUevent_flags_enum",
        ("CU_EVENT_DEFAULT", "CU_EVENT_BLOCKING_SYNC", "CU_EVENT_DISABLE_TIMING", "CU_EVENT_INTERPROCESS"),
    ),
    "CUmemAllocationHandleType": (
        "CUmemAllocationHandleType_enum",
        (
            "CU_MEM_HANDLE_TYPE_NONE",
            "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
            "CU_MEM_HANDLE_TYPE_WIN32",
            "CU_MEM_HANDLE_TYPE_WIN32_KMT",
            "CU_MEM_HANDLE_TYPE_FABRIC",
        ),
    ),
    "CUmemAccess_flags": (
        "CUmemAccess_flags_enum",
        (
            "CU_MEM_ACCESS_FLAGS_PROT_NONE",
            "CU_MEM_ACCESS_FLAGS_PROT_READ",
            "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
        ),
    ),
    "CUmemLocationType": (
        "CUmemLocationType_enum",
        (
            "CU_MEM_LOCATION_TYPE_INVALID",
            "CU_MEM_LOCATION_TYPE_DEVICE",
            "CU_MEM_LOCATION_TYPE_HOST",
            "CU_MEM_LOCATION_TYPE_HOST_NUMA",
            "CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT",
        ),
    ),
    "CUmemAllocationType": (
        "CUmemAllocationType_enum",
        ("CU_MEM_ALLOCATION_TYPE_INVALID", "CU_MEM_ALLOCATION_TYPE_PINNED", "CU_MEM_ALLOCATION_TYPE_MANAGED"),
    ),
    "CUmemAllocationGranularity_flags": (
        "CUmemAllocationGranularity_flags_enum",
        ("CU_MEM_ALLOC_GRANULARITY_MINIMUM", "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED"),
    ),
    "CUmemPool_attribute": (
        "CUmemPool_attribute_enum",
        (
            "CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES",
            "CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC",
            "CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES",
            "CU_MEMPOOL_ATTR_RELEASE_THRESHOLD",
            "CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT",
            "CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH",
            "CU_MEMPOOL_ATTR_USED_MEM_CURRENT",
            "CU_MEMPOOL_ATTR_USED_MEM_HIGH",
        ),
    ),
    "CUdevice_attribute": (
        "CUdevice_attribute_enum",
        (
            "CU_DEVICE_ATTRIBUTE_PCI_BUS_ID",
            "CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID",
            "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING",
            "CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID",
            "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
            "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
            "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
            "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
            "CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED",
            "CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES",
            "CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED",
        ),
    ),
}

# Types and functions, as in cuda.h for an LP64 Linux host. Opaque handles are pointers to incomplete structs;
# CUdeviceptr is CUdeviceptr_v2 (unsigned long long). Struct layouts are byte-exact (see the tests' offsetof
# table).
_CDEF_TYPES: Final = """
typedef unsigned long long cuuint64_t;
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUevent_st *CUevent;
typedef struct CUstream_st *CUstream;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct CUuuid_st { char bytes[16]; } CUuuid;
typedef struct CUipcEventHandle_st { char reserved[64]; } CUipcEventHandle;
typedef struct CUipcMemHandle_st { char reserved[64]; } CUipcMemHandle;
typedef struct CUmemPoolPtrExportData_st { unsigned char reserved[64]; } CUmemPoolPtrExportData;

typedef struct CUmemLocation_st {
    CUmemLocationType type;
    int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    CUmemAllocationType type;
    CUmemAllocationHandleType requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    CUmemAccess_flags flags;
} CUmemAccessDesc;

typedef struct CUmemPoolProps_st {
    CUmemAllocationType allocType;
    CUmemAllocationHandleType handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;
"""

_CDEF_FUNCTIONS: Final = """
CUresult cuGetErrorName(CUresult error, const char **pStr);
CUresult cuGetErrorString(CUresult error, const char **pStr);
CUresult cuInit(unsigned int Flags);
CUresult cuDriverGetVersion(int *driverVersion);

CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
CUresult cuCtxSynchronize(void);

CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);

CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr);
CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                CUdeviceptr ptr);

CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags);
CUresult cuIpcCloseMemHandle(CUdeviceptr dptr);

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
CUresult cuEventQuery(CUevent hEvent);
CUresult cuEventSynchronize(CUevent hEvent);
CUresult cuEventDestroy_v2(CUevent hEvent);
CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event);
CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle);
CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags);
CUresult cuStreamSynchronize(CUstream hStream);

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps);
CUresult cuMemPoolDestroy(CUmemoryPool pool);
CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value);
CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value);
CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count);
CUresult cuMemPoolGetAccess(CUmemAccess_flags *flags, CUmemoryPool memPool, CUmemLocation *location);
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream);
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
CUresult cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool,
                                          CUmemAllocationHandleType handleType, unsigned long long flags);
CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle,
                                            CUmemAllocationHandleType handleType, unsigned long long flags);
CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *shareData_out, CUdeviceptr ptr);
CUresult cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool, CUmemPoolPtrExportData *shareData);

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType handleType, unsigned long long flags);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                        CUmemAllocationHandleType shHandleType);
"""

_UINT64_MAX: Final = (1 << 64) - 1
_DEFAULT_LIBRARY: Final = "libcuda.so.1"
# Lets a test or an unusual install point at another driver library; the default is the driver's soname.
_LIBRARY_ENV: Final = "ARROW_IPC_BRIDGE_LIBCUDA"


def cdef_source() -> str:
    """Return the C declarations given to ``cffi.FFI.cdef``: the enums, the types and the driver functions.

    Returns
    -------
    str
        C source; the enums carry the values of the module constants (one source for Python and C).
    """
    module = globals()
    parts = []
    for typedef, (tag, members) in _ENUMS.items():
        body = ",\n".join(f"    {name} = {int(module[name])}" for name in members)
        parts.append(f"typedef enum {tag} {{\n{body}\n}} {typedef};\n")
    return "".join(parts) + _CDEF_TYPES + _CDEF_FUNCTIONS


def _declared_functions() -> list[str]:
    """Names of the driver functions in the declarations."""
    return re.findall(r"^CUresult\s+(cu\w+)\s*\(", _CDEF_FUNCTIONS, flags=re.MULTILINE)


def build_ffi() -> Any:
    """Build a fresh ``cffi.FFI`` with this module's declarations, without opening any library.

    Returns
    -------
    cffi.FFI
        Usable for ``sizeof``/``offsetof``/``new`` and for ``dlopen``; the tests check layouts with it.
    """
    import cffi  # deferred: the declarations are only parsed when CUDA is used

    ffi = cffi.FFI()
    ffi.cdef(cdef_source())
    return ffi


# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------

_HINTS: Final[dict[int, str]] = {
    CUDA_ERROR_NOT_INITIALIZED: (
        "the driver is not initialised in this process; if it was forked from a process that used CUDA, "
        "start it with the multiprocessing 'spawn' method instead"
    ),
    CUDA_ERROR_NO_DEVICE: "no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES)",
    CUDA_ERROR_INVALID_DEVICE: "the device is not visible to this process (check CUDA_VISIBLE_DEVICES)",
    CUDA_ERROR_STUB_LIBRARY: (
        "the loaded libcuda.so.1 is the toolkit's stub; put the real driver on the loader path"
    ),
    CUDA_ERROR_OUT_OF_MEMORY: "the device is out of memory",
    CUDA_ERROR_DEINITIALIZED: "the driver is shutting down (interpreter exit)",
}


def _format_error(call: str, code: int, name: str, description: str, hint: str | None) -> CudaError:
    """Build the CudaError for a failed call: ``cuX failed: NAME (code): description. hint``."""
    message = f"{call} failed: {name} ({code}): {description}"
    hint = hint or _HINTS.get(code)
    if hint:
        message += f". {hint}"
    return CudaError(message, call=call, code=code, name=name)


# ----------------------------------------------------------------------------------------------------------
# The driver: loaded once per process, lazily, under a lock
# ----------------------------------------------------------------------------------------------------------


class _Driver:
    """One dlopen'ed libcuda, the per-device caches that depend on it, and the process that initialised it."""

    def __init__(self, library: str) -> None:
        self.library = library
        self.lock = threading.RLock()
        self.ffi: Any = None
        self.lib: Any = None
        self.pid = 0  # the process that initialised the driver
        self.forked = False  # set in a child forked after initialisation: CUDA is unusable there
        self.failure: CudaError | None = None
        self.device_count: int | None = None
        self.devices: dict[int, Any] = {}  # ordinal -> CUdevice
        self.primary: dict[int, Any] = {}  # ordinal -> retained primary CUcontext
        self.uuids: dict[bytes, int] | None = None

    @property
    def loaded(self) -> bool:
        return self.lib is not None

    def load(self) -> Any:
        """Return the library, opening it and running ``cuInit(0)`` the first time; CudaError if unusable."""
        lib = self.lib
        if lib is not None and not self.forked:
            return lib
        with self.lock:
            if self.lib is not None:
                if self.forked:
                    raise CudaError(
                        f"CUDA was initialised in process {self.pid} before it forked this process "
                        f"({os.getpid()}); CUDA cannot be used in a forked child. Start workers with the "
                        "multiprocessing 'spawn' method (multiprocessing.get_context('spawn')).",
                        call="fork",
                        code=CUDA_ERROR_NOT_INITIALIZED,
                        name="CUDA_ERROR_NOT_INITIALIZED",
                    )
                return self.lib
            if self.failure is not None:
                raise CudaError(self.failure.message, **self.failure.details)
            if self.ffi is None:
                self.ffi = build_ffi()
            try:
                lib = self.ffi.dlopen(self.library)
            except OSError as exc:
                reason = str(exc).split("  Additionally,")[0].rstrip(". ")  # cffi adds a ctypes.util note
                self.failure = CudaError(
                    f"CUDA driver {self.library} not found: {reason}. The NVIDIA driver is needed for GPU "
                    "data; host-memory features work without it.",
                    call="dlopen",
                    code=None,
                    name=None,
                )
                raise CudaError(self.failure.message, **self.failure.details) from None
            # ABI mode resolves symbols on first use; check them all now so an old driver fails here, clearly,
            # and not with an AttributeError in the middle of a hand-off.
            missing = sorted(name for name in _declared_functions() if not hasattr(lib, name))
            if "cuDeviceGetUuid" in missing and "cuDeviceGetUuid_v2" not in missing:
                missing.remove("cuDeviceGetUuid")  # only the fallback for drivers before CUDA 11.4
            if "cuDeviceGetUuid_v2" in missing and "cuDeviceGetUuid" not in missing:
                missing.remove("cuDeviceGetUuid_v2")
            if missing:
                self.failure = CudaError(
                    f"CUDA driver {self.library} is too old: it lacks {', '.join(missing)}; the bridge "
                    "needs a driver for CUDA 12 or newer",
                    call="dlopen",
                    code=None,
                    name=None,
                )
                raise CudaError(self.failure.message, **self.failure.details)
            rc = int(lib.cuInit(0))
            if rc != CUDA_SUCCESS:
                self.failure = self._error(lib, "cuInit", rc, None)
                raise CudaError(self.failure.message, **self.failure.details)
            self.pid = os.getpid()
            self.lib = lib
            # Structs of imported data carry their sync_event only while it is pending: the C core
            # asks the driver (cffi_build/sync_event.c).
            _core.aib_cuda_set_event_query(int(self.ffi.cast("uintptr_t", lib.cuEventQuery)))
            return lib

    def _error(self, lib: Any, call: str, code: int, hint: str | None) -> CudaError:
        ffi = self.ffi
        text = ffi.new("const char **")
        name = f"CUDA_ERROR_{code}"
        description = "unknown error code"
        # The error being reported matters more than its decoration: never fail while describing it.
        with contextlib.suppress(Exception):
            if int(lib.cuGetErrorName(code, text)) == CUDA_SUCCESS and text[0] != ffi.NULL:
                name = ffi.string(text[0]).decode("ascii", "replace")
            if int(lib.cuGetErrorString(code, text)) == CUDA_SUCCESS and text[0] != ffi.NULL:
                description = ffi.string(text[0]).decode("utf-8", "replace")
        return _format_error(call, code, name, description, hint)

    def error(self, call: str, code: int, hint: str | None = None) -> CudaError:
        return self._error(self.lib, call, code, hint)

    def reset_after_fork(self) -> None:
        # A lock held by another thread at fork time would stay locked forever in the child.
        self.lock = threading.RLock()
        if self.lib is not None:
            self.forked = True


_DRIVER = _Driver(os.environ.get(_LIBRARY_ENV, _DEFAULT_LIBRARY))
_CACHE_LOCK = threading.Lock()  # guards the module-level caches below (IPC events, own pools)

if hasattr(os, "register_at_fork"):

    def _after_fork_in_child() -> None:
        global _CACHE_LOCK
        _DRIVER.reset_after_fork()
        _CACHE_LOCK = threading.Lock()

    os.register_at_fork(after_in_child=_after_fork_in_child)


def _lib() -> Any:
    return _DRIVER.load()


def _api() -> tuple[Any, Any]:
    """``(lib, ffi)``, loading the driver on first use. The one place the untyped cffi objects come from."""
    lib = _DRIVER.load()
    return lib, _DRIVER.ffi


def _ffi() -> Any:
    return _api()[1]


def _check(call: str, rc: int, hint: str | None = None) -> None:
    if rc != CUDA_SUCCESS:
        raise _DRIVER.error(call, int(rc), hint)


def _usable_in_this_process() -> bool:
    """True when the driver was initialised by this very process (finalizers skip cleanup otherwise)."""
    return _DRIVER.lib is not None and not _DRIVER.forked


def driver_available() -> bool:
    """Whether the CUDA driver can be used in this process.

    Opens ``libcuda.so.1`` and runs ``cuInit`` the first time; the answer is cached (a failure too).

    Returns
    -------
    bool
        False when the library is missing, ``cuInit`` failed (no device, stub library, ...), or this process
        was forked after CUDA was initialised.
    """
    try:
        _DRIVER.load()
    except CudaError:
        return False
    return True


def load_driver() -> None:
    """Load and initialise the CUDA driver now.

    Raises
    ------
    CudaError
        ``"CUDA driver libcuda.so.1 not found: ..."`` when the library is absent, or the failed ``cuInit``.
    """
    _DRIVER.load()


def driver_version() -> int:
    """Return the driver's CUDA version as ``1000 * major + 10 * minor`` (13000 for CUDA 13.0).

    Returns
    -------
    int
        The value of ``cuDriverGetVersion``.
    """
    lib, ffi = _api()
    out = ffi.new("int *")
    _check("cuDriverGetVersion", lib.cuDriverGetVersion(out))
    return int(out[0])


# ----------------------------------------------------------------------------------------------------------
# Devices and contexts
# ----------------------------------------------------------------------------------------------------------


def device_count() -> int:
    """Return how many CUDA devices this process sees (after ``CUDA_VISIBLE_DEVICES``).

    Returns
    -------
    int
        The value of ``cuDeviceGetCount``, cached for the life of the process.
    """
    count = _DRIVER.device_count
    if count is not None and _usable_in_this_process():
        return count
    lib, ffi = _api()
    out = ffi.new("int *")
    _check("cuDeviceGetCount", lib.cuDeviceGetCount(out))
    _DRIVER.device_count = int(out[0])
    return int(out[0])


def _visible_devices_note() -> str:
    return f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}"


def _device(ordinal: int) -> Any:
    """Return the CUdevice of an ordinal, checked against the visible count."""
    cached = _DRIVER.devices.get(ordinal)
    if cached is not None and _usable_in_this_process():
        return cached
    count = device_count()
    if not isinstance(ordinal, int) or isinstance(ordinal, bool) or not 0 <= ordinal < count:
        raise CudaError(
            f"no CUDA device with ordinal {ordinal!r}: this process sees {count} device(s) "
            f"({_visible_devices_note()})",
            call="cuDeviceGet",
            code=CUDA_ERROR_INVALID_DEVICE,
            name="CUDA_ERROR_INVALID_DEVICE",
        )
    lib, ffi = _api()
    out = ffi.new("CUdevice *")
    _check("cuDeviceGet", lib.cuDeviceGet(out, ordinal))
    with _DRIVER.lock:
        _DRIVER.devices[ordinal] = out[0]
    return out[0]


def device_name(ordinal: int) -> str:
    """Return the device's marketing name, e.g. ``"NVIDIA H100 80GB HBM3"``.

    Parameters
    ----------
    ordinal : int
        Device ordinal in this process.
    """
    lib, ffi = _api()
    dev = _device(ordinal)
    buf = ffi.new("char[]", 256)
    _check("cuDeviceGetName", lib.cuDeviceGetName(buf, 256, dev))
    return str(ffi.string(buf).decode("utf-8", "replace"))


def device_uuid(ordinal: int) -> bytes:
    """Return the 16-byte UUID of a device: the identity that crosses processes (invariant 6).

    Parameters
    ----------
    ordinal : int
        Device ordinal in this process.

    Returns
    -------
    bytes
        16 bytes (``CUuuid``); :func:`format_uuid` spells them the way ``nvidia-smi -L`` does.
    """
    lib, ffi = _api()
    dev = _device(ordinal)
    out = ffi.new("CUuuid *")
    try:
        fn = lib.cuDeviceGetUuid_v2
        call = "cuDeviceGetUuid_v2"
    except AttributeError:  # drivers before CUDA 11.4 export only the unversioned symbol
        fn = lib.cuDeviceGetUuid
        call = "cuDeviceGetUuid"
    _check(call, fn(out, dev))
    return bytes(ffi.buffer(out))


def format_uuid(uuid: bytes) -> str:
    """Spell a device UUID as ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (as ``nvidia-smi -L`` prints it).

    Parameters
    ----------
    uuid : bytes
        16 bytes from :func:`device_uuid`.
    """
    if len(uuid) != UUID_SIZE:
        raise RegionError(f"a device UUID has {UUID_SIZE} bytes, got {len(uuid)}", field="uuid")
    h = uuid.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def ordinal_for_uuid(uuid: bytes) -> int:
    """Return this process's ordinal for the device with that UUID.

    Parameters
    ----------
    uuid : bytes
        16 bytes from :func:`device_uuid` (typically received from another process).

    Raises
    ------
    RegionError
        The device is not visible here (``uuid`` and ``visible`` are attached): another
        ``CUDA_VISIBLE_DEVICES``, a container without that GPU, or another host.
    """
    uuid = bytes(uuid)
    if len(uuid) != UUID_SIZE:
        raise RegionError(f"a device UUID has {UUID_SIZE} bytes, got {len(uuid)}", field="uuid")
    table = _DRIVER.uuids
    if table is None or not _usable_in_this_process():
        table = {device_uuid(i): i for i in range(device_count())}
        with _DRIVER.lock:
            _DRIVER.uuids = table
        # The C core's get path resolves a message's GPU by the same table (region_table.c).
        for known, index in table.items():
            _core.aib_regions_put(_core.AIB_REGION_KEY_DEVICE, known, len(known), index, _core_ffi.NULL)
    ordinal = table.get(uuid)
    if ordinal is None:
        visible = [format_uuid(u) for u in table]
        raise RegionError(
            f"GPU {format_uuid(uuid)} is not visible to this process, which sees {visible or 'no GPU'} "
            f"({_visible_devices_note()}); producer and consumer must share the GPU",
            uuid=format_uuid(uuid),
            visible=visible,
        )
    return ordinal


def device_attribute(ordinal: int, attribute: int) -> int:
    """Return ``cuDeviceGetAttribute(attribute)`` for a device.

    Parameters
    ----------
    ordinal : int
        Device ordinal in this process.
    attribute : int
        A ``CU_DEVICE_ATTRIBUTE_*`` value (this module defines the ones the bridge uses).
    """
    lib, ffi = _api()
    dev = _device(ordinal)
    out = ffi.new("int *")
    _check("cuDeviceGetAttribute", lib.cuDeviceGetAttribute(out, attribute, dev))
    return int(out[0])


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceCapabilities:
    """What a device supports among the sharing mechanisms the bridge uses."""

    #: compute capability, e.g. ``(9, 0)`` for H100/H200
    compute_capability: tuple[int, int]
    #: unified virtual addressing (every legacy IPC and pointer-attribute path needs it)
    unified_addressing: bool
    #: interprocess events (``CU_EVENT_INTERPROCESS``)
    ipc_events: bool
    #: stream-ordered memory pools, and pools exportable as POSIX file descriptors
    memory_pools: bool
    mempool_posix_fd: bool
    #: virtual memory management, and VMM allocations exportable as POSIX file descriptors
    vmm: bool
    vmm_posix_fd: bool


def device_capabilities(ordinal: int) -> DeviceCapabilities:
    """Query which sharing mechanisms a device supports.

    Parameters
    ----------
    ordinal : int
        Device ordinal in this process.
    """

    def attr(a: int) -> int:
        return device_attribute(ordinal, a)

    pools = bool(attr(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED))
    return DeviceCapabilities(
        compute_capability=(
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        ),
        unified_addressing=bool(attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)),
        ipc_events=bool(attr(CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED)),
        memory_pools=pools,
        mempool_posix_fd=pools
        and bool(
            attr(CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)
            & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        ),
        vmm=bool(attr(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)),
        vmm_posix_fd=bool(attr(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)),
    )


def _primary_context(ordinal: int) -> Any:
    """Return the device's primary context, retained once per process (CuPy/PyTorch share the same one)."""
    ctx = _DRIVER.primary.get(ordinal)
    if ctx is not None and _usable_in_this_process():
        return ctx
    dev = _device(ordinal)
    lib, ffi = _api()
    with _DRIVER.lock:
        ctx = _DRIVER.primary.get(ordinal)
        if ctx is None:
            out = ffi.new("CUcontext *")
            _check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(out, dev))
            # Kept for the life of the process: releasing it while CuPy/PyTorch use it would be harmless
            # (reference counted) but re-retaining it costs a context activation.
            ctx = out[0]
            _DRIVER.primary[ordinal] = ctx
    return ctx


class _ContextGuard:
    """Make a device's primary context current for a block, then restore whatever was current before."""

    __slots__ = ("_ordinal", "_pushed")

    def __init__(self, ordinal: int | None) -> None:
        self._ordinal = ordinal
        self._pushed = False

    def __enter__(self) -> None:
        lib, ffi = _api()
        current = ffi.new("CUcontext *")
        _check("cuCtxGetCurrent", lib.cuCtxGetCurrent(current))
        if self._ordinal is None:
            # Any context will do (the call is context-independent under UVA): keep the caller's if it has
            # one.
            if current[0] != ffi.NULL:
                return
            ctx = _primary_context(0)
        else:
            ctx = _primary_context(self._ordinal)
            if current[0] == ctx:
                return
        _check("cuCtxPushCurrent_v2", lib.cuCtxPushCurrent_v2(ctx))
        self._pushed = True

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._pushed:
            return
        self._pushed = False
        lib, ffi = _DRIVER.lib, _DRIVER.ffi
        popped = ffi.new("CUcontext *")
        rc = int(lib.cuCtxPopCurrent_v2(popped))
        if rc != CUDA_SUCCESS and exc_type is None:  # never mask the exception already in flight
            raise _DRIVER.error("cuCtxPopCurrent_v2", rc)


def _current_context() -> int:
    """The calling thread's current ``CUcontext`` as an integer (0 for none); used by the tests."""
    lib, ffi = _api()
    out = ffi.new("CUcontext *")
    _check("cuCtxGetCurrent", lib.cuCtxGetCurrent(out))
    return int(ffi.cast("uintptr_t", out[0]))


def device_context(ordinal: int) -> AbstractContextManager[None]:
    """Make the device's primary context current for the calling thread inside a ``with`` block.

    The previous context (CuPy's, PyTorch's, or none) is current again after the block. Nothing is pushed when
    the primary context is already current. Safe to nest and to use from several threads.

    Parameters
    ----------
    ordinal : int
        Device ordinal in this process.

    Examples
    --------
    >>> with device_context(0):  # doctest: +SKIP
    ...     ...
    """
    _device(ordinal)  # validate eagerly, so a bad ordinal fails at the call, not at __enter__
    return _ContextGuard(ordinal)


def _ctx(device: int | None) -> _ContextGuard:
    return _ContextGuard(device)


def synchronize(device: int) -> None:
    """Wait until all work on the device's primary context has finished (``cuCtxSynchronize``).

    Parameters
    ----------
    device : int
        Device ordinal in this process.
    """
    lib = _lib()
    with device_context(device):
        _check("cuCtxSynchronize", lib.cuCtxSynchronize())


def mem_get_info(device: int) -> tuple[int, int]:
    """Return ``(free, total)`` bytes of device memory (``cuMemGetInfo_v2``).

    Parameters
    ----------
    device : int
        Device ordinal in this process.
    """
    lib, ffi = _api()
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    with device_context(device):
        _check("cuMemGetInfo_v2", lib.cuMemGetInfo_v2(free, total))
    return int(free[0]), int(total[0])


# ----------------------------------------------------------------------------------------------------------
# Argument conversion (validation happens before any driver call: invariant 1)
# ----------------------------------------------------------------------------------------------------------


def _address(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _UINT64_MAX:
        raise RegionError(f"{what} must be an integer address in [0, 2**64), got {value!r}", field=what)
    return value


def _nbytes(value: int, what: str = "nbytes", *, allow_zero: bool = True) -> int:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _UINT64_MAX:
        raise RegionError(f"{what} must be an integer >= {low}, got {value!r}", field=what)
    return value


def _handle_bytes(value: bytes | bytearray | memoryview, what: str) -> bytes:
    data = bytes(value)
    if len(data) != IPC_HANDLE_SIZE:
        raise RegionError(f"{what} must be {IPC_HANDLE_SIZE} bytes, got {len(data)}", field=what)
    return data


def _fd(value: int, what: str = "fd") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RegionError(f"{what} must be a non-negative file descriptor, got {value!r}", field=what)
    return value


def _stream_value(stream: Any) -> int:
    """Accept a raw ``CUstream`` integer or a stream object of CuPy (``.ptr``), PyTorch (``.cuda_stream``) or
    anything with ``__cuda_stream__`` (the CUDA stream protocol); 0 is the legacy default stream."""
    if stream is None:
        return 0
    value: Any
    if isinstance(stream, int) and not isinstance(stream, bool):
        value = stream
    elif hasattr(stream, "__cuda_stream__"):
        value = stream.__cuda_stream__()[1]
    elif hasattr(stream, "cuda_stream"):
        value = stream.cuda_stream
    elif hasattr(stream, "ptr"):
        value = stream.ptr
    else:
        raise RegionError(
            f"not a CUDA stream: {stream!r} (pass an int, or a CuPy/PyTorch stream)", field="stream"
        )
    return _address(int(value), "stream")


# ----------------------------------------------------------------------------------------------------------
# Pointer facts
# ----------------------------------------------------------------------------------------------------------

MemoryType = Literal["device", "host", "managed", "array"]


@dataclasses.dataclass(frozen=True, slots=True)
class PointerInfo:
    """What the driver knows about one CUDA pointer (one ``cuPointerGetAttributes`` call)."""

    #: device ordinal (in this process) the memory was allocated on or registered with
    device: int
    #: ``"device"`` (cudaMalloc, pools, VMM, IPC-opened), ``"host"`` (pinned/registered host memory),
    #: ``"managed"`` (unified memory) or ``"array"``
    memory_type: MemoryType
    is_managed: bool
    #: start and size of the allocation that contains the pointer (``cuMemGetAddressRange``)
    base: int
    size: int
    #: process-unique id of the allocation, never reused: the key for caching per-allocation handles
    buffer_id: int
    #: ``cuIpcGetMemHandle`` works on this allocation
    legacy_ipc_capable: bool
    #: the ``CUmemoryPool`` the memory came from, or 0
    mempool: int
    #: bitmask of ``CU_MEM_HANDLE_TYPE_*`` the allocation may be exported as (VMM allocations)
    allowed_handle_types: int


_POINTER_ATTRIBUTES: Final = (
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    CU_POINTER_ATTRIBUTE_IS_MANAGED,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    CU_POINTER_ATTRIBUTE_BUFFER_ID,
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
    CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
)


_POINTER_ATTRIBUTE_ARRAY: Any = None


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def pointer_info(ptr: int) -> PointerInfo | None:
    """Describe the allocation a pointer belongs to, in a single ``cuPointerGetAttributes`` call.

    Parameters
    ----------
    ptr : int
        Any address: device, managed, pinned host, IPC-opened or pool-imported memory, or plain host memory.

    Returns
    -------
    PointerInfo or None
        None when the driver does not know the address (plain ``malloc``/numpy host memory, address 0): such
        memory is the host path's business, not CUDA's.
    """
    ptr = _address(ptr, "ptr")
    if ptr == 0:
        return None
    global _POINTER_ATTRIBUTE_ARRAY
    lib, ffi = _api()
    n = len(_POINTER_ATTRIBUTES)
    attributes = _POINTER_ATTRIBUTE_ARRAY
    if attributes is None:  # built once; the driver only reads it, so threads may share it
        attributes = _POINTER_ATTRIBUTE_ARRAY = ffi.new("CUpointer_attribute[]", list(_POINTER_ATTRIBUTES))
    # One zeroed 8-byte slot per attribute: the driver writes 1 (bool), 4 (int, enum) or 8 (pointer, u64)
    # bytes into it, and reading the whole little-endian slot gives the value whatever the width.
    slots = ffi.new("unsigned long long[]", n)
    data = ffi.new("void *[]", [slots + i for i in range(n)])
    with _ctx(None):
        rc = int(lib.cuPointerGetAttributes(n, attributes, data, ptr))
        if rc != CUDA_SUCCESS:
            if rc != CUDA_ERROR_INVALID_VALUE:
                raise _DRIVER.error("cuPointerGetAttributes", rc)
            # Some attribute is not defined for this kind of memory: ask one by one and keep what answers.
            for i, attribute in enumerate(_POINTER_ATTRIBUTES):
                slots[i] = 0
                if int(lib.cuPointerGetAttribute(slots + i, attribute, ptr)) != CUDA_SUCCESS:
                    slots[i] = 0
    return _info_from_slots(ffi.unpack(slots, n))


def _info_from_slots(slots: Sequence[int]) -> PointerInfo | None:
    """A :class:`PointerInfo` from the 8-byte slots of :data:`_POINTER_ATTRIBUTES`, in order."""
    raw_type = slots[0] & 0xFFFFFFFF
    if raw_type == 0:
        return None  # not a CUDA pointer: the driver leaves every attribute at its default
    is_managed = slots[2] != 0
    memory_type: MemoryType
    if is_managed or raw_type == CU_MEMORYTYPE_UNIFIED:
        memory_type = "managed"
    elif raw_type == CU_MEMORYTYPE_HOST:
        memory_type = "host"
    elif raw_type == CU_MEMORYTYPE_ARRAY:
        memory_type = "array"
    else:
        memory_type = "device"
    return PointerInfo(
        device=_signed32(slots[1]),
        memory_type=memory_type,
        is_managed=is_managed,
        base=slots[3],
        size=slots[4],
        buffer_id=slots[5],
        legacy_ipc_capable=slots[6] != 0,
        mempool=slots[7],
        allowed_handle_types=slots[8] & 0xFFFFFFFF,
    )


def describe_buffers(
    addresses: Sequence[int], lengths: Sequence[int]
) -> tuple[list[PointerInfo | None], list[int]] | None:
    """The allocations behind buffers sorted by address: ``(infos, index of each buffer's info)``.

    One ``cuPointerGetAttributes`` per allocation (a buffer inside the previous buffer's allocation
    asks nothing), looped in the C core: a message's attribute queries cost the driver's calls,
    not a Python round per buffer. None when the driver refuses the attribute set for one of the
    buffers (memory for which an attribute is undefined): :func:`pointer_info` copes with those, one
    by one.
    """
    n = len(addresses)
    if n == 0:
        return [], []
    global _POINTER_ATTRIBUTE_ARRAY
    lib, ffi = _api()
    if _POINTER_ATTRIBUTE_ARRAY is None:
        _POINTER_ATTRIBUTE_ARRAY = ffi.new("CUpointer_attribute[]", list(_POINTER_ATTRIBUTES))
    n_attributes = len(_POINTER_ATTRIBUTES)
    attributes = _core_ffi.cast("int *", int(ffi.cast("uintptr_t", _POINTER_ATTRIBUTE_ARRAY)))
    infos = _core_ffi.new("uint64_t[]", n * n_attributes)
    allocation_of = _core_ffi.new("uint32_t[]", n)
    n_infos = _core_ffi.new("size_t *")
    get_attributes = int(ffi.cast("uintptr_t", lib.cuPointerGetAttributes))
    with _ctx(None):
        rc = _core.aib_cuda_describe_buffers(
            get_attributes,
            attributes,
            n_attributes,
            3,  # CU_POINTER_ATTRIBUTE_RANGE_START_ADDR's slot
            4,  # CU_POINTER_ATTRIBUTE_RANGE_SIZE's slot
            _core_ffi.new("uint64_t[]", list(addresses)),
            _core_ffi.new("uint64_t[]", list(lengths)),
            n,
            infos,
            allocation_of,
            n_infos,
        )
    if rc == CUDA_ERROR_INVALID_VALUE:
        return None
    if rc != CUDA_SUCCESS:
        raise _DRIVER.error("cuPointerGetAttributes", rc)
    flat: list[int] = _core_ffi.unpack(infos, int(n_infos[0]) * n_attributes)
    described = [_info_from_slots(flat[k : k + n_attributes]) for k in range(0, len(flat), n_attributes)]
    return described, _core_ffi.unpack(allocation_of, n)


def _device_of(ptr: int) -> int:
    info = pointer_info(ptr)
    if info is None:
        raise RegionError(f"address {ptr:#x} is not CUDA memory known to this process", field="ptr")
    return info.device


# ----------------------------------------------------------------------------------------------------------
# Copies (helpers for tests and for the bridge's own copy-if-needed path)
# ----------------------------------------------------------------------------------------------------------


def mem_alloc(nbytes: int, device: int) -> int:
    """Allocate ``nbytes`` of device memory on ``device`` (``cuMemAlloc_v2``, what ``cudaMalloc``
    does): shareable through a legacy IPC handle. Free it with :func:`mem_free`."""
    nbytes = _nbytes(nbytes, allow_zero=False)
    lib, ffi = _api()
    out = ffi.new("CUdeviceptr *")
    with device_context(device):
        _check("cuMemAlloc_v2", lib.cuMemAlloc_v2(out, nbytes))
    return int(out[0])


def mem_free(ptr: int, *, device: int | None = None) -> None:
    """Free memory from :func:`mem_alloc` (``cuMemFree_v2``)."""
    ptr = _address(ptr, "ptr")
    lib, _ = _api()
    with device_context(_device_of(ptr) if device is None else device):
        _check("cuMemFree_v2", lib.cuMemFree_v2(ptr))


def memcpy_dtoh(dst_host_addr: int, src_dev: int, n: int, *, device: int | None = None) -> None:
    """Copy ``n`` bytes from device memory to host memory, synchronously (``cuMemcpyDtoH_v2``).

    The copy runs on the legacy default stream of the device's primary context, so it is ordered after work
    queued there (including a :func:`stream_wait_event` on stream 0).

    Parameters
    ----------
    dst_host_addr : int
        Host address with room for ``n`` bytes.
    src_dev : int
        Device address.
    n : int
        Byte count.
    device : int, optional
        Device ordinal whose context runs the copy; default: the one ``src_dev`` lives on.
    """
    dst, src, n = _address(dst_host_addr, "dst_host_addr"), _address(src_dev, "src_dev"), _nbytes(n)
    if n == 0:
        return
    lib, ffi = _api()
    with device_context(_device_of(src) if device is None else device):
        _check("cuMemcpyDtoH_v2", lib.cuMemcpyDtoH_v2(ffi.cast("void *", dst), src, n))


def memcpy_htod(dst_dev: int, src_host_addr: int, n: int, *, device: int | None = None) -> None:
    """Copy ``n`` bytes from host memory to device memory, synchronously (``cuMemcpyHtoD_v2``).

    Parameters
    ----------
    dst_dev : int
        Device address.
    src_host_addr : int
        Host address of ``n`` readable bytes.
    n : int
        Byte count.
    device : int, optional
        Device ordinal whose context runs the copy; default: the one ``dst_dev`` lives on.
    """
    dst, src, n = _address(dst_dev, "dst_dev"), _address(src_host_addr, "src_host_addr"), _nbytes(n)
    if n == 0:
        return
    lib, ffi = _api()
    with device_context(_device_of(dst) if device is None else device):
        _check("cuMemcpyHtoD_v2", lib.cuMemcpyHtoD_v2(dst, ffi.cast("const void *", src), n))


def memcpy_dtod(dst_dev: int, src_dev: int, n: int, *, device: int | None = None) -> None:
    """Copy ``n`` bytes between device allocations (``cuMemcpyDtoD_v2``; ordered on the legacy stream).

    Parameters
    ----------
    dst_dev, src_dev : int
        Device addresses.
    n : int
        Byte count.
    device : int, optional
        Device ordinal whose context runs the copy; default: the one ``dst_dev`` lives on.
    """
    dst, src, n = _address(dst_dev, "dst_dev"), _address(src_dev, "src_dev"), _nbytes(n)
    if n == 0:
        return
    lib, _ = _api()
    with device_context(_device_of(dst) if device is None else device):
        _check("cuMemcpyDtoD_v2", lib.cuMemcpyDtoD_v2(dst, src, n))


def read_device(ptr: int, n: int, *, device: int | None = None) -> bytes:
    """Return ``n`` bytes of device memory as ``bytes`` (a synchronous copy on the legacy default stream).

    Parameters
    ----------
    ptr : int
        Device address.
    n : int
        Byte count.
    device : int, optional
        Device ordinal whose context runs the copy; default: the one ``ptr`` lives on.
    """
    ptr, n = _address(ptr, "ptr"), _nbytes(n)
    if n == 0:
        return b""
    lib, ffi = _api()
    buf = ffi.new("char[]", n)
    with device_context(_device_of(ptr) if device is None else device):
        _check("cuMemcpyDtoH_v2", lib.cuMemcpyDtoH_v2(buf, ptr, n))
    return bytes(ffi.buffer(buf, n))


def write_device(ptr: int, data: bytes | bytearray | memoryview, *, device: int | None = None) -> None:
    """Copy a bytes-like object into device memory (synchronously).

    Parameters
    ----------
    ptr : int
        Device address with room for ``len(data)`` bytes.
    data : bytes-like
        The bytes to write.
    device : int, optional
        Device ordinal whose context runs the copy; default: the one ``ptr`` lives on.
    """
    ptr = _address(ptr, "ptr")
    view = memoryview(data).cast("B")
    if view.nbytes == 0:
        return
    lib, ffi = _api()
    src = ffi.from_buffer(view)
    with device_context(_device_of(ptr) if device is None else device):
        _check("cuMemcpyHtoD_v2", lib.cuMemcpyHtoD_v2(ptr, src, view.nbytes))


def memset_d8(ptr: int, value: int, n: int, *, device: int | None = None) -> None:
    """Set ``n`` bytes of device memory to ``value`` (``cuMemsetD8_v2``).

    Parameters
    ----------
    ptr : int
        Device address.
    value : int
        Byte value, 0-255.
    n : int
        Byte count.
    device : int, optional
        Device ordinal whose context runs the call; default: the one ``ptr`` lives on.
    """
    ptr, n = _address(ptr, "ptr"), _nbytes(n)
    if not 0 <= value <= 255:
        raise RegionError(f"value must be a byte (0-255), got {value!r}", field="value")
    if n == 0:
        return
    lib = _lib()
    with device_context(_device_of(ptr) if device is None else device):
        _check("cuMemsetD8_v2", lib.cuMemsetD8_v2(ptr, value, n))


# ----------------------------------------------------------------------------------------------------------
# Resource base: close() idempotent, context manager, finalizer that warns and never raises
# ----------------------------------------------------------------------------------------------------------


class _DriverResource:
    """Base of objects that own a driver resource."""

    # Class-level default, so a finalizer running on an instance whose __init__ failed sees "nothing to do".
    _closed: bool = True

    def _release(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def close(self) -> None:
        """Release the driver resource. Idempotent; after a ``fork`` it only forgets the resource."""
        if self._closed:
            return
        self._closed = True  # first, so a failing release is not retried by the finalizer
        if _usable_in_this_process():
            self._release()

    def __enter__(self) -> _DriverResource:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        if globals().get("contextlib") is None:  # interpreter shutdown cleared this module's globals
            return
        # A finalizer never raises: not at interpreter shutdown, not with warnings turned into errors.
        with contextlib.suppress(Exception):
            warnings.warn(
                f"{type(self).__name__} was not closed; releasing it from the finalizer",
                ResourceWarning,
                stacklevel=2,
            )
        with contextlib.suppress(Exception):
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ReleasedError(f"{type(self).__name__} is closed", field=type(self).__name__)


# ----------------------------------------------------------------------------------------------------------
# Legacy CUDA IPC (cudaIpc* on cudaMalloc memory)
# ----------------------------------------------------------------------------------------------------------

_IPC_OPEN_HINT: Final = (
    "the handle is stale (the exporter freed the allocation or exited before it was opened), corrupted, or "
    "was made by this same process (legacy handles open only in another process)"
)


def ipc_get_mem_handle(base: int, *, device: int | None = None) -> bytes:
    """Return the 64-byte legacy IPC handle of a ``cudaMalloc``-style allocation (``cuIpcGetMemHandle``).

    Costs 10-23 us: cache it per allocation (:class:`LegacyHandleCache`, keyed by ``buffer_id``).

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

    Opened with ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``. Costs 88-400 us; opening the same handle again in the
    same process succeeds and returns the same pointer (measured), but every open needs its own close.

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
    """Unmap memory opened with :func:`ipc_open_mem_handle` (``cuIpcCloseMemHandle``, 73-169 us).

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
            raise RegionError(f"max_entries must be >= 1, got {max_entries}", field="max_entries")
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


# ----------------------------------------------------------------------------------------------------------
# Events
# ----------------------------------------------------------------------------------------------------------


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
        """Record the event on a stream (``cuEventRecord``, ~1.6 us).

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


class EventPool(_DriverResource):
    """Reusable interprocess events for one device: ``cuEventCreate`` costs ~225 us, a pooled event nothing.

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
        event = Event(self._device, _pool=self)  # created outside the lock: it takes ~225 us
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


# Opened IPC events, per process: (handle bytes, device) -> CUevent as int.
_OPENED_EVENTS: dict[tuple[bytes, int], int] = {}
# CUevent -> device ordinal of the opened events, so calls on a bare event integer use the right context.
_OPENED_EVENT_DEVICES: dict[int, int] = {}


def _event_device(event: int | Event) -> int | None:
    if isinstance(event, Event):
        return event.device
    with _CACHE_LOCK:
        return _OPENED_EVENT_DEVICES.get(event)


def open_ipc_event(handle: bytes | bytearray | memoryview, device: int) -> int:
    """Open an interprocess event from its 64-byte handle, cached per process.

    The first open of a handle costs ~185 us, a cache hit ~1 us. The exporter reuses pooled events, so the
    same handle arrives again and again; it stays open until :func:`close_ipc_event`.

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
    key = (data, device)
    with _CACHE_LOCK:
        cached = _OPENED_EVENTS.get(key)
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
        winner = _OPENED_EVENTS.setdefault(key, value)
        _OPENED_EVENT_DEVICES[winner] = device
        if winner == value:  # the C core's get path finds opened events here (region_table.c)
            _core.aib_regions_put(_core.AIB_REGION_KEY_EVENT, data, len(data), value, _core_ffi.NULL)
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
    with _CACHE_LOCK:
        value = _OPENED_EVENTS.pop((data, device), None)
        if value is not None:
            _OPENED_EVENT_DEVICES.pop(value, None)
            _core.aib_regions_remove(_core.AIB_REGION_KEY_EVENT, data, len(data))
    if value is None:
        return False
    lib, ffi = _api()
    with device_context(device):
        _check("cuEventDestroy_v2", lib.cuEventDestroy_v2(ffi.cast("CUevent", value)))
    return True


def clear_ipc_event_cache() -> None:
    """Destroy every opened IPC event of this process (e.g. when a producer disconnects)."""
    with _CACHE_LOCK:
        items = list(_OPENED_EVENTS.items())
        _OPENED_EVENTS.clear()
        _OPENED_EVENT_DEVICES.clear()
        for (data, _), _ in items:
            _core.aib_regions_remove(_core.AIB_REGION_KEY_EVENT, data, len(data))
    if not items or not _usable_in_this_process():
        return
    lib, ffi = _api()
    for (_, device), value in items:
        with device_context(device):
            lib.cuEventDestroy_v2(ffi.cast("CUevent", value))


def ipc_event_cache_size() -> int:
    """Number of IPC events this process holds open."""
    with _CACHE_LOCK:
        return len(_OPENED_EVENTS)


def stream_wait_event(stream: object, event: int | Event, *, device: int | None = None) -> None:
    """Make future work on ``stream`` wait for the event's last recording (``cuStreamWaitEvent``, ~2.4 us).

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


# ----------------------------------------------------------------------------------------------------------
# Stream-ordered memory pools exportable as POSIX file descriptors
# ----------------------------------------------------------------------------------------------------------

# Pools created by this process: handle -> pool. Exportability of these is known without asking the driver.
_OWN_POOLS: weakref.WeakValueDictionary[int, IpcMemoryPool] = weakref.WeakValueDictionary()
# Serial numbers of this process's pools: the driver reuses a destroyed pool's handle value, these
# are never reused, so consumers can cache imported pools by them (see IpcMemoryPool.serial).
_POOL_SERIALS = itertools.count(1)


def _set_non_inheritable(fd: int) -> int:
    # fds returned by the driver may lack O_CLOEXEC; they must not leak into unrelated child processes.
    with contextlib.suppress(OSError):
        os.set_inheritable(fd, False)
    return fd


class IpcMemoryPool(_DriverResource):
    """A stream-ordered memory pool whose allocations other processes can import (POSIX fd handle type).

    A consumer imports the pool once (~100 us, :func:`import_pool`) and then each pointer for ~1.5 us, which
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
        lib, ffi = _api()
        if not self._shared_once:
            # Measured on the H200 (driver 580): cuMemPoolExportPointer answers INVALID_VALUE until
            # the pool itself was exported as a shareable handle once. Do that first (the fd is
            # closed again at once; consumers get theirs from export_pool_fd, which sets the flag).
            os.close(self.export_pool_fd())
        n = len(pointers)
        array = _core_ffi.new("uint64_t[]", [_address(ptr, "ptr") for ptr in pointers])
        out = _core_ffi.new("uint8_t[]", 64 * n)
        done = _core_ffi.new("size_t *")
        export_fn = int(ffi.cast("uintptr_t", lib.cuMemPoolExportPointer))
        with device_context(self._device):
            rc = _core.aib_cuda_export_pool_pointers(export_fn, array, n, out, done)
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
        """Map one allocation of the exporter's pool (``cuMemPoolImportPointer``, ~1.5 us after the first).

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
        import_fn = int(ffi.cast("uintptr_t", lib.cuMemPoolImportPointer))
        pool = int(ffi.cast("uintptr_t", self._pool))
        with device_context(self._device):
            rc = _core.aib_cuda_import_pool_pointers(import_fn, pool, blob, n, out, done)
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
                raise RegionError(f"{what} was not imported from this pool (or was freed)", field="ptr")
            self._imported.difference_update(pointers)
        lib, ffi = _api()
        array = _core_ffi.new("uint64_t[]", list(pointers) or [0])
        free_fn = int(ffi.cast("uintptr_t", lib.cuMemFree_v2))
        with device_context(self._device):
            _check("cuMemFree_v2", _core.aib_cuda_free_pointers(free_fn, array, len(pointers)))

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
    """Import another process's IPC memory pool from its file descriptor (~100 us, once per pool).

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


def pool_of_pointer(ptr: int) -> int:
    """Return the ``CUmemoryPool`` (as an integer) a pointer was allocated from, or 0.

    Parameters
    ----------
    ptr : int
        A device address.
    """
    info = pointer_info(ptr)
    return 0 if info is None else info.mempool


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


class _PoolAllocationOwner:
    """Keeps one CuPy allocation alive; returns it to the pool when CuPy drops the memory."""

    __slots__ = ("nbytes", "pool", "ptr", "stream")

    def __init__(self, pool: IpcMemoryPool, ptr: int, nbytes: int, stream: int) -> None:
        self.pool = pool
        self.ptr = ptr
        self.nbytes = nbytes
        self.stream = stream

    def __del__(self) -> None:
        try:
            if not _usable_in_this_process():
                return
            try:
                self.pool.free(self.ptr, self.stream)
            except CudaError:
                # The allocating stream is gone: wait for all work on the device, then free on the legacy
                # stream.
                synchronize(self.pool.device)
                self.pool.free(self.ptr, 0)
        except Exception as exc:
            with contextlib.suppress(Exception):  # finalizers never raise
                warnings.warn(
                    f"could not free {self.ptr:#x} to its IPC pool: {exc}", ResourceWarning, stacklevel=2
                )


def cupy_allocation_request(cupy: Any, device: int, nbytes: int) -> tuple[int, int]:
    """What a CuPy allocator call asks for: (bytes, at least 1, since CuPy asks for 0 for empty
    arrays and the driver refuses 0; CuPy's current stream). RegionError when CuPy's current
    device is not the allocator's."""
    current = cupy.cuda.Device().id
    if current != device:
        raise RegionError(
            f"CuPy allocates on device {current} but this allocator serves device {device}", field="device"
        )
    return max(int(nbytes), 1), int(cupy.cuda.get_current_stream().ptr)


class CupyPoolAllocator:
    """A CuPy allocator (for ``cupy.cuda.set_allocator``) that serves memory from an :class:`IpcMemoryPool`.

    Every CuPy array allocated while it is installed lives in an IPC-capable pool, so the bridge shares it at
    pool-import cost instead of copying it. Allocations are ordered on CuPy's current stream and freed on that
    same stream when CuPy releases them.

    Parameters
    ----------
    device : int
        Device ordinal; CuPy's current device must be this one when it allocates.
    pool : IpcMemoryPool, optional
        The pool to serve from; default: a new one for ``device``.
    """

    def __init__(self, device: int = 0, *, pool: IpcMemoryPool | None = None) -> None:
        import cupy  # optional and heavy: only this allocator needs it

        self._cupy: Any = cupy
        self.device = device
        self.pool = pool if pool is not None else IpcMemoryPool(device)

    def __call__(self, nbytes: int) -> Any:
        cupy = self._cupy
        size, stream = cupy_allocation_request(cupy, self.device, nbytes)
        ptr = self.pool.allocate(size, stream)
        owner = _PoolAllocationOwner(self.pool, ptr, size, stream)
        memory = cupy.cuda.UnownedMemory(ptr, size, owner, self.device)
        return cupy.cuda.MemoryPointer(memory, 0)


def cupy_allocator(
    device: int = 0, *, pool: IpcMemoryPool | None = None, slab_size: int | None = None
) -> CupyPoolAllocator | CupySlabAllocator:
    """Return an allocator for ``cupy.cuda.set_allocator`` whose allocations are shareable via a pool fd.

    Parameters
    ----------
    device : int
        Device ordinal.
    pool : IpcMemoryPool, optional
        Pool to allocate from; default: a new one (reachable as ``allocator.pool``). Not with
        ``slab_size``.
    slab_size : int, optional
        Carve arrays out of kept slabs of this many bytes (``memory.slab.SlabAllocator``): a
        consumer imports each slab once, and new arrays in it cost no driver call there; the
        slabs are never freed while this process lives. Default: one pool allocation per array,
        freed when CuPy drops it (each new array is one pointer import per consumer).

    Examples
    --------
    >>> import cupy  # doctest: +SKIP
    >>> cupy.cuda.set_allocator(cupy_allocator(0))  # doctest: +SKIP
    >>> cupy.cuda.set_allocator(cupy_allocator(0, slab_size=256 << 20))  # doctest: +SKIP
    """
    if slab_size is not None:
        if pool is not None:
            raise ValueError("pool and slab_size do not go together: a slab allocator makes its own pool")
        from arrow_ipc_bridge.memory.slab import CupySlabAllocator

        return CupySlabAllocator(device, slab_size=slab_size)
    return CupyPoolAllocator(device, pool=pool)


# ----------------------------------------------------------------------------------------------------------
# Virtual memory management (cuMemCreate allocations exported as POSIX file descriptors)
# ----------------------------------------------------------------------------------------------------------


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
    """Import a VMM allocation from its POSIX fd and map it read/write for ``device`` (210-260 us).

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
