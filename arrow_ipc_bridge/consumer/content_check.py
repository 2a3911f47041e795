"""Checks of buffer *contents* after mapping: the values a reader follows from one buffer into
another (offsets, views, dictionary indices, union type ids and offsets, run ends).

Decoding (``metadata.Decoded``) proves every buffer lies inside its region; it reads no buffer.
A hostile or buggy producer can still send a string column whose offsets point far past its data
buffer, and a reader that trusts them reads out of bounds. These checks run in the C core
(``cffi_build/content_check.c``) once the regions are mapped, before the import is handed out.
``docs/wire-format.md`` ("Content checks") says what each level guarantees:

``"full"``
    every index a reader follows is checked (the default for host data);
``"bounds"``
    O(1) per array: first and last offsets, variadic buffer sizes and the last run end against
    what they index: enough that ``pyarrow``'s ``validate(full=True)`` itself is safe and catches the
    rest;
``"none"``
    structure only, for a producer the consumer trusts (the default for CUDA data, whose contents
    cost a device-to-host read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from arrow_ipc_bridge._ffi import ffi, lib, new_error, raise_for
from arrow_ipc_bridge.runtime import arguments
from arrow_ipc_bridge.wire.metadata import Decoded

__all__ = ["CHECK_LEVELS", "check_code", "check_level", "check_content", "ReadFunction"]

CHECK_LEVELS = ("full", "bounds", "none")
_LEVEL_CODES = {
    "full": int(lib.AIB_CHECK_FULL),
    "bounds": int(lib.AIB_CHECK_BOUNDS),
    "none": int(lib.AIB_CHECK_NONE),
}

# (address, n) -> n bytes read at address (device memory copied to the host)
ReadFunction = Callable[[int, int], bytes]


def check_level(value: object, what: str = "check") -> str:
    """``value`` if it names a level; ``InvalidArgumentError`` for a non-str, ``InvalidArgumentError``
    naming the allowed levels for another string."""
    return arguments.choice(value, what, CHECK_LEVELS)


def check_code(level: str) -> int:
    """The C core's code (``AIB_CHECK_*``) of a level :func:`check_level` accepted."""
    return _LEVEL_CODES[check_level(level)]


def check_content(decoded: Decoded, region_bases: Any, level: str, read: ReadFunction | None = None) -> None:
    """Check ``decoded``'s buffer contents over ``region_bases`` (a ``uint64_t[]`` cdata, as for
    ``rebuild_array``) at ``level``; raises :class:`~arrow_ipc_bridge.errors.ProtocolError`
    naming the column path, the buffer and the bad value.

    ``read`` is None for host mappings (read in place); for device memory it copies ``n`` bytes at
    an address to the host (a test may pass a stand-in over host memory).
    """
    code = check_code(level)
    if code == lib.AIB_CHECK_NONE:
        return
    err = new_error()
    if read is None:
        rc = lib.aib_check_content(
            decoded.raw, region_bases, len(region_bases), code, ffi.NULL, ffi.NULL, err
        )
    else:
        failures: list[BaseException] = []

        def bridge(_ctx: Any, address: int, dst: Any, n: int) -> int:
            try:
                data = read(int(address), int(n))
                if len(data) != n:
                    raise ValueError(f"read {len(data)} bytes where {n} were asked for")
                ffi.memmove(dst, data, n)
                return 0
            except BaseException as exc:  # reported below, after the C call returns
                failures.append(exc)
                return -1

        callback = ffi.callback("aib_read_fn", bridge)
        rc = lib.aib_check_content(
            decoded.raw, region_bases, len(region_bases), code, callback, ffi.NULL, err
        )
        if failures:
            raise failures[0]
    if rc:
        raise_for(rc, err, "checking buffer contents", wire=rc == lib.AIB_E_WIRE)


def cuda_reader(device: int) -> ReadFunction:
    """A read function over CUDA device memory of ``device`` (synchronous device-to-host copies)."""
    from arrow_ipc_bridge.cuda.pointers import read_device

    def read(address: int, n: int) -> bytes:
        return read_device(address, n, device=device)

    return read
