"""Publisher/session tests across processes: round trips, leases, failures, hostile peers, leaks.

Layout of the multiprocess tests:

* a long-lived *producer child* (``session_children.producer_main``, started once per test by the
  ``producer`` fixture with the "spawn" start method) publishes what this process sends it: either an
  object rebuilt from Arrow IPC bytes, or, for exact round trips of every Arrow type hypothesis
  generates, an object it ``get``s from a publisher in *this* process and republishes as is (the
  "relay": this process -> child -> this process, all through the bridge, no serialization);
* a *relay child* over a socketpair (``session_children.fd_relay_main``) for ``export`` +
  ``Session().import_message`` with the descriptors passed by ``SCM_RIGHTS``;
* short-lived consumer children (subprocess) that are killed with SIGKILL.

Every test runs under the ``no_leaks`` fixture: open descriptors, the C core's live owners, struct nodes
and mappings, the reaper's pending callbacks and this process's threads return to what they were before
the test.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import itertools
import json
import logging
import multiprocessing
import multiprocessing.resource_tracker
import os
import queue
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import nanoarrow as na
import polars as pl
import pyarrow as pa
import pytest
import session_children as children
from arrow_strategies import arrow_arrays, assert_arrays_equal, record_batches, tables
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from wire_craft import encode_item

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import _reaper, protocol, transport
from arrow_ipc_bridge._ffi import WIRE_VERSION, ffi, lib
from arrow_ipc_bridge.capsules import capsule_struct, owner_address
from arrow_ipc_bridge.metadata import Decoded

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SPAWN = multiprocessing.get_context("spawn")
JOIN_S = 30.0
EXAMPLES = settings.default.max_examples
HYPOTHESIS_WITH_FIXTURES = settings(
    suppress_health_check=[*settings.default.suppress_health_check, HealthCheck.function_scoped_fixture],
)
ANY_ARROW = st.one_of(arrow_arrays(), record_batches(), tables(max_batches=4))


# --- helpers ------------------------------------------------------------------------------------------------
def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.005) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return predicate()
        time.sleep(interval)


def settle() -> None:
    """Collect garbage and run the release callbacks of owners that died so far."""
    gc.collect()
    _reaper.drain()


def snapshot() -> dict[str, int]:
    settle()
    return {
        "fds": fd_count(),
        "owners": int(lib.aib_live_owners()),
        "nodes": int(lib.aib_live_nodes()),
        "mappings": int(lib.aib_live_mappings()),
        "reaper_callbacks": _reaper.pending_callbacks(),
        "threads": threading.active_count(),
    }


def assert_back_to(baseline: dict[str, int], timeout: float = 5.0) -> None:
    """Every counter of :func:`snapshot` returns to ``baseline`` (server threads and the reaper need a
    moment after a close)."""
    now: dict[str, int] = {}

    def same() -> bool:
        now.update(snapshot())
        return now == baseline

    assert wait_for(same, timeout, interval=0.02), f"leak: before {baseline}, after {now}"


def materialize(imported: aib.ImportedArray | aib.ImportedStream, like: object) -> Any:
    """The pyarrow object ``imported`` stands for (``like`` is the original or a kind string)."""
    if isinstance(imported, aib.ImportedStream):
        return pa.table(imported)
    if isinstance(like, pa.RecordBatch) or (isinstance(like, str) and like == "batch"):
        return pa.record_batch(imported)
    return pa.array(imported)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, env.get("PYTHONPATH")) if p)
    return env


def read_line(stream: Any, timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no output from the child within {timeout} s"
    return str(stream.readline().decode().strip())


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is in the stopped state (after SIGSTOP)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/stat") as f:
            states.append(f.read().rpartition(")")[2].split()[0])
    return bool(states) and all(state == "T" for state in states)


def sample_table(rows: int = 2000, batches: int = 1) -> pa.Table:
    """A table with fixed-width, variable-width, nested, dictionary and null columns."""
    parts = []
    for b in range(batches):
        base = b * rows
        ids = list(range(base, base + rows))
        parts.append(
            pa.record_batch(
                {
                    "i": pa.array([i if i % 7 else None for i in ids], pa.int64()),
                    "s": pa.array([f"value-{i}" if i % 5 else None for i in ids]),
                    "l": pa.array([[i, i + 1] if i % 3 else [] for i in ids], pa.list_(pa.int32())),
                    "d": pa.array([f"k{i % 4}" for i in ids]).dictionary_encode(),
                    "st": pa.array([{"a": i, "b": float(i) / 2} for i in ids]),
                    "n": pa.nulls(rows),
                }
            )
        )
    return pa.Table.from_batches(parts)


def write_shm_ipc_file(table: pa.Table) -> str:
    with tempfile.NamedTemporaryFile(
        dir="/dev/shm", prefix="aib-session-", suffix=".arrow", delete=False
    ) as f:
        path = f.name
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


# --- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def warm() -> dict[str, int]:
    """Open once what the library and multiprocessing keep open for the life of the process (the reaper's
    pipe and thread, the linger thread, /proc/self/maps and pagemap, the resource tracker's pipe), then
    record the baseline."""
    from arrow_ipc_bridge import _linger

    multiprocessing.resource_tracker.ensure_running()
    _linger.watch(FakeLingering([]))  # starts the thread (it is collected right away)
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-")
    shm = write_shm_ipc_file(sample_table(100))
    try:
        mapped = pa.ipc.open_file(pa.memory_map(shm)).read_all()
        with aib.Publisher(os.path.join(directory, "w.sock")) as pub:
            pub.publish("heap", sample_table(100))
            pub.publish("mapped", mapped)
            with aib.connect(pub.path, timeout=10.0) as session:
                for name in ("heap", "mapped"):
                    with session.get(name) as imported:
                        assert pa.table(imported).num_rows == 100
        del mapped
    finally:
        os.unlink(shm)
        shutil.rmtree(directory, ignore_errors=True)
    return snapshot()


@pytest.fixture(autouse=True)
def no_leaks(warm: dict[str, int]) -> Iterator[None]:
    """After each test (and all its other fixtures' teardown): nothing of it is left behind."""
    before = snapshot()
    yield
    assert_back_to(before)


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A short directory for socket files (AF_UNIX paths are limited to about 107 bytes)."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def publisher(sock_dir: str) -> Iterator[aib.Publisher]:
    pub = aib.Publisher(os.path.join(sock_dir, "pub.sock"))
    yield pub
    pub.close()
    assert pub.active_leases == 0


class ProducerChild:
    """The spawn-started ``session_children.producer_main``, driven over a multiprocessing pipe."""

    def __init__(self, own_path: str, upstream_path: str | None) -> None:
        self.conn, child_conn = SPAWN.Pipe()
        self.process = SPAWN.Process(
            target=children.producer_main,
            args=(child_conn, own_path, upstream_path),
            name="aib-test-producer",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.killed = False
        reply = self._recv(60.0)
        assert reply[0] == "ready", reply
        self.pid = reply[1]

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"the producer child did not answer within {timeout} s")
        return self.conn.recv()

    def call(self, *command: Any, timeout: float = 30.0) -> Any:
        self.conn.send(command)
        reply = self._recv(timeout)
        if reply[0] == "error":
            raise AssertionError(f"the producer child failed {command[0]!r}: {reply[1]}: {reply[2]}")
        return reply

    def state(self) -> tuple[int, int, list[str]]:
        _, leases, sessions, names = self.call("state")
        return leases, sessions, names

    def kill(self) -> None:
        self.killed = True
        self.process.kill()
        self.process.join(JOIN_S)
        assert self.process.exitcode == -signal.SIGKILL

    def stop(self) -> None:
        try:
            if not self.killed:
                self.conn.send(("stop",))
                reply = self._recv(JOIN_S)
                assert reply == ("bye", 0), reply
            self.process.join(JOIN_S)
            assert not self.process.is_alive(), "the producer child did not exit"
            assert self.process.exitcode == (-signal.SIGKILL if self.killed else 0)
        finally:
            if self.process.is_alive():
                self.process.kill()
                self.process.join(JOIN_S)
            self.conn.close()
            self.process.close()


@dataclass
class ProducerRig:
    child: ProducerChild
    upstream: aib.Publisher  # in this process: what the child relays from
    path: str  # the child's publisher
    session: aib.Session  # this process's session to the child's publisher


@pytest.fixture
def producer(sock_dir: str) -> Iterator[ProducerRig]:
    """A producer child (spawn) with its own Publisher, connected to a Publisher in this process."""
    upstream = aib.Publisher(os.path.join(sock_dir, "up.sock"))
    path = os.path.join(sock_dir, "child.sock")
    child = ProducerChild(path, upstream.path)
    session = None
    try:
        session = aib.connect(path, timeout=10.0)
        yield ProducerRig(child, upstream, path, session)
    finally:
        if session is not None:
            session.close()
        child.stop()
        upstream.close()
        assert upstream.active_leases == 0


Reply = tuple[int, bytes, list[int]] | Callable[[transport.Connection], None] | None


class FakePublisher:
    """A hand-written publisher on ``transport.Server``: answers HELLO (or not), answers each GET with
    the next scripted frame (``None``: never answers; a callable writes its own bytes), each POOL_FD
    with the next of ``pool_replies``, records the RELEASE frames it gets. ``features`` go in WELCOME."""

    def __init__(
        self,
        path: str,
        *,
        welcome: bool | bytes = True,
        replies: list[Reply] | None = None,
        pool_replies: list[Reply] | None = None,
        features: list[str] | None = None,
    ) -> None:
        self.releases: queue.Queue[int] = queue.Queue()
        if welcome is True:
            info = {"protocol": protocol.PROTOCOL_VERSION, "wire": list(WIRE_VERSION), "publisher_id": "fake"}
            if features is not None:
                info["features"] = features
            welcome = protocol.encode_json({**info, "pid": os.getpid()})
        self._welcome = welcome
        self._replies = list(replies or [])
        self._pool_replies = list(pool_replies or [])
        self.server = transport.Server(path, self._handle, name="aib-fake")
        self.path = self.server.path

    def _handle(self, conn: transport.Connection) -> None:
        while True:
            try:
                frame = conn.recv()
            except aib.PeerClosedError:
                return
            frame.close_fds()
            if frame.kind == protocol.HELLO and self._welcome:
                conn.send(protocol.WELCOME, self._welcome)
            elif frame.kind in (protocol.GET, protocol.POOL_FD):
                replies = self._replies if frame.kind == protocol.GET else self._pool_replies
                reply = replies.pop(0) if replies else None
                if callable(reply):
                    reply(conn)  # writes its own bytes
                elif reply is not None:
                    conn.send(*reply)
            elif frame.kind == protocol.RELEASE:
                self.releases.put(protocol.decode_lease(frame.payload))

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> FakePublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- 1. cross-process round trips ---------------------------------------------------------------------------
def relay_round_trip(rig: ProducerRig, obj: Any, name: str = "x") -> None:
    """Publish ``obj`` here, have the child ``get`` and republish it, ``get`` it back and compare; then
    check that every lease of the chain ends in both processes."""
    rig.upstream.publish(name, obj)
    stats = rig.child.call("relay", name)[1]
    assert stats["copied_bytes"] >= 0
    with rig.session.get(name) as imported:
        got = materialize(imported, obj)
        # The child's export holds the array structs of its import, so its lease on us lasts until it
        # unpublishes; a stream without batches has no array struct (the schema needs no lease).
        holds_arrays = isinstance(imported, aib.ImportedArray) or imported.batch_count > 0
    if holds_arrays:
        assert rig.upstream.active_leases == 1
    else:
        assert wait_for(lambda: rig.upstream.active_leases == 0, 5.0)
    assert_arrays_equal(got, obj)
    del got
    settle()
    assert wait_for(lambda: rig.child.state()[0] == 0, 5.0), "our lease on the child did not end"
    rig.child.call("unpublish", name)
    rig.upstream.unpublish(name)
    assert wait_for(lambda: rig.upstream.active_leases == 0, 5.0), "the child's lease on us did not end"


@HYPOTHESIS_WITH_FIXTURES
@given(obj=ANY_ARROW)
def test_relay_round_trip_all_types(producer: ProducerRig, obj: Any) -> None:
    """Any array, record batch or table (every Arrow type, nulls, slices, nesting, metadata) published here,
    imported by the producer child and republished from its own imported object, comes back equal; the
    leases of both hops end once the pyarrow objects are dropped and the names unpublished."""
    relay_round_trip(producer, obj)


@HYPOTHESIS_WITH_FIXTURES
@given(obj=ANY_ARROW, data=st.data())
def test_producer_child_publishes_its_own_data(producer: ProducerRig, obj: Any, data: st.DataObject) -> None:
    """Data that lives in the producer child's own pyarrow memory (rebuilt there from Arrow IPC bytes, then
    often sliced to a non-zero offset) arrives equal to the same rebuild done here. (Arrow IPC is lossy for
    a few exotic types; the relay test above covers every type exactly.)"""
    try:
        kind, payload = children.to_ipc(obj)
        expected = children.from_ipc(kind, payload)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        reject()  # Arrow IPC itself cannot carry this (e.g. a dictionary of uuid): not what is tested here
    window = None
    n = len(expected) if kind == "array" else expected.num_rows
    if n and data.draw(st.booleans(), label="slice"):
        offset = data.draw(st.integers(0, n), label="offset")
        window = (offset, data.draw(st.integers(0, n - offset), label="length"))
        expected = expected.slice(*window)
    producer.child.call("ipc", "x", kind, payload, window)
    with producer.session.get("x") as imported:
        got = materialize(imported, kind)
    assert_arrays_equal(got, expected)
    del got
    settle()
    assert wait_for(lambda: producer.child.state()[0] == 0, 5.0)


def stream_batch_count(table: pa.Table) -> int:
    """How many batches pyarrow's own C stream of ``table`` yields (it skips empty chunks)."""
    return sum(1 for _ in pa.RecordBatchReader.from_stream(table))


def check_fifty(rig: ProducerRig, table: pa.Table) -> None:
    relay_round_trip(rig, table, name="fifty")
    kind, payload = children.to_ipc(table)
    expected = children.from_ipc(kind, payload)
    rig.child.call("ipc", "fifty", kind, payload, None)
    with rig.session.get("fifty") as imported:
        assert isinstance(imported, aib.ImportedStream)
        assert imported.batch_count == stream_batch_count(expected)
        got = pa.table(imported)
    assert len(got.to_batches()) == stream_batch_count(expected)
    assert_arrays_equal(got, expected)


@settings(HYPOTHESIS_WITH_FIXTURES, max_examples=max(3, EXAMPLES // 12))
@given(table=tables(min_batches=50, max_batches=50, max_rows=5, min_columns=1, max_columns=4))
def test_tables_with_50_batches_both_ways(producer: ProducerRig, table: pa.Table) -> None:
    """A 50-batch table crosses the relay (both directions) and the child's own-memory path with every
    batch (as many as pyarrow's own stream yields: it skips empty chunks) and equal data."""
    check_fifty(producer, table)


def test_fifty_non_empty_batches_arrive_as_fifty(producer: ProducerRig) -> None:
    """A table of 50 non-empty batches arrives as exactly 50 batches, both ways."""
    table = sample_table(20, batches=50)
    assert stream_batch_count(table) == 50
    check_fifty(producer, table)


# --- 2. export + import_message over a socketpair ----------------------------------------------------------
@pytest.fixture
def fd_relay() -> Iterator[socket.socket]:
    """A subprocess running ``fd_relay_main`` on one end of a socketpair; this test holds the other."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, session_children as c; c.fd_relay_main(int(sys.argv[1]))",
            str(theirs.fileno()),
        ],
        pass_fds=[theirs.fileno()],
        env=child_env(),
    )
    theirs.close()
    ours.settimeout(30.0)
    try:
        yield ours
        children.send_message(ours, b"", [])
        assert proc.wait(timeout=JOIN_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(JOIN_S)
        ours.close()


@HYPOTHESIS_WITH_FIXTURES
@given(obj=ANY_ARROW)
def test_export_import_message_across_processes(fd_relay: socket.socket, obj: Any) -> None:
    """``aib.export`` here, message + fds through SCM_RIGHTS to a child that imports it with
    ``Session().import_message``, re-exports the imported object and sends it back the same way: the
    object that arrives equals the original. Our export is closed right after sending, and the child is
    told to close its own as soon as our import holds its mappings: the mappings keep the data. No fd is
    left open."""
    before = fd_count()
    exported = aib.export(obj)
    children.send_message(fd_relay, exported.message, exported.fds)
    exported.close()
    message, fds = children.recv_message(fd_relay)
    assert not message.startswith(b"ERROR:"), message.decode(errors="replace")
    with aib.Session() as session:
        try:
            imported = session.import_message(message, fds)
        finally:
            for fd in fds:
                os.close(fd)
        fd_relay.sendall(b"k")  # the child closes its export now
        with imported:
            got = materialize(imported, obj)
    assert_arrays_equal(got, obj)
    del got
    assert fd_count() == before


# --- 3. many consumers at once ------------------------------------------------------------------------------
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
        assert session.remembered_gets >= 2 * 8 * rounds - 8
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


def test_names_are_utf8_and_listed_sorted(publisher: aib.Publisher) -> None:
    """Any non-empty UTF-8 name up to 4096 bytes can be published, listed (sorted) and got back."""
    names = ["b", "a", "ü 日本/x", "with\nnewline", "é" * 2048]  # the last one is 4096 UTF-8 bytes
    for i, name in enumerate(names):
        publisher.publish(name, pa.array([i]))
    with aib.connect(publisher.path, timeout=5.0) as session:
        assert session.list() == sorted(names)
        for i, name in enumerate(names):
            with session.get(name) as imported:
                assert imported.name == name
                assert pa.array(imported).to_pylist() == [i]
        with pytest.raises(ValueError, match="name"):
            session.get("é" * 2049)
        with pytest.raises(aib.NotPublishedError):
            session.get("c")


# --- 4. a consumer killed while it holds a lease ------------------------------------------------------------
def test_killed_consumer_gives_its_lease_back(publisher: aib.Publisher) -> None:
    """A consumer process that holds a lease (and a pyarrow table built from it) and is killed with
    SIGKILL loses its lease within 1 s: ``active_leases`` returns to 0 and ``active_sessions`` drops."""
    publisher.publish("t", sample_table(5000))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, session_children as c; c.hold_lease_main(sys.argv[1], sys.argv[2])",
            publisher.path,
            "t",
        ],
        stdout=subprocess.PIPE,
        env=child_env(),
    )
    try:
        assert read_line(proc.stdout, 60.0) == "held 5000"
        assert publisher.active_leases == 1
        assert publisher.active_sessions == 1
        killed_at = time.monotonic()
        proc.kill()
        assert wait_for(lambda: publisher.active_leases == 0, 1.0), "lease still held 1 s after SIGKILL"
        assert wait_for(lambda: publisher.active_sessions == 0, 1.0)
        assert time.monotonic() - killed_at < 1.5
        assert proc.wait(JOIN_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(JOIN_S)
        assert proc.stdout is not None
        proc.stdout.close()
    # the publisher still serves
    with aib.connect(publisher.path, timeout=5.0) as session, session.get("t") as imported:
        assert pa.table(imported).num_rows == 5000


# --- 5. the producer killed while we hold its data ----------------------------------------------------------
def test_consumer_keeps_data_after_producer_is_killed(
    producer: ProducerRig, caplog: pytest.LogCaptureFixture
) -> None:
    """After SIGKILL of the producer, everything we imported stays readable and correct (the table built
    before, and a new table built from the imported object after), releasing it raises nothing (not even on
    the reaper thread), and a new ``get`` on the dead session raises TransportError at once, not a hang."""
    caplog.set_level(logging.WARNING, logger="arrow_ipc_bridge")
    expected = sample_table(20_000, batches=3)
    kind, payload = children.to_ipc(expected)
    producer.child.call("ipc", "big", kind, payload, None)
    imported = producer.session.get("big")
    before_kill = pa.table(imported)
    producer.child.kill()
    assert_arrays_equal(before_kill, expected)
    after_kill = pa.table(imported)
    assert_arrays_equal(after_kill, expected)
    imported.release()
    imported.release()
    assert_arrays_equal(after_kill, expected)
    del before_kill, after_kill
    settle()
    started = time.monotonic()
    with pytest.raises(aib.TransportError):
        producer.session.get("big")
    assert time.monotonic() - started < 2.0
    with pytest.raises(aib.TransportError):
        producer.session.list()
    settle()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_get_in_flight_fails_when_producer_dies(producer: ProducerRig) -> None:
    """A ``get`` waiting on a stopped producer (SIGSTOP) raises TransportError as soon as the producer is
    killed, long before the session's 20 s timeout."""
    producer.child.call("ipc", "t", *children.to_ipc(sample_table(100)), None)
    waiting = aib.connect(producer.path, timeout=20.0)
    outcome: list[BaseException | None] = []
    try:
        os.kill(producer.child.pid, signal.SIGSTOP)
        # A group stop takes effect when the thread picked for the signal runs, which may be a few ms
        # later: until every thread of the child is stopped, it could still answer.
        assert wait_for(lambda: all_threads_stopped(producer.child.pid), 5.0)

        def get() -> None:
            try:
                waiting.get("t").release()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=get, name="in-flight-get")
        thread.start()
        time.sleep(0.3)
        assert not outcome, "the stopped producer answered"
        killed_at = time.monotonic()
        producer.child.kill()
        thread.join(JOIN_S)
        assert not thread.is_alive()
        assert time.monotonic() - killed_at < 3.0
        assert len(outcome) == 1
        assert isinstance(outcome[0], aib.TransportError), outcome
    finally:
        waiting.close()


# --- 6. hostile and broken traffic --------------------------------------------------------------------------
@contextlib.contextmanager
def good_consumer(path: str, expected: pa.Table) -> Iterator[dict[str, Any]]:
    """A well-behaved session getting ``t`` in a loop on a thread while the test body runs."""
    stats: dict[str, Any] = {"ok": 0, "errors": []}
    stop = threading.Event()

    def loop() -> None:
        try:
            with aib.connect(path, timeout=10.0) as session:
                while not stop.is_set():
                    with session.get("t") as imported:
                        assert_arrays_equal(pa.table(imported), expected)
                    stats["ok"] += 1
        except BaseException as exc:
            stats["errors"].append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=loop, name="good-consumer")
    thread.start()
    try:
        assert wait_for(lambda: stats["ok"] > 0 or bool(stats["errors"]), 10.0)
        yield stats
    finally:
        ok_before_stop = stats["ok"]
        assert wait_for(lambda: stats["ok"] > ok_before_stop or bool(stats["errors"]), 10.0)
        stop.set()
        thread.join(JOIN_S)
    assert not thread.is_alive()
    assert stats["errors"] == []


def expect_error_then_close(conn: transport.Connection, error_type: str) -> None:
    frame = conn.recv(timeout=5.0)
    frame.close_fds()
    assert frame.kind == protocol.ERROR, frame
    body = protocol.decode_json(frame.payload, "ERROR")
    assert body["type"] == error_type, body
    with pytest.raises(aib.PeerClosedError):
        conn.recv(timeout=5.0)


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        pytest.param(999, b"", id="unknown-kind"),
        pytest.param(protocol.ITEM, struct.pack("<Q", 1) + b"junk", id="item-from-a-session"),
        pytest.param(protocol.GET, b"\xff\xfe\xfd", id="get-invalid-utf8"),
        pytest.param(protocol.GET, b"", id="get-empty-name"),
        pytest.param(protocol.GET, b"n" * (protocol.MAX_NAME + 1), id="get-name-too-long"),
        pytest.param(protocol.RELEASE, b"\x01\x02\x03", id="release-3-bytes"),
        pytest.param(protocol.RELEASE, b"\x00" * 9, id="release-9-bytes"),
        pytest.param(protocol.PING, b"p" * (protocol.MAX_PING + 1), id="ping-too-long"),
        pytest.param(protocol.PONG, b"", id="pong-from-a-session"),
        pytest.param(protocol.HELLO, struct.pack("<H", 99), id="hello-wrong-version"),
        pytest.param(protocol.HELLO, b"\x01", id="hello-short"),
    ],
)
def test_protocol_violations_get_error_and_close(publisher: aib.Publisher, kind: int, payload: bytes) -> None:
    """A raw client that first takes a lease, then sends a frame the protocol forbids, gets an ERROR
    (ProtocolError) and a closed connection; its lease is given back; a well-behaved session is served
    all along."""
    table = sample_table(200)
    publisher.publish("t", table)
    with good_consumer(publisher.path, table), transport.connect(publisher.path, timeout=5.0) as raw:
        raw.send(protocol.HELLO, protocol.encode_hello())
        with raw.recv(timeout=5.0) as welcome:
            assert welcome.kind == protocol.WELCOME
        raw.send(protocol.GET, b"t")
        with raw.recv(timeout=5.0) as item:
            assert item.kind == protocol.ITEM
            assert item.fds
        assert wait_for(lambda: publisher.active_leases >= 1, 1.0)
        raw.send(kind, payload)
        expect_error_then_close(raw, "ProtocolError")
        assert wait_for(lambda: publisher.active_sessions == 1, 5.0)  # only the good consumer is left
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_ping_echoes_its_payload_from_the_c_loop(publisher: aib.Publisher) -> None:
    """PING is answered in C with its payload (empty to MAX_PING bytes), between gets on the same
    connection; a payload over the limit is refused before anything is sent."""
    publisher.publish("t", sample_table(100))
    with aib.connect(publisher.path, timeout=5.0) as session:
        assert "ping" in session.publisher_info["features"]
        for payload in (b"", b"x", bytes(range(protocol.MAX_PING))):
            assert session.ping(payload) > 0
        with session.get("t") as imported:
            assert session.ping() > 0
            assert pa.table(imported).num_rows == 100
        with pytest.raises(ValueError, match="at most"):
            session.ping(b"p" * (protocol.MAX_PING + 1))
        assert session.ping(b"still usable") > 0
    with pytest.raises(aib.BridgeError, match="closed"):
        session.ping()


