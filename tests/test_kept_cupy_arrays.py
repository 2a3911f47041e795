"""Kept CuPy arrays (``consumer/array_cache.py``): a standing-lease session's ``column_arrays(..., "cupy")``
hands out the arrays it made for the same remembered message again when nothing else holds them,
moves their owner to the new get's lease, and lets go of what it keeps ``pool_linger`` seconds after
the last hand-out, on ``forget`` and on ``close``. docs/lifetime.md ("Kept CuPy arrays") says what is
tested here.

Without a GPU: a stand-in CuPy whose ``UnownedMemory`` / ``MemoryPointer`` / ``ndarray`` link to
each other as CuPy's do (array.data -> pointer, pointer.mem -> memory, memory.owner -> owner), over
host data labelled as CUDA data (nothing reads it as such). test_columns_gpu.py runs real CuPy.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from helpers.counting import SessionCounts

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import _ffi
from arrow_ipc_bridge.consumer.imported import imported_from
from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA
from arrow_ipc_bridge.wire.metadata import Decoded
from tests.helpers.session_rig import wait_for

# Long enough that the tests which do not wait for the linger finish each step well within it on a
# loaded 2-core machine (each step's gc.collect() alone can take a tenth of a second there); the
# tests that wait for it poll (wait_for).
LINGER = 2.0


class _Memory:
    def __init__(self, ptr: int, size: int, owner: object, device_id: int) -> None:
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class _Pointer:
    def __init__(self, mem: _Memory, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + offset


class _Array:
    def __init__(self, shape: tuple[int, ...], dtype: Any, memptr: _Pointer) -> None:
        self.shape, self.dtype, self.data = shape, dtype, memptr


class _FakeCupy(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("cupy")
        self.dtype = np.dtype
        self.cuda = types.SimpleNamespace(UnownedMemory=_Memory, MemoryPointer=_Pointer)
        self.ndarray = _Array


@pytest.fixture(autouse=True)
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy())


def _batch(values: list[float]) -> pa.RecordBatch:
    return pa.record_batch({"a": pa.array(values), "b": pa.array(range(len(values)), pa.int32())})


@pytest.fixture
def publisher() -> Iterator[aib.Publisher]:
    with aib.Publisher(os.path.join(tempfile.mkdtemp(dir="/tmp"), "kept.sock")) as pub:
        pub.publish(
            "t", pa.record_batch({"a": pa.array([1.0, 2.0, 3.0]), "b": pa.array([4, 5, 6], pa.int32())})
        )
        yield pub


def _as_cuda(imported: Any) -> Any:
    """The import labelled as CUDA data, with what the session set on it for column_arrays."""
    labelled = imported_from(
        Decoded.sharing(imported._decoded),
        imported._bases,
        device_type=DEVICE_CUDA,
        device_id=0,
        name=imported.name,
    )
    labelled._kept_arrays = imported._kept_arrays
    return labelled


def _arrays(session: aib.Session, **kwargs: Any) -> dict[str, Any]:
    """One step of a consumer: get, take the columns as (stand-in) CuPy arrays, release the import."""
    with session.get("t") as imported:
        arrays = aib.column_arrays(_as_cuda(imported), "cupy", stream=0, **kwargs)
    gc.collect()  # the labelled import is gone: only the arrays hold the batch
    return arrays


def _lease_of(array: _Array) -> object:
    holder = array.data.mem.owner
    return holder.lease  # type: ignore[attr-defined]


def _warm(session: aib.Session) -> None:
    """Two gets: the second remembers the message and takes the standing lease."""
    for _ in range(2):
        session.get("t").release()


def test_unheld_arrays_are_handed_out_again_with_the_new_lease(publisher: aib.Publisher) -> None:
    counts = SessionCounts()
    before = aib.stats().session.reused_cupy_arrays
    with aib.connect(publisher.path, timeout=10.0, pool_linger=LINGER) as session:
        _warm(session)
        first = _arrays(session)
        ids = {name: id(array) for name, array in first.items()}
        first_lease = _lease_of(first["a"])
        del first
        second = _arrays(session)
        assert {name: id(array) for name, array in second.items()} == ids
        assert list(second) == ["a", "b"]
        assert (second["a"].shape, second["b"].dtype) == ((3,), np.dtype("int32"))
        # The arrays hold this get's batch lease now, not the first one's.
        lease = _lease_of(second["a"])
        assert _ffi.capsule_name(lease) == b"arrow_ipc_bridge.batch_lease"
        assert lease is not first_lease
        assert counts.reused_cupy_arrays == 1
        assert counts.local_gets >= 2
    assert aib.stats().session.reused_cupy_arrays - before == 1


@pytest.mark.parametrize("held", ["dict", "array", "pointer", "memory", "view"])
def test_arrays_anything_still_holds_are_not_handed_out_again(publisher: aib.Publisher, held: str) -> None:
    """Holding the dict, an array, its pointer, its memory, or an object that holds an array (as a
    view's base does) makes the next call make new arrays."""
    counts = SessionCounts()
    with aib.connect(publisher.path, timeout=10.0, pool_linger=LINGER) as session:
        _warm(session)
        first = _arrays(session)
        keep: object = {
            "dict": first,
            "array": first["b"],
            "pointer": first["b"].data,
            "memory": first["b"].data.mem,
            "view": types.SimpleNamespace(base=first["b"]),
        }[held]
        old = {name: id(array) for name, array in first.items()}
        del first
        second = _arrays(session)
        assert all(id(second[name]) != old[name] for name in old)
        assert counts.reused_cupy_arrays == 0
        # What is still held keeps its own (first) lease; the new arrays hold the new one.
        del second
        third = _arrays(session)  # the second set is unheld now: handed out again
        assert counts.reused_cupy_arrays == 1
        del third, keep


def test_an_array_reshaped_in_place_is_not_handed_out_again(publisher: aib.Publisher) -> None:
    counts = SessionCounts()
    with aib.connect(publisher.path, timeout=10.0, pool_linger=LINGER) as session:
        _warm(session)
        first = _arrays(session)
        first["a"].shape = (1, 3)  # CuPy lets a contiguous array's shape be set in place
        del first
        second = _arrays(session)
        assert second["a"].shape == (3,)
        assert counts.reused_cupy_arrays == 0


def test_each_column_choice_and_batch_is_kept_apart(publisher: aib.Publisher) -> None:
    counts = SessionCounts()
    with aib.connect(publisher.path, timeout=10.0, pool_linger=LINGER) as session:
        _warm(session)
        everything = _arrays(session)
        only_b = _arrays(session, names=["b"])
        assert list(only_b) == ["b"]
        assert only_b["b"] is not everything["b"]
        everything_id, only_b_id = id(everything["a"]), id(only_b["b"])
        del everything, only_b
        assert id(_arrays(session)["a"]) == everything_id
        assert id(_arrays(session, names=["b"])["b"]) == only_b_id
        assert counts.reused_cupy_arrays == 2


def test_other_data_under_the_name_gets_new_arrays(publisher: aib.Publisher) -> None:
    counts = SessionCounts()
    with aib.connect(publisher.path, timeout=10.0, pool_linger=LINGER) as session:
        _warm(session)
        first = _arrays(session)
        old_id = id(first["a"])
        del first
        publisher.publish(
            "t", pa.record_batch({"a": pa.array([7.0, 8.0]), "b": pa.array([1, 2], pa.int32())})
        )
        _warm(session)
        second = _arrays(session)
        assert id(second["a"]) != old_id
        assert second["a"].shape == (2,)
        assert counts.reused_cupy_arrays == 0


def test_what_is_kept_is_let_go_after_the_linger(publisher: aib.Publisher) -> None:
    """Once the consumer holds nothing, the kept arrays hold the lease only for pool_linger seconds,
    as the standing lease does: then the publisher sees no lease."""
    with aib.connect(publisher.path, timeout=10.0, pool_linger=LINGER) as session:
        _warm(session)
        del _arrays(session)["a"]
        assert publisher.active_leases >= 1
        assert wait_for(lambda: publisher.active_leases == 0, 10.0)
        assert len(session._kept_arrays or ()) == 0
        # and the next call makes arrays again, kept again
        _warm(session)
        _arrays(session)
        assert len(session._kept_arrays or ()) == 1


def test_arrays_the_user_holds_outlive_the_linger_and_keep_their_lease(publisher: aib.Publisher) -> None:
    with aib.connect(publisher.path, timeout=10.0, pool_linger=LINGER) as session:
        _warm(session)
        arrays = _arrays(session)
        assert wait_for(lambda: len(session._kept_arrays or ()) == 0, 10.0)
        assert publisher.active_leases >= 1  # the user's arrays hold their batch lease
        assert arrays["a"].data.mem.owner.lease is not None
        del arrays
        assert wait_for(lambda: publisher.active_leases == 0, 10.0)


@pytest.mark.parametrize("end", ["forget", "close"])
def test_forget_and_close_let_go_at_once(publisher: aib.Publisher, end: str) -> None:
    session = aib.connect(publisher.path, timeout=10.0, pool_linger=60.0)
    try:
        _warm(session)
        del _arrays(session)["a"]
        assert len(session._kept_arrays or ()) == 1
        if end == "forget":
            session.forget("t")
        else:
            session.close()
        assert len(session._kept_arrays or ()) == 0
        assert wait_for(lambda: publisher.active_leases == 0, 10.0)
    finally:
        session.close()


def test_without_standing_leases_nothing_is_kept(publisher: aib.Publisher) -> None:
    """``pool_linger=0`` keeps no standing lease, and so no CuPy arrays either."""
    counts = SessionCounts()
    with aib.connect(publisher.path, timeout=10.0, pool_linger=0) as session:
        _warm(session)
        first = _arrays(session)
        assert _ffi.capsule_name(first["a"].data.mem.owner) == b"arrow_ipc_bridge.batch_lease"
        del first
        second = _arrays(session)
        assert _ffi.capsule_name(second["a"].data.mem.owner) == b"arrow_ipc_bridge.batch_lease"
        assert counts.reused_cupy_arrays == 0
        assert session._kept_arrays is None
        del second  # the user's last array: its lease ends with it
        assert wait_for(lambda: publisher.active_leases == 0, 10.0)
