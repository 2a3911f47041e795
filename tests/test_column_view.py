"""Zero-copy column views: DLPack (versioned and legacy) for host data (numpy), every numeric type,
tables and streams batch by batch, lifetimes, and clear refusals."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import _ffi
from arrow_ipc_bridge._ffi import lib
from arrow_ipc_bridge.runtime import reaper


def _live() -> tuple[int, int, int]:
    gc.collect()
    reaper.settle()
    return int(lib.aib_live_owners()), int(lib.aib_live_nodes()), int(lib.aib_live_mappings())


@pytest.fixture
def imported() -> Iterator[aib.ImportedArray]:
    batch = pa.record_batch(
        {
            "f": pa.array([1.5, 2.5, 3.5]),
            "i": pa.array([1, 2, 3], pa.int32()),
            "u": pa.array([7, 8, 9], pa.uint8()),
            "s": pa.array(["a", "b", "c"]),
            "n": pa.array([1, None, 3]),
        }
    )
    exported = aib.export(batch)
    session = aib.Session()
    result = session.import_message(exported.message, exported.fds)
    assert isinstance(result, aib.ImportedArray)
    yield result
    session.close()
    exported.close()


def test_numpy_reads_host_columns_without_copying(imported: aib.ImportedArray) -> None:
    """numpy.from_dlpack gives the imported column's values, by name or index, at the mapped memory."""
    values = np.from_dlpack(aib.column_view(imported, "f"))
    assert values.tolist() == [1.5, 2.5, 3.5]
    assert np.from_dlpack(aib.column_view(imported, 1)).tolist() == [1, 2, 3]
    assert np.from_dlpack(aib.column_view(imported, "u")).dtype == np.uint8
    view = aib.column_view(imported, "f")
    assert view.__dlpack_device__() == (1, 0)
    assert not hasattr(view, "__cuda_array_interface__")  # host data: DLPack only
    assert values.ctypes.data == np.from_dlpack(view).ctypes.data  # the same memory, no copy
    assert not values.flags.writeable  # the mapping is read-only; numpy must not offer writes


def test_view_keeps_the_data_alive_and_then_frees_it() -> None:
    """The numpy array outlives the imported object, the export and the session; dropping it frees
    every owner, node and mapping."""
    before = _live()
    exported = aib.export(pa.record_batch({"x": pa.array(range(1000), pa.int64())}))
    session = aib.Session()
    imported = session.import_message(exported.message, exported.fds)
    values = np.from_dlpack(aib.column_view(imported, "x"))
    imported.release()
    exported.close()
    session.close()
    gc.collect()
    assert int(values.sum()) == sum(range(1000))
    del values, imported
    assert _live() == before


def test_unconsumed_dlpack_capsule_is_freed() -> None:
    """A __dlpack__ capsule nobody consumes releases its hold when it is dropped."""
    before = _live()
    exported = aib.export(pa.record_batch({"x": pa.array([1.0, 2.0])}))
    with aib.Session() as session, session.import_message(exported.message, exported.fds) as imported:
        capsule = aib.column_view(imported, "x").__dlpack__()
        del capsule
    exported.close()
    assert _live() == before


def test_views_refuse_what_a_plain_array_cannot_show(imported: aib.ImportedArray) -> None:
    """Strings, nulls, unknown columns and copy requests are refused with clear errors."""
    with pytest.raises(aib.BridgeError, match="numbers only"):
        aib.column_view(imported, "s")
    with pytest.raises(aib.BridgeError, match="nulls"):
        aib.column_view(imported, "n")
    with pytest.raises(aib.BridgeError, match="no column named"):
        aib.column_view(imported, "missing")
    with pytest.raises(aib.BridgeError, match="no column 9"):
        aib.column_view(imported, 9)
    with pytest.raises(BufferError, match="copy"):
        aib.column_view(imported, "f").__dlpack__(copy=True)


