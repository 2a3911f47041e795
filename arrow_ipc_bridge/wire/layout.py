"""Arrow format strings -> layout rules (buffers, their minimum sizes, children).

The rules live in the C core (``cffi_build/layout.c``), where the describe walk and the message
validator use them; this module exposes the same rules to Python for diagnostics and tests, so
there is one table, not two.

Examples
--------
>>> info = parse_format("+w:3")
>>> info.kind, info.n_buffers, info.n_children, info.fixed_size
('fixed_size_list', 1, 1, 3)
>>> min_buffer_sizes("l", length=10, offset=2)
[2, 96]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from arrow_ipc_bridge._ffi import ffi, lib, new_error, raise_for

__all__ = ["Layout", "parse_format", "min_buffer_sizes"]

_KIND_NAMES = {
    lib.AIB_KIND_NULL: "null",
    lib.AIB_KIND_BOOL: "bool",
    lib.AIB_KIND_FIXED: "fixed_width",
    lib.AIB_KIND_BINARY: "binary",
    lib.AIB_KIND_LARGE_BINARY: "large_binary",
    lib.AIB_KIND_VIEW: "binary_view",
    lib.AIB_KIND_LIST: "list",
    lib.AIB_KIND_LARGE_LIST: "large_list",
    lib.AIB_KIND_LIST_VIEW: "list_view",
    lib.AIB_KIND_LARGE_LIST_VIEW: "large_list_view",
    lib.AIB_KIND_FIXED_LIST: "fixed_size_list",
    lib.AIB_KIND_STRUCT: "struct",
    lib.AIB_KIND_MAP: "map",
    lib.AIB_KIND_DENSE_UNION: "dense_union",
    lib.AIB_KIND_SPARSE_UNION: "sparse_union",
    lib.AIB_KIND_RUN_END: "run_end_encoded",
}


@dataclass(frozen=True)
class Layout:
    """The physical layout of one Arrow format string.

    ``n_buffers`` counts the fixed buffers; a binary/string view has its variadic data buffers in
    addition, between the views and the variadic-sizes buffer. ``n_children`` is -1 for "any"
    (struct). ``bit_width`` is the element width of the data buffer of fixed-width types.
    """

    format: str
    kind: str
    n_buffers: int
    n_children: int
    bit_width: int
    fixed_size: int
    is_integer: bool
    type_ids: tuple[int, ...]


def _parse(fmt: str) -> Any:
    raw = fmt.encode("utf-8")
    out = ffi.new("aib_layout *")
    err = new_error()
    rc = lib.aib_layout_parse(raw, len(raw), out, err)
    if rc:
        raise_for(rc, err, f"parsing format {fmt!r}")
    return out


def parse_format(fmt: str) -> Layout:
    """The layout rules of an Arrow C data interface format string.

    Raises :class:`~arrow_ipc_bridge.errors.UnsupportedFormatError` for strings the bridge does not
    understand.
    """
    c = _parse(fmt)
    return Layout(
        format=fmt,
        kind=_KIND_NAMES[c.kind],
        n_buffers=int(c.n_buffers),
        n_children=int(c.n_children),
        bit_width=int(c.bit_width),
        fixed_size=int(c.fixed_size),
        is_integer=bool(c.is_integer),
        type_ids=tuple(int(c.type_ids[i]) for i in range(c.n_type_ids)),
    )


def min_buffer_sizes(fmt: str, *, length: int, offset: int = 0, n_buffers: int | None = None) -> list[int]:
    """Minimum byte size of each buffer of an array of ``fmt`` with ``length`` and ``offset``.

    Sizes that depend on the data (the character data of strings, variadic view buffers) are 0
    here; the producer reads them from the offsets, and the message carries them.
    """
    layout = _parse(fmt)
    count = n_buffers if n_buffers is not None else int(layout.n_buffers)
    sizes = ffi.new("int64_t[]", max(count, 1))
    err = new_error()
    rc = lib.aib_layout_min_sizes(layout, length, offset, count, sizes, err)
    if rc:
        raise_for(rc, err, f"sizing buffers of {fmt!r}")
    return [int(sizes[i]) for i in range(count)]
