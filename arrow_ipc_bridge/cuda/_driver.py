"""The one place that talks to ``libcuda.so.1``: the lazy loader, the error mapping, argument checks.

The library is opened with ``dlopen`` on first use (cffi ABI mode, nothing compiled against CUDA), so
importing any ``arrow_ipc_bridge.cuda`` module works on a machine with no GPU and no driver (invariant 7).
Every driver call goes through :func:`_check`: a failure raises :class:`~arrow_ipc_bridge.errors.CudaError`
naming the call, the numeric ``CUresult``, the driver's own name and description of it, and a hint where one
helps. CUDA state does not survive ``fork``: a child forked after the driver was initialised here gets a
:class:`CudaError` telling it to use the ``spawn`` start method instead of undefined behaviour.
:class:`_DriverResource` is the base of every object that owns a driver handle.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from types import TracebackType
from typing import Any, Final

from arrow_ipc_bridge._ffi import ffi as _core_ffi
from arrow_ipc_bridge._ffi import lib as _core
from arrow_ipc_bridge.cuda._declarations import (
    CUDA_ERROR_DEINITIALIZED,
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_STUB_LIBRARY,
    CUDA_SUCCESS,
    IPC_HANDLE_SIZE,
    _declared_functions,
    build_ffi,
)
from arrow_ipc_bridge.errors import ClosedError, CudaError, InvalidArgumentError

__all__ = [
    "driver_available",
    "driver_version",
    "load_driver",
]


_UINT64_MAX: Final = (1 << 64) - 1
_DEFAULT_LIBRARY: Final = "libcuda.so.1"
# Lets a test or an unusual install point at another driver library; the default is the driver's soname.
_LIBRARY_ENV: Final = "ARROW_IPC_BRIDGE_LIBCUDA"


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
        # Whether this process's GPUs' UUIDs are in the C core's region table (ordinal_for_uuid).
        self.uuids_resolved = False

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
            # The C core calls the driver itself in its loops (cffi_build/cuda_batch.c) and when it
            # hands out a sync event (sync_event.c): it gets the functions once, here.
            _core.aib_cuda_set_driver(core_driver_table(lib, self.ffi))
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


def core_driver_table(lib: Any, ffi: Any) -> Any:
    """The ``aib_cuda_driver`` table of the driver functions the C core calls, from a loaded ``lib``.

    The one way driver functions reach C: their addresses, handed over once with ``aib_cuda_set_driver``.
    """

    def address(function: Any) -> int:
        return int(ffi.cast("uintptr_t", function))

    return _core_ffi.new(
        "aib_cuda_driver *",
        {
            "event_query": address(lib.cuEventQuery),
            "pointer_get_attributes": address(lib.cuPointerGetAttributes),
            "mem_pool_export_pointer": address(lib.cuMemPoolExportPointer),
            "mem_pool_import_pointer": address(lib.cuMemPoolImportPointer),
            "mem_free": address(lib.cuMemFree_v2),
            "ctx_get_current": address(lib.cuCtxGetCurrent),
            "ctx_push_current": address(lib.cuCtxPushCurrent_v2),
            "ctx_pop_current": address(lib.cuCtxPopCurrent_v2),
            "stream_wait_event": address(lib.cuStreamWaitEvent),
            "event_record": address(lib.cuEventRecord),
        },
    )


_DRIVER = _Driver(os.environ.get(_LIBRARY_ENV, _DEFAULT_LIBRARY))

if hasattr(os, "register_at_fork"):

    def _after_fork_in_child() -> None:
        _DRIVER.reset_after_fork()

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
# Argument conversion (validation happens before any driver call: invariant 1)
# ----------------------------------------------------------------------------------------------------------


def _address(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _UINT64_MAX:
        raise InvalidArgumentError(
            f"{what} must be an integer address in [0, 2**64), got {value!r}", argument=what
        )
    return value


def _nbytes(value: int, what: str = "nbytes", *, allow_zero: bool = True) -> int:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _UINT64_MAX:
        raise InvalidArgumentError(f"{what} must be an integer >= {low}, got {value!r}", argument=what)
    return value


def _handle_bytes(value: bytes | bytearray | memoryview, what: str) -> bytes:
    data = bytes(value)
    if len(data) != IPC_HANDLE_SIZE:
        raise InvalidArgumentError(f"{what} must be {IPC_HANDLE_SIZE} bytes, got {len(data)}", argument=what)
    return data


def _fd(value: int, what: str = "fd") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(
            f"{what} must be a non-negative file descriptor, got {value!r}", argument=what
        )
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
        raise InvalidArgumentError(
            f"not a CUDA stream: {stream!r} (pass an int, or a CuPy/PyTorch stream)", argument="stream"
        )
    return _address(int(value), "stream")


def _set_non_inheritable(fd: int) -> int:
    # fds returned by the driver may lack O_CLOEXEC; they must not leak into unrelated child processes.
    with contextlib.suppress(OSError):
        os.set_inheritable(fd, False)
    return fd


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
            raise ClosedError(f"{type(self).__name__} is closed", what=type(self).__name__)
