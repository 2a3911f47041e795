"""Self-test of the Arrow data strategies (``helpers.arrow_types``, ``helpers.arrow_values``) and of
``helpers.arrow_equality.assert_arrays_equal``."""

from __future__ import annotations

import collections
import itertools
from typing import Any

import nanoarrow as na
import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.arrow_types import (
    ALL_KINDS,
    LEAF_KINDS,
    NESTED_KINDS,
    OPT_IN_KINDS,
    PRIMITIVE_KINDS,
    TYPE_KINDS,
    TaggedType,
    arrow_types,
    kind_of,
    kinds_in,
)
from helpers.arrow_values import arrays_of_type, arrow_arrays, arrow_schemas, record_batches, tables
from hypothesis import HealthCheck, assume, find, given, settings
from hypothesis import strategies as st

# Own settings only (the project-wide profile lives in conftest.py): no example database, no deadline.
_QUICK = settings(max_examples=10, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
_SURVEY = settings(
    max_examples=400,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)

REQUIRED_KINDS = {
    "null",
    "bool",
    *(f"{s}int{b}" for s in ("", "u") for b in (8, 16, 32, 64)),
    "float16",
    "float32",
    "float64",
    "decimal32",
    "decimal64",
    "decimal128",
    "decimal256",
    "date32",
    "date64",
    "time32",
    "time64",
    "timestamp",
    "duration",
    "interval_month_day_nano",
    "fixed_size_binary",
    "binary",
    "string",
    "large_binary",
    "large_string",
    "binary_view",
    "string_view",
    "list",
    "large_list",
    "list_view",
    "large_list_view",
    "fixed_size_list",
    "struct",
    "map",
    "dense_union",
    "sparse_union",
    "dictionary",
    "run_end_encoded",
    "extension",
    "uuid",
    "opaque",
}


def c_round_trip(arr: pa.Array) -> pa.Array:
    schema_capsule, array_capsule = arr.__arrow_c_array__()
    return pa.Array._import_from_c_capsule(schema_capsule, array_capsule)


def walk_arrays(arr: pa.Array) -> Any:
    """Yield ``arr`` and its descendant arrays as pyarrow exposes them (children unsliced)."""
    yield arr
    kind = kind_of(arr.type)
    if kind in OPT_IN_KINDS or kinds_in(arr.type) & OPT_IN_KINDS:
        return  # pyarrow cannot wrap these children
    if kind in ("extension", "opaque", "uuid", "bool8", "json"):
        yield from walk_arrays(arr.storage)
    elif kind == "struct":
        for i in range(arr.type.num_fields):
            yield from walk_arrays(arr.field(i))
    elif kind in ("list", "large_list", "list_view", "large_list_view", "fixed_size_list"):
        yield from walk_arrays(arr.values)
    elif kind == "map":
        yield from walk_arrays(arr.keys)
        yield from walk_arrays(arr.items)
    elif kind in ("dense_union", "sparse_union"):
        for i in range(arr.type.num_fields):
            yield from walk_arrays(arr.field(i))
    elif kind == "dictionary":
        yield from walk_arrays(arr.dictionary)
    elif kind == "run_end_encoded":
        yield from walk_arrays(arr.values)


def c_formats(schema: Any) -> list[str]:
    """Format strings of a nanoarrow CSchema tree (children and dictionaries)."""
    out = [schema.format]
    for i in range(schema.n_children):
        out += c_formats(schema.child(i))
    if schema.dictionary is not None:
        out += c_formats(schema.dictionary)
    return out


def c_child_offsets(c_arr: Any) -> list[int]:
    """Offsets of every descendant ArrowArray (children and dictionaries) as exported."""
    out = []
    for i in range(c_arr.n_children):
        out += [c_arr.child(i).offset, *c_child_offsets(c_arr.child(i))]
    if c_arr.dictionary is not None:
        out += [c_arr.dictionary.offset, *c_child_offsets(c_arr.dictionary)]
    return out


# --------------------------------------------------------------------------------------------
# Kinds and argument checking
# --------------------------------------------------------------------------------------------


def test_kind_sets() -> None:
    assert REQUIRED_KINDS <= TYPE_KINDS
    assert {"bool8", "json"} <= TYPE_KINDS
    assert TYPE_KINDS == LEAF_KINDS | NESTED_KINDS
    assert not LEAF_KINDS & NESTED_KINDS
    assert not TYPE_KINDS & OPT_IN_KINDS
    assert {"interval_months", "interval_day_time"} == OPT_IN_KINDS
    assert ALL_KINDS == TYPE_KINDS | OPT_IN_KINDS
    assert PRIMITIVE_KINDS <= LEAF_KINDS


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: arrow_types(allow={"int32", "no_such_kind"}), "unknown"),
        (lambda: arrow_arrays(allow={"list"}), "leaf"),
        (lambda: arrow_arrays(allow={"list", "uuid"}), "leaf"),
        (lambda: arrow_types(allow={"map", "null"}), "keys"),
        (lambda: arrow_types(allow=set()), "at least one"),
        (lambda: arrow_types(allow={"int32"}, root="string"), "not in allow"),
        (lambda: arrow_types(allow=ALL_KINDS, root="interval_months"), "root"),
        (lambda: arrow_types(allow={"int32", "interval_months"}), "nested"),
        (lambda: arrow_types(max_depth=0, root="struct"), "max_depth"),
        (lambda: arrays_of_type(arrow_strategies_month_interval()), "top-level"),
    ],
)
def test_bad_arguments_raise_value_error(factory: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        factory()


def arrow_strategies_month_interval() -> pa.DataType:
    return pa.DataType._import_from_c_capsule(na.c_schema(na.interval_months()).__arrow_c_schema__())


@_QUICK
@given(arrow_types(allow={"int32", "float64", "list", "struct"}))
def test_allow_restricts_every_node(dtype: pa.DataType) -> None:
    assert kinds_in(dtype) <= {"int32", "float64", "list", "struct"}


@_QUICK
@given(arrow_arrays(allow=PRIMITIVE_KINDS, max_length=8))
def test_primitive_only(arr: pa.Array) -> None:
    assert kinds_in(arr.type) <= PRIMITIVE_KINDS
    assert len(arr) <= 8


@_QUICK
@given(arrow_types(max_depth=0))
def test_max_depth_zero_gives_leaves(dtype: pa.DataType) -> None:
    assert kind_of(dtype) in LEAF_KINDS


# --------------------------------------------------------------------------------------------
# Every kind: generated, valid, survives pyarrow's C data interface, readable by nanoarrow
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(TYPE_KINDS))
@_QUICK
@given(data=st.data())
def test_each_kind_generates_valid_arrays_that_round_trip(kind: str, data: st.DataObject) -> None:
    arr = data.draw(arrow_arrays(max_depth=2, max_length=16, root=kind), label="arr")
    assert kind_of(arr.type) == kind
    assert len(arr) <= 16
    arr.validate(full=True)
    assert_arrays_equal(arr, arr)
    back = c_round_trip(arr)
    back.validate(full=True)
    assert_arrays_equal(back, arr)


