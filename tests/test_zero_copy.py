"""Zero copy: memory-mapped and shareable data published without a copy (here and from a producer
child), ``copy="never"``, more regions than one frame carries, and the session's mapping cache
(LRU eviction, size zero, concurrent misses).

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.counting import SessionCounts
from helpers.session_rig import ProducerRig, child_env, sample_table, settle, wait_for, write_shm_ipc_file

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_zero_copy_publish_and_mapping_cache(
    publisher: aib.Publisher, shm_file: tuple[str, pa.Table]
) -> None:
    """A table memory-mapped from an Arrow IPC file in /dev/shm publishes with no byte copied (even under
    ``copy="never"``); a second get of it is the remembered message (no new mapping); another
    publication over the same file (a slice: other bytes) hits the session's mapping cache; the data
    is equal."""
    counts = SessionCounts()
    path, expected = shm_file
    mapped = pa.ipc.open_file(pa.memory_map(path)).read_all()
    stats = publisher.publish("z", mapped, copy="never")
    assert stats.copied_bytes == 0
    assert stats.zero_copy_regions >= 1
    publisher.publish("z2", mapped.slice(10), copy="never")
    with aib.connect(publisher.path, timeout=5.0) as session:
        cache = session.mapping_cache
        with session.get("z") as first:
            assert_arrays_equal(pa.table(first), expected)
        misses, hits = cache.misses, cache.hits
        with session.get("z") as second:
            assert_arrays_equal(pa.table(second), expected)
        assert counts.remembered_gets == 1
        assert (cache.misses, cache.hits) == (misses, hits)
        with session.get("z2") as other:
            assert_arrays_equal(pa.table(other), expected.slice(10))
        assert cache.hits > hits
        assert cache.misses == misses
    del mapped


def test_copy_never_refuses_heap_data(publisher: aib.Publisher) -> None:
    """``copy="never"`` on ordinary heap data raises CopyRequiredError, publishes
    nothing, and leaves the publisher serving; a publisher made with ``copy="never"`` refuses too."""
    with pytest.raises(aib.CopyRequiredError):
        publisher.publish("h", sample_table(100), copy="never")
    assert publisher.names() == []
    stats = publisher.publish("h", sample_table(100))
    assert stats.copied_bytes > 0
    with aib.Publisher(publisher.path + ".2", copy="never") as strict, pytest.raises(aib.CopyRequiredError):
        strict.publish("h", pa.array([1, 2, 3]))


def test_zero_copy_from_producer_child(producer: ProducerRig, shm_file: tuple[str, pa.Table]) -> None:
    """Across processes: the producer child publishes the memory-mapped table with no copy; two gets here
    share one mapping (the second is the remembered message) and read equal data; the data stays valid
    after the child unpublishes."""
    counts = SessionCounts()
    path, expected = shm_file
    stats = producer.child.call("mmap", "z", path, "never")[1]
    assert stats["copied_bytes"] == 0
    assert stats["zero_copy_regions"] >= 1
    cache = producer.session.mapping_cache
    first = producer.session.get("z")
    misses, remembered = cache.misses, counts.remembered_gets
    with producer.session.get("z") as second:
        assert_arrays_equal(pa.table(second), expected)
    assert cache.misses == misses
    assert counts.remembered_gets == remembered + 1
    producer.child.call("unpublish", "z")
    assert_arrays_equal(pa.table(first), expected)
    first.release()
    settle()
    assert wait_for(lambda: producer.child.state()[0] == 0, 5.0)


def test_more_regions_than_one_frame_can_carry(publisher: aib.Publisher, sock_dir: str) -> None:
    """A table whose buffers live in 300 different shareable files (more than the 253 descriptors one frame
    can carry) either fails at publish time with a BridgeError that names the descriptor limit, or is
    served correctly; it never breaks a session at get time."""
    paths = []
    parts = []
    try:
        for i in range(300):
            path = write_shm_ipc_file(pa.table({"x": pa.array(range(i * 4, i * 4 + 4), pa.int64())}))
            paths.append(path)
            parts.append(pa.ipc.open_file(pa.memory_map(path)).read_all())
        table = pa.concat_tables(parts)
        del parts
        refusal = ""
        try:
            publisher.publish("many", table)
        except aib.BridgeError as exc:
            refusal = str(exc)
        if refusal:
            assert "descriptor" in refusal
            assert publisher.names() == []
        else:
            with aib.connect(publisher.path, timeout=5.0) as session, session.get("many") as imported:
                assert_arrays_equal(pa.table(imported), table)
        publisher.publish("small", pa.array([1]))
        with aib.connect(publisher.path, timeout=5.0) as session, session.get("small") as imported:
            assert pa.array(imported).to_pylist() == [1]
        del table
        gc.collect()
    finally:
        for path in paths:
            os.unlink(path)


def test_mapping_cache_evicts_the_least_recently_used() -> None:
    """With a 2-entry mapping cache, after importing four different zero-copy files in turn, the two most
    recently used files are the ones cached: importing other data in them hits the cache (the oldest were
    evicted). Regression test: the cache used to evict its newest entry (dict.popitem()), pinning the oldest
    forever. (The same message again would be a remembered message, which keeps its own mappings.)"""
    paths = [write_shm_ipc_file(pa.table({"x": pa.array([i] * 100, pa.int64())})) for i in range(4)]
    exports: list[aib.Exported] = []
    slices: list[aib.Exported] = []
    try:
        tables_ = [pa.ipc.open_file(pa.memory_map(path)).read_all() for path in paths]
        exports = [aib.export(table, copy="never") for table in tables_]
        slices = [aib.export(table.slice(1), copy="never") for table in tables_]
        del tables_
        with aib.Session(mapping_cache_size=2) as session:
            cache = session.mapping_cache
            for exported in exports:
                session.import_message(exported.message, exported.fds).release()
            assert (cache.hits, cache.misses, len(cache)) == (0, 4, 2)
            for newest in (3, 2):
                hits = cache.hits
                session.import_message(slices[newest].message, slices[newest].fds).release()
                assert cache.hits == hits + 1, f"file {newest} (recently used) was evicted"
    finally:
        for exported in exports + slices:
            exported.close()
        for path in paths:
            os.unlink(path)


def run_ok_child(code: str, path: str) -> None:
    """Run ``code`` in a fresh interpreter with ``path`` as its argument; it must print ``ok``."""
    proc = subprocess.run(
        [sys.executable, "-c", code, path],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


CACHE_ZERO_CHILD = "import sys, helpers.session_children as c; c.cache_size_zero_main(sys.argv[1])"


def test_mapping_cache_size_zero_disables_caching(shm_file: tuple[str, pa.Table]) -> None:
    """``Session(mapping_cache_size=0)`` imports zero-copy data without caching it: no error, no hit, no
    entry, and no owner/node/mapping left (run in a fresh interpreter, so a leak cannot spill into the
    other tests). Regression test: it used to raise KeyError from dict.popitem() and leak the mapping."""
    run_ok_child(CACHE_ZERO_CHILD, shm_file[0])


CONCURRENT_MISS_CHILD = "import sys, helpers.session_children as c; c.concurrent_miss_main(sys.argv[1])"


def test_concurrent_cache_misses_leak_nothing(shm_file: tuple[str, pa.Table]) -> None:
    """Two threads of one session importing the same zero-copy region at once (both missing the cache)
    both get correct data, the cache ends with one entry, and closing the session leaves no owner, node or
    mapping behind (run in a fresh interpreter, so a leak cannot spill into the other tests)."""
    run_ok_child(CONCURRENT_MISS_CHILD, shm_file[0])