def test_ping_to_an_older_publisher_is_refused_without_sending(sock_dir: str) -> None:
    """A publisher whose WELCOME names no "ping" feature would close the connection on a PING frame:
    the session refuses up front and stays usable."""
    old = os.path.join(sock_dir, "old.sock")
    with FakePublisher(old) as fake, aib.connect(fake.path, timeout=5.0) as session:
        with pytest.raises(aib.BridgeError, match="does not answer PING"):
            session.ping()
        assert not session.closed


def test_publisher_refuses_pool_fds_it_did_not_name_and_serves_on(publisher: aib.Publisher) -> None:
    """POOL_FD for an identity that names no pool of the publisher's process (a guess, another
    producer's nonce) is answered with RegionError and the session goes on; a malformed identity is
    a protocol error that closes the connection. No descriptor is left behind either way."""
    from arrow_ipc_bridge.cuda import placer

    assert "pool_fd" in protocol.FEATURES
    publisher.publish("t", sample_table(10))
    base_fds = fd_count()
    with aib.connect(publisher.path, timeout=5.0) as session:
        assert "pool_fd" in session.publisher_info["features"]  # type: ignore[operator]
        ours = placer._NONCE + (1234).to_bytes(8, "little")  # our nonce, no such pool
        for identity in (b"\x00" * 24, ours):
            with pytest.raises(aib.RegionError, match=r"publisher: .*pool"):
                session._fetch_pool_fd(identity)
        with session.get("t") as imported:
            assert pa.table(imported).num_rows == 10
        with pytest.raises(aib.ProtocolError, match="pool identity of 5 bytes"):
            session._request(protocol.POOL_FD, b"short")
        with pytest.raises(aib.BridgeError):
            session.list()  # the publisher closed the connection
    assert wait_for(lambda: publisher.active_sessions == 0, 5.0)
    assert fd_count() == base_fds


