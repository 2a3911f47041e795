"""Facts about CUDA pointers (which allocation, which kind of memory) and synchronous copies.

:func:`pointer_info` asks for every attribute in one ``cuPointerGetAttributes`` call (the C core's
placement walk, ``aib_cuda_place``, makes its own calls for a whole message). The copies serve the
bridge's copy-if-needed path and ``to_host``/``to_device``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final, Literal

from arrow_ipc_bridge.cuda._declarations import (
    CU_MEMORYTYPE_ARRAY,
    CU_MEMORYTYPE_HOST,
    CU_MEMORYTYPE_UNIFIED,
    CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
    CU_POINTER_ATTRIBUTE_BUFFER_ID,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    CU_POINTER_ATTRIBUTE_IS_MANAGED,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
    CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_SUCCESS,
)
from arrow_ipc_bridge.cuda._driver import (
    _DRIVER,
    _address,
    _api,
    _check,
    _nbytes,
)
from arrow_ipc_bridge.cuda.devices import _ctx, device_context
from arrow_ipc_bridge.errors import InvalidArgumentError

__all__ = [
    "MemoryType",
    "PointerInfo",
    "mem_alloc",
    "mem_free",
    "memcpy_dtod",
    "memcpy_dtoh",
    "memcpy_htod",
    "pointer_info",
    "read_device",
]


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


def _device_of(ptr: int) -> int:
    info = pointer_info(ptr)
    if info is None:
        raise InvalidArgumentError(
            f"address {ptr:#x} is not CUDA memory known to this process", argument="ptr"
        )
    return info.device


# ----------------------------------------------------------------------------------------------------------
# Copies (the bridge's copy-if-needed path, to_device and to_host)
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
