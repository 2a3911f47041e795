"""New messages imported by the C core (``aib_session_get``) when every handle they name is already
open: any Arrow type, streams, GPU/event/legacy handles, kept slabs, and the sync event that rides
on the C Device interface only while it is pending.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers.arrow_values import record_batches
from helpers.counting import SessionCounts
from helpers.session_rig import wait_for
from hypothesis import HealthCheck, given, settings

import arrow_ipc_bridge as aib
from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.wire.capsules import capsule_struct

pytestmark = pytest.mark.usefixtures("no_leaks")


def _cuda_shaped_message(
    batch: pa.RecordBatch | pa.Table,
    handles: list[bytes],
    uuid: bytes,
    sync: bytes,
    *,
    kind: int | None = None,
    flags: int = 0,
) -> bytes:
    """A CUDA message over ``batch``'s layout whose buffers live in regions with ``handles`` (one
    per buffer, in slot order, each at offset 0; legacy regions unless ``kind`` says otherwise):
    what a producer of new arrays sends."""
    from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA, capture
    from arrow_ipc_bridge.wire.metadata import (
        REGION_CUDA_LEGACY,
        SLOT_FIRST_REGION,
        Described,
        DeviceInfo,
        Region,
    )

    captured = capture(batch)
    try:
        described = Described(captured)
        slots = described.slots()
        regions = []
        for s in range(0, len(slots), 4):
            if slots[s + 1] == 0:
                continue
            regions.append(
                Region(
                    REGION_CUDA_LEGACY if kind is None else kind,
                    slots[s + 1],
                    handle=handles[len(regions)],
                    flags=flags,
                )
            )
            slots[s + 2] = SLOT_FIRST_REGION + len(regions) - 1
            slots[s + 3] = 0
        return described.encode(DeviceInfo(DEVICE_CUDA, identity=uuid, sync=sync), regions)
    finally:
        captured.close()


def _publish_raw(publisher: aib.Publisher, name: str, message: bytes) -> None:
    """Serve ``message`` (no descriptors) as ``name`` from the publisher's C table directly."""
    keeper = lib.aib_owner_new(0)
    err = ffi.new("aib_error *")
    raw = name.encode()
    try:
        assert (
            lib.aib_pubtable_put(
                publisher._table, raw, len(raw), message, len(message), ffi.NULL, 0, keeper, err
            )
            == 0
        )
    finally:
        lib.aib_owner_unref(keeper)


def _event_key(sync: bytes, ordinal: int) -> bytes:
    """The region table's key for an event opened from handle ``sync`` on GPU ``ordinal``."""
    key = ffi.new("uint8_t[]", lib.AIB_REGION_KEY_MAX)
    n = lib.aib_regions_event_key(sync, len(sync), ordinal, key)
    assert n == len(sync) + 8
    return ffi.buffer(key, n)[:]


@contextlib.contextmanager
def _open_in_region_table(
    uuid: bytes,
    ordinal: int,
    sync: bytes,
    event: int,
    handles: list[tuple[bytes, int]],
    *,
    key_kind: int = lib.AIB_REGION_KEY_LEGACY,
) -> Iterator[None]:
    """Put a GPU, an opened event and handles (legacy ones, or kept pool slabs with ``key_kind``
    AIB_REGION_KEY_POOL; with their bases here) in the process's region table, as the driver
    module and the opener would, the handles held by one owner; take them out again after."""
    keeper = lib.aib_owner_new(0)
    event_key = _event_key(sync, ordinal)
    keys = [(lib.AIB_REGION_KEY_DEVICE, uuid), (lib.AIB_REGION_KEY_EVENT, event_key)]
    try:
        assert lib.aib_regions_put(lib.AIB_REGION_KEY_DEVICE, uuid, len(uuid), ordinal, ffi.NULL, 0) == 0
        assert (
            lib.aib_regions_put(lib.AIB_REGION_KEY_EVENT, event_key, len(event_key), event, ffi.NULL, 0) == 0
        )
        for handle, base in handles:
            assert lib.aib_regions_put(key_kind, handle, len(handle), base, keeper, 0) == 0
            keys.append((key_kind, handle))
        yield
    finally:
        for kind, key in keys:
            lib.aib_regions_remove(kind, key, len(key))
        lib.aib_owner_unref(keeper)