def test_session_checks_the_publishers_pool_fd_answer(sock_dir: str) -> None:
    """The session takes exactly one fd from a POOL answer that repeats the identity it asked for;
    anything else (another frame kind, no fd, two fds, another identity) is a ProtocolError and
    every descriptor that came is closed. A publisher that does not list "pool_fd" is not asked."""
    identity = bytes(range(24))

    def pool_frame(payload: bytes, n_fds: int) -> Callable[[transport.Connection], None]:
        def send(conn: transport.Connection) -> None:
            files = [os.open(os.devnull, os.O_RDONLY) for _ in range(n_fds)]
            try:
                conn.send(protocol.POOL, payload, files)
            finally:
                for fd in files:
                    os.close(fd)

        return send

    bad: list[Reply] = [
        (protocol.PONG, identity, []),
        pool_frame(identity, 0),
        pool_frame(identity, 2),
        pool_frame(bytes(24), 1),
    ]
    path = os.path.join(sock_dir, "fake-pool.sock")
    base_fds = fd_count()
    replies = [*bad, pool_frame(identity, 1)]
    with (
        FakePublisher(path, features=["pool_fd"], pool_replies=replies) as fake,
        aib.connect(fake.path, timeout=5.0) as session,
    ):
        for _ in bad:
            with pytest.raises(aib.ProtocolError, match="expected POOL"):
                session._fetch_pool_fd(identity)
        fd = session._fetch_pool_fd(identity)
        try:
            assert os.fstat(fd).st_ino == os.stat(os.devnull).st_ino
        finally:
            os.close(fd)
    old = os.path.join(sock_dir, "old-pool.sock")
    with FakePublisher(old, features=["ping"]) as fake, aib.connect(fake.path, timeout=5.0) as session:
        with pytest.raises(aib.ProtocolError, match="does not serve pool fds"):
            session._fetch_pool_fd(identity)
        assert not session.closed  # nothing was sent
    assert fd_count() == base_fds


def test_pool_region_without_its_fd_needs_a_known_pool_or_a_source() -> None:
    """A pool region with fd_index -1 (a publisher's message) imports only through a pool this
    process has imported or a way to ask for the fd; without either it is a RegionError, and a
    failing source leaves nothing cached. An index past the fds that came is refused too. None of
    this reaches the driver, so it runs without a GPU."""
    from arrow_ipc_bridge.cuda import opener as cuda_opener
    from arrow_ipc_bridge.metadata import REGION_CUDA_POOL, Region

    opener = cuda_opener.CudaOpener()
    handle = bytes(range(88))
    region = Region(REGION_CUDA_POOL, 4096, fd_index=-1, handle=handle)
    with pytest.raises(aib.RegionError, match="without its pool's fd"):
        opener.open_pool_regions([region], [], 0)

    asked: list[bytes] = []

    def failing_source(identity: bytes) -> int:
        asked.append(identity)
        raise aib.PeerClosedError("the publisher went away")

    with pytest.raises(aib.PeerClosedError):
        opener.open_pool_regions([region], [], 0, failing_source)
    assert asked == [handle[:24]]
    assert opener._pools == {}
    assert opener._pool_pointers == {}
    past_end = Region(REGION_CUDA_POOL, 4096, fd_index=1, handle=handle)
    with pytest.raises(aib.RegionError, match="fd index 1 but 1 fds came"):
        opener.open_pool_regions([past_end], [0], 0)
    with pytest.raises(aib.RegionError, match="88-byte handle"):
        opener.open_pool_regions([Region(REGION_CUDA_POOL, 4096, fd_index=-1, handle=b"x")], [], 0)


class _FakeImportedPool:
    """Stands in for cuda.ImportedPool in the opener's bookkeeping tests (no driver)."""

    addresses = itertools.count(0x10000, 0x1000)

    def __init__(self) -> None:
        self.imported: set[int] = set()
        self.closed = False

    @property
    def imported_count(self) -> int:
        return len(self.imported)

    def import_pointers(self, export_datas: list[bytes]) -> list[int]:
        assert not self.closed, "imported through a closed pool"
        pointers = [next(self.addresses) for _ in export_datas]
        self.imported.update(pointers)
        return pointers

    def free_imported_many(self, pointers: list[int]) -> None:
        self.imported.difference_update(pointers)

    def close(self) -> None:
        self.closed = True


