"""The one importer of the compiled C core.

Everything else does ``from arrow_ipc_bridge._ffi import ffi, lib``. At import we check that the core
was compiled from this package version: a stale in-place build fails loudly here instead of
misbehaving later. ``raise_for`` turns the core's error codes into the package's exceptions.

This is also the one way Python objects cross into the core. cffi passes C values only, so what takes
or returns Python objects (every PyCapsule: made, read, destroyed) is C in ``cffi_build/py_capsules.c``
that the core installs here at import as builtin functions (``aib_py_install``); ``wire/capsules.py`` and
``arrays/device.py`` and ``arrays/columns.py`` call them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from arrow_ipc_bridge._version import __version__
from arrow_ipc_bridge.errors import (
    BridgeError,
    BuildMismatchError,
    ClosedError,
    ProtocolError,
    UnsupportedFormatError,
)

try:
    from arrow_ipc_bridge._bridge_core import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise BuildMismatchError(
        f"the arrow_ipc_bridge C core is not built ({exc}); run `pip install .` "
        "or `python setup.py build_ext --inplace` in the source tree"
    ) from exc

_core_version = ffi.string(lib.aib_core_version()).decode()
if _core_version != __version__:  # pragma: no cover - only with a stale build
    raise BuildMismatchError(
        f"the compiled C core is version {_core_version} but the package is {__version__}: "
        "rebuild it (`pip install .` or `python setup.py build_ext --inplace`)"
    )

WIRE_VERSION = (lib.aib_wire_version() >> 16, lib.aib_wire_version() & 0xFFFF)

# Installed by the core just below (py_capsules.c says what each does; bridge.h lists them).
new_struct_capsule: Callable[[int], tuple[object, int]]
capsule_address: tuple[Callable[[object], int], ...]  # indexed by lib.AIB_CAPSULE_*
capsule_name: Callable[[object], bytes | None]
device_array_capsules: Callable[[int], tuple[object, object] | None]
array_capsules: Callable[[int], tuple[object, object] | None]
dlpack_capsule: Callable[[int, int, int, int, int, int, int], object]
# (owner, bases, n_bases, device_type, device_id, sync_slot, batch, form, select, waiter)
#   -> (lease, event, ((name, numeric, length, null_count, item), ...), is_record_batch), or why not (str)
_BatchColumns = tuple[object, int, tuple[tuple[str, int, int, int, Any] | None, ...], bool]
batch_columns: Callable[..., _BatchColumns | str]
DLPackColumn: type  # what batch_columns hands out for DLPack consumers (columns.ColumnView wraps it)
# py_columns.c (from_cuda_arrays): (values, n, cupy_type) -> (columns read, aib_cuda_column[n] as bytes,
# why the next was not read (a READ_* code), the offending value or None)
read_cuda_columns: Callable[[list[Any], int, type | None], tuple[int, bytes, int, Any]]
# py_local_get.c: a session's local re-gets in one builtin call (consumer/session.py makes one per session).
LocalGetter: type
# py_state.c: the C base types whose slots hold a Decoded's, an imported object's and a remembered
# message's attributes (C fills them by offset). Their subclasses annotate the slots they use; to
# the type checker the bases are plain classes.
if TYPE_CHECKING:

    class DecodedState: ...

    class ImportState: ...

    class RememberedState:
        def __init__(self, *args: Any) -> None: ...

        # A new import of the message: a Decoded sharing its template over owner, and an object of
        # its imported class over that (py_state.c, aib_py_remembered_import).
        def adopt(self, owner: Any, sync: Any, name: str | None, owner_address: int) -> Any: ...


if (
    lib.aib_py_install(__name__.encode()) != 0
    or lib.aib_py_install_columns(__name__.encode()) != 0
    or lib.aib_py_install_state(__name__.encode()) != 0
    or lib.aib_py_install_local_get(__name__.encode()) != 0
):
    raise BuildMismatchError(  # pragma: no cover - only out of memory
        "the C core could not install its Python functions (the error is printed above)"
    )

__all__ = [
    "ffi",
    "lib",
    "new_error",
    "raise_for",
    "WIRE_VERSION",
    "new_struct_capsule",
    "capsule_address",
    "capsule_name",
    "device_array_capsules",
    "array_capsules",
    "dlpack_capsule",
    "batch_columns",
    "DLPackColumn",
    "read_cuda_columns",
    "LocalGetter",
    "DecodedState",
    "ImportState",
    "RememberedState",
]


def new_error() -> Any:
    """A zeroed ``aib_error`` for one C call."""
    return ffi.new("aib_error *")


def raise_for(code: int, err: Any, what: str, *, wire: bool = False) -> NoReturn:
    """Raise the package exception for a failed core call.

    Parameters
    ----------
    code
        The core's return code (non-zero).
    err
        The ``aib_error`` the call filled in.
    what
        What was being done, for the message ("decoding a message").
    wire
        The input came from another process: every failure is a ``ProtocolError``.
    """
    message = ffi.string(err.message).decode("utf-8", "replace")
    field = ffi.string(err.field).decode("utf-8", "replace")
    path = ffi.string(err.path).decode("utf-8", "replace")
    where = f" at {path}" if path else ""
    text = f"{what} failed{where}: {message}" + (f" (field {field})" if field else "")
    if code == lib.AIB_E_NOMEM:
        raise MemoryError(text)
    if wire or code in (lib.AIB_E_WIRE, lib.AIB_E_LIMIT):
        raise ProtocolError(text, field=field, path=path, code=code)
    if code == lib.AIB_E_FORMAT:
        raise UnsupportedFormatError(text, field=field, path=path, code=code)
    if code == lib.AIB_E_RELEASED:
        raise ClosedError(text, reason="released")
    raise BridgeError(text, field=field, path=path, code=code)
