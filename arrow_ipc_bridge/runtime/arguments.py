"""Argument checks at the public API's boundary, one rule per kind of argument.

Every public function checks its arguments here before it does anything, so that a bad value is a
clear error naming the argument and what it allows instead of a failure deep inside (``'int' object
has no attribute 'encode'``) or, worse, a silent misreading. A value of the wrong type raises
:class:`~arrow_ipc_bridge.errors.InvalidArgumentError` (a ``TypeError``), a value of the right type that
is not allowed :class:`~arrow_ipc_bridge.errors.InvalidArgumentError` (a ``ValueError``); both are
:class:`~arrow_ipc_bridge.errors.BridgeError` with ``argument`` set.

The rules, the same everywhere:

- a bool is never a number (``True`` is an ``int`` to Python, but ``timeout=True`` is a mistake);
- numbers of seconds are finite and not NaN; ``None`` only where a function documents it (no limit);
- choices given as strings must be one of the listed strings, exactly;
- counts and limits are ints (``numpy`` integers too), not floats that happen to be whole.

The common types are tested first with ``type(x) is ...`` so the checks on hot paths (``publish``,
``Session.get``) cost one type comparison per argument; the rarer forms (NumPy scalars,
``os.PathLike``) are handled on the slower path only when the fast test fails.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Mapping, Sequence
from typing import NoReturn, SupportsIndex, cast

from arrow_ipc_bridge.errors import InvalidArgumentError

__all__ = [
    "boolean",
    "byte_string",
    "choice",
    "count",
    "device_ordinal",
    "fail_type",
    "fail_value",
    "name",
    "optional_name",
    "path",
    "optional_seconds",
    "seconds",
    "stream_handle",
    "refuse_removed",
]


def fail_type(what: str, allowed: str, value: object) -> NoReturn:
    """Raise the type error for argument ``what``: ``allowed`` says what it takes."""
    raise InvalidArgumentError(f"{what} must be {allowed}, not {type(value).__name__}", argument=what)


def fail_value(what: str, allowed: str, value: object) -> NoReturn:
    """Raise the value error for argument ``what``: ``allowed`` says what it takes."""
    raise InvalidArgumentError(f"{what} must be {allowed}, not {value!r}", argument=what)


def name(value: object, what: str, max_bytes: int) -> bytes:
    """A name (published object, stream): a ``str`` of 1 to ``max_bytes`` UTF-8 bytes; its bytes."""
    allowed = f"a str of 1 to {max_bytes} UTF-8 bytes"
    if type(value) is not str and not isinstance(value, str):
        fail_type(what, allowed, value)
    try:
        raw = value.encode()
    except UnicodeEncodeError:  # a lone surrogate cannot be sent as UTF-8
        fail_value(what, allowed + " (this one has a character UTF-8 cannot encode)", value)
    if not raw or len(raw) > max_bytes:
        fail_value(what, allowed, value if len(value) <= 80 else f"{value[:40]}...({len(raw)} bytes)")
    return raw


def optional_name(value: object, what: str, max_bytes: int) -> str | None:
    """None, or a name as :func:`name` takes it."""
    if value is None:
        return None
    name(value, what, max_bytes)
    assert isinstance(value, str)
    return value


def optional_seconds(value: object, what: str, *, maximum: float = math.inf) -> float | None:
    """None (no limit), or a duration as :func:`seconds` takes it."""
    if value is None:
        return None
    return _seconds(value, what, none=True, positive=False, maximum=maximum)


def seconds(value: object, what: str, *, positive: bool = False, maximum: float = math.inf) -> float:
    """A duration in seconds: an int or float (not a bool; NumPy floats too), finite, ``>= 0``
    (``> 0`` with ``positive``) and at most ``maximum``."""
    return _seconds(value, what, none=False, positive=positive, maximum=maximum)


def _seconds(value: object, what: str, *, none: bool, positive: bool, maximum: float) -> float:
    kind = type(value)
    if kind is float or kind is int:
        number = float(value)  # type: ignore[arg-type]  # an int or a float, tested just above
    elif kind is not bool and isinstance(value, numbers.Real):
        number = float(value)  # NumPy scalars, fractions, subclasses of int and float
    else:
        fail_type(what, _seconds_text(none, positive, maximum), value)
    # NaN fails every comparison, so it is refused with the negative numbers.
    if not (number > 0 if positive else number >= 0) or not number <= maximum or number == math.inf:
        fail_value(what, _seconds_text(none, positive, maximum), value)
    return number


def _seconds_text(none: bool, positive: bool, maximum: float) -> str:
    low = "> 0" if positive else ">= 0"
    high = f" and <= {maximum:.0f}" if maximum != math.inf else ", finite"
    return f"a number of seconds {low}{high}" + (" or None (no limit)" if none else "")


def count(value: object, what: str, *, least: int = 0, most: int | None = None) -> int:
    """An int (not a bool; NumPy integers too) from ``least`` to ``most`` (None: no upper bound)."""
    if type(value) is int:
        number = value
    elif isinstance(value, bool) or not hasattr(type(value), "__index__"):
        fail_type(what, _count_text(least, most), value)
    else:
        number = operator.index(cast(SupportsIndex, value))  # has __index__, tested above
    if number < least or (most is not None and number > most):
        fail_value(what, _count_text(least, most), value)
    return number


def _count_text(least: int, most: int | None) -> str:
    return f"an int from {least} to {most}" if most is not None else f"an int >= {least}"


def device_ordinal(value: object, what: str = "device") -> int:
    """A CUDA device ordinal: an int >= 0 (whether that device exists is the driver's to say)."""
    return count(value, what, least=0)


def choice(value: object, what: str, allowed: Sequence[str]) -> str:
    """One of the strings ``allowed``, exactly."""
    if type(value) is str and value in allowed:
        return value
    text = "one of " + ", ".join(repr(a) for a in allowed)
    if not isinstance(value, str):
        fail_type(what, text, value)
    fail_value(what, text, value)


def boolean(value: object, what: str) -> bool:
    """``True`` or ``False`` (not 0, 1 or any other truthy object)."""
    if value is True or value is False:
        return value
    fail_type(what, "a bool", value)


def path(value: object, what: str = "path") -> str:
    """A filesystem path: a ``str`` or ``os.PathLike`` of ``str``, not empty, without NUL bytes."""
    allowed = "a non-empty path (str or os.PathLike) without NUL characters"
    if type(value) is not str:
        if not isinstance(value, str | os.PathLike):
            fail_type(what, allowed, value)
        value = os.fspath(value)
        if not isinstance(value, str):  # a PathLike of bytes
            fail_type(what, allowed, value)
    if not value or "\0" in value:
        fail_value(what, allowed, value)
    return value


def byte_string(value: object, what: str, *, max_bytes: int | None = None) -> bytes:
    """Bytes: ``bytes``, ``bytearray`` or a C-contiguous ``memoryview`` (copied to ``bytes``), at
    most ``max_bytes`` long."""
    if type(value) is not bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            fail_type(what, "bytes (or bytearray, memoryview)", value)
        value = bytes(value)
    if max_bytes is not None and len(value) > max_bytes:
        fail_value(what, f"at most {max_bytes} bytes", f"{len(value)} bytes")
    return value


def stream_handle(value: object, what: str = "stream") -> int | None:
    """None, or a CUDA stream handle as an int >= 0 (``cupy.cuda.Stream.ptr``,
    ``torch.cuda.Stream.cuda_stream``; 0 is the legacy default stream)."""
    if value is None:
        return None
    return count(value, what, least=0)


def refuse_removed(options: Mapping[str, object], where: str) -> None:
    """TypeError for keyword arguments ``where`` does not take, naming the replacement of a removed
    one: a caller of the old surface learns what to do instead of meeting a bare unknown name."""
    if "standing_leases" in options:
        raise TypeError(
            f"{where} no longer takes standing_leases: standing leases are the default "
            "(docs/lifetime.md, 5b); pass pool_linger=0 to keep no lease (every get asks the "
            "publisher, every release gives its lease back at once)"
        )
    if options:
        raise TypeError(f"{where} got unexpected keyword arguments {sorted(options)}")
