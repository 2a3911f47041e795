"""Shared array trees of the C core (struct_trees.c): a consumer may move a child out and release the parent.

The C data interface allows a consumer to move any child of an array (``memcpy`` it out and set the
original's ``release`` to NULL) and release the parent and the child independently, in any order, on
any thread. The trees ``aib_array_share`` builds for captured data must then release each node exactly
once: the parent must skip the moved child, and the child, released on its own, must free its node and
drop its reference on the capture's owner. These tests move children out of shared arrays and check
that every counter of the core (owners, nodes) and pyarrow's allocation come back to the baseline.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pyarrow as pa
import pytest

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.wire.capsules import capture, export_captured, new_capsule


def _counters() -> tuple[int, int, int]:
    gc.collect()
    return int(lib.aib_live_owners()), int(lib.aib_live_nodes()), pa.total_allocated_bytes()


@pytest.fixture
def baseline() -> tuple[int, int, int]:
    """Live owners, live struct nodes and pyarrow's allocated bytes before the test body."""
    return _counters()


def _nested_batch() -> pa.RecordBatch:
    return pa.record_batch(
        {
            "x": pa.array([1, None, 3] * 100),
            "s": pa.array(["a", None, "ccc"] * 100),
            "l": pa.array([[1, 2], None, [3]] * 100, pa.list_(pa.int32())),
        }
    )


def _shared_array(batch: pa.RecordBatch) -> tuple[object, Any]:
    """A capsule owning a shared (``aib_array_share``) ArrowArray of ``batch``, and the struct.

    The capture and its exporter are dropped before returning: the shared tree alone keeps the
    producer's buffers alive."""
    exported = export_captured(capture(batch))
    capsule, array = new_capsule("array")
    exported._fill_batch(0, array)
    del exported
    gc.collect()
    return capsule, array


def _move_child_out(array: Any, index: int) -> Any:
    """Move ``array.children[index]`` into a fresh struct (C data interface move semantics)."""
    child = ffi.new("struct ArrowArray *")
    assert lib.aib_array_move(array.children[index], child) == lib.AIB_OK
    assert array.children[index].release == ffi.NULL
    return child


def _release(array: Any, *, on_thread: bool) -> None:
    if on_thread:
        assert lib.aib_debug_release_on_thread(array) == 0
    else:
        array.release(array)
    assert array.release == ffi.NULL


@pytest.mark.parametrize("on_thread", [False, True], ids=["this-thread", "bare-pthread"])
@pytest.mark.parametrize("parent_first", [True, False], ids=["parent-first", "child-first"])
@pytest.mark.parametrize("index", [0, 1, 2], ids=["flat", "string", "nested-list"])
def test_child_moved_out_of_shared_array_releases_in_any_order(
    baseline: tuple[int, int, int], index: int, parent_first: bool, on_thread: bool
) -> None:
    """Move one child out of a shared array, release parent and child in either order (from a bare
    pthread too): nothing is released twice, the child stays readable while the parent is gone, and
    every owner, node and pyarrow byte is returned once both are released."""
    batch = _nested_batch()
    expected = batch.column(index)
    capsule, array = _shared_array(batch)
    del batch
    child = _move_child_out(array, index)
    first, second = (array, child) if parent_first else (child, array)
    _release(first, on_thread=on_thread)
    if parent_first:
        # The parent is gone; the moved child still holds the capture's owner and its buffers.
        owners, nodes, allocated = _counters()
        assert owners > baseline[0]
        assert nodes == baseline[1] + 1 + int(child.n_children)
        assert allocated > baseline[2]
        shared = _copy_for_pyarrow(child)  # kept referenced until pyarrow has moved it out
        moved = pa.Array._import_from_c(int(ffi.cast("uintptr_t", shared)), expected.type)
        assert moved.equals(expected)
        del moved, shared
    _release(second, on_thread=on_thread)
    del capsule, array, child, expected
    assert _counters() == baseline


def _copy_for_pyarrow(child: Any) -> Any:
    """A struct pyarrow may import (and release) that shares ``child``'s buffers without taking it:
    a fresh shared tree made from the moved child through the core's own share function."""
    owner = lib.aib_owner_new(0)
    out = ffi.new("struct ArrowArray *")
    err = ffi.new("aib_error *")
    assert lib.aib_array_share(child, owner, out, err) == lib.AIB_OK
    lib.aib_owner_unref(owner)  # the shared tree holds its own reference
    return out