# nanoarrow 0.9 limitations (the record of what this test leaves out, and why):
NANOARROW_LIMITS = {
    # ArrowSchemaViewInit: "Expected size > 0 for fixed size binary but found size 0".  na.c_array()
    # accepts the array; building an ArrowArrayView (and anything that reads it) does not.
    "fixed_size_binary(0)": "nanoarrow rejects fixed_size_binary with byte width 0",
    # Re-exporting an imported non-empty string_view/binary_view array (pa.array(na.c_array(a)))
    # corrupts the heap / segfaults, and so do nanoarrow.Array(a).to_pylist() and
    # nanoarrow.c_array_stream(a): nanoarrow's shallow copy mishandles the variadic buffers
    # (cf. apache/arrow-nanoarrow#808).  Reading them through na.c_array(a).view() works.
    "view re-export": "nanoarrow crashes re-exporting string_view/binary_view arrays",
}
# Not used here either: nanoarrow.Array(...).to_pylist() has no iterator for decimal32/decimal64,
# list_view/large_list_view, map and run_end_encoded (KeyError "Can't resolve iterator").


@pytest.mark.parametrize("kind", sorted(TYPE_KINDS))
@_QUICK
@given(data=st.data())
def test_each_kind_is_readable_by_nanoarrow(kind: str, data: st.DataObject) -> None:
    arr = data.draw(arrow_arrays(max_depth=2, max_length=16, root=kind), label="arr")
    c_arr = na.c_array(arr)  # imports pyarrow's ArrowSchema/ArrowArray export
    assert c_arr.length == len(arr)
    assert c_arr.offset == arr.offset
    formats = c_formats(c_arr.schema)
    if "w:0" in formats:  # NANOARROW_LIMITS["fixed_size_binary(0)"]
        with pytest.raises(na._utils.NanoarrowException, match="size > 0"):
            c_arr.view()
        return
    c_arr.view()  # ArrowArrayViewInitFromSchema + ArrowArrayViewSetArray (default validation)
    if {"vu", "vz"} & set(formats):  # NANOARROW_LIMITS["view re-export"]
        return
    # nanoarrow re-exports what it imported; pyarrow must read back the same thing.
    assert_arrays_equal(pa.array(c_arr), arr)


