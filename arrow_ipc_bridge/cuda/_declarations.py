"""The CUDA driver's declarations: the ``cuda.h`` values the bridge names and the C text cffi parses.

Nothing here opens a library: :func:`cdef_source` and :func:`build_ffi` only describe the driver's ABI
(enums, struct layouts, function signatures), and ``_driver`` dlopens ``libcuda.so.1`` with them on first
use. Enum values and struct layouts are those of ``cuda.h`` (CUDA 13.0, as generated into NVIDIA/cuda-python's
``cydriver.pxd``); ``tests/test_cuda_driver.py`` pins each of them. Where the driver exports versioned symbols
(``_v2``) the versioned one is declared, since that is what ``cuda.h`` maps the plain name to.
"""

from __future__ import annotations

import re
from typing import Any, Final

__all__ = [
    "IPC_HANDLE_SIZE",
    "UUID_SIZE",
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
CUDA_ERROR_PEER_ACCESS_UNSUPPORTED: Final = 217
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
CUDA_ERROR_PEER_ACCESS_NOT_ENABLED: Final = 705
CUDA_ERROR_CONTEXT_IS_DESTROYED: Final = 709
CUDA_ERROR_TOO_MANY_PEERS: Final = 711
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

# CUstream_flags (cuStreamCreate's unsigned int Flags)
CU_STREAM_NON_BLOCKING: Final = 1

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

# CUdevice_P2PAttribute (what one GPU can do with another's memory)
CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK: Final = 1
CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED: Final = 2
CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED: Final = 3
CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED: Final = 4

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

# The enums of peer access (several GPUs, ``peer.py``), kept apart from the table above because the
# tests pin that table member by member; ``tests/test_multigpu_cpu.py`` pins these. The CUresult codes
# of peer access (217, 705, 711) stay Python constants: the driver returns them as plain ints.
_PEER_ENUMS: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "CUdevice_P2PAttribute": (
        "CUdevice_P2PAttribute_enum",
        (
            "CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK",
            "CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED",
            "CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED",
            "CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED",
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
CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev);
CUresult cuDeviceGetP2PAttribute(int *value, CUdevice_P2PAttribute attrib, CUdevice srcDevice,
                                 CUdevice dstDevice);

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
CUresult cuCtxSynchronize(void);
CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags);

CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags);
CUresult cuMemFreeHost(void *p);
CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);
CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                           CUcontext srcContext, size_t ByteCount, CUstream hStream);

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
CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
CUresult cuStreamDestroy_v2(CUstream hStream);

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


def cdef_source() -> str:
    """Return the C declarations given to ``cffi.FFI.cdef``: the enums, the types and the driver functions.

    Returns
    -------
    str
        C source; the enums carry the values of the module constants (one source for Python and C).
    """
    module = globals()
    parts = []
    for typedef, (tag, members) in (_ENUMS | _PEER_ENUMS).items():
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