def test_imported_pools_beyond_the_bound_are_dropped_once_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The opener keeps at most max_pools imported pools: the least recently used ones with no
    pointer imported are destroyed when another is imported; a pool whose pointers are in use
    stays. A pool evicted under a message being imported is looked up again, and after three
    such evictions the import fails with RegionError."""
    from arrow_ipc_bridge.cuda import opener as cuda_opener
    from arrow_ipc_bridge.metadata import REGION_CUDA_POOL, Region

    made: list[_FakeImportedPool] = []

    def fake_import_pool(fd: int, device: int) -> _FakeImportedPool:
        made.append(_FakeImportedPool())
        return made[-1]

    monkeypatch.setattr(cuda_opener, "import_pool", fake_import_pool)
    opener = cuda_opener.CudaOpener(max_pools=2)

    def region(pool: int, pointer: int) -> Region:
        handle = bytes([pool]) * 24 + bytes([pointer]) * 64
        return Region(REGION_CUDA_POOL, 4096, fd_index=0, handle=handle)

    def use(pool: int, pointer: int) -> Any:
        return opener.open_pool_regions([region(pool, pointer)], [0], 0)[1]

    def let_go(owner: Any) -> None:
        lib.aib_owner_unref(owner)
        _reaper.drain()

    held = use(1, 1)  # pool 1 stays in use
    let_go(use(2, 1))  # pool 2 idle
    kept = use(3, 1)  # over the bound: pool 2 (idle) goes, pool 1 (in use) stays
    assert [p.closed for p in made] == [False, True, False]
    assert list(opener._pools) == [bytes([1]) * 24, bytes([3]) * 24]
    let_go(held)
    let_go(use(4, 1))  # pool 1 is idle now and the least recently used
    assert [p.closed for p in made] == [True, True, False, False]
    assert made[0].imported == set()
    let_go(kept)

    monkeypatch.setattr(opener, "_pool", lambda *args: _FakeImportedPool())  # never the cached one
    with pytest.raises(aib.RegionError, match="evicted three times"):
        use(5, 1)
    assert opener._pool_pointers == {}


def test_kept_slab_imports_outlive_their_leases_in_a_bounded_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pool regions flagged kept (slabs the producer never frees) are imported once and stay
    imported after the message using them ends, in an LRU the C get path sees too; a later message
    over the same slab imports nothing (pool_kept_hits). Unflagged pool pointers of the same
    message are still freed with it. Beyond max_kept the least recently used slab leaves the LRU
    and its import is freed once no message uses it; close() lets the rest go."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import opener as cuda_opener
    from arrow_ipc_bridge.metadata import REGION_CUDA_POOL, REGION_FLAG_KEPT, Region

    pool = _FakeImportedPool()
    monkeypatch.setattr(cuda_opener, "import_pool", lambda fd, device: pool)
    opener = cuda_opener.CudaOpener(max_kept=2)

    def region(pointer: int, kept: bool = True) -> Region:
        return Region(
            REGION_CUDA_POOL,
            1 << 20,
            fd_index=0,
            handle=b"P" * 24 + bytes([pointer]) * 64,
            flags=REGION_FLAG_KEPT if kept else 0,
        )

    def let_go(owner: Any) -> None:
        lib.aib_owner_unref(owner)
        _reaper.drain()

    tables_before = lib.aib_regions_count()
    stats = cuda.cuda_stats()
    bases, owner = opener.open_pool_regions([region(1), region(1), region(2, kept=False)], [0], 0)
    slab_1 = bases[0]
    assert bases[1] == slab_1
    assert len(pool.imported) == 2
    assert lib.aib_regions_count() == tables_before + 1  # the kept slab, for the C get path
    let_go(owner)
    assert pool.imported == {slab_1}  # the kept slab stays; the counted pointer went with its lease
    bases, owner = opener.open_pool_regions([region(1)], [0], 0)
    assert bases == [slab_1]
    assert len(pool.imported) == 1
    after = cuda.cuda_stats()
    assert after["pool_kept_hits"] - stats["pool_kept_hits"] == 1
    assert after["pool_pointer_imports"] - stats["pool_pointer_imports"] == 2
    held = owner  # a message still using slab 1
    let_go(opener.open_pool_regions([region(2)], [0], 0)[1])
    let_go(opener.open_pool_regions([region(3)], [0], 0)[1])  # over the bound: slab 1 leaves the LRU
    assert list(opener._kept) == [region(2).handle, region(3).handle]
    assert slab_1 in pool.imported  # still used
    let_go(held)
    assert slab_1 not in pool.imported
    assert len(pool.imported) == 2
    assert lib.aib_regions_count() == tables_before + 2
    opener.close()
    _reaper.drain()
    assert pool.imported == set()
    assert opener._pool_pointers == {}
    assert lib.aib_regions_count() == tables_before


def test_legacy_regions_of_a_message_open_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message's legacy regions open under one owner: each handle once (a repeat is a cache
    hit), in order; the LRU still bounds what stays open, and a handle it pushes out closes only
    when the last message using it lets go. A handle that is not 64 bytes opens nothing."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import opener as cuda_opener
    from arrow_ipc_bridge.metadata import REGION_CUDA_LEGACY, Region

    opened: list[bytes] = []
    closed: list[int] = []

    def fake_open(handle: bytes, device: int) -> int:
        opened.append(handle)
        return 0x1000 * len(opened)

    monkeypatch.setattr(cuda_opener, "ipc_open_mem_handle", fake_open)
    monkeypatch.setattr(cuda_opener, "ipc_close_mem_handle", lambda ptr, device=None: closed.append(ptr))
    opener = cuda_opener.CudaOpener(max_legacy=2)
    a, b, c = (bytes([i]) * 64 for i in (1, 2, 3))

    def message(*handles: bytes) -> tuple[list[int], Any]:
        return opener.open_legacy_regions([Region(REGION_CUDA_LEGACY, 64, handle=h) for h in handles], 0)

    def let_go(owner: Any) -> None:
        lib.aib_owner_unref(owner)
        _reaper.drain()

    before = cuda.cuda_stats()
    bases, first = message(a, b, a)
    assert bases == [0x1000, 0x2000, 0x1000]
    assert opened == [a, b]
    after = cuda.cuda_stats()
    assert after["legacy_opens"] - before["legacy_opens"] == 2
    assert after["legacy_hits"] - before["legacy_hits"] == 1
    bases, second = message(c)  # pushes b (least recently used) out of the LRU
    assert bases == [0x3000]
    assert closed == []  # the first message still uses b
    let_go(first)
    let_go(second)
    assert closed == [0x2000]  # a and c stay open in the LRU
    with pytest.raises(aib.RegionError, match="64 bytes"):
        message(a, b"short")
    assert opened == [a, b, c]
    opener.close()  # the LRU lets go: every handle is closed once
    _reaper.drain()
    assert sorted(closed) == [0x1000, 0x2000, 0x3000]


def _forked_child(parent_objects: dict[str, Any], path: str, out: int) -> None:
    """The body of test_a_forked_child_neither_uses_nor_breaks_its_parents_bridge's child: writes
    a JSON report to ``out``. ``parent_objects`` holds what the child inherited."""
    session, pub, held = parent_objects["session"], parent_objects["pub"], parent_objects["held"]
    report: list[Any] = [pa.table(held).num_rows]  # inherited data stays readable
    for call in (lambda: session.get("t"), session.list, lambda: pub.publish("u", sample_table(1))):
        try:
            call()
            report.append("no error")
        except aib.ForeignProcessError:
            report.append("foreign")
    # Dropping and closing everything inherited must reach nothing of the parent's.
    held.release()
    parent_objects.clear()
    gc.collect()
    _reaper.drain()
    session.close()
    pub.close()
    with aib.connect(path, timeout=5.0) as own, own.get("t") as imported:  # its own session works
        report.append(pa.table(imported).num_rows)
    os.write(out, json.dumps(report).encode())


def test_a_forked_child_neither_uses_nor_breaks_its_parents_bridge(sock_dir: str) -> None:
    """A child of fork inherits a publisher, a session, their sockets and imports. It may read the
    imports, but the session and publisher raise ForeignProcessError there, and dropping or closing
    them in the child sends no frame, shuts no socket down and unlinks no file: the parent's leases,
    connection and socket file are untouched. A new session made in the child works."""
    with aib.Publisher(os.path.join(sock_dir, "fork.sock")) as pub:
        pub.publish("t", sample_table(100))
        session = aib.connect(pub.path, timeout=5.0)
        held = session.get("t")
        other = session.get("t")
        assert pub.active_leases == 2
        read_end, write_end = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: fork with threads running
            pid = os.fork()
        if pid == 0:  # never returns into pytest
            code = 1
            try:
                os.close(read_end)
                _forked_child(
                    {"session": session, "pub": pub, "held": held, "other": other}, pub.path, write_end
                )
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        try:
            _, status = os.waitpid(pid, 0)
            with os.fdopen(read_end, "rb") as reader:
                report = json.loads(reader.read() or b"null")
        finally:
            assert os.waitstatus_to_exitcode(status) == 0
        assert report == [100, "foreign", "foreign", "foreign", 100]
        assert os.path.exists(pub.path)
        assert pub.active_leases == 2  # the child's new session came and went; ours stand
        with session.get("t") as again:
            assert pa.table(again).num_rows == 100
        held.release()
        del other  # ends through the reaper thread, whose wake-ups the child did not take
        assert wait_for(lambda: pub.active_leases == 0, 5.0)
        session.close()


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
    from arrow_ipc_bridge.capsules import DEVICE_CUDA, capture
    from arrow_ipc_bridge.metadata import REGION_CUDA_LEGACY, SLOT_FIRST_REGION, Described, DeviceInfo, Region

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
    keys = [(lib.AIB_REGION_KEY_DEVICE, uuid), (lib.AIB_REGION_KEY_EVENT, sync)]
    try:
        assert lib.aib_regions_put(lib.AIB_REGION_KEY_DEVICE, uuid, len(uuid), ordinal, ffi.NULL) == 0
        assert lib.aib_regions_put(lib.AIB_REGION_KEY_EVENT, sync, len(sync), event, ffi.NULL) == 0
        for handle, base in handles:
            assert lib.aib_regions_put(key_kind, handle, len(handle), base, keeper) == 0
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
    assert lib.aib_regions_put(lib.AIB_REGION_KEY_DEVICE, uuid, len(uuid), ordinal, ffi.NULL) == 0
    assert lib.aib_regions_put(lib.AIB_REGION_KEY_EVENT, sync, len(sync), event, ffi.NULL) == 0
    keys = [(lib.AIB_REGION_KEY_DEVICE, uuid), (lib.AIB_REGION_KEY_EVENT, sync)]
    for i, handle in enumerate(handles):
        owner = lib.aib_owner_new(_reaper.register(lambda i=i: released.append(i)))
        assert (
            lib.aib_regions_put(lib.AIB_REGION_KEY_LEGACY, handle, len(handle), stride * (i + 1), owner) == 0
        )
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
    from arrow_ipc_bridge.capsules import DEVICE_CUDA
    from arrow_ipc_bridge.metadata import REGION_CUDA_LEGACY, Decoded

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
            assert session.new_message_gets == 1
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
    from arrow_ipc_bridge.capsules import DEVICE_CUDA, capture

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
            assert session.new_message_gets == 1
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
    from arrow_ipc_bridge.capsules import DEVICE_CUDA

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
            assert (session.new_message_gets, session.remembered_gets) == (1, 0)
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
            _reaper.drain()
            assert released == []
            assert publisher.active_leases == 1
            imported.release()
            assert wait_for(lambda: publisher.active_leases == 0, 5.0)
            _reaper.drain()
            assert sorted(released) == [0, 1, 2]

            # one handle missing: the Python path, which needs the driver here
            lib.aib_regions_put(lib.AIB_REGION_KEY_LEGACY, handles[0], 64, 0x10000, ffi.NULL)
            keys.append((lib.AIB_REGION_KEY_LEGACY, handles[0]))
            with pytest.raises(aib.BridgeError):
                session.get("new")
            assert session.new_message_gets == 1
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
            assert (session.new_message_gets, session.remembered_gets) == (2, 1)
            assert wait_for(lambda: publisher.active_leases == 0, 5.0)  # the template holds none
            # new data under one name every get: each a new message, none remembered
            for k in range(4):
                changed = _cuda_shaped_message(batch.slice(0, 7 - k), handles, uuid, sync)
                _publish_raw(publisher, "stream", changed)
                session.get("stream").release()
            assert (session.new_message_gets, session.remembered_gets) == (6, 1)
            for kind, key in keys[2:]:
                lib.aib_regions_remove(kind, key, len(key))
            keys = keys[:2]
            _reaper.drain()
            assert released == []  # the remembered template holds the handles' owners
            assert session.forget("poll") == 1
            _reaper.drain()
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
    from arrow_ipc_bridge.metadata import REGION_CUDA_POOL, REGION_FLAG_KEPT

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
                assert session.new_message_gets == 1
                _, array_capsule = imported.__arrow_c_device_array__()
                children = capsule_struct(array_capsule, "device_array").array.children
                data = [int(ffi.cast("uintptr_t", children[i].buffers[1])) for i in range(2)]
                assert data == [0x400000, 0x800000]
                del children, array_capsule
            with pytest.raises(aib.BridgeError):
                session.get("leased")
            assert session.new_message_gets == 1
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
    from arrow_ipc_bridge.capsules import DEVICE_CUDA, capture, new_capsule

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


def test_ping_to_a_dead_publisher_raises_peer_closed(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "dead.sock")
    pub = aib.Publisher(path)
    session = aib.connect(path, timeout=5.0)
    try:
        pub.close()
        with pytest.raises(aib.PeerClosedError):
            session.ping()
        assert session._conn is not None
        assert session._conn.closed
    finally:
        session.close()


def raw_hello(raw: transport.Connection) -> None:
    """The handshake a raw client must make before any request."""
    raw.send(protocol.HELLO, protocol.encode_hello())
    with raw.recv(timeout=5.0) as welcome:
        assert welcome.kind == protocol.WELCOME


def test_raw_client_edge_cases_that_are_allowed(publisher: aib.Publisher) -> None:
    """Releasing an unknown lease id, another connection's lease id, or one lease twice, is harmless (no
    reply, no miscount); a GET of an unknown name answers NotPublishedError and the connection stays
    usable; descriptors a client attaches to its frames are closed by the publisher (our fd count returns
    to the baseline)."""
    publisher.publish("t", sample_table(100))
    base_fds = fd_count()
    with transport.connect(publisher.path, timeout=5.0) as raw:
        raw_hello(raw)
        raw.send(protocol.RELEASE, protocol.encode_lease(12345))
        raw.send(protocol.GET, b"t")
        with raw.recv(timeout=5.0) as item:
            assert item.kind == protocol.ITEM
            lease_id, _ = protocol.decode_item(item.payload)
        raw.send(protocol.GET, b"t")
        with raw.recv(timeout=5.0) as item2:
            lease_id2, _ = protocol.decode_item(item2.payload)
        assert lease_id2 != lease_id
        assert publisher.active_leases == 2
        # lease ids belong to their connection: another client cannot release ours
        with transport.connect(publisher.path, timeout=5.0) as other:
            raw_hello(other)
            for foreign in (lease_id, lease_id2):
                other.send(protocol.RELEASE, protocol.encode_lease(foreign))
            other.send(protocol.LIST, b"")
            with other.recv(timeout=5.0) as names:
                assert names.kind == protocol.NAMES
        assert publisher.active_leases == 2
        raw.send(protocol.RELEASE, protocol.encode_lease(lease_id))
        raw.send(protocol.RELEASE, protocol.encode_lease(lease_id))
        raw.send(protocol.LIST, b"")
        with raw.recv(timeout=5.0) as names:
            assert names.kind == protocol.NAMES
        assert publisher.active_leases == 1
        raw.send(protocol.GET, "nicht veröffentlicht".encode())
        with raw.recv(timeout=5.0) as error:
            assert error.kind == protocol.ERROR
            assert protocol.decode_json(error.payload, "ERROR")["type"] == "NotPublishedError"
        # descriptors attached by a client: the publisher closes its copies
        memfds = [os.memfd_create(f"junk{i}", os.MFD_CLOEXEC) for i in range(3)]
        try:
            raw.send(protocol.LIST, b"", memfds)
            with raw.recv(timeout=5.0) as names:
                assert names.kind == protocol.NAMES
        finally:
            for fd in memfds:
                os.close(fd)
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    assert wait_for(lambda: fd_count() == base_fds, 2.0)


HEADER = struct.Struct("<4sHHIHH")


@pytest.mark.parametrize(
    ("data", "half_close"),
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False, id="http-request"),
        pytest.param(HEADER.pack(b"XXXX", 1, protocol.LIST, 0, 0, 0), False, id="bad-magic"),
        pytest.param(HEADER.pack(b"AIBT", 7, protocol.LIST, 0, 0, 0), False, id="bad-version"),
        pytest.param(HEADER.pack(b"AIBT", 1, protocol.LIST, 0, 0, 1), False, id="reserved-set"),
        pytest.param(HEADER.pack(b"AIBT", 1, protocol.GET, 0xFFFFFFFF, 0, 0), False, id="huge-length"),
        pytest.param(HEADER.pack(b"AIBT", 1, protocol.LIST, 0, 400, 0), False, id="too-many-fds"),
        pytest.param(HEADER.pack(b"AIBT", 1, protocol.LIST, 0, 2, 0), False, id="fds-announced-missing"),
        pytest.param(HEADER.pack(b"AIBT", 1, protocol.GET, 0, 0, 0)[:9], True, id="truncated-header"),
        pytest.param(HEADER.pack(b"AIBT", 1, protocol.GET, 10, 0, 0) + b"abc", True, id="truncated-payload"),
        pytest.param(b"", True, id="connect-and-hang-up"),
    ],
)
def test_garbage_bytes_are_dropped(publisher: aib.Publisher, data: bytes, half_close: bool) -> None:
    """Bytes that are not a valid frame (or a frame cut short by the client) end that connection: the
    client sees end-of-file or a reset, quickly; the publisher keeps serving a well-behaved session."""
    table = sample_table(200)
    publisher.publish("t", table)
    with good_consumer(publisher.path, table):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(5.0)
            raw.connect(publisher.path)
            raw.sendall(data)
            if half_close:
                raw.shutdown(socket.SHUT_WR)
            received = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := raw.recv(65536):
                    received += chunk
            # nothing but (at most) an ERROR frame comes back
            assert received == b"" or received[:4] == b"AIBT"
        assert wait_for(lambda: publisher.active_sessions == 1, 5.0)
    assert publisher.active_leases == 0 or wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_fds_with_a_garbage_frame_are_closed(publisher: aib.Publisher) -> None:
    """Descriptors that arrive with a frame the publisher rejects (more fds than the header announced)
    are closed: our fd count returns to the baseline once the connection is dropped."""
    base_fds = fd_count()
    memfds = [os.memfd_create(f"junk{i}", os.MFD_CLOEXEC) for i in range(4)]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(5.0)
            raw.connect(publisher.path)
            socket.send_fds(raw, [HEADER.pack(b"AIBT", 1, protocol.LIST, 0, 1, 0)], memfds)
            with contextlib.suppress(ConnectionResetError):
                while raw.recv(65536):
                    pass
    finally:
        for fd in memfds:
            os.close(fd)
    assert wait_for(lambda: publisher.active_sessions == 0, 5.0)
    assert wait_for(lambda: fd_count() == base_fds, 2.0)


def with_device(message: bytes, device_type: int) -> bytes:
    """``message`` (a CPU message: device type 1 at byte 16) claiming another one-byte device type."""
    assert message[16] == 1
    return message[:16] + bytes([device_type]) + message[17:]


def test_corrupted_item_messages_raise_wire_format_error(sock_dir: str) -> None:
    """A publisher that answers GET with a corrupted ITEM (flipped header bytes, truncated, padded, fds
    missing, payload shorter than a lease id) makes ``session.get`` raise WireFormatError (ProtocolError for
    the short payload); the descriptors that came with it are closed, the session gives the lease back
    (the fake publisher receives exactly one RELEASE for that lease id) and stays usable. A valid message
    whose descriptor is not a file (a pipe), is not sealed although the region says so, or is smaller than
    the region, or that claims a device this session cannot map, raises RegionError (or CudaError), with
    the same guarantees."""
    exported = aib.export(sample_table(300))
    message, fds = exported.message, exported.fds
    read_end, write_end = os.pipe()
    decoded = Decoded(message, len(fds))
    region_size = decoded.regions()[0].size
    decoded.close()
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, region_size)
    too_small = os.memfd_create("small", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(too_small, region_size // 2)
    fcntl.fcntl(too_small, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    cases: list[tuple[str, type[Exception] | tuple[type[Exception], ...], bytes, list[int], bool]] = [
        ("flipped magic", aib.WireFormatError, bytes([message[0] ^ 0xFF]) + message[1:], fds, True),
        (
            "flipped version",
            aib.WireFormatError,
            message[:4] + bytes([message[4] ^ 0x7F]) + message[5:],
            fds,
            True,
        ),
        ("truncated by one", aib.WireFormatError, message[:-1], fds, True),
        ("truncated to half", aib.WireFormatError, message[: len(message) // 2], fds, True),
        ("truncated to the header", aib.WireFormatError, message[:16], fds, True),
        ("empty message", aib.WireFormatError, b"", fds, True),
        ("trailing bytes", aib.WireFormatError, message + b"\x00" * 7, fds, True),
        ("fds missing", aib.WireFormatError, message, [], True),
        ("not a file", aib.RegionError, message, [read_end], True),
        # byte 16 is the device type (docs/wire-format.md): a valid message about memory we cannot map
        (
            "device type CUDA, no GPU UUID",
            (aib.RegionError, aib.CudaError),
            with_device(message, 2),
            fds,
            True,
        ),
        ("device type 7 (an unsupported device)", aib.RegionError, with_device(message, 7), fds, True),
        ("memfd not sealed", aib.RegionError, message, [unsealed], True),
        ("memfd smaller than the region", aib.RegionError, message, [too_small], True),
        ("payload shorter than a lease id", aib.ProtocolError, b"", fds, False),
    ]
    replies: list[tuple[int, bytes, list[int]] | None] = []
    for lease_id, (_, _, body, item_fds, with_lease) in enumerate(cases, start=100):
        payload = encode_item(lease_id, body) if with_lease else b"\x01\x02\x03"
        replies.append((protocol.ITEM, payload, item_fds))
    replies.append((protocol.ITEM, encode_item(7, message), fds))  # finally a good one
    try:
        with FakePublisher(os.path.join(sock_dir, "fake.sock"), replies=replies) as fake:
            base_fds = fd_count()
            with aib.connect(fake.path, timeout=5.0) as session:
                base_fds = fd_count()
                for lease_id, (what, error, _, _, with_lease) in enumerate(cases, start=100):
                    with pytest.raises(error):
                        session.get("t")
                    assert fd_count() == base_fds, f"{what}: received fds were not closed"
                    if with_lease:
                        assert fake.releases.get(timeout=2.0) == lease_id, what
                    settle()
                    with pytest.raises(queue.Empty):
                        fake.releases.get(timeout=0.05)
                with session.get("t") as imported:
                    assert_arrays_equal(pa.table(imported), sample_table(300))
                settle()
                assert fake.releases.get(timeout=2.0) == 7
    finally:
        exported.close()
        for fd in (read_end, write_end, unsealed, too_small):
            os.close(fd)


def test_error_reply_with_bad_json_is_protocol_error(sock_dir: str) -> None:
    """An ERROR reply that is not JSON, or JSON of the wrong shape, raises ProtocolError; a well-formed
    one of an unknown type arrives as BridgeError with the publisher's message."""
    replies: list[tuple[int, bytes, list[int]] | None] = [
        (protocol.ERROR, b"\xff not json", []),
        (protocol.ERROR, b"[1, 2]", []),
        (protocol.ERROR, protocol.encode_json({"type": "Weird", "message": "boom"}), []),
        (protocol.NAMES, protocol.encode_json(["t"]), []),
    ]
    with (
        FakePublisher(os.path.join(sock_dir, "fake.sock"), replies=replies) as fake,
        aib.connect(fake.path, timeout=5.0) as session,
    ):
        with pytest.raises(aib.ProtocolError):
            session.get("t")
        with pytest.raises(aib.ProtocolError):
            session.get("t")
        with pytest.raises(aib.BridgeError, match="publisher: boom"):
            session.get("t")
        with pytest.raises(aib.ProtocolError, match="expected ITEM"):
            session.get("t")


