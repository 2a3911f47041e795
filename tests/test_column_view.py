"""Zero-copy column views: DLPack for host data (numpy), lifetimes, and clear refusals."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import _reaper
from arrow_ipc_bridge._ffi import lib


def _live() -> tuple[int, int, int]:
    gc.collect()
    _reaper.drain()
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