@pytest.mark.parametrize("kind", sorted(OPT_IN_KINDS))
def test_opt_in_interval_kinds(kind: str) -> None:
    arr = find(
        arrow_arrays(max_depth=2, max_length=8, allow={"int32", "string", "struct", "list", kind}),
        lambda a: kind in kinds_in(a.type) and len(a) > 0,
        settings=settings(database=None, max_examples=1000, deadline=None),
    )
    assert kind_of(arr.type) not in OPT_IN_KINDS  # only ever nested
    arr.validate(full=True)
    assert_arrays_equal(c_round_trip(arr), arr)
    assert ("tiM" if kind == "interval_months" else "tiD") in c_formats(na.c_schema(arr.type))
    na.c_array(arr).view()


@_QUICK
@given(arrow_arrays(max_depth=2, max_length=10, allow=ALL_KINDS))
def test_opt_in_allowed_arrays_validate_and_round_trip(arr: pa.Array) -> None:
    arr.validate(full=True)
    assert_arrays_equal(c_round_trip(arr), arr)


def test_extension_metadata_travels_in_c_schema_field_metadata() -> None:
    dtype = pa.struct([pa.field("e", TaggedType(pa.int32(), "ünit"), metadata={"k": "v"})])
    child = na.c_schema(dtype).child(0)
    assert child.format == "i"  # the storage type's format
    metadata = dict(child.metadata)
    assert metadata[b"ARROW:extension:name"] == b"arrow_ipc_bridge.tests.tagged"
    assert metadata[b"ARROW:extension:metadata"] == "ünit".encode()
    assert metadata[b"k"] == b"v"
    # pyarrow folds the ARROW:extension:* keys back into the type on import.
    back = pa.DataType._import_from_c_capsule(dtype.__arrow_c_schema__())
    assert back.field(0).type == TaggedType(pa.int32(), "ünit")
    assert back.field(0).metadata == {b"k": b"v"}


# --------------------------------------------------------------------------------------------
# The default mix: broad, valid, with the layout features the bridge must handle
# --------------------------------------------------------------------------------------------