def _put_handles_recording_release(
    uuid: bytes,
    ordinal: int,
    sync: bytes,
    event: int,
    handles: list[bytes],
    *,
    stride: int,
    released: list[int],
) -> list[tuple[int, bytes]]:
    """Put a GPU, an opened event and legacy handles (handle i based at stride * (i + 1)) in the
    region table, each handle held by an owner of its own (the table's reference only) whose end
    appends i to ``released``; returns the keys put, for the caller to remove."""
    assert lib.aib_regions_put(lib.AIB_REGION_KEY_DEVICE, uuid, len(uuid), ordinal, ffi.NULL, 0) == 0
    event_key = _event_key(sync, ordinal)
    assert lib.aib_regions_put(lib.AIB_REGION_KEY_EVENT, event_key, len(event_key), event, ffi.NULL, 0) == 0
    keys = [(lib.AIB_REGION_KEY_DEVICE, uuid), (lib.AIB_REGION_KEY_EVENT, event_key)]
    for i, handle in enumerate(handles):
        owner = lib.aib_owner_new(reaper.register(lambda i=i: released.append(i)))
        base = stride * (i + 1)
        assert lib.aib_regions_put(lib.AIB_REGION_KEY_LEGACY, handle, len(handle), base, owner, 0) == 0
        keys.append((lib.AIB_REGION_KEY_LEGACY, handle))
        lib.aib_owner_unref(owner)  # the table holds it now
    return keys


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record_batches(max_columns=4, max_rows=20))
def test_new_messages_of_any_type_over_open_handles_import_in_c(
    publisher: aib.Publisher, batch: pa.RecordBatch
) -> None:
    """Any Arrow type goes through the C new-message path: the session's structs carry the
    producer's schema and every data buffer points at its region's base plus its offset."""
    counts = SessionCounts()
    from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA
    from arrow_ipc_bridge.wire.metadata import REGION_CUDA_LEGACY, Decoded

    uuid, sync = b"U" * 16, b"S" * 64
    handles = [i.to_bytes(4, "little") * 16 for i in range(1, 4096)]
    message = _cuda_shaped_message(batch, handles, uuid, sync)
    decoded = Decoded(message, 0)
    try:
        regions = decoded.regions()
    finally:
        decoded.close()
    assert {r.kind for r in regions} <= {REGION_CUDA_LEGACY}
    _publish_raw(publisher, "any", message)
    bases = [(region.handle, 0x1000000 * (i + 1)) for i, region in enumerate(regions)]
    try:
        with (
            _open_in_region_table(uuid, 0, sync, 0x99, bases),
            aib.connect(publisher.path, timeout=5.0) as session,
            session.get("any") as imported,
        ):
            assert counts.new_message_gets == 1
            assert pa.Schema._import_from_c_capsule(imported.__arrow_c_schema__()) == batch.schema
            _, array_capsule = imported.__arrow_c_device_array__()
            device_array = capsule_struct(array_capsule, "device_array")
            assert device_array.device_type == DEVICE_CUDA
            assert device_array.array.length == batch.num_rows
            # Every region backs a buffer, which starts at the region's base (offset 0 here).
            seen: set[int] = set()
            pending = [device_array.array]
            while pending:
                node = pending.pop()
                for k in range(node.n_buffers):
                    index, offset = divmod(int(ffi.cast("uintptr_t", node.buffers[k])), 0x1000000)
                    if 1 <= index <= len(regions):
                        assert offset == 0
                        seen.add(index)
                pending.extend(node.children[c] for c in range(node.n_children))
                if node.dictionary != ffi.NULL:
                    pending.append(node.dictionary)
            assert seen == set(range(1, len(regions) + 1))
            del device_array, array_capsule, pending, node
        assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    finally:
        publisher.unpublish("any")


