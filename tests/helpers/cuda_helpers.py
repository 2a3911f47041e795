"""CUDA driver helpers only the tests use: the current context, device memory info, writing device memory.

They call the driver layer's own checked entry points (``arrow_ipc_bridge.cuda._driver``), so a failure
reads as it would in the library. Import as ``from helpers import cuda_helpers`` (pytest puts ``tests/``
on ``sys.path``).
"""

from __future__ import annotations

from arrow_ipc_bridge.cuda._driver import _address, _api, _check, _lib, _nbytes
from arrow_ipc_bridge.cuda.devices import device_context
from arrow_ipc_bridge.cuda.pointers import _device_of, pointer_info
from arrow_ipc_bridge.errors import InvalidArgumentError

__all__ = ["current_context", "mem_get_info", "memset_d8", "pool_of_pointer", "write_device"]


def current_context() -> int:
    """The calling thread's current ``CUcontext`` as an integer (0 for none)."""
    lib, ffi = _api()
    out = ffi.new("CUcontext *")
    _check("cuCtxGetCurrent", lib.cuCtxGetCurrent(out))
    return int(ffi.cast("uintptr_t", out[0]))


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
        raise InvalidArgumentError(f"value must be a byte (0-255), got {value!r}", argument="value")
    if n == 0:
        return
    lib = _lib()
    with device_context(_device_of(ptr) if device is None else device):
        _check("cuMemsetD8_v2", lib.cuMemsetD8_v2(ptr, value, n))


def pool_of_pointer(ptr: int) -> int:
    """Return the ``CUmemoryPool`` (as an integer) a pointer was allocated from, or 0.

    Parameters
    ----------
    ptr : int
        A device address.
    """
    info = pointer_info(ptr)
    return 0 if info is None else info.mempool
