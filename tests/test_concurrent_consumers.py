"""Many consumers at once: concurrent sessions, one session shared by threads, publishing churn
while consumers get, and a publisher closed while they are busy.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.counting import SessionCounts
from helpers.session_rig import JOIN_S, sample_table, settle, wait_for

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_32_concurrent_sessions(publisher: aib.Publisher) -> None:
    """32 threads, each with its own session, hold leases on every published name at the same moment (the
    publisher counts 32 sessions and 32 * names leases), all read correct data, and once they are done
    every lease and every session is gone."""
    data = {f"t{i}": sample_table(300 + 50 * i) for i in range(3)}
    for name, table in data.items():
        publisher.publish(name, table)
    consumers = 32
    barrier = threading.Barrier(consumers + 1)
    errors: list[str] = []

    def consume() -> None:
        try:
            with aib.connect(publisher.path, timeout=30.0) as session:
                assert sorted(session.list()) == sorted(data)
                held = {name: session.get(name) for name in data}
                barrier.wait(timeout=60.0)  # everybody holds a lease on every name
                barrier.wait(timeout=60.0)  # the main thread has counted them
                for name, imported in held.items():
                    with imported:
                        assert_arrays_equal(pa.table(imported), data[name])
                for name, table in data.items():
                    with session.get(name) as imported:
                        assert pa.table(imported).num_rows == table.num_rows
        except BaseException as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            barrier.abort()

    threads = [threading.Thread(target=consume, name=f"consumer{i}") for i in range(consumers)]
    for thread in threads:
        thread.start()
    try:
        barrier.wait(timeout=60.0)
        assert publisher.active_sessions == consumers
        assert publisher.active_leases == consumers * len(data)
        barrier.wait(timeout=60.0)
    except threading.BrokenBarrierError:
        pass  # a consumer failed: its error is reported below
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    assert wait_for(lambda: publisher.active_sessions == 0, 5.0)


def test_one_session_shared_by_threads(publisher: aib.Publisher, shm_file: tuple[str, pa.Table]) -> None:
    """Eight threads share one session and get a zero-copy and a copied object concurrently: every get
    returns the right data, the zero-copy file is mapped once (beforehand), every re-get of either
    object is imported by the C core from the remembered message and its mappings, and all leases
    end."""
    counts = SessionCounts()
    path, expected = shm_file
    mapped = pa.ipc.open_file(pa.memory_map(path)).read_all()
    heap = sample_table(700)
    publisher.publish("z", mapped, copy="never")
    publisher.publish("h", heap)
    errors: list[str] = []
    rounds = 10
    with aib.connect(publisher.path, timeout=10.0) as session:
        # Map the zero-copy file once before the threads start: two threads missing the cache at the same
        # moment leak a mapping (test_concurrent_cache_misses_leak_nothing), which is not what this tests.
        with session.get("z") as first:
            assert pa.table(first).equals(expected)

        def work() -> None:
            try:
                for _ in range(rounds):
                    with session.get("z") as z, session.get("h") as h:
                        assert pa.table(z).equals(expected)
                        assert pa.table(h).equals(heap)
            except BaseException as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=work, name=f"sharer{i}") for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_S)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert session.mapping_cache.misses == 1
        # The first get of "h" may happen in several threads at once; every later one is remembered.
        assert counts.remembered_gets >= 2 * 8 * rounds - 8
        settle()
        assert wait_for(lambda: publisher.active_leases == 0, 2.0)
    del mapped


def test_publish_churn_while_consumers_get(publisher: aib.Publisher) -> None:
    """While one thread republishes and unpublishes a name as fast as it can, four consumers keep getting
    it: each get returns one complete version (never a mix, never garbage) or NotPublishedError; afterwards
    no lease is left and every replaced version's memory was freed (checked by the leak fixture)."""
    versions = [
        pa.table({"v": pa.array([k] * 500, pa.int64()), "s": [f"{k}-{i}" for i in range(500)]})
        for k in range(3)
    ]
    publisher.publish("t", versions[0])
    stop = threading.Event()
    errors: list[str] = []
    seen: set[int] = set()

    def churn() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            if k % 7 == 0:
                with contextlib.suppress(aib.NotPublishedError):
                    publisher.unpublish("t")
            else:
                publisher.publish("t", versions[k % 3])

    def consume() -> None:
        try:
            with aib.connect(publisher.path, timeout=10.0) as session:
                while not stop.is_set():
                    try:
                        with session.get("t") as imported:
                            table = pa.table(imported)
                    except aib.NotPublishedError:
                        continue
                    version = table["v"][0].as_py()
                    assert_arrays_equal(table, versions[version])
                    seen.add(version)
        except BaseException as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=churn, name="churn")]
    threads += [threading.Thread(target=consume, name=f"churn-consumer{i}") for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    stop.set()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert len(seen) >= 2
    settle()
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_close_while_consumers_are_busy(publisher: aib.Publisher) -> None:
    """Closing the publisher while eight consumers are in the middle of getting makes every one of them
    stop with TransportError (never a hang or another exception), and no lease survives."""
    publisher.publish("t", sample_table(500))
    outcomes: list[str] = []
    started = threading.Barrier(9)

    def consume() -> None:
        try:
            with aib.connect(publisher.path, timeout=10.0) as session:
                started.wait(timeout=30.0)
                while True:
                    with session.get("t") as imported:
                        pa.table(imported)
        except aib.TransportError:
            outcomes.append("transport")
        except BaseException as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=consume, name=f"busy{i}") for i in range(8)]
    for thread in threads:
        thread.start()
    started.wait(timeout=30.0)
    time.sleep(0.2)
    publisher.close()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    assert outcomes == ["transport"] * 8
    assert publisher.active_leases == 0
