"""Capsule ownership: capture from any producer, serve back out, release exactly once."""

from __future__ import annotations

import ctypes
import gc
import re
from pathlib import Path

import nanoarrow
import nanoarrow.device
import polars as pl
import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.arrow_values import arrow_arrays, record_batches, tables
from hypothesis import given

import arrow_ipc_bridge
from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.errors import BridgeError, ClosedError, InvalidArgumentError
from arrow_ipc_bridge.wire.capsules import (
    ArrowArrayExporter,
    CapturedArray,
    CapturedStream,
    capsule_struct,
    capture,
    export_captured,
    new_capsule,
)


def _live() -> tuple[int, int]:
    gc.collect()
    return int(lib.aib_live_owners()), int(lib.aib_live_nodes())


@pytest.fixture
def baseline() -> tuple[int, int, int]:
    """Live owners, live nodes and pyarrow's allocated bytes before the test body."""
    owners, nodes = _live()
    return owners, nodes, pa.total_allocated_bytes()


def _assert_back_to(baseline: tuple[int, int, int]) -> None:
    owners, nodes = _live()
    assert (owners, nodes) == baseline[:2]
    assert pa.total_allocated_bytes() == baseline[2]


def test_capture_export_release_returns_memory(baseline: tuple[int, int, int]) -> None:
    """Capturing moves pyarrow's buffers; after every holder lets go, pyarrow's allocation returns
    to the baseline and no owner or struct node of ours is left."""
    arr = pa.array(["a", None, "ccc"] * 10_000)
    assert pa.total_allocated_bytes() > baseline[2]
    exported = export_captured(capture(arr))
    del arr
    again = pa.array(exported)
    assert again.to_pylist()[:3] == ["a", None, "ccc"]
    assert pa.total_allocated_bytes() > baseline[2]  # still alive through the capture
    del exported
    assert pa.total_allocated_bytes() > baseline[2]  # still alive through `again`
    del again
    _assert_back_to(baseline)


def test_consumed_capsule_cannot_be_imported_again(baseline: tuple[int, int, int]) -> None:
    """A capsule pair that was moved out is released; a second capture says so clearly."""
    pair = pa.array([1, 2, 3]).__arrow_c_array__()
    capture(pair).close()
    with pytest.raises(ClosedError, match="already consumed") as raised:
        capture(pair)
    assert raised.value.reason == "released"
    del pair
    _assert_back_to(baseline)


def test_our_capsule_consumed_by_pyarrow_then_captured_fails() -> None:
    """pyarrow moves the struct out of our capsule; capturing that capsule again raises ClosedError."""
    exported = export_captured(capture(pa.array([1, 2])))
    pair = exported.__arrow_c_array__()
    pa.Array._import_from_c_capsule(*pair)
    with pytest.raises(ClosedError) as raised:
        capture(pair)
    assert raised.value.reason == "released"


def test_wrong_capsule_names_and_non_producers_raise_capsule_error(baseline: tuple[int, int, int]) -> None:
    """Swapped capsules or objects without the protocol raise InvalidArgumentError and move nothing."""
    schema, array = pa.array([1, 2]).__arrow_c_array__()
    with pytest.raises(
        InvalidArgumentError,
        match="expected a PyCapsule named 'arrow_schema', got a capsule named 'arrow_array'",
    ):
        capture((array, schema))
    _assert_capsules_untouched(schema, array)
    # nothing was moved: the right order still works
    capture((schema, array)).close()
    with pytest.raises(InvalidArgumentError, match="PyCapsule interface"):
        capture(object())
    with pytest.raises(InvalidArgumentError):
        capsule_struct(b"not a capsule", "schema")
    del schema, array
    _assert_back_to(baseline)


