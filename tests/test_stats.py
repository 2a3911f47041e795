"""Tests of ``aib.stats()``: one frozen record whose counters move as real exports, imports and gets do."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading

import pyarrow as pa
import pytest
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.cuda import cuda_stats
from arrow_ipc_bridge.process_stats import import_counters, wait_counters

EXPORT_REGION_FIELDS = ["export_region_entries", "export_region_hits", "export_region_misses"]


def delta(before: object, after: object) -> dict[str, int]:
    """The fields of two snapshots of one section that changed, as after - before."""
    changes = {}
    for field in dataclasses.fields(before):  # type: ignore[arg-type]
        moved = getattr(after, field.name) - getattr(before, field.name)
        if moved:
            changes[field.name] = moved
    return changes


def test_record_is_frozen_typed_and_counts_only_ints() -> None:
    snapshot = aib.stats()
    assert isinstance(snapshot, aib.BridgeStats)
    assert isinstance(snapshot.host, aib.HostStats)
    assert isinstance(snapshot.cuda, aib.CudaStats)
    assert isinstance(snapshot.session, aib.SessionStats)
    assert isinstance(snapshot.streams, aib.StreamStats)
    assert isinstance(snapshot.waits, aib.WaitStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.host = snapshot.host  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.host.copied_bytes = 0  # type: ignore[misc]
    for section in (snapshot.host, snapshot.cuda, snapshot.session, snapshot.streams, snapshot.waits):
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            assert type(value) is int, (field.name, value)
            assert value >= 0, (field.name, value)


def test_session_section_reads_every_import_counter() -> None:
    """The counters the session advances and the section's fields are the same, in the same order."""
    assert import_counters._fields == tuple(f.name for f in dataclasses.fields(aib.SessionStats))


def test_cuda_section_has_every_cuda_counter() -> None:
    """The typed section names the counters of cuda_stats() and then the export region table's
    (cuda/placer.export_region_stats), then the publisher's in-place count: none dropped or invented."""
    from arrow_ipc_bridge.cuda.placer import export_region_stats

    expected = [*cuda_stats(), *EXPORT_REGION_FIELDS, "in_place_publishes"]
    assert [f.name for f in dataclasses.fields(aib.CudaStats)] == expected
    assert [f"export_region_{key}" for key in export_region_stats()] == EXPORT_REGION_FIELDS


def test_wait_section_reads_every_wait_counter() -> None:
    assert wait_counters._fields == tuple(f.name for f in dataclasses.fields(aib.WaitStats))


def test_stream_counters_move_with_batches_sent_received_and_dropped(sock_dir: str) -> None:
    """Two subscribers of a "drop_oldest" stream: one reads every batch, one holds its window and
    falls behind. The publisher counts a BATCH per subscriber sent and each drop; the subscriptions
    count what they received; subscriptions count while open."""
    before = aib.stats().streams
    with aib.Publisher(os.path.join(sock_dir, "p.sock")) as pub:
        writer = pub.open_stream("s", max_in_flight=2, on_slow="drop_oldest")
        with (
            aib.subscribe(pub.path, "s", timeout=30) as fast,
            aib.subscribe(pub.path, "s", timeout=30) as slow,
        ):
            assert aib.stats().streams.subscriptions_open - before.subscriptions_open == 2
            for i in range(6):
                writer.write(pa.record_batch({"i": [i]}))
                batch = fast.next_batch()
                assert batch is not None
                batch.release()
            # slow: 2 batches sent (its window, unreleased), then a queue of 2; 2 dropped from it
            held = [slow.next_batch(), slow.next_batch()]
            middle = aib.stats().streams
            for batch in held:
                assert batch is not None
                batch.release()
            queued = [slow.next_batch(), slow.next_batch()]
            assert slow.dropped == 2
            for batch in queued:
                assert batch is not None
                batch.release()
            writer.close()
        assert delta(before, middle) == {
            "batches_sent": 8,
            "batches_received": 8,
            "batches_dropped": 2,
            "subscriptions": 2,
            "subscriptions_open": 2,
        }
    # The publisher's serving threads see the ends in their own time.
    assert wait_for(lambda: aib.stats().streams.subscriptions_open == before.subscriptions_open, 10)
    moved = delta(before, aib.stats().streams)
    assert moved == {"batches_sent": 10, "batches_received": 10, "batches_dropped": 2, "subscriptions": 2}


def test_wait_counters_count_waits_sent_and_held(sock_dir: str) -> None:
    """A wait the publisher can answer at once is sent, not held; one for a name not published yet is held."""
    before = aib.stats().waits
    with aib.Publisher(os.path.join(sock_dir, "p.sock")) as pub:
        pub.publish("now", pa.array([1]))
        with aib.connect(pub.path) as session:
            session.get("now", wait=5).release()
            middle = aib.stats().waits
            publishing = threading.Timer(0.3, lambda: pub.publish("later", pa.array([2])))
            publishing.start()
            try:
                session.get("later", wait=30).release()
            finally:
                publishing.join()
    assert delta(before, middle) == {"waits_sent": 1}
    assert delta(middle, aib.stats().waits) == {"waits_sent": 1, "waits_held": 1}


