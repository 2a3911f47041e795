"""Planning the staging of a device import: which device bytes each chunk copies.

A chunk is one record batch of the import, or a slice of rows of a batch larger than
``chunk_bytes`` whose columns are all fixed-width (numbers, booleans, temporal types, decimals,
fixed-size binary; other batches are staged whole). :class:`ChunkPlanner` reads only the message
and the structs the C core rebuilds over the device addresses, never the device memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from arrow_ipc_bridge._ffi import ffi
from arrow_ipc_bridge.consumer.imported import message_schema
from arrow_ipc_bridge.wire.capsules import new_capsule
from arrow_ipc_bridge.wire.metadata import SLOT_FIRST_REGION, Decoded

__all__ = ["ADDRESS_MOD", "Chunk", "ChunkPlanner", "FixedWidthColumn", "aligned", "column_ranges"]

ALIGN = 64  # each copied buffer starts 64-byte aligned, as Arrow recommends
ADDRESS_MOD = 1 << 64  # the C rebuild adds offsets to bases modulo 2**64


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class FixedWidthColumn:
    """A fixed-width column of a batch, as the device struct describes it."""

    type: pa.DataType
    bit_width: int
    first_row: int  # the column's row of the batch's row 0 (struct and child offsets)
    null_count: int
    validity: int  # device address, 0 when the column has no nulls
    data: int
    validity_limit: int  # bytes readable at validity / data (from the message's buffer lengths)
    data_limit: int


@dataclass
class Chunk:
    batch: int
    nbytes: int
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # whole batch: region -> (lo, hi)
    rows: tuple[int, int] | None = None  # a slice of rows of `columns`
    columns: list[FixedWidthColumn] | None = None


def _buffer_addresses(array: Any) -> list[int]:
    """The non-null buffer addresses of a rebuilt ``ArrowArray`` tree (children, dictionaries)."""
    found = []
    stack = [array]
    while stack:
        node = stack.pop()
        for i in range(node.n_buffers):
            if node.buffers[i] != ffi.NULL:
                found.append(int(ffi.cast("uintptr_t", node.buffers[i])))
        stack.extend(node.children[i] for i in range(node.n_children))
        if node.dictionary != ffi.NULL:
            stack.append(node.dictionary)
    return found


def _fixed_width(dtype: pa.DataType) -> int | None:
    """The bit width of a type a slice of rows can be copied of as byte ranges, else None."""
    if pa.types.is_dictionary(dtype) or isinstance(dtype, pa.ExtensionType) or pa.types.is_null(dtype):
        return None
    if pa.types.is_boolean(dtype):
        return 1
    try:
        width = int(dtype.bit_width)
    except (ValueError, AttributeError):
        return None
    return width if width % 8 == 0 and width > 0 else None


class ChunkPlanner:
    """Splits a device import into chunks, reading only the message and the rebuilt structs."""

    def __init__(self, decoded: Decoded, bases: Any, chunk_bytes: int) -> None:
        self._decoded = decoded
        self._bases = bases
        self._chunk_bytes = chunk_bytes
        self.schema = message_schema(decoded)
        capsule, out = new_capsule("schema")
        decoded.rebuild_schema(out)
        self.root_is_struct = ffi.string(out.format) == b"+s"
        del capsule
        # Every buffer of the message by its device address: (region, offset, length).
        self.refs: dict[int, tuple[int, int, int]] = {}
        for code, offset, length in decoded.buffer_refs():
            if code >= SLOT_FIRST_REGION and length:
                region = code - SLOT_FIRST_REGION
                address = (int(bases[region]) + offset) % ADDRESS_MOD
                known = self.refs.get(address)
                if known is None or known[2] < length:
                    self.refs[address] = (region, offset, length)

    def chunks(self) -> Iterator[Chunk]:
        for batch in range(self._decoded.batch_count):
            capsule, root = new_capsule("array")  # the capsule releases the rebuilt structs
            self._decoded.rebuild_array(batch, self._bases, root)
            yield from self._batch_chunks(batch, root)
            del capsule

    def _batch_chunks(self, batch: int, root: Any) -> Iterator[Chunk]:
        spans: dict[int, tuple[int, int]] = {}
        for address in _buffer_addresses(root):
            ref = self.refs.get(address)
            if ref is None:
                continue  # an empty buffer: nothing to copy
            region, offset, length = ref
            lo, hi = spans.get(region, (offset, offset + length))
            spans[region] = (min(lo, offset), max(hi, offset + length))
        nbytes = sum(aligned(hi - lo) for lo, hi in spans.values())
        columns = self._columns(root) if nbytes > self._chunk_bytes else None
        if columns is None or int(root.length) <= 8:
            yield Chunk(batch, nbytes, spans=spans)
            return
        bits_per_row = sum(c.bit_width + (1 if c.validity else 0) for c in columns)
        slack = len(columns) * 2 * (ALIGN + 1)  # alignment and partial bytes per buffer
        rows = max(8, ((self._chunk_bytes - slack) * 8 // max(bits_per_row, 1)) // 8 * 8)
        length = int(root.length)
        for start in range(0, length, rows):
            stop = min(length, start + rows)
            size = sum(aligned(n) for c in columns for _, n in column_ranges(c, start, stop))
            yield Chunk(batch, size, rows=(start, stop), columns=columns)

    def _columns(self, root: Any) -> list[FixedWidthColumn] | None:
        """The batch's columns when every one can be sliced by rows, else None."""
        if not self.root_is_struct or len(self.schema) != root.n_children:
            return None
        if root.null_count != 0 or root.dictionary != ffi.NULL:
            return None
        columns = []
        for i, schema_field in enumerate(self.schema):
            width = _fixed_width(schema_field.type)
            child = root.children[i]
            if width is None or child.n_buffers != 2 or child.n_children or child.dictionary != ffi.NULL:
                return None
            validity = int(ffi.cast("uintptr_t", child.buffers[0])) if child.null_count != 0 else 0
            data = int(ffi.cast("uintptr_t", child.buffers[1]))
            columns.append(
                FixedWidthColumn(
                    type=schema_field.type,
                    bit_width=width,
                    first_row=int(root.offset) + int(child.offset),
                    null_count=int(child.null_count),
                    validity=validity,
                    data=data,
                    validity_limit=self.refs.get(validity, (0, 0, 0))[2] if validity else 0,
                    data_limit=self.refs.get(data, (0, 0, 0))[2],
                )
            )
        return columns


def column_ranges(column: FixedWidthColumn, start: int, stop: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` from the column's validity and data addresses for rows [start, stop):
    from the byte holding the first row's bit, so the slice keeps an offset below 8."""
    first = column.first_row + start
    end = column.first_row + stop
    row0 = first - first % 8
    bitmap = (row0 // 8, (end + 7) // 8 - row0 // 8)
    ranges = [bitmap] if column.validity else [(0, 0)]
    if column.bit_width == 1:
        ranges.append(bitmap)
    else:
        width = column.bit_width // 8
        ranges.append((row0 * width, (end - row0) * width))
    return ranges
