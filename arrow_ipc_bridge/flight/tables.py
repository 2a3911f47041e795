"""Imported objects as what Flight sends: a schema and record batches.

Flight streams record batches of one schema. A published table or stream is that already; a record
batch (a struct root) becomes one batch; any other array becomes a one-column batch named after the
array's field. Host data is not copied: the pyarrow objects are built over the session's mappings,
and each holds the publication's lease until gRPC has sent it and dropped it. Device data is copied
to the host first (``staging.py``).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from arrow_ipc_bridge.imported import ImportedArray, ImportedStream, to_host

__all__ = ["STRUCT_ROOT", "as_table", "flight_schema", "host_table"]

STRUCT_ROOT = "+s"


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
    """Host data as a table over the session's mappings (no copy); device data copied to host."""
    if imported.device != "cpu":
        return as_table(to_host(imported), _root_field(imported))
    if isinstance(imported, ImportedStream):
        return pa.table(imported)
    return as_table(pa.array(imported), _root_field(imported))


def flight_schema(imported: ImportedArray | ImportedStream) -> pa.Schema:
    """The schema Flight clients get for ``imported``, read from its message (no buffer read)."""
    if isinstance(imported, ImportedStream) or imported.root_format == STRUCT_ROOT:
        schema: Any = imported.schema
        return schema
    return pa.schema([_root_field(imported)])


def _root_field(imported: ImportedArray | ImportedStream) -> pa.Field:
    field: pa.Field = imported.schema.field(0)
    return field
