"""CUDA devices and their primary contexts: ordinals, UUIDs (the identity that crosses processes).

The bridge only ever uses each device's *primary* context -- the one the CUDA runtime, CuPy and PyTorch use
-- retained once per device and cached. :func:`device_context` pushes it for the calling thread and pops it
afterwards, so the caller's current context is always restored.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from arrow_ipc_bridge._ffi import ffi as _core_ffi
from arrow_ipc_bridge._ffi import lib as _core
from arrow_ipc_bridge.cuda._declarations import (
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES,
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_SUCCESS,
    UUID_SIZE,
)
from arrow_ipc_bridge.cuda._driver import (
    _DRIVER,
    _api,
    _check,
    _lib,
    _usable_in_this_process,
)
from arrow_ipc_bridge.errors import CudaError, InvalidArgumentError, ProtocolError

__all__ = [
    "DeviceCapabilities",
    "device_attribute",
    "device_capabilities",
    "device_context",
    "device_count",
    "device_name",
    "device_uuid",
    "format_uuid",
    "ordinal_for_uuid",
    "synchronize",
]


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
        raise InvalidArgumentError(f"a device UUID has {UUID_SIZE} bytes, got {len(uuid)}", argument="uuid")
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
    ProtocolError
        ``uuid`` is not 16 bytes.
    CudaError
        The device is not visible here (``reason="not_visible"``; ``uuid`` and ``visible`` are attached):
        another ``CUDA_VISIBLE_DEVICES``, a container without that GPU, or another host.
    """
    uuid = bytes(uuid)
    if len(uuid) != UUID_SIZE:  # it came in a message: bad data from the peer
        raise ProtocolError(f"a device UUID has {UUID_SIZE} bytes, got {len(uuid)}", field="uuid")
    if not _DRIVER.uuids_resolved or not _usable_in_this_process():
        # Every visible GPU goes into the C core's region table, the one record of UUID -> ordinal,
        # which its get path resolves a message's GPU by too.
        for index in range(device_count()):
            known = device_uuid(index)
            if _core.aib_regions_put(
                _core.AIB_REGION_KEY_DEVICE, known, len(known), index, _core_ffi.NULL, 0
            ):
                raise MemoryError("recording a GPU's UUID")
        with _DRIVER.lock:
            _DRIVER.uuids_resolved = True
    found = _core_ffi.new("uint64_t *")
    if not _core.aib_regions_find(_core.AIB_REGION_KEY_DEVICE, uuid, len(uuid), found, _core_ffi.NULL):
        visible = [format_uuid(device_uuid(i)) for i in range(device_count())]
        raise CudaError(
            f"GPU {format_uuid(uuid)} is not visible to this process, which sees {visible or 'no GPU'} "
            f"({_visible_devices_note()}); producer and consumer must share the GPU",
            uuid=format_uuid(uuid),
            visible=visible,
            reason="not_visible",
        )
    return int(found[0])


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