def test_capsule_functions_of_the_core_check_what_they_are_given() -> None:
    """The core's capsule functions (py_capsules.c, installed on _ffi): a new capsule of each kind
    holds a zeroed struct under the kind's name, an unknown kind is refused, and reading a capsule
    names what it got (a capsule's name, None for anything else); a DLPack capsule holds a reference
    on its owner until it dies."""
    from arrow_ipc_bridge import _ffi

    for kind, name in [
        ("schema", b"arrow_schema"),
        ("array", b"arrow_array"),
        ("stream", b"arrow_array_stream"),
    ]:
        capsule, struct = new_capsule(kind)
        assert struct.release == ffi.NULL
        assert _ffi.capsule_name(capsule) == name
        assert capsule_struct(capsule, kind) == struct
        with pytest.raises(InvalidArgumentError, match=f"got a capsule named {name.decode()!r}"):
            capsule_struct(capsule, "device_array")
    assert _ffi.capsule_name(b"arrow_schema") is None
    with pytest.raises(ValueError, match="no such capsule kind"):
        _ffi.new_struct_capsule(99)
    owner = lib.aib_owner_new(0)
    address = int(ffi.cast("uintptr_t", owner))
    data = ffi.new("int64_t[]", 4)
    tensor = _ffi.dlpack_capsule(address, int(ffi.cast("uintptr_t", data)), 1, 0, 0, 64, 4)
    assert _ffi.capsule_name(tensor) == b"dltensor"
    assert lib.aib_owner_refcount(owner) == 2
    del tensor
    gc.collect()
    assert lib.aib_owner_refcount(owner) == 1
    lib.aib_owner_unref(owner)
    with pytest.raises(ValueError, match="owner address is 0"):
        _ffi.dlpack_capsule(0, 0, 1, 0, 0, 64, 4)


def test_the_package_crosses_into_c_through_the_compiled_core_only() -> None:
    """Python objects reach C one way: the compiled core (cffi API mode and the functions it
    installs). Nothing in the package calls the C API through ctypes."""
    package = Path(arrow_ipc_bridge.__file__).parent
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if re.search(r"^\s*(import ctypes|from ctypes)|pythonapi", path.read_text(), re.M)
    ]
    assert offenders == []


def _assert_capsules_untouched(schema: object, array: object) -> None:
    """Both producer structs still hold their data (release set): nothing was moved out or released."""
    assert capsule_struct(schema, "schema").release != ffi.NULL
    assert capsule_struct(array, "array").release != ffi.NULL


@pytest.mark.parametrize(
    "bad_schema",
    [b"not a capsule", "array-capsule-twice", "stream-capsule"],
    ids=["bytes", "array-capsule", "stream-capsule"],
)
def test_failed_capture_leaves_the_callers_array_capsule_usable(
    baseline: tuple[int, int, int], bad_schema: object
) -> None:
    """A pair whose array capsule is valid but whose schema capsule is not fails with InvalidArgumentError
    *before* anything is moved: the caller's array capsule still holds its struct, and capturing it
    with the right schema afterwards gives the original values."""
    original = pa.array([10, None, 30])
    schema, array = original.__arrow_c_array__()
    stream = pa.table({"a": [1]}).__arrow_c_stream__()
    wrong = {"array-capsule-twice": array, "stream-capsule": stream}.get(str(bad_schema), bad_schema)
    with pytest.raises(InvalidArgumentError, match="expected a PyCapsule named 'arrow_schema'"):
        capture((wrong, array))
    _assert_capsules_untouched(schema, array)
    captured = export_captured(capture((schema, array)))
    assert pa.array(captured).equals(original)
    del captured, schema, array, stream, wrong, original
    _assert_back_to(baseline)