def test_new_stream_over_open_handles_is_imported_by_the_c_core(publisher: aib.Publisher) -> None:
    """A two-batch stream over open handles takes the same C path: the session hands out a stream
    whose device batches point into the regions' bases on the GPU's ordinal."""
    counts = SessionCounts()
    from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA, capture

    table = pa.Table.from_batches(
        [pa.record_batch({"x": pa.array([float(b)] * 4, pa.float64())}) for b in range(2)]
    )
    handles = [bytes([0x40 + i]) * 64 for i in range(2)]
    uuid, sync = bytes(range(1, 17)), bytes(range(2, 66))
    _publish_raw(publisher, "stream", _cuda_shaped_message(table, handles, uuid, sync))
    bases = [(handle, 0x200000 * (i + 1)) for i, handle in enumerate(handles)]
    try:
        with (
            _open_in_region_table(uuid, 1, sync, 0x55, bases),
            aib.connect(publisher.path, timeout=5.0) as session,
            session.get("stream") as imported,
        ):
            assert isinstance(imported, aib.ImportedStream)
            assert counts.new_message_gets == 1
            captured = capture(imported)
            try:
                assert len(captured.arrays) == 2
                for b, device_array in enumerate(captured.arrays):
                    assert (device_array.device_type, device_array.device_id) == (DEVICE_CUDA, 1)
                    column = device_array.array.children[0]
                    assert int(ffi.cast("uintptr_t", column.buffers[1])) == 0x200000 * (b + 1)
            finally:
                captured.close()
        assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    finally:
        publisher.unpublish("stream")


def test_new_message_over_open_handles_is_imported_by_the_c_core(publisher: aib.Publisher) -> None:
    """A message the session has not seen, whose GPU, event and legacy handles are all in the
    process's region table (what the opener and the driver module put there), is imported by the
    C core: its structs point into the regions' bases, name the GPU's ordinal and the event, and
    hold the handles' owners until released; the lease ends with it. With one handle missing the
    get takes the Python path (here that path needs the CUDA driver: CudaError) and gives its lease
    back. No GPU needed: nothing is dereferenced."""
    counts = SessionCounts()
    from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA

    batch = pa.record_batch({f"c{i}": pa.array([float(i)] * 8, pa.float32()) for i in range(3)})
    handles = [bytes([i + 1]) * 64 for i in range(3)]
    uuid, sync = bytes(range(16)), bytes(range(64))
    _publish_raw(publisher, "new", _cuda_shaped_message(batch, handles, uuid, sync))

    released: list[int] = []
    keys = _put_handles_recording_release(uuid, 3, sync, 0x77, handles, stride=0x10000, released=released)
    try:
        from arrow_ipc_bridge import cuda

        before = cuda.cuda_stats()
        with aib.connect(publisher.path, timeout=5.0) as session:
            imported = session.get("new")
            assert (counts.new_message_gets, counts.remembered_gets) == (1, 0)
            after = cuda.cuda_stats()
            assert after["c_imports"] - before["c_imports"] == 1
            assert after["c_legacy_hits"] - before["c_legacy_hits"] == 3
            assert imported.device_id == 3
            _, array_capsule = imported.__arrow_c_device_array__()
            device_array = capsule_struct(array_capsule, "device_array")
            assert device_array.device_type == DEVICE_CUDA
            assert device_array.device_id == 3
            assert ffi.cast("uint64_t *", device_array.sync_event)[0] == 0x77
            children = device_array.array.children
            data = [int(ffi.cast("uintptr_t", children[i].buffers[1])) for i in range(3)]
            assert data == [0x10000 * (i + 1) for i in range(3)]
            del children, device_array, array_capsule
            for _, key in keys[2:]:  # the table lets go; the import still holds the handles
                lib.aib_regions_remove(lib.AIB_REGION_KEY_LEGACY, key, 64)
            keys = keys[:2]
            reaper.settle()
            assert released == []
            assert publisher.active_leases == 1
            imported.release()
            assert wait_for(lambda: publisher.active_leases == 0, 5.0)
            reaper.settle()  # the reaper thread may be running a callback already
            assert sorted(released) == [0, 1, 2]

            # one handle missing: the Python path, which needs the driver here
            lib.aib_regions_put(lib.AIB_REGION_KEY_LEGACY, handles[0], 64, 0x10000, ffi.NULL, 0)
            keys.append((lib.AIB_REGION_KEY_LEGACY, handles[0]))
            with pytest.raises(aib.BridgeError):
                session.get("new")
            assert counts.new_message_gets == 1
            assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    finally:
        for kind, key in keys:
            lib.aib_regions_remove(kind, key, len(key))
        publisher.unpublish("new")