def _survey_array(arr: pa.Array, seen: collections.Counter[str]) -> None:
    seen.update(f"kind:{k}" for k in kinds_in(arr.type))
    seen["length 0"] += len(arr) == 0
    seen["top-level offset"] += arr.offset > 0
    seen["top-level bit offset"] += arr.offset % 8 != 0
    if kind_of(arr.type) not in ("null", "dense_union", "sparse_union", "run_end_encoded") and len(arr):
        seen["all null"] += arr.null_count == len(arr)
        seen["no null"] += arr.null_count == 0
        seen["some null"] += 0 < arr.null_count < len(arr)
    seen["child with its own offset"] += any(o > 0 for o in c_child_offsets(na.c_array(arr)))
    for node in walk_arrays(arr):
        kind = kind_of(node.type)
        if kind in ("binary_view", "string_view"):
            seen["view value > 12 bytes"] += any(len(v) > 12 for v in node.to_pylist() if v is not None)
            seen["view with >= 2 variadic buffers"] += len(node.buffers()) >= 4
        elif kind in ("list_view", "large_list_view") and len(node) > 1:
            offsets = node.offsets.to_pylist()
            seen["list_view out of order"] += offsets != sorted(offsets)
            ends = [o + s for o, s in zip(offsets, node.sizes.to_pylist(), strict=True)]
            spans = sorted(zip(offsets, ends, strict=True))
            seen["list_view overlap"] += any(
                b[0] < a[1] and a[1] > a[0] and b[1] > b[0] for a, b in itertools.pairwise(spans)
            )
        elif kind in ("list", "large_list") and len(node):
            seen["list offsets start > 0"] += node.offsets[0].as_py() > 0
        elif kind in ("dense_union", "sparse_union"):
            seen["union codes not 0..n-1"] += list(node.type.type_codes) != list(range(node.type.num_fields))
        elif kind == "dictionary":
            seen[f"dictionary index {node.type.index_type}"] += 1
        elif kind == "run_end_encoded":
            seen[f"run ends {node.type.run_end_type}"] += 1
        elif kind == "timestamp":
            seen["timestamp with tz" if node.type.tz else "timestamp without tz"] += 1
    _survey_type(arr.type, seen, inside=None)


def _survey_type(dtype: pa.DataType, seen: collections.Counter[str], inside: str | None) -> None:
    kind = kind_of(dtype)
    if kind == "dictionary" and inside in ("list", "struct"):
        seen[f"dictionary inside {inside}"] += 1
    if kind in ("struct", "dense_union", "sparse_union"):
        fields = [dtype.field(i) for i in range(dtype.num_fields)]
    elif kind == "map":
        fields = [dtype.key_field, dtype.item_field]
    elif kind in ("list", "large_list", "list_view", "large_list_view", "fixed_size_list"):
        fields = [dtype.value_field]
    else:
        fields = []
    for f in fields:
        seen["field metadata"] += bool(f.metadata)
        seen["non-nullable field"] += not f.nullable
        seen["empty field name"] += f.name == ""
        seen["non-ASCII field name"] += not f.name.isascii()
        _survey_type(f.type, seen, kind if kind in ("list", "struct") else inside)
    if kind in {"extension", "opaque"}:
        _survey_type(dtype.storage_type, seen, inside)
    if kind in ("dictionary", "run_end_encoded"):
        _survey_type(dtype.value_type, seen, inside)


GENERAL_FEATURES = [
    "length 0",
    "top-level offset",
    "top-level bit offset",
    "all null",
    "no null",
    "some null",
    "child with its own offset",
    "field metadata",
    "non-nullable field",
    "empty field name",
    "non-ASCII field name",
]
# Features of particular kinds, surveyed with `allow`/`root` narrowed to those kinds so that the
# check does not depend on how often the default mix happens to pick them.
TARGETED_SURVEYS = {
    "views": (
        {"allow": {"int32", "binary_view", "string_view", "list"}},
        ["view value > 12 bytes", "view with >= 2 variadic buffers"],
    ),
    "lists": (
        {"allow": {"int32", "string", "list", "large_list", "list_view", "large_list_view"}},
        ["list_view out of order", "list_view overlap", "list offsets start > 0"],
    ),
    "unions": (
        {
            "allow": {"int32", "string", "dense_union", "sparse_union"},
            "root": ["dense_union", "sparse_union"],
        },
        ["union codes not 0..n-1"],
    ),
    "dictionaries": (
        {"allow": {"int32", "string", "list", "struct", "dictionary"}, "root": "dictionary"},
        [f"dictionary index {s}int{b}" for s in ("", "u") for b in (8, 16, 32, 64)],
    ),
    "nested dictionaries": (
        {"allow": {"int32", "string", "list", "struct", "dictionary"}, "root": ["list", "struct"]},
        ["dictionary inside list", "dictionary inside struct"],
    ),
    "timestamps": ({"allow": {"timestamp"}}, ["timestamp with tz", "timestamp without tz"]),
    "run ends": (
        {"allow": {"int32", "string", "run_end_encoded"}, "root": "run_end_encoded"},
        [f"run ends int{b}" for b in (16, 32, 64)],
    ),
}