def test_item_with_extra_fds_closes_them(sock_dir: str) -> None:
    """An ITEM that carries more descriptors than its message uses (here 100 extra) still imports; every
    received descriptor is closed once the import holds its mappings."""
    exported = aib.export(sample_table(300))
    junk = [os.memfd_create(f"junk{i}", os.MFD_CLOEXEC) for i in range(100)]
    try:
        item = (protocol.ITEM, encode_item(5, exported.message), [*exported.fds, *junk])
        with (
            FakePublisher(os.path.join(sock_dir, "fake.sock"), replies=[item]) as fake,
            aib.connect(fake.path, timeout=5.0) as session,
        ):
            base_fds = fd_count()
            with session.get("t") as imported:
                assert fd_count() == base_fds
                assert_arrays_equal(pa.table(imported), sample_table(300))
            settle()
            assert fake.releases.get(timeout=2.0) == 5
    finally:
        exported.close()
        for fd in junk:
            os.close(fd)


@pytest.mark.parametrize(
    "welcome",
    [
        pytest.param(b"\xffnot json", id="not-json"),
        pytest.param(b"[1, 2]", id="not-an-object"),
        pytest.param(b'{"protocol": 1}', id="no-wire-version"),
        pytest.param(b'{"protocol": 1, "wire": [99, 0]}', id="other-wire-major"),
    ],
)
def test_malformed_welcome_fails_connect(sock_dir: str, welcome: bytes) -> None:
    """``connect`` to a publisher whose WELCOME is not JSON, not an object, or announces another wire major
    version raises ProtocolError and closes its connection (no descriptor left open)."""
    with FakePublisher(os.path.join(sock_dir, "fake.sock"), welcome=welcome) as fake:
        base_fds = fd_count()
        with pytest.raises(aib.ProtocolError):
            aib.connect(fake.path, timeout=5.0)
        assert wait_for(lambda: fd_count() == base_fds, 2.0)  # the fake server's end closes on EOF


# --- 8. lease semantics -------------------------------------------------------------------------------------
def test_lease_lasts_until_pyarrow_lets_go(publisher: aib.Publisher) -> None:
    """get -> pa.table -> release the imported object: the publisher still counts the lease (the table
    holds the structs); dropping the table ends it shortly after. Releasing twice is harmless; using a
    released object raises ReleasedError."""
    expected = sample_table(1000)
    publisher.publish("t", expected)
    with aib.connect(publisher.path, timeout=5.0) as session:
        imported = session.get("t")
        table = pa.table(imported)
        imported.release()
        assert imported.released
        time.sleep(0.1)
        assert publisher.active_leases == 1
        assert_arrays_equal(table, expected)
        imported.release()
        with pytest.raises(aib.ReleasedError):
            pa.table(imported)
        assert publisher.active_leases == 1
        del table
        gc.collect()
        assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_dropping_imported_without_release_ends_the_lease(publisher: aib.Publisher) -> None:
    """An imported object that is just dropped (never released) gives its lease back once collected."""
    publisher.publish("t", sample_table(100))
    with aib.connect(publisher.path, timeout=5.0) as session:
        imported = session.get("t")
        assert publisher.active_leases == 1
        del imported
        gc.collect()
        assert wait_for(lambda: publisher.active_leases == 0, 2.0)


CONSUMERS: dict[str, Callable[[Any], Any]] = {
    "pyarrow": pa.table,
    "polars": pl.DataFrame,
    "nanoarrow-array": na.Array,
    "nanoarrow-stream": lambda imported: na.ArrayStream(imported).read_all(),
}


def rows_of(built: Any) -> list[tuple[Any, Any]]:
    if isinstance(built, pa.Table):
        return list(zip(built["i"].to_pylist(), built["s"].to_pylist(), strict=True))
    if isinstance(built, pl.DataFrame):
        return list(zip(built["i"].to_list(), built["s"].to_list(), strict=True))
    return [(row["i"], row["s"]) for row in built.to_pylist()]