def test_a_new_message_got_twice_in_a_row_is_remembered(publisher: aib.Publisher) -> None:
    """A consumer polling a name the producer has not republished gets the same new message again:
    the C core imports it twice (new-message path), then the session remembers it, so the third
    get is the remembered path. The remembered template holds the regions' owners open, not a
    lease; forget() lets them go (they die once the table lets go too). A stream of different
    messages under one name is never remembered."""
    counts = SessionCounts()
    batch = pa.record_batch({f"c{i}": pa.array([float(i)] * 8, pa.float32()) for i in range(2)})
    handles = [bytes([0x70 + i]) * 64 for i in range(2)]
    uuid, sync = b"p" * 16, b"q" * 64
    message = _cuda_shaped_message(batch, handles, uuid, sync)
    _publish_raw(publisher, "poll", message)
    released: list[int] = []
    keys = _put_handles_recording_release(uuid, 0, sync, 0x55, handles, stride=0x20000, released=released)
    try:
        with aib.connect(publisher.path, timeout=5.0) as session:
            for _ in range(3):
                with session.get("poll") as imported:
                    _, array_capsule = imported.__arrow_c_device_array__()
                    children = capsule_struct(array_capsule, "device_array").array.children
                    assert int(ffi.cast("uintptr_t", children[1].buffers[1])) == 0x40000
                    del children, array_capsule
            assert (counts.new_message_gets, counts.remembered_gets) == (2, 1)
            assert wait_for(lambda: publisher.active_leases == 0, 5.0)  # the template holds none
            # new data under one name every get: each a new message, none remembered
            for k in range(4):
                changed = _cuda_shaped_message(batch.slice(0, 7 - k), handles, uuid, sync)
                _publish_raw(publisher, "stream", changed)
                session.get("stream").release()
            assert (counts.new_message_gets, counts.remembered_gets) == (6, 1)
            for kind, key in keys[2:]:
                lib.aib_regions_remove(kind, key, len(key))
            keys = keys[:2]
            reaper.settle()
            assert released == []  # the remembered template holds the handles' owners
            assert session.forget("poll") == 1
            reaper.settle()  # the reaper thread may be running a callback already
            assert sorted(released) == [0, 1]
    finally:
        for kind, key in keys:
            lib.aib_regions_remove(kind, key, len(key))
        publisher.unpublish("poll")
        publisher.unpublish("stream")


def test_new_message_over_kept_slabs_is_imported_by_the_c_core(publisher: aib.Publisher) -> None:
    """Pool regions flagged kept whose slabs are in the region table (what the opener puts there)
    take the C new-message path like open legacy handles; the same regions without the flag (pool
    pointers that need a lease) never do: the get goes to Python, which needs the driver here."""
    counts = SessionCounts()
    from arrow_ipc_bridge.wire.metadata import REGION_CUDA_POOL, REGION_FLAG_KEPT

    batch = pa.record_batch({f"c{i}": pa.array([float(i)] * 8, pa.float32()) for i in range(2)})
    handles = [b"K" * 24 + bytes([i + 1]) * 64 for i in range(2)]
    uuid, sync = b"k" * 16, b"e" * 64
    kept = _cuda_shaped_message(batch, handles, uuid, sync, kind=REGION_CUDA_POOL, flags=REGION_FLAG_KEPT)
    _publish_raw(publisher, "kept", kept)
    _publish_raw(publisher, "leased", _cuda_shaped_message(batch, handles, uuid, sync, kind=REGION_CUDA_POOL))
    bases = [(handle, 0x400000 * (i + 1)) for i, handle in enumerate(handles)]
    try:
        with (
            _open_in_region_table(uuid, 0, sync, 0x66, bases, key_kind=lib.AIB_REGION_KEY_POOL),
            aib.connect(publisher.path, timeout=5.0) as session,
        ):
            with session.get("kept") as imported:
                assert counts.new_message_gets == 1
                _, array_capsule = imported.__arrow_c_device_array__()
                children = capsule_struct(array_capsule, "device_array").array.children
                data = [int(ffi.cast("uintptr_t", children[i].buffers[1])) for i in range(2)]
                assert data == [0x400000, 0x800000]
                del children, array_capsule
            with pytest.raises(aib.BridgeError):
                session.get("leased")
            assert counts.new_message_gets == 1
        assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    finally:
        publisher.unpublish("kept")
        publisher.unpublish("leased")


