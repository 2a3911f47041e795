"""Capsules of imported data built by the C core: protocol capsule pairs from one C call, a release
racing struct building, children moved out of a released parent, owners without a view.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pyarrow as pa
import pytest
from helpers.counting import SessionCounts
from helpers.session_rig import JOIN_S, null_batch, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.wire.capsules import capsule_struct, owner_address
from arrow_ipc_bridge.wire.metadata import Decoded

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_protocol_capsules_are_built_by_the_c_core(publisher: aib.Publisher, monkeypatch: Any) -> None:
    """Imported arrays' capsule pairs come from one C call (device_array_capsules, array_capsules) on
    the first get, on remembered gets and for host data with regions; they hold what the Python path
    builds, and when the C call cannot (no view) the Python path answers. A released object refuses
    both calls."""
    counts = SessionCounts()
    from arrow_ipc_bridge.consumer import imported as imported_module
    from arrow_ipc_bridge.wire.capsules import device_array_capsules

    with_regions = pa.record_batch({"x": pa.array([1, None, 3]), "s": pa.array(["a", None, "ccc"])})
    publisher.publish("nulls", null_batch(4, 100))
    publisher.publish("data", with_regions)
    expected = {"nulls": null_batch(4, 100), "data": with_regions}
    with aib.connect(publisher.path, timeout=5.0) as session:
        for _ in range(3):
            for name, batch in expected.items():
                with session.get(name) as imported:
                    decoded = imported._decoded
                    assert device_array_capsules(owner_address(decoded.owner)) is not None
                    assert pa.RecordBatch._import_from_c_device_capsule(
                        *imported.__arrow_c_device_array__()
                    ).equals(batch)
                    assert pa.record_batch(imported).equals(batch)  # __arrow_c_array__
        assert counts.remembered_gets == 4  # host data with regions is remembered too
        monkeypatch.setattr(imported_module, "device_array_capsules", lambda address: None)
        monkeypatch.setattr(imported_module, "array_capsules", lambda address: None)
        for name, batch in expected.items():
            with session.get(name) as imported:
                assert pa.record_batch(imported).equals(batch)
                schema, array = imported.__arrow_c_device_array__()
                assert pa.RecordBatch._import_from_c_device_capsule(schema, array).equals(batch)
        monkeypatch.undo()
        imported = session.get("data")
        imported.release()
        with pytest.raises(aib.ClosedError) as raised:
            imported.__arrow_c_device_array__()
        assert raised.value.reason == "released"
        with pytest.raises(aib.ClosedError) as raised:
            imported.__arrow_c_array__()
        assert raised.value.reason == "released"
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_release_while_another_thread_builds_structs_waits_for_it(publisher: aib.Publisher) -> None:
    """A protocol call borrows the imported message around its C calls (which release the GIL): a
    release() on another thread meanwhile refuses new calls at once but frees nothing until the call
    is done. Deterministic part: a borrow held across release(); then threads racing for real."""
    batch = pa.record_batch({"x": pa.array(range(1000)), "s": pa.array(["v"] * 1000)})
    publisher.publish("t", batch)
    with aib.connect(publisher.path, timeout=5.0) as session:
        imported = session.get("t")
        decoded = imported._decoded
        decoded.borrow()
        imported.release()
        with pytest.raises(aib.ClosedError) as raised:
            pa.record_batch(imported)
        assert raised.value.reason == "released"
        reaper.settle()
        session.ping()  # a RELEASE, had one gone out, would have reached the publisher by now
        assert publisher.active_leases == 1  # still borrowed
        decoded.unborrow()  # the deferred release happens here
        assert wait_for(lambda: publisher.active_leases == 0, 2.0)

        errors: list[BaseException] = []
        for _ in range(100):
            imported = session.get("t")
            start = threading.Barrier(2)

            def build(target: aib.ImportedArray = imported, start: threading.Barrier = start) -> None:
                start.wait()
                try:
                    while True:
                        assert pa.record_batch(target).num_rows == 1000
                        target.__arrow_c_device_array__()
                except aib.ClosedError:
                    pass
                except BaseException as exc:
                    errors.append(exc)

            thread = threading.Thread(target=build)
            thread.start()
            start.wait()
            imported.release()
            thread.join(JOIN_S)
            assert not thread.is_alive()
        assert errors == []
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_a_child_moved_out_outlives_its_released_parent(publisher: aib.Publisher) -> None:
    """The C data interface lets a consumer move a child array (and schema) out and release the parent:
    the child's memory, in the rebuilt tree's one allocation, stays valid until the child is released
    too; then every node is gone and the lease ends."""
    batch = pa.record_batch(
        {
            "x": pa.array([1, None, 3]),
            "s": pa.array(["a", None, "ccc"]),
            "l": pa.array([[1, 2], None, [3]], pa.list_(pa.int32())),
        }
    )
    publisher.publish("t", batch)
    nodes_before = int(lib.aib_live_nodes())
    with aib.connect(publisher.path, timeout=5.0) as session:
        for _ in range(2):  # the first get and a remembered-or-not second one
            with session.get("t") as imported:
                schema_capsule, array_capsule = imported.__arrow_c_array__()
            schema = capsule_struct(schema_capsule, "schema")
            array = capsule_struct(array_capsule, "array")
            for i in (2, 0):  # a nested child, then a flat one; each moved out, then its parent released
                child_schema = ffi.new("struct ArrowSchema *")
                child_array = ffi.new("struct ArrowArray *")
                ffi.memmove(child_schema, schema.children[i], ffi.sizeof("struct ArrowSchema"))
                ffi.memmove(child_array, array.children[i], ffi.sizeof("struct ArrowArray"))
                schema.children[i].release = ffi.NULL
                array.children[i].release = ffi.NULL
                schema.release(schema)
                array.release(array)
                reaper.settle()  # a RELEASE, had the lease ended, is sent now
                session.ping()  # and the publisher took it before answering (frames are in order)
                assert publisher.active_leases == 1  # the moved child still holds the lease
                moved = pa.Array._import_from_c(
                    int(ffi.cast("uintptr_t", child_array)), int(ffi.cast("uintptr_t", child_schema))
                )
                assert moved.equals(batch.column(i))
                del moved  # pyarrow released the moved structs: the lease ends (on the reaper thread)
                assert wait_for(lambda: publisher.active_leases == 0, 2.0)
                schema_capsule, array_capsule = imported_again(session)
                schema = capsule_struct(schema_capsule, "schema")
                array = capsule_struct(array_capsule, "array")
            del schema, array, schema_capsule, array_capsule
            gc.collect()
            assert int(lib.aib_live_nodes()) == nodes_before
            assert wait_for(lambda: publisher.active_leases == 0, 2.0)
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def imported_again(session: aib.Session) -> tuple[object, object]:
    """A fresh capsule pair of "t" whose import is released at once (the structs keep the lease)."""
    with session.get("t") as imported:
        return imported.__arrow_c_array__()


def test_an_owner_without_a_view_builds_no_capsules() -> None:
    """The C capsule functions answer None (the caller's cue for the Python path) for an owner that was
    never told where its regions are, and for one without a decoded message; a 0 address is refused."""
    from arrow_ipc_bridge.wire.capsules import array_capsules, device_array_capsules

    decoded = Decoded(aib.export(null_batch(2, 5)).message)
    try:
        assert device_array_capsules(owner_address(decoded.owner)) is None
        assert array_capsules(owner_address(decoded.owner)) is None
    finally:
        decoded.close()
    bare = ffi.gc(lib.aib_owner_new(0), lib.aib_owner_unref)
    bases = ffi.new("uint64_t[]", [0])
    assert lib.aib_owner_set_view(bare, bases, 1, lib.ARROW_DEVICE_CPU, -1) == 0
    assert lib.aib_owner_set_view(bare, bases, 1, lib.ARROW_DEVICE_CPU, -1) == lib.AIB_E_STATE
    assert device_array_capsules(owner_address(bare)) is None
    with pytest.raises(ValueError, match="0"):
        device_array_capsules(0)
