"""column_arrays: every numeric column of a batch as arrays of one library in one call (host data
through NumPy here; CuPy and PyTorch in test_columns_gpu.py), zero-copy, each array holding the
batch (and the producer's lease) alive on its own.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): descriptors, live owners,
struct nodes, mappings and threads return to what they were.
"""

from __future__ import annotations

import gc
import sys
import types

import numpy as np
import pyarrow as pa
import pytest
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import _ffi
from arrow_ipc_bridge._ffi import lib
from arrow_ipc_bridge.runtime import reaper

pytestmark = pytest.mark.usefixtures("no_leaks")

NUMERIC = {
    "i8": pa.int8(),
    "i16": pa.int16(),
    "i32": pa.int32(),
    "i64": pa.int64(),
    "u8": pa.uint8(),
    "u16": pa.uint16(),
    "u32": pa.uint32(),
    "u64": pa.uint64(),
    "f16": pa.float16(),
    "f32": pa.float32(),
    "f64": pa.float64(),
}


def _mixed_batch(rows: int = 6, start: int = 0) -> pa.RecordBatch:
    columns: dict[str, pa.Array] = {
        name: pa.array(range(start, start + rows), t) for name, t in NUMERIC.items()
    }
    columns["text"] = pa.array([str(i) for i in range(rows)])
    columns["category"] = pa.array(["a", "b"] * (rows // 2)).dictionary_encode()
    return pa.record_batch(columns)


def test_every_numeric_column_in_one_call(publisher: aib.Publisher) -> None:
    """All numeric columns come back by name, in order, with their dtypes and values, read-only, at
    the imported memory; strings and dictionary-encoded columns are left out."""
    publisher.publish("b", _mixed_batch())
    with aib.connect(publisher.path) as session, session.get("b") as imported:
        arrays = aib.column_arrays(imported, "numpy")
        assert list(arrays) == list(NUMERIC)
        for name, arrow_type in NUMERIC.items():
            assert arrays[name].dtype == np.dtype(arrow_type.to_pandas_dtype()), name
            assert arrays[name].tolist() == list(range(6)), name
            assert not arrays[name].flags.writeable, name
        view = np.from_dlpack(aib.column_view(imported, "f32"))
        assert arrays["f32"].ctypes.data == view.ctypes.data  # zero-copy: the same mapped memory
        del arrays, view


def test_names_pick_columns_and_order(publisher: aib.Publisher) -> None:
    """names= takes the columns asked for, in that order; the module itself works as ``like``."""
    publisher.publish("b", _mixed_batch())
    with aib.connect(publisher.path) as session, session.get("b") as imported:
        arrays = aib.column_arrays(imported, np, names=["f64", "i8"])
        assert list(arrays) == ["f64", "i8"]
        assert arrays["i8"].tolist() == list(range(6))
        del arrays


def test_arrays_hold_the_lease_until_the_last_one_dies(publisher: aib.Publisher) -> None:
    """The arrays outlive the imported object and the publication; the producer's lease ends when the
    last array is dropped, not before (the session stays connected: closing it ends every lease)."""
    publisher.publish(
        "b", pa.record_batch({"x": pa.array(range(1000), pa.int64()), "y": pa.array([0.5] * 1000)})
    )
    with aib.connect(publisher.path) as session:
        imported = session.get("b")
        arrays = aib.column_arrays(imported, "numpy")
        assert publisher.active_leases == 1
        imported.release()
        del imported
        publisher.unpublish("b")
        gc.collect()
        reaper.settle()
        assert publisher.active_leases == 1
        first = arrays.pop("x")
        arrays.clear()
        gc.collect()
        reaper.settle()
        assert publisher.active_leases == 1  # one array still holds the batch
        assert int(first.sum()) == sum(range(1000))
        del first
        gc.collect()
        assert wait_for(lambda: (reaper.drain(), publisher.active_leases == 0)[1], 5.0)


def test_tables_give_each_batch(publisher: aib.Publisher) -> None:
    """A table's batches are taken one at a time with batch=; out of range is refused."""
    table = pa.Table.from_batches([_mixed_batch(4, start=10 * i) for i in range(3)])
    publisher.publish("t", table)
    with aib.connect(publisher.path) as session, session.get("t") as imported:
        assert isinstance(imported, aib.ImportedStream)
        for i in range(3):
            assert aib.column_arrays(imported, "numpy", batch=i)["i64"].tolist() == [
                10 * i + j for j in range(4)
            ]
        with pytest.raises(aib.BridgeError, match="batch 3 out of range"):
            aib.column_arrays(imported, "numpy", batch=3)


def test_refusals_say_why(publisher: aib.Publisher) -> None:
    """Nulls, unknown or non-numeric names, duplicate names, a plain array, the wrong library for the
    device, an unknown library and released data each raise a clear error."""
    publisher.publish("nulls", pa.record_batch({"x": pa.array([1.0, None]), "y": pa.array([1.0, 2.0])}))
    publisher.publish("dup", pa.RecordBatch.from_arrays([pa.array([1]), pa.array([2])], names=["a", "a"]))
    publisher.publish("plain", pa.array([1, 2, 3]))
    publisher.publish("b", _mixed_batch())
    with aib.connect(publisher.path) as session:
        with session.get("nulls") as imported:
            with pytest.raises(aib.BridgeError, match="'x' has nulls"):
                aib.column_arrays(imported, "numpy")
            assert aib.column_arrays(imported, "numpy", names=["y"])["y"].tolist() == [1.0, 2.0]
        with (
            session.get("dup") as imported,
            pytest.raises(aib.BridgeError, match="two columns are named 'a'"),
        ):
            aib.column_arrays(imported, "numpy")
        with session.get("plain") as imported, pytest.raises(aib.BridgeError, match="use column_view"):
            aib.column_arrays(imported, "numpy")
        with session.get("b") as imported:
            with pytest.raises(aib.BridgeError, match="no column named 'nope'"):
                aib.column_arrays(imported, "numpy", names=["nope"])
            with pytest.raises(aib.BridgeError, match="numbers only"):
                aib.column_arrays(imported, "numpy", names=["text"])
            with pytest.raises(aib.BridgeError, match="numbers only"):
                aib.column_arrays(imported, "numpy", names=["category"])
            with pytest.raises(TypeError, match="not one string"):
                aib.column_arrays(imported, "numpy", names="i8")
            with pytest.raises(aib.BridgeError, match="needs CUDA data"):
                aib.column_arrays(imported, "cupy")
            with pytest.raises(aib.BridgeError, match="no read-only tensors"):
                aib.column_arrays(imported, "torch")
            with pytest.raises(ValueError, match="like must be one of"):
                aib.column_arrays(imported, "jax")
            imported.release()
            with pytest.raises(aib.ClosedError, match="released") as raised:
                aib.column_arrays(imported, "numpy")
            assert raised.value.reason == "released"


def test_address_form_refuses_nulls_too(publisher: aib.Publisher) -> None:
    """The CuPy path reads addresses, which every column has: a numeric column with nulls is still
    refused before any array is made (checked here on host data, where CuPy cannot run)."""
    from arrow_ipc_bridge.arrays import columns

    publisher.publish("nulls", pa.record_batch({"x": pa.array([1.0, None]), "y": pa.array([1.0, 2.0])}))
    with aib.connect(publisher.path) as session, session.get("nulls") as imported:
        _, _, facts, _ = columns._read_batch(imported, 0, columns._AS_ADDRESSES, None, None)
        with pytest.raises(aib.BridgeError, match="'x' has nulls"):
            columns._choose(facts, None)
        assert [fact[0] for fact in columns._choose(facts, ["y"])] == ["y"]


# ---------- the CUDA branches, with stand-ins for CuPy and PyTorch -----------------------------------
# The GPU tests (test_columns_gpu.py) run the real libraries; these check on any machine what
# column_arrays hands them: every address, length, dtype and device, and an owner that keeps the
# batch alive. The data is host memory labelled as CUDA data (nothing reads it as such).
class _FakeCupy(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("cupy")
        self.dtype = np.dtype
        self.cuda = types.SimpleNamespace(
            UnownedMemory=lambda ptr, size, owner, device: {
                "ptr": ptr,
                "size": size,
                "owner": owner,
                "device": device,
            },
            MemoryPointer=lambda memory, offset: (memory, offset),
        )
        self.ndarray = lambda shape, dtype, memptr: {"shape": shape, "dtype": dtype, "memptr": memptr}


def _as_cuda_data(imported: aib.ImportedArray) -> aib.ImportedArray:
    from arrow_ipc_bridge.consumer.imported import imported_from
    from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA
    from arrow_ipc_bridge.wire.metadata import Decoded

    cuda_labelled = imported_from(
        Decoded.sharing(imported._decoded), imported._bases, device_type=DEVICE_CUDA, device_id=3
    )
    assert isinstance(cuda_labelled, aib.ImportedArray)
    return cuda_labelled


def test_cupy_branch_wraps_every_address_with_the_batch_lease(
    publisher: aib.Publisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """like="cupy": one UnownedMemory per column at the column's address and size, on the data's
    device, owned by a batch lease that keeps the message alive until the arrays are gone."""
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy())
    publisher.publish("b", _mixed_batch())
    with aib.connect(publisher.path) as session, session.get("b") as imported:
        expected = {name: np.from_dlpack(aib.column_view(imported, name)) for name in NUMERIC}
        cuda_data = _as_cuda_data(imported)
        arrays = aib.column_arrays(cuda_data, "cupy")
        cuda_data.release()
        assert list(arrays) == list(NUMERIC)
        for name, array in arrays.items():
            memory, offset = array["memptr"]
            assert (array["shape"], array["dtype"], offset) == ((6,), expected[name].dtype, 0)
            assert (memory["ptr"], memory["size"], memory["device"]) == (
                expected[name].ctypes.data,
                expected[name].nbytes,
                3,
            )
            assert _ffi.capsule_name(memory["owner"]) == b"arrow_ipc_bridge.batch_lease"
        owners = int(lib.aib_live_owners())
        del arrays, expected, array, memory
        gc.collect()
        assert int(lib.aib_live_owners()) < owners  # the lease went with the last array


def test_torch_branch_gets_legacy_capsules(publisher: aib.Publisher, monkeypatch: pytest.MonkeyPatch) -> None:
    """like="torch": torch.from_dlpack gets one legacy capsule per numeric column (raw capsules:
    the wait for the producer was made once for the batch)."""
    seen: list[object] = []
    fake_torch = types.ModuleType("torch")
    fake_torch.from_dlpack = lambda capsule: seen.append(capsule) or capsule  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    publisher.publish("b", _mixed_batch())
    with aib.connect(publisher.path) as session, session.get("b") as imported:
        cuda_data = _as_cuda_data(imported)
        tensors = aib.column_arrays(cuda_data, "torch", names=["f32", "u8"])
        cuda_data.release()
        assert list(tensors) == ["f32", "u8"]
        assert [_ffi.capsule_name(capsule) for capsule in seen] == [b"dltensor", b"dltensor"]
        del tensors
        seen.clear()
