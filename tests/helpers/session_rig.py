"""What the publisher/session tests share: leak snapshots, process helpers, sample data, the
producer child driver, a hand-written publisher and a stand-in for a lingering session.

The fixtures built from these (``warm``, ``no_leaks``, ``publisher``, ``producer`` ...) are in
tests/conftest.py; the children's entry points are in ``session_children``.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.resource_tracker
import os
import queue
import select
import signal
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge._ffi import WIRE_VERSION, lib
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.transport import protocol
from helpers import session_children as children
from helpers.arrow_values import arrow_arrays, record_batches, tables

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, the helpers' parent
SPAWN = multiprocessing.get_context("spawn")
JOIN_S = 30.0
EXAMPLES = settings.default.max_examples
HYPOTHESIS_WITH_FIXTURES = settings(
    suppress_health_check=[*settings.default.suppress_health_check, HealthCheck.function_scoped_fixture],
)
ANY_ARROW = st.one_of(arrow_arrays(), record_batches(), tables(max_batches=4))


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


def run_later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    """Run ``action`` on a thread after ``seconds`` (joined by the caller)."""

    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run, name="test-later")
    thread.start()
    return thread


def report_from_forked_child(body: Callable[[], Any]) -> Any:
    """``body()`` run in a child of fork (which never returns into the caller's test: it exits), its
    JSON-able result sent back down a pipe; asserts the child exited with status 0."""
    import json
    import warnings

    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: fork with threads running
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read_end)
            os.write(write_end, json.dumps(body()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as reader:
        report = json.loads(reader.read() or b"null")
    assert os.waitstatus_to_exitcode(status) == 0
    return report


def settle() -> None:
    """Collect garbage and run the release callbacks of owners that died so far."""
    gc.collect()
    reaper.settle()


def snapshot() -> dict[str, int]:
    settle()
    return {
        "fds": fd_count(),
        "owners": int(lib.aib_live_owners()),
        "nodes": int(lib.aib_live_nodes()),
        "mappings": int(lib.aib_live_mappings()),
        "reaper_callbacks": reaper.pending_callbacks(),
        "threads": threading.active_count(),
    }


def assert_back_to(baseline: dict[str, int], timeout: float = 5.0) -> None:
    """Every counter of :func:`snapshot` returns to ``baseline`` (server threads and the reaper need a
    moment after a close)."""
    now: dict[str, int] = {}

    def same() -> bool:
        now.update(snapshot())
        # Fewer threads than before is not a leak: a thread an earlier test started (a server's, a
        # publisher's) may end while this test runs.
        counts, base = dict(now), dict(baseline)
        return counts.pop("threads") <= base.pop("threads", 0) and counts == base

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


def raw_hello(raw: transport.Connection) -> None:
    """The handshake a raw client must make before any request."""
    raw.send(protocol.HELLO, protocol.encode_hello())
    with raw.recv(timeout=5.0) as welcome:
        assert welcome.kind == protocol.WELCOME


HEADER = struct.Struct("<4sHHIHH")


def null_batch(columns: int, rows: int) -> pa.RecordBatch:
    """Data without buffers: its message has no regions and travels without descriptors, so a session
    remembers it like an all-legacy CUDA message and re-gets take the C core's path (on any machine)."""
    return pa.record_batch({f"c{i}": pa.nulls(rows) for i in range(columns)})


class FakeKeptLeaseHolder:
    """Stands in for a session's remembered messages in the linger thread's loop; records each ask."""

    def __init__(self, deadlines: list[float | None]) -> None:
        self.deadlines = deadlines  # relative seconds to answer with, in order; then None
        self.calls: list[float] = []
        self.asked = threading.Event()

    def _expire_kept_leases(self, now: float) -> float | None:
        self.calls.append(now)
        self.asked.set()
        if not self.deadlines:
            return None
        relative = self.deadlines.pop(0)
        return None if relative is None else now + relative