def _survey(strategy: Any, max_examples: int = 250) -> collections.Counter[str]:
    seen: collections.Counter[str] = collections.Counter()

    @settings(_SURVEY, max_examples=max_examples)
    @given(strategy)
    def survey(arr: pa.Array) -> None:
        assert len(arr) <= 40
        arr.validate(full=True)
        assert_arrays_equal(arr, arr)
        _survey_array(arr, seen)

    survey()
    return seen


def test_default_strategy_is_broad_and_valid() -> None:
    seen = _survey(arrow_arrays())
    missing = [f for f in GENERAL_FEATURES if not seen[f]]
    assert not missing, f"never generated: {missing}"
    # Every kind is shown to be generatable by the per-kind tests; the default mix must be broad too.
    kinds = {k.removeprefix("kind:") for k in seen if k.startswith("kind:")}
    assert kinds <= TYPE_KINDS  # the opt-in kinds only come when asked for
    assert len(kinds) >= 0.85 * len(TYPE_KINDS), sorted(TYPE_KINDS - kinds)


@pytest.mark.parametrize("name", sorted(TARGETED_SURVEYS))
def test_kind_specific_layout_features(name: str) -> None:
    kwargs, features = TARGETED_SURVEYS[name]
    # 400 examples: with a new seed every run, 150 missed one of eight index types now and then.
    seen = _survey(arrow_arrays(max_depth=2, **kwargs), max_examples=400)
    missing = [f for f in features if not seen[f]]
    assert not missing, f"never generated: {missing}"


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrow_arrays(sliced=False))
def test_unsliced_arrays_have_no_top_level_offset(arr: pa.Array) -> None:
    assert arr.offset == 0
    assert not any(c_child_offsets(na.c_array(arr)))


# --------------------------------------------------------------------------------------------
# Record batches and tables
# --------------------------------------------------------------------------------------------


def _assert_no_top_level_nulls(column: Any) -> None:
    kind = kind_of(column.type)
    if kind in ("dense_union", "sparse_union", "run_end_encoded"):
        return  # no validity bitmap of their own
    assert column.null_count == 0


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(record_batches())
def test_record_batches(batch: pa.RecordBatch) -> None:
    batch.validate(full=True)
    assert batch.num_columns <= 6
    assert batch.num_rows <= 40
    assert len(set(batch.schema.names)) == batch.num_columns
    for field, column in zip(batch.schema, batch.columns, strict=True):
        assert column.type.equals(field.type)
        if not field.nullable:
            _assert_no_top_level_nulls(column)
    assert_arrays_equal(batch, batch)
    schema_capsule, array_capsule = batch.__arrow_c_array__()
    back = pa.RecordBatch._import_from_c_capsule(schema_capsule, array_capsule)
    assert_arrays_equal(back, batch)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables())
def test_tables(table: pa.Table) -> None:
    table.validate(full=True)
    assert len(table.to_batches()) <= 4
    assert_arrays_equal(table, table)
    back = pa.RecordBatchReader._import_from_c_capsule(table.__arrow_c_stream__()).read_all()
    assert_arrays_equal(back, table)


@_QUICK
@given(arrow_schemas(max_columns=3, allow={"int64", "string", "struct"}, min_columns=1), st.data())
def test_record_batches_with_given_schema(schema: pa.Schema, data: st.DataObject) -> None:
    batch = data.draw(record_batches(schema=schema, max_rows=5))
    assert batch.schema.equals(schema, check_metadata=True)
    table = data.draw(tables(schema=schema, max_rows=5, min_batches=2))
    assert table.schema.equals(schema, check_metadata=True)
    # to_batches() drops empty batches; the chunk count keeps them
    assert table.num_columns == 0 or table.column(0).num_chunks >= 2