def test_plain_array_has_one_column() -> None:
    """A plain numeric array is viewed as column 0; other columns are refused."""
    exported = aib.export(pa.array([4, 5, 6], pa.int16()))
    with aib.Session() as session, session.import_message(exported.message, exported.fds) as imported:
        assert np.from_dlpack(aib.column_view(imported)).tolist() == [4, 5, 6]
        with pytest.raises(aib.BridgeError, match="one column"):
            aib.column_view(imported, 1)
    exported.close()


# ---------- every numeric type, batches, releases ---------------------------------------------------
NUMERIC_TYPES = [
    (pa.int8(), np.int8),
    (pa.int16(), np.int16),
    (pa.int32(), np.int32),
    (pa.int64(), np.int64),
    (pa.uint8(), np.uint8),
    (pa.uint16(), np.uint16),
    (pa.uint32(), np.uint32),
    (pa.uint64(), np.uint64),
    (pa.float16(), np.float16),
    (pa.float32(), np.float32),
    (pa.float64(), np.float64),
]


def _import(obj: object) -> tuple[aib.Session, aib.ImportedArray | aib.ImportedStream, aib.Exported]:
    exported = aib.export(obj)
    session = aib.Session()
    return session, session.import_message(exported.message, exported.fds), exported


@pytest.mark.parametrize(("arrow_type", "dtype"), NUMERIC_TYPES, ids=[str(t) for t, _ in NUMERIC_TYPES])
def test_every_numeric_type_is_viewed_with_its_values(arrow_type: pa.DataType, dtype: type) -> None:
    """Each numeric type reaches numpy with its dtype and values, read-only, at the imported memory,
    from a column that is not the first (its own offset in the region)."""
    values = np.arange(-3, 29).astype(dtype) if np.dtype(dtype).kind != "u" else np.arange(32).astype(dtype)
    batch = pa.record_batch({"pad": pa.array([1.0] * 32), "x": pa.array(values, arrow_type)})
    session, imported, exported = _import(batch)
    try:
        view = aib.column_view(imported, "x")
        array = np.from_dlpack(view)
        assert array.dtype == np.dtype(dtype)
        assert array.tolist() == values.tolist()
        assert not array.flags.writeable
        assert view.shape == (32,)
        assert view.typestr == np.dtype(dtype).str
        assert np.from_dlpack(view).ctypes.data == array.ctypes.data
    finally:
        session.close()
        exported.close()


def test_sliced_batches_show_their_rows() -> None:
    """A sliced record batch (offsets in the struct and its children) shows only its rows."""
    batch = pa.record_batch({"x": pa.array(range(100), pa.int64()), "y": pa.array(range(100), pa.float32())})
    session, imported, exported = _import(batch.slice(10, 5))
    try:
        assert np.from_dlpack(aib.column_view(imported, "x")).tolist() == [10, 11, 12, 13, 14]
        assert np.from_dlpack(aib.column_view(imported, "y")).tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]
    finally:
        session.close()
        exported.close()


def test_a_sliced_struct_root_offsets_its_columns() -> None:
    """A struct array sliced at its root (the offset on the struct, not on its children) shows the
    struct's rows of each child."""
    struct = pa.StructArray.from_arrays([pa.array(range(10), pa.int16())], names=["x"]).slice(4, 3)
    session, imported, exported = _import(struct)
    try:
        assert np.from_dlpack(aib.column_view(imported, "x")).tolist() == [4, 5, 6]
        assert aib.column_arrays(imported, "numpy")["x"].tolist() == [4, 5, 6]
    finally:
        session.close()
        exported.close()


def test_tables_and_streams_are_viewed_batch_by_batch() -> None:
    """column_view of an ImportedStream takes a batch index; each batch shows its own rows; a batch out
    of range is refused."""
    table = pa.Table.from_batches(
        [pa.record_batch({"x": pa.array([i * 10 + j for j in range(i + 1)], pa.int32())}) for i in range(3)]
    )
    session, imported, exported = _import(table)
    try:
        assert isinstance(imported, aib.ImportedStream)
        for i in range(3):
            assert np.from_dlpack(aib.column_view(imported, "x", batch=i)).tolist() == [
                i * 10 + j for j in range(i + 1)
            ]
        assert np.from_dlpack(aib.column_view(imported, 0)).tolist() == [0]  # batch 0 by default
        with pytest.raises(aib.BridgeError, match="batch 3 out of range"):
            aib.column_view(imported, "x", batch=3)
        with pytest.raises(aib.InvalidArgumentError, match="batch must be an int >= 0"):
            aib.column_view(imported, "x", batch=-1)
    finally:
        session.close()
        exported.close()