@contextlib.contextmanager
def _stand_in_event_query(answer: list[int]) -> Iterator[tuple[list[int], Any]]:
    """Make the C core ask a stand-in for ``cuEventQuery``: it answers ``answer[0]`` and records the
    events it was asked about (yields them and the stand-in); the driver's own query (or none) is
    put back after."""
    from arrow_ipc_bridge.cuda import _driver

    asked: list[int] = []

    @ffi.callback("int(void *)")
    def query(event: Any) -> int:
        asked.append(int(ffi.cast("uintptr_t", event)))
        return answer[0]

    _set_event_query(query)
    try:
        yield asked, query
    finally:
        real = _driver._DRIVER.lib
        restore = _driver.core_driver_table(real, _driver._DRIVER.ffi) if real is not None else None
        lib.aib_cuda_set_driver(restore if restore is not None else ffi.new("aib_cuda_driver *"))


def _set_event_query(query: Any) -> None:
    """Hand the C core a driver table whose only function is ``query`` as cuEventQuery (None: none)."""
    address = int(ffi.cast("uintptr_t", query)) if query is not None else 0
    lib.aib_cuda_set_driver(ffi.new("aib_cuda_driver *", {"event_query": address}))


def test_imported_structs_carry_the_sync_event_only_while_it_is_pending(publisher: aib.Publisher) -> None:
    """The C Device interface's sync_event may be NULL when nothing needs waiting for: every struct
    of imported CUDA data asks the driver about the producer's event when it is built and carries
    it only unless the answer is 'complete' (CUDA_SUCCESS). Not ready (600) and errors keep it; so
    does a process without a query function. Array capsules (the C path and the Python builder) and
    every batch of a device stream; cuda_stats() counts both outcomes."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA, capture, new_capsule

    batch = pa.record_batch({"x": pa.array([1.0, 2.0], pa.float32())})
    table = pa.Table.from_batches([batch, batch])
    uuid, sync = b"u" * 16, b"s" * 64
    _publish_raw(publisher, "one", _cuda_shaped_message(batch, [b"\x31" * 64], uuid, sync))
    _publish_raw(publisher, "two", _cuda_shaped_message(table, [b"\x32" * 64, b"\x33" * 64], uuid, sync))
    handles = [(b"\x31" * 64, 0x100000), (b"\x32" * 64, 0x200000), (b"\x33" * 64, 0x300000)]

    def events_handed_out(imported: Any) -> list[int]:
        out = []
        _, array_capsule = imported.__arrow_c_device_array__()
        out.append(int(ffi.cast("uintptr_t", capsule_struct(array_capsule, "device_array").sync_event)))
        schema, array = new_capsule("schema"), new_capsule("device_array")
        imported._fill_device_array(schema[1], array[1])  # the Python builder
        out.append(int(ffi.cast("uintptr_t", array[1].sync_event)))
        return out

    answer = [0]
    try:
        with (
            _open_in_region_table(uuid, 0, sync, 0x99, handles),
            _stand_in_event_query(answer) as (asked, stand_in),
            aib.connect(publisher.path, timeout=5.0) as session,
        ):
            with session.get("one") as imported:
                assert imported.device_type == DEVICE_CUDA
                before = cuda.cuda_stats()
                assert events_handed_out(imported) == [0, 0]  # complete: nothing to wait for
                assert asked == [0x99, 0x99]
                answer[0] = 600  # CUDA_ERROR_NOT_READY: the event travels, pointing at the CUevent
                pending = events_handed_out(imported)
                assert all(p != 0 and ffi.cast("uint64_t *", p)[0] == 0x99 for p in pending)
                answer[0] = 201  # an error (no context here, say): kept too
                assert all(p != 0 for p in events_handed_out(imported))
                after = cuda.cuda_stats()
                assert after["sync_events_complete"] - before["sync_events_complete"] == 2
                assert after["sync_events_pending"] - before["sync_events_pending"] == 4
                _set_event_query(None)  # no driver loaded: handed out as it is, not asked
                answer[0] = 0
                assert all(p != 0 for p in events_handed_out(imported))
                assert len(asked) == 6
                _set_event_query(stand_in)
            with session.get("two") as imported:
                assert isinstance(imported, aib.ImportedStream)
                answer[0] = 0
                captured = capture(imported)  # the device stream asks once per batch
                try:
                    assert [a.sync_event == ffi.NULL for a in captured.arrays] == [True, True]
                finally:
                    captured.close()
                answer[0] = 600
                captured = capture(imported)
                try:
                    assert [a.sync_event != ffi.NULL for a in captured.arrays] == [True, True]
                finally:
                    captured.close()
        assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    finally:
        publisher.unpublish("one")
        publisher.unpublish("two")


def _legacy_keys_held() -> list[bytes]:
    """The legacy handles in the region table, least recently used first."""
    n = lib.aib_regions_list(lib.AIB_REGION_KEY_LEGACY, ffi.NULL, 64, 0)
    keys = ffi.new("uint8_t[]", max(n, 1) * 64)
    n = lib.aib_regions_list(lib.AIB_REGION_KEY_LEGACY, keys, 64, n)
    raw = ffi.buffer(keys, n * 64)[:]
    return [raw[i * 64 : (i + 1) * 64] for i in range(n)]


def test_a_c_side_import_counts_as_a_use_of_its_handles(publisher: aib.Publisher) -> None:
    """The region table keeps its least-recently-used order where the new-message imports happen:
    a handle the C core just imported a message over is newer than one it did not use, so a put
    under a bound of two lets the unused one go (its owner ends) and keeps the used one."""
    counts = SessionCounts()
    batch = pa.record_batch({"c0": pa.array([1.0] * 8, pa.float32())})
    handles = [bytes([0x50 + i]) * 64 for i in range(3)]
    uuid, sync = b"u" * 16, b"v" * 64
    released: list[int] = []
    keys = _put_handles_recording_release(uuid, 0, sync, 0x11, handles[:2], stride=0x10000, released=released)
    try:
        assert _legacy_keys_held()[-2:] == handles[:2]
        _publish_raw(publisher, "one", _cuda_shaped_message(batch, handles[:1], uuid, sync))
        with aib.connect(publisher.path, timeout=5.0) as session:
            session.get("one").release()
            assert counts.new_message_gets == 1
        assert _legacy_keys_held()[-2:] == [handles[1], handles[0]]  # the import used handle 0
        owner = lib.aib_owner_new(0)
        assert lib.aib_regions_put(lib.AIB_REGION_KEY_LEGACY, handles[2], 64, 0x30000, owner, 2) == 0
        lib.aib_owner_unref(owner)
        keys.append((lib.AIB_REGION_KEY_LEGACY, handles[2]))
        assert _legacy_keys_held() == [handles[0], handles[2]]
        reaper.settle()  # the reaper thread may be running a callback already
        assert released == [1]
    finally:
        for kind, key in keys:
            lib.aib_regions_remove(kind, key, len(key))
        publisher.unpublish("one")
        reaper.settle()


def test_opened_ipc_events_are_asked_of_the_region_table() -> None:
    """The events module keeps no record of its own: an event in the region table under (handle,
    device) is what open_ipc_event returns for that pair without opening anything, its device is
    found from the bare event, it counts in ipc_event_cache_size, and clear_ipc_event_cache takes
    every event out of the table (the C get path then finds none)."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import events

    handle = b"e" * 64
    key = _event_key(handle, 2)
    before = cuda.ipc_event_cache_size()
    assert lib.aib_regions_put(lib.AIB_REGION_KEY_EVENT, key, len(key), 0xE7E7, ffi.NULL, 0) == 0
    try:
        assert cuda.open_ipc_event(handle, 2) == 0xE7E7
        assert events._event_device(0xE7E7) == 2
        assert events._event_device(0xE7E8) is None
        assert cuda.ipc_event_cache_size() == before + 1
        cuda.clear_ipc_event_cache()
        assert cuda.ipc_event_cache_size() == 0
        found = ffi.new("uint64_t *")
        assert not lib.aib_regions_find(lib.AIB_REGION_KEY_EVENT, key, len(key), found, ffi.NULL)
    finally:
        lib.aib_regions_remove(lib.AIB_REGION_KEY_EVENT, key, len(key))
