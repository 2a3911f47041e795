"""Strict comparison of Arrow data for the tests: ``assert_arrays_equal``.

Import from tests as ``from helpers.arrow_equality import assert_arrays_equal``.
``assert_arrays_equal(actual, expected, *, check_metadata=True)`` compares arrays / chunked arrays /
record batches / tables (types, field names, nullability and metadata, then logical values), and
names the path of the first difference; see its docstring. pyarrow's ``UnionArray.type_codes`` and
``.offsets`` ignore the array's offset, so it reads union buffers itself.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import pyarrow as pa

from helpers.arrow_types import (
    BINARY_KINDS,
    EXTENSION_KINDS,
    FLOAT_KINDS,
    NESTED_KINDS,
    OPT_IN_KINDS,
    PRIMITIVE_KINDS,
    TEMPORAL_KINDS,
    child_fields,
    kind_of,
    kinds_in,
    reinterpret,
    substitute,
)

__all__ = [
    "assert_arrays_equal",
]

# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------

# Kinds for which pyarrow's ``equals`` may say "different" although the logical values agree:
# NaN != NaN, different dictionaries/indices with equal decoded values, and layouts (list views,
# run ends) that encode the same logical values differently.
_EQUALS_TOO_STRICT = frozenset(
    (*FLOAT_KINDS, "dictionary", "list_view", "large_list_view", "run_end_encoded")
)


def _fail(path: str, message: str) -> None:
    raise AssertionError(f"{path or '<root>'}: {message}")


def _norm_meta(metadata: dict[bytes, bytes] | None) -> dict[bytes, bytes]:
    return dict(metadata or {})


def _assert_fields_equal(a: pa.Field, b: pa.Field, path: str, check_metadata: bool) -> None:
    if a.name != b.name:
        _fail(path, f"field name {a.name!r} != {b.name!r}")
    if a.nullable != b.nullable:
        _fail(path, f"field {a.name!r} nullable {a.nullable} != {b.nullable}")
    if check_metadata and _norm_meta(a.metadata) != _norm_meta(b.metadata):
        _fail(path, f"field {a.name!r} metadata {a.metadata!r} != {b.metadata!r}")
    _assert_types_equal(a.type, b.type, f"{path}.{a.name}", check_metadata)


def _ext_params(dtype: pa.DataType) -> Any:
    """What distinguishes extension types of one name besides storage (their serialized metadata)."""
    if hasattr(dtype, "__arrow_ext_serialize__"):  # Python-defined extension types
        return dtype.__arrow_ext_serialize__()
    if kind_of(dtype) == "opaque":
        return (dtype.type_name, dtype.vendor_name)
    return str(dtype)  # C++ canonical types (uuid, bool8, json): parameters show in their repr


def _assert_types_equal(a: pa.DataType, b: pa.DataType, path: str, check_metadata: bool = True) -> None:
    ka, kb = kind_of(a), kind_of(b)
    if ka != kb:
        _fail(path, f"type kind {ka} ({a}) != {kb} ({b})")
    if ka in EXTENSION_KINDS:
        if a.extension_name != b.extension_name:
            _fail(path, f"extension name {a.extension_name!r} != {b.extension_name!r}")
        if _ext_params(a) != _ext_params(b):
            _fail(path, f"extension parameters {_ext_params(a)!r} != {_ext_params(b)!r}")
        _assert_types_equal(a.storage_type, b.storage_type, f"{path}<storage>", check_metadata)
    elif ka == "dictionary":
        if a.index_type != b.index_type or a.ordered != b.ordered:
            _fail(path, f"dictionary type {a} != {b}")
        _assert_types_equal(a.value_type, b.value_type, f"{path}<dictionary>", check_metadata)
    elif ka == "run_end_encoded":
        if a.run_end_type != b.run_end_type:
            _fail(path, f"run end type {a.run_end_type} != {b.run_end_type}")
        _assert_types_equal(a.value_type, b.value_type, f"{path}<values>", check_metadata)
    elif ka in NESTED_KINDS:
        if ka == "fixed_size_list" and a.list_size != b.list_size:
            _fail(path, f"list size {a.list_size} != {b.list_size}")
        if ka == "map" and a.keys_sorted != b.keys_sorted:
            _fail(path, f"keys_sorted {a.keys_sorted} != {b.keys_sorted}")
        if ka in ("dense_union", "sparse_union") and list(a.type_codes) != list(b.type_codes):
            _fail(path, f"union type codes {list(a.type_codes)} != {list(b.type_codes)}")
        fa, fb = child_fields(a), child_fields(b)
        if len(fa) != len(fb):
            _fail(path, f"{len(fa)} child fields != {len(fb)}")
        for x, y in zip(fa, fb, strict=True):
            _assert_fields_equal(x, y, path, check_metadata)
    elif not a.equals(b) or str(a) != str(b):
        _fail(path, f"type {a} != {b}")
    # Backstop: pyarrow's own type equality (ignores list field names, hence the walk above).
    if not a.equals(b, check_metadata=check_metadata):
        _fail(path, f"pyarrow says type {a} != {b}")


def _float_canon(arr: pa.Array) -> list[Any]:
    bits = arr.view({16: pa.uint16(), 32: pa.uint32(), 64: pa.uint64()}[arr.type.bit_width]).to_pylist()
    return [
        None if b is None else ("NaN" if math.isnan(v) else b)
        for v, b in zip(arr.to_pylist(), bits, strict=True)
    ]


def _canon(arr: pa.Array) -> list[Any]:
    """Canonical per-element Python values (exact: floats by bit pattern, temporals as integers)."""
    dtype = arr.type
    kind = kind_of(dtype)
    n = len(arr)
    if kind == "null":
        return [None] * n
    if kind in EXTENSION_KINDS:
        return _canon(arr.storage)
    if kind in FLOAT_KINDS:
        return _float_canon(arr)
    if kind in TEMPORAL_KINDS:
        return arr.view(pa.int32() if kind in ("date32", "time32") else pa.int64()).to_pylist()
    if kind == "interval_month_day_nano":
        return [None if v is None else tuple(v) for v in arr.to_pylist()]
    if kind in PRIMITIVE_KINDS or kind in BINARY_KINDS:
        return arr.to_pylist()
    if kind == "dictionary":
        values = _canon(arr.dictionary)
        return [None if i is None else values[i] for i in arr.indices.to_pylist()]
    if kind == "run_end_encoded":
        run_ends = arr.run_ends.to_pylist()
        values = _canon(arr.values)
        return [values[bisect.bisect_right(run_ends, arr.offset + i)] for i in range(n)]
    if kind in ("dense_union", "sparse_union"):
        if n == 0:  # an empty slice may sit past the end of its buffers
            return []
        # UnionArray.type_codes / .offsets ignore the array's offset (pyarrow 26), so read the
        # type-id and offset buffers directly.
        start, buffers = arr.offset, arr.buffers()
        codes = pa.Array.from_buffers(pa.int8(), start + n, [None, buffers[1]]).to_pylist()[start:]
        child_of = {code: j for j, code in enumerate(dtype.type_codes)}
        children = [_canon(arr.field(j)) for j in range(dtype.num_fields)]
        if kind == "dense_union":  # offsets index the whole child (field() is not sliced)
            positions = pa.Array.from_buffers(pa.int32(), start + n, [None, buffers[2]]).to_pylist()[start:]
        else:  # field() is already sliced to this array's offset
            positions = list(range(n))
        return [(code, children[child_of[code]][p]) for code, p in zip(codes, positions, strict=True)]
    valid = arr.is_valid().to_pylist()
    if kind == "struct":
        children = [_canon(arr.field(j)) for j in range(dtype.num_fields)]
        return [tuple(c[i] for c in children) if valid[i] else None for i in range(n)]
    if kind == "fixed_size_list":
        size = dtype.list_size
        child = _canon(arr.values)  # .values ignores the parent's offset
        base = arr.offset
        return [
            tuple(child[(base + i) * size : (base + i + 1) * size]) if valid[i] else None for i in range(n)
        ]
    offsets = arr.offsets.to_pylist()
    if kind == "map":
        child = list(zip(_canon(arr.keys), _canon(arr.items), strict=True))
    else:
        child = _canon(arr.values)
    if kind in ("list_view", "large_list_view"):
        sizes = arr.sizes.to_pylist()
        return [
            tuple(child[o : o + s]) if valid[i] else None
            for i, (o, s) in enumerate(zip(offsets, sizes, strict=True))
        ]
    return [tuple(child[offsets[i] : offsets[i + 1]]) if valid[i] else None for i in range(n)]


def _canon_any(arr: pa.Array | pa.ChunkedArray) -> list[Any]:
    if isinstance(arr, pa.ChunkedArray):
        return [v for chunk in arr.chunks for v in _canon_any(chunk)]
    stand_in = substitute(arr.type)
    if stand_in is not arr.type:
        arr = reinterpret(arr, stand_in)
    return _canon(arr)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _assert_array_values_equal(a: Any, b: Any, path: str, check_metadata: bool) -> None:
    _assert_types_equal(a.type, b.type, path, check_metadata)
    if len(a) != len(b):
        _fail(path, f"length {len(a)} != {len(b)}")
    if a.null_count != b.null_count:
        _fail(path, f"null_count {a.null_count} != {b.null_count}")
    ca, cb = _canon_any(a), _canon_any(b)
    if ca != cb:
        index = next(i for i, (x, y) in enumerate(zip(ca, cb, strict=True)) if x != y)
        _fail(path, f"values differ first at index {index}: {_short(ca[index])} != {_short(cb[index])}")
    if not kinds_in(a.type) & (_EQUALS_TOO_STRICT | OPT_IN_KINDS):
        if isinstance(a, pa.ChunkedArray) != isinstance(b, pa.ChunkedArray):
            a, b = (x if isinstance(x, pa.ChunkedArray) else pa.chunked_array([x], x.type) for x in (a, b))
        if not a.equals(b):
            _fail(path, "pyarrow's equals() says the values differ but the logical comparison does not")


def assert_arrays_equal(actual: Any, expected: Any, *, check_metadata: bool = True) -> None:
    """Assert two Arrow objects hold the same typed data; raise ``AssertionError`` otherwise.

    Accepts ``pa.Array``/``pa.ChunkedArray`` (may be mixed; chunk boundaries are not compared) or
    ``pa.RecordBatch``/``pa.Table`` (may be mixed; chunking is not compared).  It checks:

    * types, recursively and strictly: kind, all parameters (unit, time zone, precision/scale,
      byte width, list size, index type, ``ordered``, run-end type, union mode and type codes,
      ``keys_sorted``), every child field's name, nullability and (with ``check_metadata``) its
      metadata, where ``None`` and ``{}`` count as equal (the C data interface cannot tell them
      apart), extension name and serialized extension metadata, and storage types.  pyarrow's
      own ``DataType.equals`` ignores list/map field names; this does not.
    * length and null count (the logical null count as pyarrow reports it).
    * logical values, element by element: floats by bit pattern so ``-0.0 != 0.0`` but any NaN
      equals any NaN (pyarrow's ``equals`` says NaN != NaN and 0.0 == -0.0); temporal values as
      their integer storage (no lossy datetime conversion); dictionaries by decoded values (the
      dictionary and index buffers themselves may differ); list views, run-end encoded arrays and
      unions by what each slot logically refers to (unions: type code and child value); null
      slots compare as null regardless of the bytes underneath; extension arrays by storage.
    * as a cross-check, pyarrow's ``equals`` must agree unless floats, dictionaries, list views or
      run-end encoding are involved (where it is too strict).
    * for batches and tables: schema field names, nullability, types, field metadata and schema
      metadata (``check_metadata``), row count, then every column as above.

    Physical layout (offsets, buffer identity, bytes under nulls, unused child slots, variadic
    buffer split) is deliberately not compared.
    """
    array_like = (pa.Array, pa.ChunkedArray)
    table_like = (pa.RecordBatch, pa.Table)
    if isinstance(actual, array_like) and isinstance(expected, array_like):
        _assert_array_values_equal(actual, expected, "", check_metadata)
        return
    if not (isinstance(actual, table_like) and isinstance(expected, table_like)):
        raise AssertionError(f"cannot compare {type(actual).__name__} with {type(expected).__name__}")
    sa, sb = actual.schema, expected.schema
    if len(sa) != len(sb):
        _fail("", f"{len(sa)} columns != {len(sb)}: {sa.names} vs {sb.names}")
    for x, y in zip(sa, sb, strict=True):
        _assert_fields_equal(x, y, "", check_metadata)
    if check_metadata and _norm_meta(sa.metadata) != _norm_meta(sb.metadata):
        _fail("", f"schema metadata {sa.metadata!r} != {sb.metadata!r}")
    if actual.num_rows != expected.num_rows:
        _fail("", f"num_rows {actual.num_rows} != {expected.num_rows}")
    for i, name in enumerate(sa.names):
        _assert_array_values_equal(
            actual.column(i), expected.column(i), f"column {i} ({name!r})", check_metadata
        )