@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_any_consumer_holds_the_lease(publisher: aib.Publisher, consumer: str) -> None:
    """What pyarrow, polars or nanoarrow build from an imported table keeps the lease (and the data) after
    the imported object is released and the name unpublished; dropping it ends the lease."""
    ids = list(range(3000))
    expected = [(i if i % 3 else None, f"s{i}" if i % 4 else None) for i in ids]
    publisher.publish("t", pa.table({"i": [e[0] for e in expected], "s": [e[1] for e in expected]}))
    with aib.connect(publisher.path, timeout=5.0) as session:
        imported = session.get("t")
        built = CONSUMERS[consumer](imported)
        imported.release()
        publisher.unpublish("t")
        settle()
        assert publisher.active_leases == 1
        assert rows_of(built) == expected
        del built
        settle()
        assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_session_close_releases_everything(publisher: aib.Publisher) -> None:
    """``session.close()`` releases every imported object it handed out and ends all its leases; tables
    built before stay valid, even after the publisher itself is closed."""
    expected = sample_table(500)
    publisher.publish("a", expected)
    publisher.publish("b", expected.slice(100, 50))
    session = aib.connect(publisher.path, timeout=5.0)
    held = [session.get("a"), session.get("b"), session.get("a")]
    kept = pa.table(held[0])
    assert publisher.active_leases == 3
    session.close()
    session.close()
    assert all(imported.released for imported in held)
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)
    assert wait_for(lambda: publisher.active_sessions == 0, 2.0)
    with pytest.raises(aib.BridgeError, match="closed"):
        session.get("a")
    publisher.close()
    assert_arrays_equal(kept, expected)


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_session_dropped_without_close_gives_everything_back(publisher: aib.Publisher) -> None:
    """A session that is simply dropped (never closed), with its imported object and a table built from
    it, keeps its lease while the table lives; once everything is collected the lease ends and the
    connection goes away."""
    publisher.publish("t", sample_table(100))
    session = aib.connect(publisher.path, timeout=5.0)
    imported = session.get("t")
    table = pa.table(imported)
    del session, imported
    settle()
    assert publisher.active_leases == 1
    assert table.num_rows == 100
    del table

    def all_given_back() -> bool:
        settle()
        return publisher.active_leases == 0 and publisher.active_sessions == 0

    assert wait_for(all_given_back, 2.0)


def test_publisher_restart_on_the_same_path(sock_dir: str) -> None:
    """When a publisher closes and a new one takes its path, the old session's data stays valid, its
    requests raise TransportError, and a new session gets the new publisher's objects."""
    path = os.path.join(sock_dir, "p.sock")
    old_data, new_data = sample_table(300), pa.table({"x": ["new"]})
    first = aib.Publisher(path)
    first.publish("t", old_data)
    session = aib.connect(path, timeout=5.0)
    try:
        imported = session.get("t")
        first.close()
        with aib.Publisher(path) as second:
            second.publish("t", new_data)
            with pytest.raises(aib.TransportError):
                session.get("t")
            assert_arrays_equal(pa.table(imported), old_data)
            imported.release()
            with aib.connect(path, timeout=5.0) as fresh, fresh.get("t") as again:
                assert_arrays_equal(pa.table(again), new_data)
    finally:
        session.close()
        first.close()


def test_lazy_stream_reader_outlives_everything(publisher: aib.Publisher) -> None:
    """A pyarrow RecordBatchReader opened on an imported stream and read one batch at a time keeps working
    after the imported object is released, the name unpublished and the session closed."""
    expected = sample_table(1000, batches=5)
    publisher.publish("t", expected)
    session = aib.connect(publisher.path, timeout=5.0)
    imported = session.get("t")
    reader = pa.RecordBatchReader.from_stream(imported)
    first = reader.read_next_batch()
    imported.release()
    publisher.unpublish("t")
    session.close()
    settle()
    rest = reader.read_all()
    assert_arrays_equal(pa.Table.from_batches([first, *rest.to_batches()]), expected)


def test_unpublish_while_leased(publisher: aib.Publisher) -> None:
    """Unpublishing a name while a lease is held keeps the consumer's data valid; a new ``get`` of it
    raises NotPublishedError (a KeyError) and the session stays usable; unpublishing twice raises too."""
    expected = sample_table(3000)
    publisher.publish("t", expected)
    publisher.publish("other", expected.slice(0, 10))
    with aib.connect(publisher.path, timeout=5.0) as session:
        imported = session.get("t")
        publisher.unpublish("t")
        assert publisher.names() == ["other"]
        assert session.list() == ["other"]
        with pytest.raises(aib.NotPublishedError):
            session.get("t")
        with pytest.raises(KeyError):
            session.get("t")
        with pytest.raises(aib.NotPublishedError):
            publisher.unpublish("t")
        assert publisher.active_leases == 1
        settle()
        assert_arrays_equal(pa.table(imported), expected)
        with session.get("other") as other:
            assert pa.table(other).num_rows == 10
        imported.release()
        settle()
        assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_republish_replaces_for_new_gets(publisher: aib.Publisher) -> None:
    """Publishing again under a name serves the new object to new gets, while an earlier lease keeps
    seeing the old one."""
    old, new = sample_table(100), pa.table({"x": pa.array(["new"] * 7)})
    publisher.publish("t", old)
    with aib.connect(publisher.path, timeout=5.0) as session:
        first = session.get("t")
        publisher.publish("t", new)
        with session.get("t") as second:
            assert_arrays_equal(pa.table(second), new)
        settle()
        assert_arrays_equal(pa.table(first), old)
        first.release()
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_publish_validation_and_after_close(publisher: aib.Publisher) -> None:
    """Invalid names raise ValueError; publishing on a closed publisher raises BridgeError and leaves
    nothing behind (checked by the leak fixture)."""
    with pytest.raises(ValueError, match="name"):
        publisher.publish("", pa.array([1]))
    with pytest.raises(ValueError, match="name"):
        publisher.publish("n" * (protocol.MAX_NAME + 1), pa.array([1]))
    with pytest.raises(aib.CapsuleError):
        publisher.publish("x", object())
    publisher.close()
    with pytest.raises(aib.BridgeError, match="closed"):
        publisher.publish("x", pa.array([1, 2, 3]))
    assert publisher.names() == []


def test_publisher_close_with_hung_and_leasing_clients(publisher: aib.Publisher) -> None:
    """``close()`` returns promptly although one client is silent and another stopped halfway through a
    frame header; every session is disconnected and every lease ended; data a session already imported
    stays valid; that session's next request raises TransportError; the socket file is removed."""
    expected = sample_table(2000)
    publisher.publish("t", expected)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    partial = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    session = aib.connect(publisher.path, timeout=5.0)
    try:
        silent.connect(publisher.path)
        partial.connect(publisher.path)
        partial.sendall(HEADER.pack(b"AIBT", 1, protocol.GET, 10, 0, 0)[:7])
        imported = session.get("t")
        assert wait_for(lambda: publisher.active_sessions == 3, 2.0)
        assert publisher.active_leases == 1
        started = time.monotonic()
        publisher.close()
        assert time.monotonic() - started < 2.0
        assert publisher.closed
        assert publisher.active_sessions == 0
        assert publisher.active_leases == 0
        assert not os.path.exists(publisher.path)
        assert_arrays_equal(pa.table(imported), expected)
        imported.release()
        with pytest.raises(aib.TransportError):
            session.get("t")
        for raw in (silent, partial):
            raw.settimeout(5.0)
            with contextlib.suppress(ConnectionResetError):
                assert raw.recv(100) == b""
    finally:
        session.close()
        silent.close()
        partial.close()


