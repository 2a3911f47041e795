"""Concurrency: many threads on one publisher, and many threads on one session.

The guarantee: ``Publisher.publish``/``unpublish`` and ``Session.get``/``release``/``forget`` are
thread-safe. Racing them raises nothing but the documented answer to a name that is not published
at that instant (:class:`~arrow_ipc_bridge.errors.NotPublishedError`), every get reads exactly one
of the tables published under its name (never a mix, never freed memory), and when the threads are
done the leases, sessions, fds, threads and memfd mappings are back to where they started.

CI runs 500 operations per thread; ``AIB_LONG=1`` runs 3,000 per thread.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pyarrow as pa
from helpers.fault_children import quiet_counts, resource_counts, settled, table_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.errors import NotPublishedError

LONG = os.environ.get("AIB_LONG") == "1"
OPS_PER_THREAD = 3_000 if LONG else 500
THREADS = 16
NAMES = ["n0", "n1", "n2", "n3"]
VERSIONS = 3  # tables per name a mutator chooses from
ROWS = 256


def _versions() -> dict[tuple[str, int], pa.Table]:
    return {(name, v): table_for(ROWS, 10 * n + v) for n, name in enumerate(NAMES) for v in range(VERSIONS)}


def _which_version(name: str, table: pa.Table, tables: dict[tuple[str, int], pa.Table]) -> int:
    """The version of ``name`` the table is, or an AssertionError for anything else."""
    for v in range(VERSIONS):
        if table.equals(tables[name, v]):
            return v
    raise AssertionError(f"a get of {name!r} read data that was never published under it")


def _run_threads(workers: list[Callable[[], None]]) -> list[BaseException]:
    """Start every worker at once (a barrier), join them; the exceptions they raised."""
    barrier = threading.Barrier(len(workers))
    failures: list[BaseException] = []

    def run(work: Callable[[], None]) -> None:
        try:
            barrier.wait()
            work()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(work,)) for work in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
        assert not thread.is_alive(), "a worker thread hung"
    return failures


def _warm_baseline(publisher: aib.Publisher) -> dict[str, int]:
    """Counts after one get, once what lives for the process anyway (the reaper thread) has started."""
    publisher.publish("warm", table_for(4, 0))
    with aib.connect(publisher.path) as session, session.get("warm") as imported:
        pa.table(imported)
    publisher.unpublish("warm")
    return quiet_counts(publisher)


def test_sixteen_threads_publish_unpublish_and_replace_while_sessions_get(publisher: aib.Publisher) -> None:
    tables = _versions()
    baseline = _warm_baseline(publisher)
    calls: Counter[str] = Counter()
    calls_lock = threading.Lock()

    def mutator(seed: int) -> Callable[[], None]:
        def work() -> None:
            rng = random.Random(seed)
            done: Counter[str] = Counter()
            for _ in range(OPS_PER_THREAD):
                name = rng.choice(NAMES)
                if rng.random() < 0.6:  # publish, replacing whatever is there
                    publisher.publish(name, tables[name, rng.randrange(VERSIONS)])
                    done["publish"] += 1
                else:
                    try:
                        publisher.unpublish(name)
                        done["unpublish"] += 1
                    except NotPublishedError:
                        done["unpublish (not published)"] += 1
            with calls_lock:
                calls.update(done)

        return work

    def getter(seed: int) -> Callable[[], None]:
        def work() -> None:
            rng = random.Random(seed)
            done: Counter[str] = Counter()
            with aib.connect(publisher.path, timeout=30.0) as session:
                for _ in range(OPS_PER_THREAD):
                    name = rng.choice(NAMES)
                    try:
                        imported = session.get(name)
                    except NotPublishedError:
                        done["get (not published)"] += 1
                        continue
                    with imported:
                        _which_version(name, pa.table(imported), tables)
                    done["get"] += 1
            with calls_lock:
                calls.update(done)

        return work

    workers = [mutator(k) for k in range(THREADS)] + [getter(100 + k) for k in range(4)]
    failures = _run_threads(workers)
    assert failures == [], f"{len(failures)} calls failed, first: {failures[0]!r}"
    assert sum(calls.values()) == (THREADS + 4) * OPS_PER_THREAD
    assert calls["get"] > 0
    assert calls["publish"] > 0
    for name in publisher.names():
        publisher.unpublish(name)
    after = settled(
        lambda: (publisher.active_leases, publisher.active_sessions, resource_counts()), (0, 0, baseline)
    )
    assert after == (0, 0, baseline)
    print(f"publisher race: {sum(calls.values())} calls without an error ({dict(calls)})")


def test_sixteen_threads_on_one_session_get_release_and_forget(publisher: aib.Publisher) -> None:
    tables = _versions()
    baseline = _warm_baseline(publisher)
    for name in NAMES:
        publisher.publish(name, tables[name, 0])
    calls: Counter[str] = Counter()
    calls_lock = threading.Lock()
    session = aib.connect(publisher.path, timeout=30.0)

    def worker(seed: int) -> Callable[[], None]:
        def work() -> None:
            rng = random.Random(seed)
            done: Counter[str] = Counter()
            held: list[Any] = []
            for _ in range(OPS_PER_THREAD):
                action = rng.random()
                if action < 0.55 or not held:
                    name = rng.choice(NAMES)
                    imported = session.get(name)
                    assert _which_version(name, pa.table(imported), tables) == 0
                    held.append(imported)
                    done["get"] += 1
                elif action < 0.9:
                    held.pop(rng.randrange(len(held))).release()
                    done["release"] += 1
                else:
                    session.forget(rng.choice([None, *NAMES]))
                    done["forget"] += 1
                if len(held) > 8:  # bound the leases one connection holds
                    held.pop(0).release()
                    done["release"] += 1
            for imported in held:
                imported.release()
                done["release"] += 1
            with calls_lock:
                calls.update(done)

        return work

    try:
        failures = _run_threads([worker(k) for k in range(THREADS)])
        assert failures == [], f"{len(failures)} calls failed, first: {failures[0]!r}"
        assert calls["get"] == calls["release"]
        session.forget()
        leases = settled(lambda: publisher.active_leases, 0)
        assert leases == 0, f"{leases} leases left after every import was released and forgotten"
    finally:
        session.close()
    for name in NAMES:
        publisher.unpublish(name)
    after = settled(lambda: (publisher.active_sessions, resource_counts()), (0, baseline))
    assert after == (0, baseline)
    print(f"session race: {sum(calls.values())} calls without an error ({dict(calls)})")