def test_empty_columns_are_empty_arrays() -> None:
    """A batch with no rows gives empty arrays."""
    session, imported, exported = _import(pa.record_batch({"x": pa.array([], pa.float64())}))
    try:
        assert np.from_dlpack(aib.column_view(imported, "x")).shape == (0,)
    finally:
        session.close()
        exported.close()


def test_released_imported_data_is_refused_but_views_stay_valid() -> None:
    """After release, column_view raises ClosedError; a view made before keeps working."""
    before = _live()
    session, imported, exported = _import(pa.record_batch({"x": pa.array([1.0, 2.0])}))
    view = aib.column_view(imported, "x")
    imported.release()
    with pytest.raises(aib.ClosedError, match="released") as raised:
        aib.column_view(imported, "x")
    assert raised.value.reason == "released"
    assert np.from_dlpack(view).tolist() == [1.0, 2.0]
    session.close()
    exported.close()
    del view
    assert _live() == before


def test_column_view_needs_bridge_data() -> None:
    """Objects the bridge did not import are refused with a TypeError that says what it wants."""
    with pytest.raises(TypeError, match="ImportedArray or ImportedStream"):
        aib.column_view(pa.record_batch({"x": [1]}), "x")  # type: ignore[arg-type]


# ---------- DLPack: versioned and legacy capsules, refusals ------------------------------------------
class _ManagedTensorVersioned(ctypes.Structure):
    # DLManagedTensorVersioned's head: version (major, minor), manager_ctx, deleter, flags
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
    ]


def _versioned_head(capsule: object) -> _ManagedTensorVersioned:
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return _ManagedTensorVersioned.from_address(get_pointer(capsule, b"dltensor_versioned"))


def test_versioned_capsule_for_consumers_that_ask(imported: aib.ImportedArray) -> None:
    """max_version (1, 0) or higher gives a DLPack 1.0 "dltensor_versioned" capsule flagged read-only
    (host mappings are read-only); None or an older version gives the legacy "dltensor" capsule."""
    view = aib.column_view(imported, "f")
    for max_version in [(1, 0), (1, 3), (2, 0)]:
        capsule = view.__dlpack__(max_version=max_version)
        assert _ffi.capsule_name(capsule) == b"dltensor_versioned"
        head = _versioned_head(capsule)
        assert (head.major, head.minor) == (1, 0)
        assert head.flags & 1  # DLPACK_FLAG_BITMASK_READ_ONLY
        del head, capsule
    for legacy in [{}, {"max_version": None}, {"max_version": (0, 8)}]:
        assert _ffi.capsule_name(view.__dlpack__(**legacy)) == b"dltensor"


def test_numpy_reads_both_capsules(imported: aib.ImportedArray) -> None:
    """NumPy asks for the versioned capsule and gets a read-only array; a consumer that can only take
    the legacy capsule still gets the same memory."""

    class LegacyOnly:
        def __init__(self, view: aib.ColumnView) -> None:
            self.view = view

        def __dlpack__(self, stream: object = None) -> object:
            return self.view.__dlpack__()

        def __dlpack_device__(self) -> tuple[int, int]:
            return self.view.__dlpack_device__()

    view = aib.column_view(imported, "f")
    versioned = np.from_dlpack(view)
    legacy = np.from_dlpack(LegacyOnly(view))
    assert not versioned.flags.writeable
    assert legacy.tolist() == versioned.tolist() == [1.5, 2.5, 3.5]
    assert legacy.ctypes.data == versioned.ctypes.data