def test_capture_with_a_released_schema_leaves_the_callers_array_capsule_usable(
    baseline: tuple[int, int, int],
) -> None:
    """A pair whose schema capsule was already consumed but whose array capsule is live fails with
    ClosedError before the array is moved: the caller can still capture the array capsule."""
    consumed_schema, consumed_array = pa.array([1, 2]).__arrow_c_array__()
    capture((consumed_schema, consumed_array)).close()
    original = pa.array([7, 8, None])
    schema, array = original.__arrow_c_array__()
    with pytest.raises(ClosedError, match="schema capsule was already consumed") as raised:
        capture((consumed_schema, array))
    assert raised.value.reason == "released"
    _assert_capsules_untouched(schema, array)
    captured = export_captured(capture((schema, array)))
    assert pa.array(captured).equals(original)
    del captured, schema, array, original, consumed_schema, consumed_array
    _assert_back_to(baseline)


def test_destructor_tolerates_used_prefix(baseline: tuple[int, int, int]) -> None:
    """A consumer may rename a capsule to used_<name>; our destructor still releases the struct."""
    exported = export_captured(capture(pa.array([1, 2, 3])))
    schema, array = exported.__arrow_c_array__()
    set_name = ctypes.pythonapi.PyCapsule_SetName
    set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]
    used = ctypes.c_char_p(b"used_arrow_array")  # must outlive the capsule
    assert set_name(array, used) == 0
    del exported, schema, array
    _assert_back_to(baseline)
    del used


def test_release_from_a_non_python_thread(baseline: tuple[int, int, int]) -> None:
    """The release callback runs on a bare pthread (no GIL, no thread state) and frees everything."""
    exported = export_captured(capture(pa.array(["x"] * 1000)))
    capsule, array = new_capsule("array")
    exported._fill_batch(0, array)
    del exported
    assert lib.aib_debug_release_on_thread(array) == 0
    assert array.release == ffi.NULL
    del capsule
    _assert_back_to(baseline)


def test_released_struct_in_capsule_is_not_released_twice(baseline: tuple[int, int, int]) -> None:
    """The capsule destructor skips a struct whose release is already NULL (moved or released)."""
    exported = export_captured(capture(pa.array([1.5, 2.5])))
    capsule, array = new_capsule("array")
    exported._fill_batch(0, array)
    array.release(array)
    del capsule, exported
    _assert_back_to(baseline)


def test_requested_schema_calling_conventions() -> None:
    """Positional (pyarrow), keyword (nanoarrow) and no argument (cuDF) all work; unknown keywords
    are accepted when None and refused otherwise; an incompatible request fails before any work."""
    batch = pa.record_batch({"a": [1, 2], "b": ["x", "y"]})
    exported = export_captured(capture(batch))
    own_schema = batch.schema.__arrow_c_schema__()
    exported.__arrow_c_device_array__(own_schema)
    exported.__arrow_c_device_array__(requested_schema=batch.schema.__arrow_c_schema__())
    exported.__arrow_c_device_array__()
    exported.__arrow_c_device_array__(None, future_option=None)
    with pytest.raises(NotImplementedError, match="future_option"):
        exported.__arrow_c_device_array__(None, future_option=1)
    # The device protocol's own keyword: a consumer's stream to synchronise on is not supported, and
    # ignoring it would hand out data the consumer's stream may read before it is ready.
    with pytest.raises(NotImplementedError, match="'stream'"):
        exported.__arrow_c_device_array__(None, stream=7)
    other = pa.schema([("only", pa.int8())]).__arrow_c_schema__()
    with pytest.raises(BridgeError, match="incompatible"):
        exported.__arrow_c_array__(other)


def test_host_methods_refuse_device_data() -> None:
    """__arrow_c_array__ / __arrow_c_stream__ refuse data whose device is not the CPU."""
    captured = capture(pa.array([1, 2, 3]))
    captured.arrays[0].device_type = lib.ARROW_DEVICE_CUDA
    captured.arrays[0].device_id = 0
    exported = export_captured(captured)
    with pytest.raises(BridgeError, match="host memory only"):
        exported.__arrow_c_array__()
    with pytest.raises(BridgeError, match="host memory only"):
        exported.__arrow_c_stream__()
    _, device_array = exported.__arrow_c_device_array__()
    assert capsule_struct(device_array, "device_array").device_type == lib.ARROW_DEVICE_CUDA
    captured.arrays[0].device_type = lib.ARROW_DEVICE_CPU  # let the release run on a sane struct