NOBODY_CLIENT = """
import socket, struct, sys
hello = struct.pack("<4sHHIHH", b"AIBT", 1, 1, 2, 0, 0) + struct.pack("<H", 1)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(5.0)
try:
    sock.connect(sys.argv[1])
except PermissionError:
    print("denied")
    sys.exit(0)
try:
    sock.sendall(hello)
except (BrokenPipeError, ConnectionResetError):
    pass  # refused already: what the publisher said before closing can still be read
try:
    header = sock.recv(16)
except ConnectionResetError:
    header = b""
print("dropped" if not header else "rejected" if header[6:8] == struct.pack("<H", 8) else "served")
"""
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs a system python3 for the other user")
def test_other_users_cannot_connect(publisher: aib.Publisher, sock_dir: str) -> None:
    """Another user (``nobody``) cannot connect at all, the socket file being 0600 (the directory is opened
    up for this test, so only the file's mode stops it); with the file opened up too, the publisher still
    refuses the connection because that uid is not allowed (SO_PEERCRED): an ERROR frame, then closed."""
    os.chmod(sock_dir, 0o755)

    def as_nobody() -> str:
        proc = subprocess.run(
            [SYSTEM_PYTHON, "-I", "-c", NOBODY_CLIENT, publisher.path],
            user=65534,
            group=65534,
            extra_groups=[],
            cwd="/",
            env={},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert stat.S_IMODE(os.stat(publisher.path).st_mode) == 0o600
    assert as_nobody() == "denied"
    os.chmod(publisher.path, 0o666)
    assert as_nobody() == "rejected"
    assert wait_for(lambda: publisher.active_sessions == 0, 2.0)


# --- 9. zero copy -------------------------------------------------------------------------------------------
@pytest.fixture
def shm_file() -> Iterator[tuple[str, pa.Table]]:
    table = sample_table(4000, batches=2)
    path = write_shm_ipc_file(table)
    yield path, table
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def test_zero_copy_publish_and_mapping_cache(
    publisher: aib.Publisher, shm_file: tuple[str, pa.Table]
) -> None:
    """A table memory-mapped from an Arrow IPC file in /dev/shm publishes with no byte copied (even under
    ``copy="never"``); a second get of it is the remembered message (no new mapping); another
    publication over the same file (a slice: other bytes) hits the session's mapping cache; the data
    is equal."""
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
        assert session.remembered_gets == 1
        assert (cache.misses, cache.hits) == (misses, hits)
        with session.get("z2") as other:
            assert_arrays_equal(pa.table(other), expected.slice(10))
        assert cache.hits > hits
        assert cache.misses == misses
    del mapped


def test_copy_never_refuses_heap_data(publisher: aib.Publisher) -> None:
    """``copy="never"`` on ordinary heap data raises CopyRequiredError (a RegionError), publishes
    nothing, and leaves the publisher serving; a publisher made with ``copy="never"`` refuses too."""
    with pytest.raises(aib.CopyRequiredError):
        publisher.publish("h", sample_table(100), copy="never")
    assert publisher.names() == []
    stats = publisher.publish("h", sample_table(100))
    assert stats.copied_bytes > 0
    with aib.Publisher(publisher.path + ".2", copy="never") as strict, pytest.raises(aib.RegionError):
        strict.publish("h", pa.array([1, 2, 3]))


def test_zero_copy_from_producer_child(producer: ProducerRig, shm_file: tuple[str, pa.Table]) -> None:
    """Across processes: the producer child publishes the memory-mapped table with no copy; two gets here
    share one mapping (the second is the remembered message) and read equal data; the data stays valid
    after the child unpublishes."""
    path, expected = shm_file
    stats = producer.child.call("mmap", "z", path, "never")[1]
    assert stats["copied_bytes"] == 0
    assert stats["zero_copy_regions"] >= 1
    cache = producer.session.mapping_cache
    first = producer.session.get("z")
    misses, remembered = cache.misses, producer.session.remembered_gets
    with producer.session.get("z") as second:
        assert_arrays_equal(pa.table(second), expected)
    assert cache.misses == misses
    assert producer.session.remembered_gets == remembered + 1
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


CACHE_ZERO_CHILD = "import sys, session_children as c; c.cache_size_zero_main(sys.argv[1])"


def test_mapping_cache_size_zero_disables_caching(shm_file: tuple[str, pa.Table]) -> None:
    """``Session(mapping_cache_size=0)`` imports zero-copy data without caching it: no error, no hit, no
    entry, and no owner/node/mapping left (run in a fresh interpreter, so a leak cannot spill into the
    other tests). Regression test: it used to raise KeyError from dict.popitem() and leak the mapping."""
    run_ok_child(CACHE_ZERO_CHILD, shm_file[0])


CONCURRENT_MISS_CHILD = "import sys, session_children as c; c.concurrent_miss_main(sys.argv[1])"


def test_concurrent_cache_misses_leak_nothing(shm_file: tuple[str, pa.Table]) -> None:
    """Two threads of one session importing the same zero-copy region at once (both missing the cache)
    both get correct data, the cache ends with one entry, and closing the session leaves no owner, node or
    mapping behind (run in a fresh interpreter, so a leak cannot spill into the other tests)."""
    run_ok_child(CONCURRENT_MISS_CHILD, shm_file[0])


@pytest.mark.parametrize(
    "zero_copy",
    [
        pytest.param(False, id="copied-region"),
        pytest.param(True, id="zero-copy-region"),
    ],
)
def test_import_message_with_unusable_fd_raises_region_error(
    shm_file: tuple[str, pa.Table], zero_copy: bool
) -> None:
    """``import_message`` given a descriptor number that is not open raises RegionError (as documented:
    "RegionError when a region cannot be mapped"), whether the region is a copy or zero-copy, and leaks
    nothing (checked by the leak fixture). Regression test: the zero-copy case used to raise a bare
    OSError from the mapping cache's fstat."""
    path, _ = shm_file
    source = pa.ipc.open_file(pa.memory_map(path)).read_all() if zero_copy else sample_table(100)
    with aib.export(source, copy="never" if zero_copy else "always") as exported:
        assert exported.stats.zero_copy_regions == (1 if zero_copy else 0)
        not_open = 1_000_000  # far above any descriptor this process has open
        with aib.Session() as session, pytest.raises(aib.RegionError):
            session.import_message(exported.message, [not_open] * len(exported.fds))
    del source


# --- 10. timeouts and unreachable publishers ----------------------------------------------------------------
def test_connect_without_publisher_fails_fast(sock_dir: str) -> None:
    """No socket file, a stale socket file and a regular file all raise TransportError within a second."""
    missing = os.path.join(sock_dir, "missing.sock")
    stale = os.path.join(sock_dir, "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(stale)
    regular = os.path.join(sock_dir, "file")
    with open(regular, "w") as f:
        f.write("not a socket")
    for path in (missing, stale, regular):
        started = time.monotonic()
        with pytest.raises(aib.TransportError):
            aib.connect(path, timeout=5.0)
        assert time.monotonic() - started < 1.0


def test_silent_server_times_out(sock_dir: str) -> None:
    """A server that accepts but never answers HELLO makes ``connect`` raise BridgeTimeoutError after
    about the timeout; one that welcomes but never answers GET makes ``get`` raise it, after which the
    session's connection is closed (the next request raises TransportError at once)."""
    with FakePublisher(os.path.join(sock_dir, "mute.sock"), welcome=False) as mute:
        started = time.monotonic()
        with pytest.raises(aib.BridgeTimeoutError):
            aib.connect(mute.path, timeout=0.5)
        assert 0.45 <= time.monotonic() - started < 2.0
    with FakePublisher(os.path.join(sock_dir, "slow.sock")) as slow:
        session = aib.connect(slow.path, timeout=0.5)
        try:
            started = time.monotonic()
            with pytest.raises(aib.BridgeTimeoutError):
                session.get("t")
            assert 0.45 <= time.monotonic() - started < 2.0
            started = time.monotonic()
            with pytest.raises(aib.TransportError):
                session.get("t")
            assert time.monotonic() - started < 0.5
        finally:
            session.close()


# --- 11. the socket file ------------------------------------------------------------------------------------
def test_socket_file_mode_and_exclusive_path(sock_dir: str) -> None:
    """The socket file is mode 0600; a second Publisher on a live path raises TransportError and leaves
    the first one serving; a stale socket file is replaced; a regular file is refused; close removes
    the file."""
    path = os.path.join(sock_dir, "p.sock")
    with aib.Publisher(path) as first:
        st_ = os.stat(path)
        assert stat.S_ISSOCK(st_.st_mode)
        assert stat.S_IMODE(st_.st_mode) == 0o600
        with pytest.raises(aib.TransportError):
            aib.Publisher(path)
        first.publish("t", pa.array([1, 2, 3]))
        with aib.connect(path, timeout=5.0) as session, session.get("t") as imported:
            assert pa.array(imported).to_pylist() == [1, 2, 3]
    assert not os.path.exists(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(path)
    with aib.Publisher(path) as replacing:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert replacing.names() == []
    regular = os.path.join(sock_dir, "regular")
    with open(regular, "w") as f:
        f.write("x")
    with pytest.raises(aib.TransportError):
        aib.Publisher(regular)
    assert os.path.isfile(regular)


# --- 7. nothing left over -----------------------------------------------------------------------------------
def test_zz_nothing_left_after_all_tests(warm: dict[str, int]) -> None:
    """After every test above: open fds, live owners/nodes/mappings, reaper callbacks and threads are
    back to what they were before the first test (runs last in this file)."""
    assert_back_to(warm)


# --- the steady state in the C core (aib_session_get, aib_serve, channel.c) ---------------------------------
def null_batch(columns: int, rows: int) -> pa.RecordBatch:
    """Data without buffers: its message has no regions and travels without descriptors, so a session
    remembers it like an all-legacy CUDA message and re-gets take the C core's path (on any machine)."""
    return pa.record_batch({f"c{i}": pa.nulls(rows) for i in range(columns)})


def test_remembered_message_is_imported_by_the_c_core(publisher: aib.Publisher) -> None:
    """The second and later gets of an unchanged publication are imported by aib_session_get (counted in
    ``remembered_gets``): same data, a lease per get, each given back on release."""
    expected = null_batch(16, 1000)
    publisher.publish("t", expected)
    with aib.connect(publisher.path, timeout=5.0) as session:
        for i in range(50):
            with session.get("t") as imported:
                assert publisher.active_leases == 1
                assert session.remembered_gets == i
                schema, array = imported.__arrow_c_device_array__()
                got = pa.RecordBatch._import_from_c_device_capsule(schema, array)
                assert got.equals(expected)
                del got, schema, array
            assert wait_for(lambda: publisher.active_leases == 0, 2.0)
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_forget_drops_remembered_messages(publisher: aib.Publisher) -> None:
    """forget(name) drops the message last got as name, forget() all of them: the next get is
    imported by Python again (and remembered again). A closed session refuses; a bad pool_linger
    is refused up front."""
    publisher.publish("a", null_batch(2, 10))
    publisher.publish("b", null_batch(3, 10))
    with aib.connect(publisher.path, timeout=5.0) as session:
        for name in ("a", "b", "a", "b"):
            session.get(name).release()
        assert session.remembered_gets == 2
        assert session.forget("a") == 1
        assert session.forget("a") == 0  # nothing remembered under that name any more
        assert session.forget("nobody") == 0
        session.get("b").release()
        assert session.remembered_gets == 3
        session.get("a").release()  # decoded again
        assert session.remembered_gets == 3
        session.get("a").release()
        assert session.remembered_gets == 4
        assert session.forget() == 2
        session.get("b").release()
        assert session.remembered_gets == 4
    with pytest.raises(aib.BridgeError, match="closed"):
        session.forget()
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="pool_linger"):
            aib.Session(pool_linger=bad)


def test_remembered_messages_bounds_the_steady_state(publisher: aib.Publisher) -> None:
    """remembered_messages is how many names' messages re-gets find remembered: three names got in
    a cycle all hit with room for three, all miss with room for two (least recently used out
    first), and nothing is remembered with 0. Anything but an int >= 0 is refused up front."""
    for rows, name in enumerate(("a", "b", "c"), start=10):
        publisher.publish(name, null_batch(2, rows))  # three different messages
    for room, hits in ((3, 3), (2, 0), (0, 0)):
        with aib.connect(publisher.path, timeout=5.0, remembered_messages=room) as session:
            for name in ("a", "b", "c", "a", "b", "c"):
                session.get(name).release()
            assert session.remembered_gets == hits, room
            assert len(session._resolved) == min(room, 3)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="remembered_messages"):
            aib.Session(remembered_messages=bad)  # type: ignore[arg-type]


def test_pool_messages_are_kept_from_their_second_get_under_one_name() -> None:
    """The kept-lease decision (the GPU suite checks what follows from it): a get keeps its lease
    only for IPC-pool data (pool regions, legacy ones beside them allowed) got under the same name
    with the same bytes as that name's previous get; never without a lease (import_message), a
    name, or with pool_linger 0; a stream of new messages is never kept."""
    from arrow_ipc_bridge.metadata import (
        REGION_CUDA_LEGACY,
        REGION_CUDA_POOL,
        REGION_CUDA_VMM,
        REGION_HOST_FD,
        Region,
    )

    pool = [Region(REGION_CUDA_POOL, 64), Region(REGION_CUDA_LEGACY, 64)]
    with aib.Session() as session:
        keeps = session._keeps_pool_lease
        assert not keeps(pool, b"m1", "x", 7)  # first get of m1 under x
        assert keeps(pool, b"m1", "x", 7)  # second: kept
        assert not keeps(pool, b"m1", "x", 7)  # kept already: the next is a first again
        for i in range(5):  # new data every time: never
            assert not keeps(pool, b"v%d" % i, "stream", 7)
        assert not keeps(pool, b"m2", "y", 7)
        assert not keeps(pool, b"m3", "y", 7)  # other bytes under y: starts over
        assert keeps(pool, b"m3", "y", 7)
        assert not keeps(pool, b"m4", "z", 7)
        assert not keeps(pool, b"m4", "w", 7)  # same bytes, other name
        for regions in (
            [Region(REGION_CUDA_LEGACY, 64)],
            [*pool, Region(REGION_CUDA_VMM, 64)],
            [Region(REGION_HOST_FD, 64)],
            [],
        ):
            assert not keeps(regions, b"k", "k", 7)
            assert not keeps(regions, b"k", "k", 7)
        for _ in range(2):
            assert not keeps(pool, b"t", "t", 0)  # no lease (import_message)
            assert not keeps(pool, b"n", None, 7)
        for i in range(300):  # the per-name memory is bounded
            keeps(pool, b"b", f"name{i}", 7)
        assert len(session._seen_once) <= 256
    with aib.Session(pool_linger=0) as session:
        for _ in range(3):
            assert not session._keeps_pool_lease(pool, b"m1", "x", 7)


class FakeLingering:
    """Stands in for a session in the linger thread's loop: records when it was asked."""

    def __init__(self, deadlines: list[float | None]) -> None:
        self.deadlines = deadlines  # relative seconds to answer with, in order; then None
        self.calls: list[float] = []
        self.asked = threading.Event()

    def _expire_lingering(self, now: float) -> float | None:
        self.calls.append(now)
        self.asked.set()
        if not self.deadlines:
            return None
        relative = self.deadlines.pop(0)
        return None if relative is None else now + relative


def test_linger_thread_keeps_each_sessions_next_deadline() -> None:
    """The linger thread asks a watched session again at the deadline it returned (not before, and
    not never), sleeps when nothing lingers, and a new watch() wakes it."""
    from arrow_ipc_bridge import _linger

    session = FakeLingering([0.2, None])
    _linger.watch(session)
    assert wait_for(lambda: len(session.calls) >= 2, 5.0)
    assert session.calls[1] - session.calls[0] >= 0.19  # asked again at its deadline
    time.sleep(0.3)
    assert len(session.calls) == 2  # nothing lingers: not asked again
    session.deadlines = [0.05, None]
    _linger.watch(session)
    assert wait_for(lambda: len(session.calls) == 4, 5.0)

    class Failing:
        def _expire_lingering(self, now: float) -> float | None:
            raise RuntimeError("boom")

    failing = Failing()
    other = FakeLingering([None])
    _linger.watch(failing)
    _linger.watch(other)
    assert other.asked.wait(5.0)  # one session failing does not stop the others
    del failing


def test_protocol_capsules_are_built_by_the_c_core(publisher: aib.Publisher, monkeypatch: Any) -> None:
    """Imported arrays' capsule pairs come from one C call (device_array_capsules, array_capsules) on
    the first get, on remembered gets and for host data with regions; they hold what the Python path
    builds, and when the C call cannot (no view) the Python path answers. A released object refuses
    both calls."""
    from arrow_ipc_bridge import imported as imported_module
    from arrow_ipc_bridge.capsules import device_array_capsules

    with_regions = pa.record_batch({"x": pa.array([1, None, 3]), "s": pa.array(["a", None, "ccc"])})
    publisher.publish("nulls", null_batch(4, 100))
    publisher.publish("data", with_regions)
    expected = {"nulls": null_batch(4, 100), "data": with_regions}
    with aib.connect(publisher.path, timeout=5.0) as session:
        for _ in range(3):
            for name, batch in expected.items():
                with session.get(name) as imported:
                    decoded = imported._decoded
                    assert device_array_capsules(decoded, owner_address(decoded.owner)) is not None
                    assert pa.RecordBatch._import_from_c_device_capsule(
                        *imported.__arrow_c_device_array__()
                    ).equals(batch)
                    assert pa.record_batch(imported).equals(batch)  # __arrow_c_array__
        assert session.remembered_gets == 4  # host data with regions is remembered too
        monkeypatch.setattr(imported_module, "device_array_capsules", lambda message, address: None)
        monkeypatch.setattr(imported_module, "array_capsules", lambda message, address: None)
        for name, batch in expected.items():
            with session.get(name) as imported:
                assert pa.record_batch(imported).equals(batch)
                schema, array = imported.__arrow_c_device_array__()
                assert pa.RecordBatch._import_from_c_device_capsule(schema, array).equals(batch)
        monkeypatch.undo()
        imported = session.get("data")
        imported.release()
        with pytest.raises(aib.ReleasedError):
            imported.__arrow_c_device_array__()
        with pytest.raises(aib.ReleasedError):
            imported.__arrow_c_array__()
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_host_messages_are_remembered_by_bytes_and_files(publisher: aib.Publisher) -> None:
    """A host table's re-gets are imported by the C core (the descriptors that come with the answer are
    the files the remembered message mapped: closed, nothing leaks). The same bytes with other files
    (another table of the same shape) take the Python path and read their own data, and the name's old
    message is dropped."""
    a = pa.record_batch({"x": pa.array([1, 2, 3]), "s": pa.array(["a", None, "c"])})
    b = pa.record_batch({"x": pa.array([4, 5, 6]), "s": pa.array(["d", None, "f"])})
    assert aib.export(a).message == aib.export(b).message  # same shape, same bytes: only the files differ
    publisher.publish("t", a)
    base_fds = fd_count()
    with aib.connect(publisher.path, timeout=5.0) as session:
        for _ in range(50):
            with session.get("t") as imported:
                assert pa.record_batch(imported).equals(a)
        assert session.remembered_gets == 49
        assert wait_for(lambda: fd_count() <= base_fds + 2, 2.0)  # the session's socket and template file
        publisher.publish("t", b)
        with session.get("t") as imported:
            assert pa.record_batch(imported).equals(b)
        assert session.remembered_gets == 49
        assert len(session._resolved) == 1  # a's message went when the name got b
        with session.get("t") as imported:
            assert pa.record_batch(imported).equals(b)
        assert session.remembered_gets == 50
        # import_message checks the files the same way
        exported_a, exported_b = aib.export(a), aib.export(b)
        try:
            for exported, expected in ((exported_a, a), (exported_b, b), (exported_a, a)):
                with session.import_message(exported.message, exported.fds) as imported:
                    assert pa.record_batch(imported).equals(expected)
        finally:
            exported_a.close()
            exported_b.close()
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
        with pytest.raises(aib.ReleasedError):
            pa.record_batch(imported)
        _reaper.drain()
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
                except aib.ReleasedError:
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
                _reaper.drain()  # a RELEASE, had the lease ended, is sent now
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
    from arrow_ipc_bridge.capsules import array_capsules, device_array_capsules

    decoded = Decoded(aib.export(null_batch(2, 5)).message)
    try:
        assert device_array_capsules(decoded, owner_address(decoded.owner)) is None
        assert array_capsules(decoded, owner_address(decoded.owner)) is None
    finally:
        decoded.close()
    bare = ffi.gc(lib.aib_owner_new(0), lib.aib_owner_unref)
    bases = ffi.new("uint64_t[]", [0])
    assert lib.aib_owner_set_view(bare, bases, 1, lib.ARROW_DEVICE_CPU, -1) == 0
    assert lib.aib_owner_set_view(bare, bases, 1, lib.ARROW_DEVICE_CPU, -1) == lib.AIB_E_STATE
    open_message = Decoded(aib.export(null_batch(2, 5)).message)
    try:
        assert device_array_capsules(open_message, owner_address(bare)) is None
        with pytest.raises(ValueError, match="0"):
            device_array_capsules(open_message, 0)
    finally:
        open_message.close()
    with pytest.raises(aib.ReleasedError):
        device_array_capsules(open_message, owner_address(bare))  # closed: refused before any use


def test_remembered_messages_churn_across_threads(publisher: aib.Publisher) -> None:
    """More distinct messages than the session remembers, fetched by four threads of one session: every
    get returns the right data, the C mirror never holds more than the limit, and nothing leaks."""
    batches = {f"n{k}": null_batch(3, 10 + k) for k in range(5)}
    for name, batch in batches.items():
        publisher.publish(name, batch)
    with aib.connect(publisher.path, timeout=10.0) as session:
        session._resolved_max = 2
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            try:
                for i in range(60):
                    name = f"n{(seed + i * (seed + 1)) % 5}"
                    with session.get(name) as imported:
                        assert pa.record_batch(imported).equals(batches[name])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_S)
        assert errors == []
        assert lib.aib_import_cache_count(session._import_cache) <= 2
        assert session.remembered_gets > 0
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_remembered_bytes_with_a_descriptor_take_the_checked_path(sock_dir: str) -> None:
    """A publisher that sends a remembered message again but with a descriptor attached: the C core does
    not import it (only descriptor-free answers are), the Python path does and closes the descriptor."""
    message = aib.export(null_batch(2, 5)).message
    r, w = os.pipe()
    try:
        replies: list[tuple[int, bytes, list[int]] | None] = [
            (protocol.ITEM, encode_item(1, message), []),
            (protocol.ITEM, encode_item(2, message), []),
            (protocol.ITEM, encode_item(3, message), [r]),
        ]
        fake = FakePublisher(os.path.join(sock_dir, "f.sock"), replies=replies)
        with fake, aib.connect(fake.path, timeout=5.0) as session:
            for lease in (1, 2, 3):
                with session.get("x") as imported:
                    assert pa.record_batch(imported).num_rows == 5
                assert fake.releases.get(timeout=5.0) == lease
            assert session.remembered_gets == 1
    finally:
        os.close(r)
        os.close(w)