def test_every_child_moved_out_then_parent_released(baseline: tuple[int, int, int]) -> None:
    """A parent whose children were all moved out releases only itself; each child then releases on
    its own, one of them on a bare pthread."""
    capsule, array = _shared_array(_nested_batch())
    children = [_move_child_out(array, i) for i in range(int(array.n_children))]
    _release(array, on_thread=True)
    _release(children[0], on_thread=False)
    _release(children[1], on_thread=True)
    _release(children[2], on_thread=False)
    del capsule, array, children
    assert _counters() == baseline


def test_grandchild_moved_out_of_a_moved_child(baseline: tuple[int, int, int]) -> None:
    """Moves nest: a list child moved out, then its values child moved out of it; the three release
    independently (grandchild last, from a bare pthread)."""
    capsule, array = _shared_array(_nested_batch())
    child = _move_child_out(array, 2)
    grandchild = _move_child_out(child, 0)
    _release(child, on_thread=False)
    _release(array, on_thread=False)
    assert grandchild.length == 300  # [1, 2], None, [3]: three values per repeat
    _release(grandchild, on_thread=True)
    del capsule, array, child, grandchild
    assert _counters() == baseline


@pytest.mark.parametrize("parent_first", [True, False], ids=["parent-first", "child-first"])
def test_child_moved_out_of_copied_schema_releases_in_any_order(
    baseline: tuple[int, int, int], parent_first: bool
) -> None:
    """The schema copies the core hands out (``aib_schema_copy``) follow the same move rules: a child
    schema moved out is skipped by the parent's release and released on its own, in either order;
    the moved child still describes its field."""
    exported = export_captured(capture(_nested_batch()))
    capsule, schema = new_capsule("schema")
    exported._fill_schema(schema)
    del exported
    child = ffi.new("struct ArrowSchema *")
    assert lib.aib_schema_move(schema.children[2], child) == lib.AIB_OK
    assert schema.children[2].release == ffi.NULL
    first, second = (schema, child) if parent_first else (child, schema)
    assert ffi.string(child.name) == b"l"
    first.release(first)
    if parent_first:
        assert ffi.string(child.name) == b"l"  # the moved child outlives its released parent
        assert ffi.string(child.format) == b"+l"
    second.release(second)
    assert schema.release == ffi.NULL
    assert child.release == ffi.NULL
    del capsule, schema, child
    assert _counters() == baseline


def _mapped_inodes() -> set[int]:
    """The inodes of every file mapping of this process (/proc/self/maps, fifth field)."""
    with open("/proc/self/maps") as maps:
        return {int(fields[4]) for fields in (line.split() for line in maps) if len(fields) >= 5}


@pytest.mark.parametrize("cache_size", [0, 4], ids=["no-mapping-cache", "mapping-cache"])
def test_mapping_owner_unmaps_its_file_when_the_last_reference_goes(cache_size: int) -> None:
    """An imported host region is mapped by a mapping owner; when the import, every struct built from
    it and the session's mapping cache let go, the file is no longer mapped in this process (the
    owner's munmap ran), and the live-mapping counter is back to its baseline."""
    import arrow_ipc_bridge as aib

    mappings_before = int(lib.aib_live_mappings())
    table = pa.table({"v": pa.array(range(50_000), pa.int64())})
    with aib.export(table, copy="always") as exported:  # one sealed memfd: a file of its own
        inodes = {os.fstat(fd).st_ino for fd in exported.fds}
        assert not inodes & _mapped_inodes()  # the producer wrote it without mapping it
        with aib.Session(mapping_cache_size=cache_size, remembered_messages=0) as session:
            imported = session.import_message(exported.message, exported.fds)
            consumed = pa.table(imported)
            assert inodes <= _mapped_inodes()
            imported.release()
            assert consumed.equals(table)  # pyarrow's structs keep the mapping
            assert inodes <= _mapped_inodes()
            del consumed
            gc.collect()
            if cache_size == 0:
                assert not inodes & _mapped_inodes()
        gc.collect()
        assert not inodes & _mapped_inodes()
    assert int(lib.aib_live_mappings()) == mappings_before