def test_closed_capture_refuses_export() -> None:
    """Using captured data after close() raises ClosedError, never touches freed memory."""
    captured = capture(pa.array([1]))
    exported = export_captured(captured)
    captured.close()
    captured.close()  # idempotent
    with pytest.raises(ClosedError) as raised:
        exported.__arrow_c_array__()
    assert raised.value.reason == "released"


def test_close_while_borrowed_waits_for_the_borrower() -> None:
    """A close() while another thread has the captured data borrowed (a C call that released the GIL)
    refuses new calls at once but drops the record only when the borrower is done."""
    captured = capture(pa.array([1, 2, 3]))
    exported = export_captured(captured)
    owners = int(lib.aib_live_owners())
    captured.borrow()
    captured.close()
    assert captured.closed
    with pytest.raises(ClosedError) as raised:
        exported.__arrow_c_array__()
    assert raised.value.reason == "released"
    assert int(lib.aib_live_owners()) == owners  # still held for the borrower
    captured.unborrow()
    assert int(lib.aib_live_owners()) == owners - 1


def test_streams_are_not_arrays() -> None:
    """Tables capture as streams: the exporter has no array methods, so consumers pick the stream."""
    table = pa.table({"a": [1, 2, 3]})
    exported = export_captured(capture(table))
    assert isinstance(exported, CapturedStream)
    assert not isinstance(exported, ArrowArrayExporter)
    assert pa.table(exported).equals(table)
    assert isinstance(export_captured(capture(table.to_batches()[0])), CapturedArray)


def test_consumers_read_our_host_objects() -> None:
    """pyarrow, nanoarrow and polars all consume the bridge's host-memory objects."""
    batch = pa.record_batch({"x": pa.array([1, None, 3]), "s": pa.array(["a", "b", None])})
    table = pa.Table.from_batches([batch, batch])
    arr = batch.column("s")
    exported_batch = export_captured(capture(batch))
    exported_table = export_captured(capture(table))
    exported_array = export_captured(capture(arr))
    assert pa.record_batch(exported_batch).equals(batch)
    assert pa.table(exported_table).equals(table)
    assert pa.array(exported_array).equals(arr)
    assert nanoarrow.c_array(exported_array).length == 3
    assert nanoarrow.device.c_device_array(exported_array).device_type.name == "CPU"
    assert pl.DataFrame(exported_batch).shape == (3, 2)
    assert pl.DataFrame(exported_table).shape == (6, 2)
    assert pl.Series(exported_array).to_list() == ["a", "b", None]


def test_producer_stream_errors_are_reported() -> None:
    """A producer stream whose get_next fails raises BridgeError with its message; nothing leaks."""

    def failing() -> object:
        yield pa.record_batch({"a": [1]})
        raise ValueError("producer exploded")

    reader = pa.RecordBatchReader.from_batches(pa.schema([("a", pa.int64())]), failing())
    with pytest.raises(BridgeError, match="producer exploded"):
        capture(reader)


@given(arrow_arrays())
def test_any_array_survives_capture_and_export(arr: pa.Array) -> None:
    """Every Arrow type, nested, with nulls and offsets, comes back equal through the C structs."""
    assert_arrays_equal(pa.array(export_captured(capture(arr))), arr)


@given(record_batches())
def test_any_batch_survives_capture_and_export(batch: pa.RecordBatch) -> None:
    """Record batches come back equal."""
    assert_arrays_equal(pa.record_batch(export_captured(capture(batch))), batch)


@given(tables())
def test_any_table_survives_capture_and_export(table: pa.Table) -> None:
    """Tables of several batches come back equal, batch structure included."""
    again = pa.table(export_captured(capture(table)))
    assert_arrays_equal(again, table)
