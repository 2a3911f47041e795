"""Imported objects as what Flight sends: a schema and record batches.

Flight streams record batches of one schema. A published table or stream is that already; a record
batch (a struct root) becomes one batch; any other array becomes a one-column batch named after the
array's field. Host data is not copied: the pyarrow objects are built over the session's mappings,
and each holds the publication's lease until gRPC has sent it and dropped it. Device data is copied
to the host first (``staging.py``).

pyarrow's IPC writer, which gRPC's sender uses, cannot write an empty array that starts past offset
0 when it was imported over the C Data Interface, as every import is (pyarrow gives such an array
0-byte buffers and its writer then slices them at a negative length: a negative body length, or
``sendmsg`` failing with EINVAL; ``docs/flight.md``, "Empty slices"). Columns holding one are
rebuilt over the same buffers before they are sent (``sendable``).

Arrow IPC cannot describe a dictionary whose values are themselves a dictionary: a schema field
carries one dictionary encoding and its type cannot be a dictionary, so pyarrow's writer drops the
inner encoding and its reader reads the inner dictionary's indices as the values (wrong values, or
an error). ``nested_dictionary`` finds such a column so that the front refuses it before sending
(``unsendable`` says why).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream, to_host

__all__ = [
    "STRUCT_ROOT",
    "as_table",
    "flight_schema",
    "host_table",
    "nested_dictionary",
    "sendable",
    "unsendable",
]

STRUCT_ROOT = "+s"

# Arrays whose one child is ``.values`` (maps are lists); list views came with pyarrow 16.
_LIST_ARRAYS: tuple[Any, ...] = tuple(
    getattr(pa, name)
    for name in ("ListArray", "LargeListArray", "FixedSizeListArray", "ListViewArray", "LargeListViewArray")
    if hasattr(pa, name)
)


def as_table(obj: pa.Table | pa.RecordBatch | pa.Array, field: pa.Field) -> pa.Table:
    """``obj`` as a table: batches stay batches, a struct array's fields become columns (a null
    struct slot makes null children, as Arrow's flattening does), any other array one column
    described by ``field``."""
    if isinstance(obj, pa.Table):
        return obj
    if isinstance(obj, pa.RecordBatch):
        return pa.Table.from_batches([obj])
    if isinstance(obj, pa.StructArray):
        return pa.Table.from_batches([pa.RecordBatch.from_struct_array(obj)])
    return pa.Table.from_batches([pa.record_batch([obj], schema=pa.schema([field]))])


def host_table(imported: ImportedArray | ImportedStream) -> pa.Table:
    """Host data as a table over the session's mappings (no copy); device data copied to host.
    Either is passed through ``sendable``."""
    if imported.device != "cpu":
        return sendable(as_table(to_host(imported), _root_field(imported)))
    if isinstance(imported, ImportedStream):
        return sendable(pa.table(imported))
    return sendable(as_table(pa.array(imported), _root_field(imported)))


def sendable(table: pa.Table) -> pa.Table:
    """``table`` with each chunk that holds an empty slice past offset 0 (anywhere in its tree)
    rebuilt so that pyarrow's IPC writer writes it intact; everything else is left as it is.

    The rebuilt chunks hold the same values over the same buffers (no data copied): only the empty
    nodes are new, empty arrays at offset 0, and the nodes above them are rebuilt around them (a
    struct with nulls gets a new validity bitmap).
    """
    columns = list(table.columns)
    changed = False
    for i, column in enumerate(columns):
        if not any(_holds_empty_slice(chunk) for chunk in column.chunks):
            continue
        columns[i] = pa.chunked_array([_mended(chunk) for chunk in column.chunks], type=column.type)
        changed = True
    if not changed:
        return table
    return pa.Table.from_arrays(columns, schema=table.schema)


def _mended(array: pa.Array) -> pa.Array:
    """``array``, or an equal array over the same buffers whose empty nodes start at offset 0."""
    if not _holds_empty_slice(array):
        return array
    kind = array.type
    if isinstance(array, pa.DictionaryArray):  # the dictionary is kept: it is part of the value
        indices = array.indices if len(array) else pa.array([], kind.index_type)
        dictionary = _mended(array.dictionary)
        return pa.DictionaryArray.from_arrays(indices, dictionary, ordered=kind.ordered, safe=False)
    if len(array) == 0:  # nothing of it is read: any empty array of its type is equal to it
        return _empty(kind)
    if isinstance(array, pa.ExtensionArray):
        return pa.ExtensionArray.from_storage(kind, _mended(array.storage))
    children = [_mended(child) for child in _children(array)]
    if isinstance(array, pa.StructArray):  # its fields as the writer sees them: sliced to the struct
        mask = array.is_null() if array.null_count else None
        return pa.StructArray.from_arrays(children, fields=list(kind), mask=mask)
    buffers = array.buffers()
    if isinstance(array, pa.UnionArray) and kind.mode == "sparse":  # fields sliced to the union
        type_ids = buffers[1].slice(array.offset, len(array))
        return pa.Array.from_buffers(kind, len(array), [None, type_ids], 0, 0, children)
    # Children whole (list values, dense union fields, run ends and values): the node's own
    # buffers and offset stay. buffers() lists a node's own buffers first, then its children's.
    own = len(buffers) - sum(len(child.buffers()) for child in _children(array))
    return pa.Array.from_buffers(kind, len(array), buffers[:own], array.null_count, array.offset, children)


def _empty(kind: pa.DataType) -> pa.Array:
    """An empty array of ``kind``, every node at offset 0. Built node by node: ``pa.nulls`` gives a
    run-end encoded child a validity bitmap, which makes its parent invalid."""
    if isinstance(kind, pa.BaseExtensionType):  # Python-defined and C++ (canonical) ones
        return pa.ExtensionArray.from_storage(kind, _empty(kind.storage_type))
    if pa.types.is_run_end_encoded(kind):
        run_ends = pa.array([], kind.run_end_type)
        return pa.RunEndEncodedArray.from_arrays(run_ends, _empty(kind.value_type), type=kind)
    template = pa.nulls(0, kind)
    if kind.num_fields == 0:
        return template
    children = [_empty(kind.field(i).type) for i in range(kind.num_fields)]
    buffers = template.buffers()
    own = len(buffers) - sum(len(child.buffers()) for child in _children(template))
    return pa.Array.from_buffers(kind, 0, buffers[:own], 0, 0, children)


def _holds_empty_slice(array: pa.Array) -> bool:
    """Whether a node of ``array`` is empty and starts past offset 0 (what pyarrow's IPC writer
    slices at a negative length once the node came through the C Data Interface)."""
    if len(array) == 0 and array.offset > 0:
        return True
    # A non-empty node's own buffers reach its offset; nodes below it may be empty.
    return any(_holds_empty_slice(child) for child in _children(array))


def _children(array: pa.Array) -> list[pa.Array]:
    """The arrays the IPC writer visits below ``array`` (list values whole, as the writer slices
    them itself; struct and union fields as the writer gets them)."""
    if isinstance(array, pa.ExtensionArray):
        return [array.storage]
    if isinstance(array, pa.DictionaryArray):
        return [array.dictionary]  # the indices share the array's offset and length
    if isinstance(array, (pa.StructArray, pa.UnionArray)):
        return [array.field(i) for i in range(array.type.num_fields)]
    if isinstance(array, pa.RunEndEncodedArray):
        return [array.run_ends, array.values]
    if isinstance(array, _LIST_ARRAYS):
        return [array.values]
    return []


def nested_dictionary(schema: pa.Schema) -> tuple[str, pa.DataType] | None:
    """The first column, by path (``"s.d"`` for field ``d`` of struct column ``s``, ``"l.item"``
    for a list's values), whose type is a dictionary whose values are a dictionary (extension types
    looked through: their storage is what IPC writes), and that column's type; None when there is
    none. Such a column cannot cross Arrow IPC, so not Flight (module docstring): pyarrow's reader
    gets one dictionary holding the inner dictionary's indices as values. A dictionary whose values
    *hold* a dictionary further down (a list or struct of dictionaries) is carried intact."""
    for column in schema:
        found = _nested_dictionary(column.type, column.name)
        if found is not None:
            return found
    return None


def unsendable(name: str, schema: pa.Schema) -> str | None:
    """Why ``name``, of ``schema``, cannot be sent over Flight, or None when it can. Found from the
    schema alone, before anything is sent: a client must not get wrong values."""
    found = nested_dictionary(schema)
    if found is None:
        return None
    path, dtype = found
    return (
        f"column {path[:200]!r} of {name!r} is a dictionary whose values are a dictionary "
        f"({str(dtype)[:300]}): Arrow IPC, which Flight sends, cannot carry it (pyarrow reads it "
        "back as one dictionary of wrong values); publish its values decoded to serve it over Flight"
    )


def _storage(dtype: pa.DataType) -> pa.DataType:
    while isinstance(dtype, pa.BaseExtensionType):
        dtype = dtype.storage_type
    return dtype


def _nested_dictionary(dtype: pa.DataType, path: str) -> tuple[str, pa.DataType] | None:
    storage = _storage(dtype)
    if pa.types.is_dictionary(storage):
        if pa.types.is_dictionary(_storage(storage.value_type)):
            return path, dtype
        return _nested_dictionary(storage.value_type, path)  # the values are the column's values
    for i in range(storage.num_fields):  # struct, union and run-end fields; list and map values
        child = storage.field(i)
        found = _nested_dictionary(child.type, f"{path}.{child.name}")
        if found is not None:
            return found
    return None


def flight_schema(imported: ImportedArray | ImportedStream) -> pa.Schema:
    """The schema Flight clients get for ``imported``, read from its message (no buffer read)."""
    if isinstance(imported, ImportedStream) or imported.root_format == STRUCT_ROOT:
        schema: Any = imported.schema
        return schema
    return pa.schema([_root_field(imported)])


def _root_field(imported: ImportedArray | ImportedStream) -> pa.Field:
    field: pa.Field = imported.schema.field(0)
    return field
