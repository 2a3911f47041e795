"""The one importer of the compiled C core.

Everything else does ``from arrow_ipc_bridge._ffi import ffi, lib``. At import we check that the core
was compiled from this package version: a stale in-place build fails loudly here instead of
misbehaving later. ``raise_for`` turns the core's error codes into the package's exceptions.
"""

from __future__ import annotations

from typing import Any, NoReturn

from arrow_ipc_bridge._version import __version__
from arrow_ipc_bridge.errors import (
    BridgeError,
    BuildMismatchError,
    ReleasedError,
    UnsupportedFormatError,
    WireFormatError,
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

__all__ = ["ffi", "lib", "new_error", "raise_for", "WIRE_VERSION"]


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
        The input came from another process: every failure is a ``WireFormatError``.
    """
    message = ffi.string(err.message).decode("utf-8", "replace")
    field = ffi.string(err.field).decode("utf-8", "replace")
    path = ffi.string(err.path).decode("utf-8", "replace")
    where = f" at {path}" if path else ""
    text = f"{what} failed{where}: {message}" + (f" (field {field})" if field else "")
    if code == lib.AIB_E_NOMEM:
        raise MemoryError(text)
    if wire or code in (lib.AIB_E_WIRE, lib.AIB_E_LIMIT):
        raise WireFormatError(text, field=field, path=path, code=code)
    if code == lib.AIB_E_FORMAT:
        raise UnsupportedFormatError(text, field=field, path=path, code=code)
    if code == lib.AIB_E_RELEASED:
        raise ReleasedError(text)
    raise BridgeError(text, field=field, path=path, code=code)