def test_dlpack_refuses_other_devices_and_copies(imported: aib.ImportedArray) -> None:
    """dl_device must be where the data is and copy must not be True (BufferError: never a copy);
    copy=False and the right device are fine; a malformed max_version is a TypeError."""
    view = aib.column_view(imported, "f")
    assert _ffi.capsule_name(view.__dlpack__(dl_device=(1, 0), copy=False, max_version=(1, 0))) == (
        b"dltensor_versioned"
    )
    with pytest.raises(BufferError, match=r"device \(1, 0\), not \(2, 0\)"):
        view.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError, match="never copy"):
        view.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="never copy"):
        np.from_dlpack(view, copy=True)
    with pytest.raises(TypeError, match="max_version"):
        view.__dlpack__(max_version=3)
    with pytest.raises(TypeError):
        view.__dlpack__(unknown=1)


def test_unconsumed_versioned_capsule_is_freed() -> None:
    """A versioned capsule nobody consumes releases its hold when it is dropped."""
    before = _live()
    exported = aib.export(pa.record_batch({"x": pa.array([1.0, 2.0])}))
    with aib.Session() as session, session.import_message(exported.message, exported.fds) as imported:
        capsule = aib.column_view(imported, "x").__dlpack__(max_version=(1, 0))
    assert _live() != before  # the capsule still holds the message
    del capsule
    exported.close()
    assert _live() == before


def test_dlpack_columns_are_made_by_the_bridge_only(imported: aib.ImportedArray) -> None:
    """The C type behind a view cannot be made empty from Python, and __dlpack__ takes keywords only."""
    with pytest.raises(TypeError):
        _ffi.DLPackColumn()
    with pytest.raises(TypeError, match="keyword arguments only"):
        aib.column_view(imported, "f").__dlpack__(None)


# ---------- any numeric batch, any slice ---------------------------------------------------------------
@st.composite
def _numeric_batches(draw: st.DrawFn) -> tuple[pa.RecordBatch | pa.StructArray, pa.RecordBatch]:
    """(what to export, the batch it shows): 1-4 numeric columns of any of the 11 types with random
    values, as a record batch sliced at a random offset or a struct array sliced at its root."""
    rows = draw(st.integers(0, 40))
    columns = {}
    for i in range(draw(st.integers(1, 4))):
        arrow_type, dtype = draw(st.sampled_from(NUMERIC_TYPES))
        info = np.finfo(dtype) if np.dtype(dtype).kind == "f" else np.iinfo(dtype)
        bound = min(int(info.max), 1 << 20)
        low = 0 if np.dtype(dtype).kind == "u" else -bound
        values = draw(st.lists(st.integers(low, bound), min_size=rows, max_size=rows))
        columns[f"c{i}"] = pa.array(np.array(values).astype(dtype), arrow_type)
    batch = pa.record_batch(columns)
    start = draw(st.integers(0, rows))
    length = draw(st.integers(0, rows - start))
    if draw(st.booleans()):
        return batch.slice(start, length), batch.slice(start, length)
    struct = pa.StructArray.from_arrays(list(batch.columns), names=batch.schema.names).slice(start, length)
    return struct, pa.RecordBatch.from_struct_array(struct)


@given(case=_numeric_batches())
def test_any_numeric_batch_reads_back_exactly(
    case: tuple[pa.RecordBatch | pa.StructArray, pa.RecordBatch],
) -> None:
    """column_view and column_arrays give what pyarrow gives for every column of any numeric batch,
    sliced anywhere (on its children or at its struct root)."""
    exported_object, batch = case
    session, imported, exported = _import(exported_object)
    try:
        arrays = aib.column_arrays(imported, "numpy")
        assert list(arrays) == batch.schema.names
        for name in batch.schema.names:
            expected = batch.column(name).to_numpy(zero_copy_only=False)
            assert arrays[name].dtype == expected.dtype
            assert arrays[name].tolist() == expected.tolist()
            assert np.from_dlpack(aib.column_view(imported, name)).tolist() == expected.tolist()
        del arrays
    finally:
        session.close()
        exported.close()