def test_lease_ids_the_token_cannot_carry_take_the_python_path(sock_dir: str) -> None:
    """Leases imported by the C core carry their id in the owner's token (a reaper family, 40 bits). A
    publisher answering with lease ids 0 or from 2**40 on is served by the Python path, and each
    RELEASE names the id the publisher gave."""
    message = aib.export(null_batch(2, 5)).message
    big = (1 << _reaper.FAMILY_VALUE_BITS) + 7
    leases = [1, 2, big, 0, (1 << 64) - 1, 3]
    replies: list[Any] = [(protocol.ITEM, encode_item(lease, message), []) for lease in leases]
    fake = FakePublisher(os.path.join(sock_dir, "f.sock"), replies=replies)
    with fake, aib.connect(fake.path, timeout=5.0) as session:
        for lease in leases:
            with session.get("x") as imported:
                assert pa.record_batch(imported).num_rows == 5
            assert fake.releases.get(timeout=5.0) == lease
        assert session.remembered_gets == 2  # leases 2 and 3


def test_c_imported_leases_outlive_their_session_object(publisher: aib.Publisher) -> None:
    """A session dropped without close() while structs of C-imported leases live on: the connection
    stays open for them, each lease ends when its struct is released, and then the session's reaper
    family is retired (nothing of it stays registered)."""
    publisher.publish("t", null_batch(3, 10))
    families_before = len(_reaper._families)
    session = aib.connect(publisher.path, timeout=5.0)
    session.get("t").release()  # the first get remembers the message
    kept = []  # capsule pairs: their structs hold the leases (pyarrow lets go of buffer-less data)
    for _ in range(3):
        with session.get("t") as imported:
            kept.append(imported.__arrow_c_device_array__())
    assert session.remembered_gets == 3
    assert len(_reaper._families) == families_before + 1
    del session, imported
    gc.collect()
    assert wait_for(lambda: publisher.active_leases == 3, 2.0)
    assert publisher.active_sessions == 1
    kept.pop()
    gc.collect()
    assert wait_for(lambda: publisher.active_leases == 2, 2.0)
    kept.clear()
    gc.collect()
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)
    assert wait_for(lambda: len(_reaper._families) == families_before, 2.0)
    gc.collect()
    assert wait_for(lambda: publisher.active_sessions == 0, 2.0)


def test_reaper_family_tokens_reach_their_callback_with_the_value() -> None:
    """An owner dying with token base | value runs the family's callback with value; after the family
    is retired, its owners run nothing."""
    seen: list[int] = []
    base = _reaper.register_family(seen.append)
    try:
        for value in (1, 12345, (1 << _reaper.FAMILY_VALUE_BITS) - 1):
            lib.aib_owner_unref(lib.aib_owner_new(base | value))
        _reaper.drain()
        assert seen == [1, 12345, (1 << _reaper.FAMILY_VALUE_BITS) - 1]
    finally:
        _reaper.unregister_family(base)
    lib.aib_owner_unref(lib.aib_owner_new(base | 5))
    _reaper.drain()
    assert seen == [1, 12345, (1 << _reaper.FAMILY_VALUE_BITS) - 1]


def test_a_reaper_callback_may_drain_again() -> None:
    """A callback that drains the queue itself (on the same thread) neither loses nor repeats the
    notices of the batch being run."""
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        lib.aib_reaper_quiet(1)  # this thread drains them, not the reaper thread
        try:
            for i in range(3):  # enough to overwrite the rest of a shared batch buffer
                lib.aib_owner_unref(lib.aib_owner_new(_reaper.register(lambda i=i: ran.append(f"inner{i}"))))
        finally:
            lib.aib_reaper_quiet(0)
        _reaper.drain()

    _reaper.drain()  # nothing queued from before
    tokens = [_reaper.register(first)] + [
        _reaper.register(lambda i=i: ran.append(f"later{i}")) for i in range(3)
    ]
    owners = [lib.aib_owner_new(token) for token in tokens]
    lib.aib_reaper_quiet(1)  # queued here, run by the drain below (not by the reaper thread)
    try:
        for owner in owners:
            lib.aib_owner_unref(owner)
    finally:
        lib.aib_reaper_quiet(0)
    _reaper.drain()
    assert sorted(ran) == ["first", "inner0", "inner1", "inner2", "later0", "later1", "later2"]


def test_frames_over_64_kib_cross_the_c_channel(publisher: aib.Publisher) -> None:
    """A message bigger than the channel's 64 KiB buffer (5,000 columns) goes through the C framing's
    large-frame path in both directions, and is then remembered like any other."""
    expected = null_batch(5000, 3)
    publisher.publish("wide", expected)
    with aib.connect(publisher.path, timeout=10.0) as session:
        for _ in range(3):
            with session.get("wide") as imported:
                assert pa.record_batch(imported).equals(expected)
        assert session.remembered_gets == 2
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_silent_publisher_times_out_and_closes_the_session_connection(sock_dir: str) -> None:
    """A publisher that never answers a GET: the C request gives up at the session's timeout with
    BridgeTimeoutError, and the connection is closed (a late answer must not pass for the next one)."""
    fake = FakePublisher(os.path.join(sock_dir, "f.sock"), replies=[None])
    with fake, aib.connect(fake.path, timeout=0.3) as session:
        started = time.monotonic()
        with pytest.raises(aib.BridgeTimeoutError):
            session.get("x")
        assert 0.25 < time.monotonic() - started < 3.0
        with pytest.raises(aib.TransportError):
            session.get("x")


def trickle(pieces: int, interval: float) -> Callable[[transport.Connection], None]:
    """A FakePublisher reply: an ERROR frame (NotPublishedError) written in ``pieces`` parts,
    ``interval`` seconds apart."""

    def write(conn: transport.Connection) -> None:
        payload = protocol.encode_error(aib.NotPublishedError("trickled"))
        frame = struct.pack("<4sHHIHH", b"AIBT", 1, protocol.ERROR, len(payload), 0, 0) + payload
        step = -(-len(frame) // pieces)
        for offset in range(0, len(frame), step):
            if offset:
                time.sleep(interval)
            os.write(conn.fileno(), frame[offset : offset + step])

    return write


def test_a_frame_arriving_in_pieces_is_read_within_the_deadline(sock_dir: str) -> None:
    """The session's receive blocks with the socket's receive timeout on the first read and keeps
    to its own deadline across later reads: a reply trickling in within the timeout is assembled, one
    still trickling at the deadline times out then: the read that starts at 0.4 s, with 0.05 s left,
    must not wait for the piece due at 0.8 s."""
    fake = FakePublisher(os.path.join(sock_dir, "t.sock"), replies=[trickle(4, 0.05), trickle(3, 0.4)])
    with fake, aib.connect(fake.path, timeout=0.45) as session:
        with pytest.raises(aib.NotPublishedError, match="trickled"):
            session.get("x")
        started = time.monotonic()
        with pytest.raises(aib.BridgeTimeoutError):
            session.get("x")
        assert 0.4 < time.monotonic() - started < 0.7