def test_heap_export_with_a_copy_counts_the_copied_bytes() -> None:
    array = pa.array(range(1000), pa.int64())  # Arrow's heap: not shareable, so copied
    before = aib.stats().host
    with aib.export(array, copy="if_needed") as exported:
        copied = exported.stats.copied_bytes
    moved = delta(before, aib.stats().host)
    assert copied >= 8000
    assert moved["copied_bytes"] == copied
    assert moved["copy_regions"] == 1
    assert moved["exports"] == 1
    assert "zero_copy_regions" not in moved


def test_zero_copy_export_of_shared_memory_copies_nothing() -> None:
    before = aib.stats().host
    with aib.allocate_shared(8 * 1000) as shared:
        shared.view()[:] = b"\x07" * (8 * 1000)
        array = pa.Array.from_buffers(pa.int64(), 1000, [None, shared.as_pyarrow()])
        with aib.export(array, copy="never"):
            pass
        del array
    moved = delta(before, aib.stats().host)
    assert moved["shared_allocations"] == 1
    assert moved["zero_copy_regions"] == 1
    assert moved["zero_copy_bytes"] == 8000
    assert "copied_bytes" not in moved


def test_import_maps_regions_and_a_repeat_reuses_the_remembered_import() -> None:
    array = pa.array([float(i) for i in range(500)])
    with aib.export(array, copy="always") as exported, aib.Session() as session:
        before = aib.stats()
        first = session.import_message(exported.message, exported.fds)
        after_first = aib.stats()
        assert pa.array(first).equals(array)
        second = session.import_message(exported.message, exported.fds)
        after_second = aib.stats()
        assert pa.array(second).equals(array)
        first.release()
        second.release()
    mapped = delta(before.host, after_first.host)
    assert mapped["regions_mapped"] == 1
    assert mapped["bytes_mapped"] >= 500 * 8
    assert delta(before.session, after_first.session) == {"python_imports": 1}
    # The same bytes with the same files again: the session's remembered decode and mapping serve it.
    assert delta(after_first.host, after_second.host) == {}
    assert delta(after_first.session, after_second.session) == {"python_remembered_imports": 1}


def test_a_new_message_on_a_mapped_file_is_a_mapping_cache_hit() -> None:
    """Two exports of one shared allocation (the array and a slice: other messages, the same region) map
    the file once; the second import is served by the session's cache of mappings."""
    with aib.allocate_shared(8 * 100) as shared:
        array = pa.Array.from_buffers(pa.int64(), 100, [None, shared.as_pyarrow()])
        with (
            aib.Session() as session,
            aib.export(array, copy="never") as whole,
            aib.export(array.slice(10), copy="never") as part,
        ):
            before = aib.stats().host
            first = session.import_message(whole.message, whole.fds)
            middle = aib.stats().host
            second = session.import_message(part.message, part.fds)
            after = aib.stats().host
            assert pa.array(second).equals(array.slice(10))
            first.release()
            second.release()
        del array
    assert delta(before, middle)["regions_mapped"] == 1
    assert delta(middle, after) == {"mapping_cache_hits": 1}


def test_gets_count_by_import_path(sock_dir: str) -> None:
    """The first get of a publication is imported in Python; the next are the C core's remembered gets,
    the third one local (from the publisher's version board, under the standing lease the second took)."""
    table = pa.table({"x": list(range(64))})
    with aib.Publisher(os.path.join(sock_dir, "p.sock")) as pub:
        pub.publish("t", table)
        with aib.connect(pub.path) as session:
            before = aib.stats().session
            for _ in range(3):
                with session.get("t") as imported:
                    assert pa.table(imported).equals(table)
            after = aib.stats().session
    assert delta(before, after) == {"python_imports": 1, "remembered_gets": 2, "local_gets": 1}


def test_stats_never_loads_the_cuda_driver() -> None:
    """In a process that never used CUDA, reading every counter (after host work) leaves the driver unloaded:
    not even a failed attempt to load it."""
    code = """
import pyarrow as pa
import arrow_ipc_bridge as aib
with aib.export(pa.array([1, 2, 3])) as exported, aib.Session() as session:
    session.import_message(exported.message, exported.fds).release()
snapshot = aib.stats()
assert snapshot.host.regions_mapped >= 1, snapshot
from arrow_ipc_bridge.cuda._driver import _DRIVER
assert _DRIVER.lib is None and _DRIVER.failure is None, "the CUDA driver was loaded"
with open("/proc/self/maps") as maps:
    assert "libcuda" not in maps.read(), "libcuda is mapped"
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
