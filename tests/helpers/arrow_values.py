"""Hypothesis strategies for arbitrary Arrow data (arrays, schemas, record batches, tables) with pyarrow.

Import from tests as ``from helpers.arrow_values import ...``. The types come from
``helpers.arrow_types`` (``allow`` / ``root`` name its kinds); compare results with
``helpers.arrow_equality.assert_arrays_equal``.

Public API
----------
``arrays_of_type(dtype, *, min_length=0, max_length=40, sliced=True, nullable=True)``
    Strategy for arrays of one given type.  ``nullable=False`` means "no logical nulls at the
    top level" (used for non-nullable fields).
``arrow_arrays(max_depth=3, max_length=40, *, allow=None, root=None, sliced=True, min_length=0)``
    Strategy for ``pa.Array`` of arbitrary type.
``arrow_schemas(max_columns=6, max_depth=2, *, allow=None, min_columns=0)``
    Strategy for ``pa.Schema`` (unique column names, optional schema metadata).
``record_batches(max_columns=6, max_rows=40, *, ..., schema=None)`` / ``tables(max_batches=4, ...)``
    Strategies for ``pa.RecordBatch`` / ``pa.Table`` (every batch of a table has the same schema).

Shape of the data
-----------------
Per element nulls (per array: none, all, or a random mix), lengths from 0, and with ``sliced=True``
frequent slices with non-zero (also non-byte-aligned) offsets, at every level: children built
from already-sliced arrays (struct/union children, list values, dictionaries, REE values,
extension storage) keep their own offsets; list offsets need not start at 0, null list slots may
span values, list views overlap / go out of order / leave gaps; dense union offsets leave unused
child slots; view arrays have values over 12 bytes and are sometimes concatenated from chunks (several
variadic buffers); fixed_size_list sizes include 0; union type codes are sometimes not 0..n-1.
Structs have 0..4 fields, unions 1..3 children (names unique per parent), and a type tree has at
most 8 nested nodes.  Map key/item fields are always named "key"/"value" (pyarrow's C importer
renames them).  Timestamps stay within years 2..9998 (convertible to ``datetime`` in any zone),
date64 values are whole days, time values lie within a day, decimals fit their precision.

pyarrow 26 limitations worked around
------------------------------------
* ``month_interval`` / ``day_time_interval`` have no Python array wrapper in pyarrow (wrapping a
  top-level array raises ``KeyError(21)`` / ``KeyError(22)``; so do ``to_pylist``,
  ``StructArray.field`` and ``RecordBatch.column`` on them), and no constructor (``pa.month_interval``
  does not exist).  They are obtained through the C data interface (nanoarrow builds the schema) and
  are generated only when named in ``allow`` (``OPT_IN_KINDS``), and only *nested* (never as the
  root type or a record-batch column): the data is built with an int32 / fixed_size_binary(8)
  stand-in and re-imported with the interval schema.
* ``FixedSizeListArray.from_arrays(values, type=<list_size 0>)`` divides by zero (SIGFPE); size-0
  fixed-size lists are built with ``pa.Array.from_buffers`` instead.
* ``pa.UnionArray.from_dense/from_sparse`` cannot carry field nullability/metadata, so unions are
  built with ``pa.Array.from_buffers`` from a full ``pa.union`` type.  ``UnionArray.type_codes`` and
  ``.offsets`` ignore the array's offset, so ``assert_arrays_equal`` reads the buffers itself.
* ``pa.array(<Decimal>, decimalNN(p, negative scale))`` fails for large values ("Rescaling Decimal
  value would cause data loss"); decimals are built from raw unscaled integers.
* ``st.floats(width=16)`` filters too much; float16 data is built from raw bit patterns.
* A run-end encoded array whose values are directly run-end encoded is rejected by pyarrow's C
  importer ("ArrowArray struct contains a nested run-end encoded array"), so REE values are never
  REE themselves (REE deeper inside, e.g. REE<struct<REE>>, is fine and generated).
* Not worked around (IPC only, not the C data interface): IPC cannot tell
  dictionary<extension values> from extension<dictionary storage>; pyarrow reads the former back as
  the latter, or fails for uuid/json/bool8.  Suites that go through IPC should leave the extension
  kinds out of ``allow``.

All randomness comes from Hypothesis draws; the only module state is the one-time registration of
``TaggedType``.  Generation is kept cheap: every example has a budget of per-element draws (about
``4 * max_length + 64``); once it is spent, further values are repeated cyclically from a few drawn
ones, so deep/wide nesting stays fast and within Hypothesis' data-size limit.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from helpers.arrow_types import (
    BINARY_KINDS,
    DECIMAL_KINDS,
    FLOAT_KINDS,
    INT_KINDS,
    OPT_IN_KINDS,
    TEMPORAL_KINDS,
    TypeConfig,
    TypeDraw,
    arrow_types,
    child_fields,
    draw_type,
    field_metadata,
    kind_of,
    only_nulls,
    reinterpret,
    substitute,
    unique_names,
)

__all__ = [
    "arrays_of_type",
    "arrow_arrays",
    "arrow_schemas",
    "record_batches",
    "tables",
]

# --------------------------------------------------------------------------------------------
# Array construction
# --------------------------------------------------------------------------------------------

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
# Keep timestamps convertible to datetime.datetime in any time zone: years 2..9998.
_TS_SECONDS = (
    int((datetime(2, 1, 1, tzinfo=timezone.utc) - _EPOCH).total_seconds()),
    int((datetime(9998, 12, 31, tzinfo=timezone.utc) - _EPOCH).total_seconds()),
)
_DATE_DAYS = (_TS_SECONDS[0] // 86400, _TS_SECONDS[1] // 86400)
_UNIT_SCALE = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
_I64 = (-(2**63) + 1, 2**63 - 1)  # INT64_MIN left out: some consumers read it as NaT
_TD_SECONDS = int(timedelta.max.total_seconds())


# float16 bit patterns: +-0, +-inf, quiet/signalling NaN with payloads, smallest subnormal, max.
_FLOAT16_SPECIALS = (0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x0001, 0x7BFF, 0x3C00)


def _clip64(lo: int, hi: int) -> tuple[int, int]:
    return max(lo, _I64[0]), min(hi, _I64[1])


def _text_values() -> SearchStrategy[str]:
    short = st.text(max_size=12)
    long = st.builds(lambda s, r: s * r, st.text(min_size=1, max_size=6), st.integers(3, 12))
    return st.one_of(short, long)


def _bytes_values() -> SearchStrategy[bytes]:
    short = st.binary(max_size=12)
    long = st.builds(lambda s, r: s * r, st.binary(min_size=1, max_size=6), st.integers(3, 12))
    return st.one_of(short, long)


_json_values = st.builds(
    json.dumps,
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(10**6), 10**6),
        st.text(max_size=8),
        st.lists(st.integers(-9, 9), max_size=3),
    ),
)


class _Ctx:
    """Per-example generation state: the draw function and a budget of element draws."""

    def __init__(self, draw: Any, max_length: int, sliced: bool) -> None:
        self.draw = draw
        self.max_length = max(max_length, 1)
        self.sliced = sliced
        self.budget = 4 * max_length + 64

    def values(self, n: int, elements: SearchStrategy[Any]) -> list[Any]:
        """``n`` values; past the budget only a few are drawn and then repeated cyclically."""
        if n <= 0:
            return []
        k = n if self.budget >= n else max(1, min(n, self.budget, 4))
        self.budget -= k
        drawn = [self.draw(elements) for _ in range(k)]
        return drawn if k == n else [drawn[i % k] for i in range(n)]

    def validity(self, n: int, nullable: bool) -> list[bool] | None:
        """Per-element validity (``None`` = all valid): no nulls, all nulls, or a random mix."""
        if not nullable or n == 0:
            return None
        mode = self.draw(st.integers(0, 5))
        if mode == 0:
            return None
        if mode == 1:
            return [False] * n
        bits = self.draw(st.integers(0, 2**n - 1))
        return [not (bits >> i) & 1 for i in range(n)]


def _with_nulls(values: list[Any], valid: list[bool] | None) -> list[Any]:
    if valid is None:
        return values
    return [v if ok else None for v, ok in zip(values, valid, strict=True)]


def _mask(valid: list[bool] | None) -> pa.Array | None:
    return None if valid is None else pa.array([not v for v in valid], pa.bool_())


def _bitmap(valid: list[bool] | None) -> pa.Buffer | None:
    return None if valid is None else pa.array(valid, pa.bool_()).buffers()[1]


def _array(ctx: _Ctx, dtype: pa.DataType, n: int, nullable: bool) -> pa.Array:
    """An array of ``dtype`` and length ``n``; often a slice of a longer one."""
    pre = post = 0
    # Empty slices with an offset are left out: pyarrow 26 re-imports an empty view array with an
    # offset as invalid ("View buffer size (bytes): 0 isn't large enough for length: 0 and offset: 1").
    if ctx.sliced and n > 0 and ctx.draw(st.booleans()):
        pre = ctx.draw(st.integers(0, 11))
        post = ctx.draw(st.integers(0, 3))
    full = _build(ctx, dtype, pre + n + post, nullable)
    if pre or post:
        return full.slice(pre, n)
    return full


def _primitive(
    ctx: _Ctx, dtype: pa.DataType, n: int, nullable: bool, elements: SearchStrategy[Any]
) -> pa.Array:
    return pa.array(_with_nulls(ctx.values(n, elements), ctx.validity(n, nullable)), dtype)


def _build(ctx: _Ctx, dtype: pa.DataType, n: int, nullable: bool) -> pa.Array:
    draw = ctx.draw
    kind = kind_of(dtype)
    if kind == "null":
        return pa.nulls(n)
    if kind == "bool":
        return _primitive(ctx, dtype, n, nullable, st.booleans())
    if kind in INT_KINDS:
        bits = dtype.bit_width
        lo, hi = (0, 2**bits - 1) if kind.startswith("u") else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        return _primitive(ctx, dtype, n, nullable, st.integers(lo, hi))
    if kind == "float16":
        # Raw bit patterns (st.floats(width=16) filters too much); specials are drawn often.
        bits = st.one_of(st.sampled_from(_FLOAT16_SPECIALS), st.integers(0, 0xFFFF))
        return _primitive(ctx, pa.uint16(), n, nullable, bits).view(dtype)
    if kind in FLOAT_KINDS:
        return _primitive(ctx, dtype, n, nullable, st.floats(width=dtype.bit_width))
    if kind in DECIMAL_KINDS:
        # From raw little-endian unscaled integers: pa.array(<Decimal>) fails for negative scales
        # ("Rescaling Decimal value would cause data loss" for e.g. 9.99999E+9 in decimal32(6, -4)).
        limit = 10**dtype.precision - 1
        width = dtype.bit_width // 8
        unscaled = ctx.values(n, st.integers(-limit, limit))
        data = b"".join(u.to_bytes(width, "little", signed=True) for u in unscaled)
        valid = ctx.validity(n, nullable)
        return pa.Array.from_buffers(dtype, n, [_bitmap(valid), pa.py_buffer(data)])
    if kind in TEMPORAL_KINDS:
        if kind == "date32":
            lo, hi, storage = *_DATE_DAYS, pa.int32()
        elif kind == "date64":
            lo, hi, storage = *_DATE_DAYS, pa.int64()
        elif kind in ("time32", "time64"):
            lo, hi = 0, 86400 * _UNIT_SCALE[dtype.unit] - 1
            storage = pa.int32() if kind == "time32" else pa.int64()
        elif kind == "timestamp":
            scale = _UNIT_SCALE[dtype.unit]
            lo, hi, storage = *_clip64(_TS_SECONDS[0] * scale, _TS_SECONDS[1] * scale), pa.int64()
        else:  # duration
            scale = _UNIT_SCALE[dtype.unit]
            lo, hi, storage = *_clip64(-_TD_SECONDS * scale, _TD_SECONDS * scale), pa.int64()
        elements = st.integers(lo, hi)
        if kind == "date64":
            elements = elements.map(lambda days: days * 86_400_000)
        return _primitive(ctx, storage, n, nullable, elements).view(dtype)
    if kind == "interval_month_day_nano":
        elements = st.tuples(
            st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1), st.integers(*_I64)
        )
        return _primitive(ctx, dtype, n, nullable, elements)
    if kind == "fixed_size_binary":
        width = dtype.byte_width
        return _primitive(ctx, dtype, n, nullable, st.binary(min_size=width, max_size=width))
    if kind in BINARY_KINDS:
        elements = _text_values() if kind in ("string", "large_string", "string_view") else _bytes_values()
        values = _with_nulls(ctx.values(n, elements), ctx.validity(n, nullable))
        if kind in ("binary_view", "string_view") and n >= 2 and draw(st.booleans()):
            # Concatenating separately built chunks gives several variadic data buffers.
            cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=3))))
            bounds = [0, *cuts, n]
            chunks = [pa.array(values[a:b], dtype) for a, b in itertools.pairwise(bounds)]
            return pa.concat_arrays(chunks)
        return pa.array(values, dtype)
    if kind == "uuid":
        storage = _primitive(ctx, pa.binary(16), n, nullable, st.binary(min_size=16, max_size=16))
        return pa.ExtensionArray.from_storage(dtype, storage)
    if kind == "bool8":
        storage = _primitive(ctx, pa.int8(), n, nullable, st.integers(-128, 127))
        return pa.ExtensionArray.from_storage(dtype, storage)
    if kind == "json":
        storage = _primitive(ctx, dtype.storage_type, n, nullable, _json_values)
        return pa.ExtensionArray.from_storage(dtype, storage)
    if kind in ("extension", "opaque"):
        return pa.ExtensionArray.from_storage(dtype, _array(ctx, dtype.storage_type, n, nullable))
    if kind in ("list", "large_list", "map"):
        return _build_list(ctx, dtype, kind, n, nullable)
    if kind in ("list_view", "large_list_view"):
        return _build_list_view(ctx, dtype, kind, n, nullable)
    if kind == "fixed_size_list":
        valid = ctx.validity(n, nullable)
        field = dtype.value_field
        child = _array(ctx, field.type, n * dtype.list_size, field.nullable)
        return pa.Array.from_buffers(dtype, n, [_bitmap(valid)], children=[child])
    if kind == "struct":
        valid = ctx.validity(n, nullable)
        fields = child_fields(dtype)
        if not fields:
            return pa.Array.from_buffers(dtype, n, [_bitmap(valid)])
        children = [_array(ctx, f.type, n, f.nullable) for f in fields]
        return pa.StructArray.from_arrays(children, fields=fields, mask=_mask(valid))
    if kind in ("dense_union", "sparse_union"):
        return _build_union(ctx, dtype, kind, n, nullable)
    if kind == "dictionary":
        size = draw(st.integers(1 if (n and not nullable) else 0, min(8, ctx.max_length)))
        dictionary = _array(ctx, dtype.value_type, size, nullable)
        if size == 0:
            indices = pa.nulls(n, dtype.index_type)
        else:
            indices = _primitive(ctx, dtype.index_type, n, nullable, st.integers(0, size - 1))
        return pa.DictionaryArray.from_arrays(indices, dictionary, ordered=dtype.ordered)
    if kind == "run_end_encoded":
        cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=min(n - 1, 8))))) if n > 1 else []
        run_ends = [*cuts, n] if n else []
        values = _array(ctx, dtype.value_type, len(run_ends), nullable)
        return pa.RunEndEncodedArray.from_arrays(pa.array(run_ends, dtype.run_end_type), values, type=dtype)
    raise AssertionError(f"cannot build {dtype}")  # pragma: no cover


def _list_size_cap(ctx: _Ctx, n: int) -> int:
    return max(1, min(4, ctx.max_length // max(n, 1)))


def _build_list(ctx: _Ctx, dtype: pa.DataType, kind: str, n: int, nullable: bool) -> pa.Array:
    draw = ctx.draw
    valid = ctx.validity(n, nullable)
    sizes = ctx.values(n, st.integers(0, _list_size_cap(ctx, n)))
    offsets = [draw(st.integers(0, 3))]  # the first list need not start at child index 0
    for size in sizes:
        offsets.append(offsets[-1] + size)
    child_len = offsets[-1] + draw(st.integers(0, 2))
    offsets_arr = pa.array(offsets, pa.int64() if kind == "large_list" else pa.int32())
    if kind == "map":
        keys = _array(ctx, dtype.key_type, child_len, False)
        items = _array(ctx, dtype.item_type, child_len, dtype.item_field.nullable)
        return pa.MapArray.from_arrays(offsets_arr, keys, items, type=dtype, mask=_mask(valid))
    field = dtype.value_field
    child = _array(ctx, field.type, child_len, field.nullable)
    cls = pa.ListArray if kind == "list" else pa.LargeListArray
    return cls.from_arrays(offsets_arr, child, type=dtype, mask=_mask(valid))


def _build_list_view(ctx: _Ctx, dtype: pa.DataType, kind: str, n: int, nullable: bool) -> pa.Array:
    draw = ctx.draw
    valid = ctx.validity(n, nullable)
    child_len = draw(st.integers(0, min(ctx.max_length, 4 * max(n, 1))))
    # Views may overlap, be out of order and leave gaps.
    cap = min(_list_size_cap(ctx, n), child_len)
    views = ctx.values(n, st.tuples(st.integers(0, cap), st.integers(0, child_len)))
    sizes = [size for size, _ in views]
    offsets = [min(start, child_len - size) for size, start in views]
    index_type = pa.int32() if kind == "list_view" else pa.int64()
    field = dtype.value_field
    child = _array(ctx, field.type, child_len, field.nullable)
    cls = pa.ListViewArray if kind == "list_view" else pa.LargeListViewArray
    return cls.from_arrays(
        pa.array(offsets, index_type), pa.array(sizes, index_type), child, type=dtype, mask=_mask(valid)
    )


def _build_union(ctx: _Ctx, dtype: pa.DataType, kind: str, n: int, nullable: bool) -> pa.Array:
    draw = ctx.draw
    fields = child_fields(dtype)
    codes = list(dtype.type_codes)
    child_ids = ctx.values(n, st.integers(0, len(fields) - 1))
    type_ids = pa.array([codes[c] for c in child_ids], pa.int8()).buffers()[1]
    if kind == "sparse_union":
        children = [_array(ctx, f.type, n, f.nullable and nullable) for f in fields]
        return pa.Array.from_buffers(dtype, n, [None, type_ids], children=children)
    # Dense: each child's offsets increase; children may have unused slots before/after.
    leads = [draw(st.integers(0, 2)) for _ in fields]
    next_slot = list(leads)
    offsets = []
    for c in child_ids:
        offsets.append(next_slot[c])
        next_slot[c] += 1
    children = [
        _array(ctx, f.type, next_slot[j] + draw(st.integers(0, 2)), f.nullable and nullable)
        for j, f in enumerate(fields)
    ]
    offsets_buf = pa.array(offsets, pa.int32()).buffers()[1]
    return pa.Array.from_buffers(dtype, n, [None, type_ids, offsets_buf], children=children)


def _make_array(ctx: _Ctx, dtype: pa.DataType, n: int, nullable: bool) -> pa.Array:
    stand_in = substitute(dtype)
    arr = _array(ctx, stand_in, n, nullable)
    return arr if stand_in is dtype else reinterpret(arr, dtype)


def arrays_of_type(
    dtype: pa.DataType,
    *,
    min_length: int = 0,
    max_length: int = 40,
    sliced: bool = True,
    nullable: bool = True,
) -> SearchStrategy[pa.Array]:
    """Strategy for arrays of exactly ``dtype`` (nested children follow their fields' nullability).

    ``nullable=False`` gives no top-level nulls, except for types whose values are all null
    (``null``, and extension/dictionary/run-end-encoded types over it).
    """
    kind_of(dtype)  # raises early for unsupported types
    if kind_of(dtype) in OPT_IN_KINDS:
        raise ValueError(f"pyarrow cannot wrap a top-level {dtype} array")

    @st.composite
    def _arrays(draw: Any) -> pa.Array:
        n = draw(st.integers(min_length, max_length))
        return _make_array(_Ctx(draw, max_length, sliced), dtype, n, nullable)

    return _arrays()


def arrow_arrays(
    max_depth: int = 3,
    max_length: int = 40,
    *,
    allow: Iterable[str] | None = None,
    root: str | Iterable[str] | None = None,
    sliced: bool = True,
    min_length: int = 0,
) -> SearchStrategy[pa.Array]:
    """Strategy for arrays of arbitrary type (``arrow_types``) with nulls, slices and nesting."""
    types = arrow_types(max_depth, allow=allow, root=root)

    @st.composite
    def _arrays(draw: Any) -> pa.Array:
        dtype = draw(types)
        n = draw(st.integers(min_length, max_length))
        return _make_array(_Ctx(draw, max_length, sliced), dtype, n, True)

    return _arrays()


def arrow_schemas(
    max_columns: int = 6,
    max_depth: int = 2,
    *,
    allow: Iterable[str] | None = None,
    min_columns: int = 0,
) -> SearchStrategy[pa.Schema]:
    """Strategy for schemas: unique column names, nullability, field and schema metadata."""
    cfg = TypeConfig(allow, None, max_depth)

    @st.composite
    def _schemas(draw: Any) -> pa.Schema:
        n = draw(st.integers(min_columns, max_columns))
        fields = []
        for name in unique_names(draw, n):
            dtype = draw_type(TypeDraw(draw), cfg, max_depth, cfg.roots, root=True)
            nullable = only_nulls(dtype) or not draw(st.booleans())
            fields.append(pa.field(name, dtype, nullable, draw(field_metadata) or None))
        return pa.schema(fields, metadata=draw(field_metadata) or None)

    return _schemas()


def _draw_batch(draw: Any, schema: pa.Schema, min_rows: int, max_rows: int, sliced: bool) -> pa.RecordBatch:
    n = draw(st.integers(min_rows, max_rows))
    pre = post = 0
    if sliced and draw(st.booleans()):
        pre, post = draw(st.integers(0, 9)), draw(st.integers(0, 2))
    total = pre + n + post
    if len(schema) == 0:
        batch = pa.RecordBatch.from_struct_array(pa.Array.from_buffers(pa.struct([]), total, [None]))
        batch = batch.replace_schema_metadata(schema.metadata)
    else:
        ctx = _Ctx(draw, max_rows, sliced)
        columns = [_make_array(ctx, f.type, total, f.nullable) for f in schema]
        batch = pa.RecordBatch.from_arrays(columns, schema=schema)
    return batch.slice(pre, n) if (pre or post) else batch


def record_batches(
    max_columns: int = 6,
    max_rows: int = 40,
    *,
    min_columns: int = 0,
    min_rows: int = 0,
    max_depth: int = 2,
    allow: Iterable[str] | None = None,
    sliced: bool = True,
    schema: pa.Schema | None = None,
) -> SearchStrategy[pa.RecordBatch]:
    """Strategy for record batches (a drawn schema, or the given ``schema``).

    With ``sliced`` both single columns and the whole batch are often slices.  Columns of
    non-nullable fields have no top-level nulls.
    """
    schemas = (
        st.just(schema)
        if schema is not None
        else arrow_schemas(max_columns, max_depth, allow=allow, min_columns=min_columns)
    )

    @st.composite
    def _batches(draw: Any) -> pa.RecordBatch:
        return _draw_batch(draw, draw(schemas), min_rows, max_rows, sliced)

    return _batches()


def tables(
    max_batches: int = 4,
    max_columns: int = 6,
    max_rows: int = 40,
    *,
    min_batches: int = 0,
    min_columns: int = 0,
    max_depth: int = 2,
    allow: Iterable[str] | None = None,
    sliced: bool = True,
    schema: pa.Schema | None = None,
) -> SearchStrategy[pa.Table]:
    """Strategy for tables made of ``min_batches..max_batches`` record batches of one schema.

    Each batch is generated independently (dictionary columns get different dictionaries per chunk).
    """
    schemas = (
        st.just(schema)
        if schema is not None
        else arrow_schemas(max_columns, max_depth, allow=allow, min_columns=min_columns)
    )

    @st.composite
    def _tables(draw: Any) -> pa.Table:
        the_schema = draw(schemas)
        count = draw(st.integers(min_batches, max_batches))
        batches = [_draw_batch(draw, the_schema, 0, max_rows, sliced) for _ in range(count)]
        return pa.Table.from_batches(batches, schema=the_schema)

    return _tables()