# --------------------------------------------------------------------------------------------
# assert_arrays_equal cannot silently pass
# --------------------------------------------------------------------------------------------


def _fails(a: Any, b: Any, match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        assert_arrays_equal(a, b)
    with pytest.raises(AssertionError, match=match):
        assert_arrays_equal(b, a)


def _struct(name: str = "a", metadata: dict[str, str] | None = None, nullable: bool = True) -> pa.Array:
    field = pa.field(name, pa.int64(), nullable, metadata)
    return pa.StructArray.from_arrays([pa.array([1, 2])], fields=[field])


def test_detects_changed_value() -> None:
    _fails(pa.array([1, 2, 3]), pa.array([1, 2, 4]), "index 2")
    _fails(pa.array([1, None, 3]), pa.array([1, 2, 3]), "null_count|index 1")
    _fails(pa.array(["a", "b"]), pa.array(["a", "c"]), "index 1")
    nested = pa.array([[{"x": 1}], [{"x": 2}]], pa.list_(pa.struct([("x", pa.int8())])))
    changed = pa.array([[{"x": 1}], [{"x": 3}]], pa.list_(pa.struct([("x", pa.int8())])))
    _fails(nested, changed, "index 1")
    _fails(pa.array([1, 2, 3]), pa.array([1, 2]), "length")
    ts = pa.array([1_000_000_001], pa.timestamp("ns"))
    _fails(ts, pa.array([1_000_000_002], pa.timestamp("ns")), "index 0")


def test_detects_changed_field_name() -> None:
    _fails(_struct("a"), _struct("b"), "field name")
    # pyarrow's own equality ignores list item names; this comparison does not.
    a = pa.array([[1]], pa.list_(pa.field("item", pa.int64())))
    b = pa.array([[1]], pa.list_(pa.field("element", pa.int64())))
    assert a.equals(b)
    _fails(a, b, "field name")
    batch_a = pa.record_batch([pa.array([1])], names=["x"])
    batch_b = pa.record_batch([pa.array([1])], names=["y"])
    _fails(batch_a, batch_b, "field name")


def test_detects_changed_metadata() -> None:
    _fails(_struct(metadata={"k": "v"}), _struct(metadata={"k": "w"}), "metadata")
    _fails(_struct(metadata={"k": "v"}), _struct(), "metadata")
    assert_arrays_equal(_struct(metadata={}), _struct())  # None and {} are the same in the C interface
    field_a = pa.field("x", pa.int64(), metadata={"unit": "m"})
    field_b = pa.field("x", pa.int64(), metadata={"unit": "ü"})
    _fails(
        pa.RecordBatch.from_arrays([pa.array([1])], schema=pa.schema([field_a])),
        pa.RecordBatch.from_arrays([pa.array([1])], schema=pa.schema([field_b])),
        "metadata",
    )
    _fails(
        pa.table({"x": [1]}).replace_schema_metadata({"a": "1"}),
        pa.table({"x": [1]}).replace_schema_metadata({"a": "2"}),
        "schema metadata",
    )
    assert_arrays_equal(_struct(metadata={"k": "v"}), _struct(metadata={"k": "w"}), check_metadata=False)


def test_detects_changed_type() -> None:
    _fails(pa.array([1], pa.int32()), pa.array([1], pa.int64()), "kind")
    _fails(pa.array([1], pa.timestamp("s", "UTC")), pa.array([1], pa.timestamp("s", "Europe/Paris")), "type")
    _fails(pa.array([1], pa.timestamp("s")), pa.array([1], pa.timestamp("ms")), "type")
    _fails(pa.array([1], pa.decimal128(5, 2)), pa.array([1], pa.decimal128(5, 1)), "type")
    _fails(_struct(nullable=True), _struct(nullable=False), "nullable")
    _fails(pa.array(["a"]).dictionary_encode(), pa.array(["a"]), "kind")
    d8 = pa.DictionaryArray.from_arrays(pa.array([0], pa.int8()), pa.array(["a"]))
    du8 = pa.DictionaryArray.from_arrays(pa.array([0], pa.uint8()), pa.array(["a"]))
    _fails(d8, du8, "dictionary type")
    storage = pa.array([1], pa.int32())
    _fails(
        pa.ExtensionArray.from_storage(TaggedType(pa.int32(), "a"), storage),
        pa.ExtensionArray.from_storage(TaggedType(pa.int32(), "b"), storage),
        "extension parameters",
    )
    _fails(
        pa.ExtensionArray.from_storage(pa.opaque(pa.int32(), "t", "v1"), storage),
        pa.ExtensionArray.from_storage(pa.opaque(pa.int32(), "t", "v2"), storage),
        "extension parameters",
    )
    _fails(pa.ExtensionArray.from_storage(TaggedType(pa.int32(), "a"), storage), storage, "kind")
    union_a = pa.UnionArray.from_sparse(pa.array([0], pa.int8()), [pa.array([1])], type_codes=[0])
    union_b = pa.UnionArray.from_sparse(pa.array([3], pa.int8()), [pa.array([1])], type_codes=[3])
    _fails(union_a, union_b, "type codes")


def test_floats() -> None:
    nan = float("nan")
    assert not pa.array([nan]).equals(pa.array([nan]))  # why equals() alone is too strict
    assert_arrays_equal(pa.array([1.0, nan, None]), pa.array([1.0, nan, None]))
    assert pa.array([0.0]).equals(pa.array([-0.0]))  # ... and too loose
    _fails(pa.array([0.0]), pa.array([-0.0]), "index 0")
    _fails(pa.array([nan]), pa.array([1.0]), "index 0")
    half = pa.array([0x7E00, 0x3C00], pa.uint16()).view(pa.float16())
    assert_arrays_equal(half, pa.array([0x7E01, 0x3C00], pa.uint16()).view(pa.float16()))  # NaN payloads
    _fails(half, pa.array([0x7E00, 0x3C01], pa.uint16()).view(pa.float16()), "index 1")


def test_logically_equal_layouts_compare_equal() -> None:
    # Dictionaries: different dictionary/indices, same decoded values.
    a = pa.DictionaryArray.from_arrays(pa.array([0, 1, None], pa.int8()), pa.array(["x", "y"]))
    b = pa.DictionaryArray.from_arrays(pa.array([1, 0, None], pa.int8()), pa.array(["y", "x", "z"]))
    assert not a.equals(b)
    assert_arrays_equal(a, b)
    _fails(
        a, pa.DictionaryArray.from_arrays(pa.array([1, 1, None], pa.int8()), pa.array(["y", "x"])), "index"
    )
    # List views: overlapping/out-of-order vs. plain layout.
    values = pa.array([1, 2, 3])
    lv1 = pa.ListViewArray.from_arrays(pa.array([1, 0], pa.int32()), pa.array([2, 2], pa.int32()), values)
    lv2 = pa.ListViewArray.from_arrays(
        pa.array([0, 2], pa.int32()), pa.array([2, 2], pa.int32()), pa.array([2, 3, 1, 2])
    )
    assert_arrays_equal(lv1, lv2)
    # Slices, chunking and variadic buffer split do not matter.
    assert_arrays_equal(pa.array([0, 1, 2, 3]).slice(1), pa.array([1, 2, 3]))
    long = ["x" * 20, None, "y" * 30]
    split = pa.concat_arrays([pa.array(long[:1], pa.string_view()), pa.array(long[1:], pa.string_view())])
    assert_arrays_equal(split, pa.array(long, pa.string_view()))
    assert_arrays_equal(pa.chunked_array([[1], [2, 3]]), pa.array([1, 2, 3]))
    table = pa.table({"a": [1, 2, 3]})
    assert_arrays_equal(pa.concat_tables([table.slice(0, 1), table.slice(1)]), table)
    # Null slots compare as null whatever lies underneath.
    under = pa.Array.from_buffers(
        pa.int32(), 2, [pa.array([True, False]).buffers()[1], pa.array([5, 6], pa.int32()).buffers()[1]]
    )
    assert_arrays_equal(under, pa.array([5, None], pa.int32()))
    with pytest.raises(AssertionError, match="cannot compare"):
        assert_arrays_equal(pa.array([1]), pa.record_batch({"a": [1]}))


def test_sliced_unions_compare_by_logical_slot() -> None:
    # pyarrow's UnionArray.type_codes/.offsets ignore the slice offset; the comparison must not.
    sparse = pa.UnionArray.from_sparse(
        pa.array([0, 1, 0, 1], pa.int8()), [pa.array([1, 2, 3, 4]), pa.array(["a", "b", "c", "d"])]
    )
    rebuilt = pa.UnionArray.from_sparse(
        pa.array([1, 0, 1], pa.int8()), [pa.array([2, 3, 4]), pa.array(["b", "c", "d"])]
    )
    assert_arrays_equal(sparse.slice(1), rebuilt)
    _fails(sparse.slice(1), sparse.slice(0, 3), "index 0")
    dense = pa.UnionArray.from_dense(
        pa.array([0, 1, 0], pa.int8()), pa.array([0, 0, 1], pa.int32()), [pa.array([1, 2]), pa.array(["a"])]
    )
    rebuilt = pa.UnionArray.from_dense(
        pa.array([1, 0], pa.int8()), pa.array([0, 0], pa.int32()), [pa.array([2]), pa.array(["a"])]
    )
    assert_arrays_equal(dense.slice(1), rebuilt)
    _fails(dense.slice(1), dense.slice(0, 2), "index 0")


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables(max_rows=12, allow=TYPE_KINDS - {"extension", "opaque", "uuid", "bool8", "json"}))
def test_ipc_stream_round_trip_compares_equal(table: pa.Table) -> None:
    """A round trip that rewrites the layout (IPC rebases offsets) still compares equal.

    Extension kinds are left out: IPC cannot tell dictionary<extension values> from
    extension<dictionary storage> (the C data interface can), so pyarrow reads the former back as
    the latter, or fails for uuid/json/bool8 ("Invalid storage type ...").
    """
    # pyarrow's IPC reader turns a dictionary whose values are a dictionary into one dictionary of
    # the inner values (pyarrow 26, any length), so such types cannot come back equal.
    assume(not any(_has_dictionary_of_dictionary(field.type) for field in table.schema))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert_arrays_equal(pa.ipc.open_stream(sink.getvalue()).read_all(), table)


def _has_dictionary_of_dictionary(dtype: pa.DataType) -> bool:
    """Whether a dictionary type with dictionary values occurs anywhere inside ``dtype``."""
    if pa.types.is_dictionary(dtype):
        if pa.types.is_dictionary(dtype.value_type):
            return True
        return _has_dictionary_of_dictionary(dtype.value_type)
    if isinstance(dtype, pa.ExtensionType):
        return _has_dictionary_of_dictionary(dtype.storage_type)
    return any(_has_dictionary_of_dictionary(dtype.field(i).type) for i in range(dtype.num_fields))


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_agrees_with_pyarrow_equals_on_random_pairs(data: st.DataObject) -> None:
    """Two independently drawn arrays of one type: pyarrow's equals is the oracle where it is exact."""
    dtype = data.draw(arrow_types(max_depth=2), label="dtype")
    length = data.draw(st.integers(1, 6), label="length")
    a = data.draw(arrays_of_type(dtype, min_length=length, max_length=length), label="a")
    b = data.draw(arrays_of_type(dtype, min_length=length, max_length=length), label="b")
    lenient = {
        "float16",
        "float32",
        "float64",
        "dictionary",
        "list_view",
        "large_list_view",
        "run_end_encoded",
    }
    exact = not kinds_in(dtype) & lenient
    if exact and not a.equals(b):
        with pytest.raises(AssertionError):
            assert_arrays_equal(a, b)
    if a.equals(b) and not kinds_in(dtype) & {"float16", "float32", "float64"}:
        assert_arrays_equal(a, b)
