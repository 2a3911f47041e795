"""Waiting and versions (feature "watch"): waiting for a publisher to appear, for a name to be
published and for a newer version of it; timeouts, many waiters, a publisher closing and a consumer
leaving while waits are held, older publishers and malformed frames.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers import waiting_children
from helpers.session_rig import FakePublisher, raw_hello, run_later, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge._ffi import WIRE_VERSION
from arrow_ipc_bridge.producer import publisher as publisher_module
from arrow_ipc_bridge.producer import watch
from arrow_ipc_bridge.transport import protocol

pytestmark = pytest.mark.usefixtures("no_leaks")

SPAWN = mp.get_context("spawn")
# Generous bounds (a loaded 2-core machine): a wait that is answered when it should be takes
# milliseconds; one that is not takes the whole timeout.
SOON = 10.0


def _values(imported: aib.ImportedArray | aib.ImportedStream) -> list[Any]:
    return list(pa.array(imported).to_pylist())


# ---------- waiting for a publisher ---------------------------------------------------------------
def test_connect_waits_for_a_publisher_started_later_in_another_process(sock_dir: str) -> None:
    """A consumer started first connects once the producer process is up (no socket file at first),
    then waits for the name too; without waiting it fails at once as before."""
    path = os.path.join(sock_dir, "late.sock")
    with pytest.raises(aib.TransportError, match="no such socket file"):
        aib.connect(path, timeout=5.0)
    parent, child = SPAWN.Pipe()
    process = SPAWN.Process(target=waiting_children.late_publisher_main, args=(child, path, 1.0), daemon=True)
    process.start()
    child.close()
    try:
        started = time.monotonic()
        with aib.connect(path, timeout=60.0, wait_for_publisher=True) as session:
            waited = time.monotonic() - started
            with session.get("late", wait=60.0) as imported:
                assert _values(imported) == [1, 2, 3]
                assert imported.version == 1
                assert imported.publisher_id == session.publisher_info["publisher_id"]
        assert waited < 60.0
        assert parent.poll(30.0)
        assert parent.recv()[0] == "published"
        parent.send("stop")
        assert parent.poll(30.0)
        assert parent.recv() == ("bye",)
    finally:
        process.join(30.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)
        parent.close()
    assert process.exitcode == 0


@pytest.mark.parametrize("stale", [False, True], ids=["no socket file", "stale socket file"])
def test_connect_wait_times_out_cleanly(sock_dir: str, stale: bool) -> None:
    """Nobody comes: BridgeTimeoutError (a BridgeTimeoutError) after about ``timeout``, for a missing
    socket file and for one left by a dead publisher (connection refused)."""
    path = os.path.join(sock_dir, "nobody.sock")
    if stale:
        left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        left.bind(path)
        left.close()  # bound, never listening: connect is refused
    started = time.monotonic()
    with pytest.raises(aib.BridgeTimeoutError, match="no server appeared") as caught:
        aib.connect(path, timeout=0.3, wait_for_publisher=True)
    elapsed = time.monotonic() - started
    assert isinstance(caught.value, aib.BridgeTimeoutError)
    assert 0.25 <= elapsed < SOON
    with pytest.raises(aib.TransportError):  # no wait: at once, as before
        aib.connect(path, timeout=5.0)


def test_connect_wait_for_publisher_arguments(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "args.sock")
    with pytest.raises(TypeError, match="wait_for_publisher must be a bool"):
        aib.connect(path, wait_for_publisher=1)  # type: ignore[arg-type]
    for bad in (-1.0, math.nan):  # the wait's bound must be a number >= 0
        with pytest.raises(ValueError, match="timeout must be"):
            aib.connect(path, timeout=bad, wait_for_publisher=True)


def test_connect_does_not_wait_through_permission_errors(sock_dir: str) -> None:
    """Only a missing or refusing socket is waited for: other failures will not mend themselves."""
    path = os.path.join(sock_dir, "not-a-socket")
    with open(path, "w") as f:
        f.write("x")
    started = time.monotonic()
    with pytest.raises(aib.TransportError):
        aib.connect(path, timeout=30.0, wait_for_publisher=True)
    assert time.monotonic() - started < SOON


def test_connect_waits_through_a_publisher_restarting(sock_dir: str) -> None:
    """A publisher restarted over and over at one path: its socket takes connections it then closes
    before answering the HELLO (going down) or that a new one takes over. ``connect`` with
    ``wait_for_publisher`` waits through that and is welcomed every time (it used to raise
    PeerClosedError on about a third of the reconnects of a restart)."""
    path = os.path.join(sock_dir, "restarting.sock")
    parent, child = SPAWN.Pipe()
    process = SPAWN.Process(
        target=waiting_children.restarting_publisher_main, args=(child, path), daemon=True
    )
    process.start()
    child.close()
    failures: list[BaseException] = []
    publishers: set[object] = set()
    try:
        started = time.monotonic()
        while time.monotonic() - started < 3.0 or len(publishers) < 20:
            try:
                with aib.connect(path, timeout=30.0, wait_for_publisher=True) as session:
                    publishers.add(session.publisher_info["publisher_id"])
            except aib.BridgeError as exc:
                failures.append(exc)
            assert time.monotonic() - started < 60.0, (len(publishers), failures[:3])
        parent.send("stop")
        assert parent.poll(30.0)
        kind, restarts = parent.recv()
    finally:
        process.join(30.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)
        parent.close()
    assert process.exitcode == 0
    assert failures == []
    assert kind == "restarts"
    assert restarts >= len(publishers) >= 20


# ---------- waiting for a name --------------------------------------------------------------------
def test_get_waits_for_a_name_publishedrun_later(sock_dir: str) -> None:
    """The publisher answers the held WAIT when the name appears, from the publishing thread, while
    the connection's serving thread is still waiting for its next request (park_after is long)."""
    pub = aib.Publisher(os.path.join(sock_dir, "p.sock"), park_after=60.0)
    with pub, aib.connect(pub.path, timeout=5.0) as session:
        assert "watch" in session.publisher_info["features"]
        publishing = run_later(0.3, lambda: pub.publish("later", pa.array([7, 8])))
        started = time.monotonic()
        with session.get("later", wait=30.0) as imported:
            elapsed = time.monotonic() - started
            assert _values(imported) == [7, 8]
            assert imported.version == pub.version("later") >= 1
            assert imported.publisher_id == pub.publisher_id
            assert pub.active_leases == 1  # the answer's lease is the connection's, like a GET's
        publishing.join()
        assert elapsed < SOON
        assert wait_for(lambda: pub.active_leases == 0, 5.0)
        assert pub.held_waits == 0


def test_waits_held_on_parked_connections(sock_dir: str) -> None:
    """A wait longer than park_after: its connection parks (no serving thread) with the wait held,
    the publish answers it there, and a parked waiter that disconnects takes its wait with it."""
    pub = aib.Publisher(os.path.join(sock_dir, "park.sock"), park_after=0.1)
    with pub, aib.connect(pub.path, timeout=5.0) as session:
        publishing = run_later(1.0, lambda: pub.publish("slow", pa.array([1])))
        with session.get("slow", wait=30.0) as imported:
            assert _values(imported) == [1]
        publishing.join()
        raw = transport.connect(pub.path, timeout=5.0)
        raw_hello(raw)
        raw.send(protocol.WAIT, protocol.encode_wait(pub.version("slow"), 60_000, b"slow"))
        assert wait_for(lambda: pub.held_waits == 1 and pub.serving_sessions == 0, SOON)
        raw.close()
        assert wait_for(lambda: pub.held_waits == 0 and pub.active_sessions == 1, SOON)


def test_get_wait_for_a_published_name_answers_at_once(publisher: aib.Publisher) -> None:
    publisher.publish("here", pa.array([1]))
    with aib.connect(publisher.path, timeout=5.0) as session:
        for wait in (0, 0.0, 5):
            with session.get("here", wait=wait) as imported:
                assert _values(imported) == [1]
                assert imported.version == publisher.version("here")
        # A plain get answered through the version board (every session's re-gets but with
        # pool_linger=0) knows the version it got, not the publisher's id.
        with session.get("here") as plain:
            assert plain.version == publisher.version("here")
            assert plain.publisher_id is None
    with (
        aib.connect(publisher.path, timeout=5.0, pool_linger=0) as session,
        session.get("here") as plain,  # no board: a plain get does not know its version
    ):
        assert plain.version is None
        assert plain.publisher_id is None


def test_get_wait_times_out_cleanly_and_the_session_goes_on(publisher: aib.Publisher) -> None:
    with aib.connect(publisher.path, timeout=5.0) as session:
        started = time.monotonic()
        with pytest.raises(aib.BridgeTimeoutError, match="to be published") as caught:
            session.get("never", wait=0.3)
        assert 0.25 <= time.monotonic() - started < SOON
        assert isinstance(caught.value, aib.BridgeTimeoutError)
        with pytest.raises(aib.BridgeTimeoutError):
            session.get("never", wait=0)
        assert not session.closed
        publisher.publish("now", pa.array([3]))
        with session.get("now") as imported:
            assert _values(imported) == [3]
        assert publisher.held_waits == 0


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (-1, ValueError),
        (-0.001, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (1e12, ValueError),
        (True, TypeError),
        ("1", TypeError),
    ],
)
def test_bad_wait_arguments_are_refused_before_anything_is_sent(
    publisher: aib.Publisher, bad: Any, error: type[Exception]
) -> None:
    with aib.connect(publisher.path, timeout=5.0) as session:
        with pytest.raises(error, match=r"(wait|timeout) must be"):
            session.get("x", wait=bad)
        with pytest.raises(error, match="timeout must be"):
            session.get_next("x", after=0, timeout=bad)
        for after, after_error in (
            (-1, ValueError),
            (1 << 64, ValueError),
            (True, TypeError),
            (1.5, TypeError),
        ):
            with pytest.raises(after_error, match="after must be"):
                session.get_next("x", after=after, timeout=1.0)
        assert session.ping() > 0  # nothing was sent: the session is in step


# ---------- waiting for a newer version -----------------------------------------------------------
def test_versions_grow_across_names_and_republish(publisher: aib.Publisher) -> None:
    """Each publish gets a new version, larger than any before (also after unpublish and republish);
    0 means not published."""
    assert publisher.version("a") == 0
    publisher.publish("a", pa.array([1]))
    first = publisher.version("a")
    publisher.publish("b", pa.array([1]))
    publisher.publish("a", pa.array([2]))
    second = publisher.version("a")
    assert 1 <= first < publisher.version("b") < second
    publisher.unpublish("a")
    assert publisher.version("a") == 0
    publisher.publish("a", pa.array([3]))
    assert publisher.version("a") > second


def test_get_next_waits_for_a_newer_version(publisher: aib.Publisher) -> None:
    publisher.publish("v", pa.array([0]))
    with aib.connect(publisher.path, timeout=5.0) as session:
        with session.get("v", wait=0) as first:
            seen = first.version
            assert seen is not None
        publishing = run_later(0.3, lambda: publisher.publish("v", pa.array([1])))
        started = time.monotonic()
        with session.get_next("v", after=seen, timeout=30.0) as newer:
            assert time.monotonic() - started < SOON
            assert _values(newer) == [1]
            assert newer.version == publisher.version("v") > seen
        publishing.join()
        # Already newer: answered at once.
        with session.get_next("v", after=seen, timeout=0) as again:
            assert _values(again) == [1]


def test_get_next_skips_versions_the_consumer_was_too_slow_for(publisher: aib.Publisher) -> None:
    publisher.publish("s", pa.array([0]))
    seen = publisher.version("s")
    with aib.connect(publisher.path, timeout=5.0) as session:
        for i in range(1, 6):
            publisher.publish("s", pa.array([i]))
        with session.get_next("s", after=seen, timeout=5.0) as newest:
            assert _values(newest) == [5]
            assert newest.version == publisher.version("s")


def test_get_next_across_unpublish_and_republish(publisher: aib.Publisher) -> None:
    """A name unpublished is waited for until it is published again, with a version larger than
    every one before."""
    publisher.publish("u", pa.array([1]))
    seen = publisher.version("u")
    publisher.unpublish("u")
    with aib.connect(publisher.path, timeout=5.0) as session:
        with pytest.raises(aib.BridgeTimeoutError):
            session.get_next("u", after=seen, timeout=0.2)
        with pytest.raises(aib.BridgeTimeoutError):
            session.get_next("u", after=0, timeout=0)
        publishing = run_later(0.2, lambda: publisher.publish("u", pa.array([2])))
        with session.get_next("u", after=seen, timeout=30.0) as back:
            assert _values(back) == [2]
            assert back.version is not None
            assert back.version > seen
        publishing.join()


def test_get_next_times_out_cleanly_and_the_session_goes_on(publisher: aib.Publisher) -> None:
    publisher.publish("t", pa.array([1]))
    seen = publisher.version("t")
    with aib.connect(publisher.path, timeout=5.0) as session:
        started = time.monotonic()
        with pytest.raises(aib.BridgeTimeoutError, match="newer than"):
            session.get_next("t", after=seen, timeout=0.3)
        assert 0.25 <= time.monotonic() - started < SOON
        assert publisher.held_waits == 0
        with session.get("t") as imported:
            assert _values(imported) == [1]
        publisher.publish("t", pa.array([2]))
        with session.get_next("t", after=seen, timeout=5.0) as newer:
            assert _values(newer) == [2]


def test_a_held_wait_lets_the_session_give_leases_back(publisher: aib.Publisher) -> None:
    """While a wait is held, objects the consumer drops still release their leases (the session
    holds the channel's send lock only while the WAIT goes out)."""
    publisher.publish("h", pa.array([1]))
    with aib.connect(publisher.path, timeout=5.0) as session:
        held = session.get("h")
        assert publisher.active_leases == 1
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                session.get("absent", wait=3.0)
            except aib.BridgeTimeoutError as exc:
                errors.append(exc)

        waiter = run_later(0, wait)
        assert wait_for(lambda: publisher.held_waits == 1, SOON)
        held.release()
        assert wait_for(lambda: publisher.active_leases == 0, 2.5)
        waiter.join()
        assert len(errors) == 1


def test_other_connections_are_served_while_waits_are_held(publisher: aib.Publisher) -> None:
    publisher.publish("busy", pa.array([4]))
    with (
        aib.connect(publisher.path, timeout=5.0) as waiting,
        aib.connect(publisher.path, timeout=5.0) as other,
    ):
        seen = publisher.version("busy")
        results: list[Any] = []
        waiter = run_later(
            0, lambda: results.append(_values(waiting.get_next("busy", after=seen, timeout=30.0)))
        )
        assert wait_for(lambda: publisher.held_waits == 1, SOON)
        for _ in range(20):
            with other.get("busy") as imported:
                assert _values(imported) == [4]
        assert other.list() == ["busy"]
        publisher.publish("busy", pa.array([5]))
        waiter.join()
        assert results == [[5]]


def test_many_waiters_at_once(publisher: aib.Publisher) -> None:
    """Sixteen sessions wait for one name and a newer version of another; one publish answers each
    group, every answer leased to its connection and given back."""
    publisher.publish("tick", pa.array([0]))
    seen = publisher.version("tick")
    sessions = [aib.connect(publisher.path, timeout=5.0) for _ in range(16)]
    results: dict[int, list[Any]] = {}
    lock = threading.Lock()

    def wait(i: int) -> None:
        if i % 2:
            imported = sessions[i].get("fresh", wait=30.0)
        else:
            imported = sessions[i].get_next("tick", after=seen, timeout=30.0)
        with imported, lock:
            results[i] = _values(imported)

    try:
        threads = [threading.Thread(target=wait, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: publisher.held_waits == 16, SOON)
        publisher.publish("fresh", pa.array([10]))
        publisher.publish("tick", pa.array([1]))
        for thread in threads:
            thread.join(SOON)
        assert results == {i: [10] if i % 2 else [1] for i in range(16)}
        assert publisher.held_waits == 0
    finally:
        for session in sessions:
            session.close()
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_waiters_follow_a_fast_publisher(publisher: aib.Publisher) -> None:
    """Four consumers loop on get_next while a thread publishes as fast as it can, sometimes
    unpublishing first: each consumer sees strictly growing versions, each the data that version
    was published with, and nothing hangs or leaks."""
    published: dict[int, int] = {}  # version -> value
    stop = threading.Event()

    def produce() -> None:
        value = 0
        while not stop.is_set():
            value += 1
            if value % 50 == 0:
                publisher.unpublish("fast")
            publisher.publish("fast", pa.array([value]))
            published[publisher.version("fast")] = value

    seen: dict[int, list[tuple[int, int]]] = {i: [] for i in range(4)}
    failures: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            with aib.connect(publisher.path, timeout=10.0) as session:
                after = 0
                for _ in range(100):
                    with session.get_next("fast", after=after, timeout=30.0) as item:
                        assert item.version is not None
                        seen[i].append((item.version, _values(item)[0]))
                        after = item.version
        except BaseException as exc:
            failures.append(exc)

    producer = threading.Thread(target=produce)
    consumers = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    producer.start()
    for thread in consumers:
        thread.start()
    for thread in consumers:
        thread.join(60.0)
    stop.set()
    producer.join(SOON)
    assert not failures, failures
    for got in seen.values():
        assert len(got) == 100
        versions = [version for version, _ in got]
        assert versions == sorted(set(versions))
        assert all(published[version] == value for version, value in got)
    assert publisher.held_waits == 0
    assert wait_for(lambda: publisher.active_leases == 0, SOON)


def test_answered_waits_do_not_pile_up_in_the_deadline_heap(publisher: aib.Publisher) -> None:
    """300 held waits with a 60 s deadline, each answered by a publish, behind one that waits 30 s
    (the heap's top, so the clock never reaches the answered ones): the heap is pruned of them
    instead of keeping each until its deadline."""
    publisher.publish("loop", pa.array([0]))
    done = threading.Event()
    raw = transport.connect(publisher.path, timeout=5.0)
    raw_hello(raw)
    raw.send(protocol.WAIT, protocol.encode_wait(0, 30_000, b"never"))
    assert wait_for(lambda: publisher.held_waits == 1, SOON)

    def produce() -> None:
        for value in range(1, 301):
            if not wait_for(lambda: publisher.held_waits == 2 or done.is_set(), SOON):
                return
            publisher.publish("loop", pa.array([value]))
            wait_for(lambda: publisher.held_waits == 1, SOON)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        with aib.connect(publisher.path, timeout=5.0) as session:
            after = publisher.version("loop")
            for value in range(1, 301):
                with session.get_next("loop", after=after, timeout=60.0) as item:
                    assert _values(item) == [value]
                    assert item.version is not None
                    after = item.version
        assert publisher._watch.pending_deadlines <= 128
    finally:
        done.set()
        producer.join(SOON)
        raw.close()


# ---------- the publisher closing, the consumer leaving -------------------------------------------
def test_publisher_close_wakes_every_waiter_with_a_clear_error(sock_dir: str) -> None:
    pub = aib.Publisher(os.path.join(sock_dir, "closing.sock"))
    sessions = [aib.connect(pub.path, timeout=5.0) for _ in range(4)]
    errors: list[BaseException] = []

    def wait(session: aib.Session) -> None:
        try:
            if session is sessions[0]:
                session.get_next("never", after=0, timeout=None)  # no limit
            else:
                session.get("never", wait=60.0)
        except aib.BridgeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(s,)) for s in sessions]
    try:
        for thread in threads:
            thread.start()
        assert wait_for(lambda: pub.held_waits == 4, SOON)
        started = time.monotonic()
        pub.close()
        for thread in threads:
            thread.join(SOON)
        assert time.monotonic() - started < SOON
        assert len(errors) == 4
        for exc in errors:
            assert isinstance(exc, aib.PeerClosedError)
            assert "publisher is closing" in str(exc)
    finally:
        for session in sessions:
            session.close()
        pub.close()


def test_recovering_from_a_publisher_restart(sock_dir: str) -> None:
    """The recipe of docs/lifetime.md: a waiting consumer gets PeerClosedError when the publisher
    closes, waits for the next one at the same path, and starts again from after=0 (a new
    publisher_id, versions from 1); the pyarrow data it built before stays readable."""
    path = os.path.join(sock_dir, "restart.sock")
    first = aib.Publisher(path)
    first.publish("state", pa.array([1]))
    session = aib.connect(path, timeout=5.0)
    old = session.get("state", wait=5.0)
    assert old.publisher_id == first.publisher_id
    kept = pa.array(old)  # pyarrow's own structs hold the mapping past the session's close
    try:
        closing = run_later(0.2, first.close)
        with pytest.raises(aib.PeerClosedError, match="publisher is closing"):
            session.get_next("state", after=old.version or 0, timeout=30.0)
        closing.join()
        session.close()
        holder: list[aib.Publisher] = []
        starting = run_later(0.5, lambda: holder.append(aib.Publisher(path)))
        session = aib.connect(path, timeout=30.0, wait_for_publisher=True)
        starting.join()
        second = holder[0]
        try:
            assert session.publisher_info["publisher_id"] == second.publisher_id != first.publisher_id
            run_later(0.2, lambda: second.publish("state", pa.array([2]))).join()
            with session.get_next("state", after=0, timeout=30.0) as new:
                assert _values(new) == [2]
                assert new.version == 1
                assert new.publisher_id == second.publisher_id
            assert kept.to_pylist() == [1]  # from the first publisher, still mapped
        finally:
            session.close()
            second.close()
    finally:
        old.release()
        session.close()
        first.close()


def test_a_consumer_leaving_while_its_wait_is_held_leaks_nothing(publisher: aib.Publisher) -> None:
    """A raw client sends WAIT and disconnects; a session closed from another thread while it waits
    raises PeerClosedError. The publisher drops both waits (the no_leaks fixture checks fds and
    threads; leases are checked here)."""
    publisher.publish("kept", pa.array([1]))
    raw = transport.connect(publisher.path, timeout=5.0)
    raw_hello(raw)
    raw.send(protocol.WAIT, protocol.encode_wait(0, 60_000, b"nobody"))
    raw.send(protocol.WAIT, protocol.encode_wait(0, protocol.WAIT_FOREVER, b"nobody"))
    assert wait_for(lambda: publisher.held_waits == 2, SOON)
    raw.close()
    assert wait_for(lambda: publisher.held_waits == 0, SOON)

    session = aib.connect(publisher.path, timeout=5.0)
    kept = session.get("kept")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            session.get_next("kept", after=publisher.version("kept"), timeout=60.0)
        except aib.BridgeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    assert wait_for(lambda: publisher.held_waits == 1, SOON)
    session.close()
    thread.join(SOON)
    assert len(errors) == 1
    assert isinstance(errors[0], aib.PeerClosedError)
    assert kept.released
    assert wait_for(lambda: publisher.held_waits == 0 and publisher.active_leases == 0, SOON)
    # Publishing afterwards answers nobody and leases nothing.
    publisher.publish("kept", pa.array([2]))
    assert publisher.active_leases == 0


def _stop_reading(raw: transport.Connection) -> socket.socket:
    """Make ``raw`` a client that stopped reading: PINGs sent without reading the PONGs until the
    publisher's serving thread is stuck sending one (no room for PINGs for 0.3 s). Returns the
    flooding socket (a duplicate of ``raw``'s, for the caller to close)."""
    flood = socket.socket(fileno=os.dup(raw.fileno()))
    ping = (
        struct.pack("<4sHHIHH", b"AIBT", 1, protocol.PING, protocol.MAX_PING, 0, 0) + b"p" * protocol.MAX_PING
    )
    full_since: float | None = None
    while full_since is None or time.monotonic() - full_since < 0.3:
        try:
            flood.send(ping, socket.MSG_DONTWAIT)
            full_since = None
        except BlockingIOError:
            full_since = full_since or time.monotonic()
            time.sleep(0.01)
    return flood


def test_a_client_that_does_not_read_its_answer_is_disconnected(publisher: aib.Publisher) -> None:
    """A waiting client that stopped reading cannot hold up a publish: with the serving thread stuck
    sending it PONGs (its socket full), the publish closes that connection instead of waiting to
    answer its held wait."""
    raw = transport.connect(publisher.path, timeout=5.0)
    flood: socket.socket | None = None
    try:
        raw_hello(raw)
        raw.send(protocol.WAIT, protocol.encode_wait(0, 60_000, b"flood"))
        assert wait_for(lambda: publisher.held_waits == 1, SOON)
        flood = _stop_reading(raw)
        started = time.monotonic()
        publisher.publish("flood", pa.array([1]))
        assert time.monotonic() - started < 1.0  # it used to wait ANSWER_SEND_TIMEOUT (1 s)
        ok = wait_for(lambda: publisher.held_waits == 0 and publisher.active_sessions == 0, SOON)
        assert ok, (publisher.held_waits, publisher.active_sessions, time.monotonic() - started)
    finally:
        if flood is not None:
            flood.close()
        raw.close()
    assert wait_for(lambda: publisher.active_leases == 0, SOON)


def test_a_publish_never_waits_for_stalled_waiters(publisher: aib.Publisher) -> None:
    """Five waiting clients that stopped reading (their sockets full) and one session waiting as it
    should: the publish returns at once (it used to wait ~1 s for each stalled client, one after the
    other), the stalled connections are closed and counted, and the session gets its answer."""
    stalled = [transport.connect(publisher.path, timeout=5.0) for _ in range(5)]
    floods: list[socket.socket] = []
    session = aib.connect(publisher.path, timeout=5.0)
    answers: list[object] = []

    def wait() -> None:
        with session.get("news", wait=60.0) as imported:
            answers.append(_values(imported))

    waiter = threading.Thread(target=wait)
    try:
        for raw in stalled:
            raw_hello(raw)
            raw.send(protocol.WAIT, protocol.encode_wait(0, 60_000, b"news"))
            floods.append(_stop_reading(raw))
        waiter.start()
        assert wait_for(lambda: publisher.held_waits == 6, SOON)
        closed_before = aib.stats().waits.stalled_waiters_closed
        started = time.monotonic()
        publisher.publish("news", pa.array([7]))
        elapsed = time.monotonic() - started
        assert elapsed < 1.0, elapsed  # it took about 5 s
        waiter.join(SOON)
        assert answers == [[7]]
        assert aib.stats().waits.stalled_waiters_closed - closed_before == 5
        assert wait_for(lambda: publisher.held_waits == 0 and publisher.active_sessions == 1, SOON)
    finally:
        if waiter.is_alive():
            waiter.join(SOON)
        for flood in floods:
            flood.close()
        for raw in stalled:
            raw.close()
        session.close()
    assert wait_for(lambda: publisher.active_leases == 0, SOON)


def test_a_large_answer_to_a_held_wait_goes_out_from_the_answering_thread(publisher: aib.Publisher) -> None:
    """An answer larger than watch.FAST_ANSWER_BYTES may take the client's reading to go out, so the
    publishing thread leaves it to the answering thread: a session waiting for a wide table still
    gets it, and the thread ends once it has nothing left to answer."""
    wide = pa.table({f"column_{i}": pa.array([i]) for i in range(2000)})
    with aib.connect(publisher.path, timeout=5.0) as session:
        answers: list[pa.Table] = []

        def wait() -> None:
            with session.get("wide", wait=60.0) as imported:
                answers.append(pa.table(imported))

        waiter = threading.Thread(target=wait)
        waiter.start()
        try:
            assert wait_for(lambda: publisher.held_waits == 1, SOON)
            publisher.publish("wide", wide)
            assert publisher._message_bytes(b"wide") > watch.FAST_ANSWER_BYTES
        finally:
            waiter.join(SOON)
        assert len(answers) == 1
        assert answers[0].equals(wide)
        answers.clear()
    assert wait_for(lambda: not any(t.name.endswith("-answers") for t in threading.enumerate()), SOON)


@pytest.mark.parametrize("limit", [None, 3], ids=["default", "3"])
def test_held_waits_per_connection_are_limited(sock_dir: str, limit: int | None) -> None:
    """A client sending WAITs without reading (4 KiB names) holds at most max_waits_per_connection
    of them (16 by default; it used to hold any number: 100,000 grew a publisher by 408 MB): one
    more gets ERROR LimitError, nothing more is held, and the connection goes on; a wait that
    is answered makes room for another."""
    options = {} if limit is None else {"max_waits_per_connection": limit}
    limit = publisher_module.MAX_WAITS_PER_CONNECTION if limit is None else limit
    with aib.Publisher(os.path.join(sock_dir, "waits.sock"), **options) as pub:
        raw = transport.connect(pub.path, timeout=5.0)
        try:
            raw_hello(raw)
            names = [f"{i:04}".encode() + b"n" * 4092 for i in range(limit)]
            for name in names:
                raw.send(protocol.WAIT, protocol.encode_wait(0, 60_000, name))
            assert wait_for(lambda: pub.held_waits == limit, SOON)
            raw.send(protocol.WAIT, protocol.encode_wait(0, 60_000, b"one more"))
            with raw.recv(timeout=SOON) as refusal:
                assert refusal.kind == protocol.ERROR
                with pytest.raises(aib.LimitError, match="max_waits_per_connection") as caught:
                    protocol.raise_error(refusal.payload)
                assert caught.value.limit == "max_waits_per_connection"
            assert isinstance(caught.value, aib.LimitError)
            assert pub.held_waits == limit
            raw.send(protocol.PING, b"still here")  # the connection goes on
            with raw.recv(timeout=SOON) as pong:
                assert (pong.kind, pong.payload) == (protocol.PONG, b"still here")
            pub.publish(names[0].decode(), pa.array([1]))
            with raw.recv(timeout=SOON) as answer:
                assert answer.kind == protocol.VERSIONED_ITEM
            assert pub.held_waits == limit - 1
            raw.send(protocol.WAIT, protocol.encode_wait(0, 60_000, b"one more"))
            assert wait_for(lambda: pub.held_waits == limit, SOON)
        finally:
            raw.close()
        assert wait_for(lambda: pub.held_waits == 0 and pub.active_leases == 0, SOON)


def test_max_waits_per_connection_argument(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "bad.sock")
    with pytest.raises(ValueError, match="max_waits_per_connection"):
        aib.Publisher(path, max_waits_per_connection=0)
    with pytest.raises(TypeError, match="max_waits_per_connection"):
        aib.Publisher(path, max_waits_per_connection=1.5)  # type: ignore[arg-type]
    assert not os.path.exists(path)


class _Interrupted(Exception):
    pass


def test_a_wait_without_limit_can_be_interrupted(publisher: aib.Publisher) -> None:
    """A signal handler that raises (Ctrl-C's KeyboardInterrupt) ends a wait without a limit within
    about a second; the connection is closed, since the publisher may still answer."""

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with aib.connect(publisher.path, timeout=5.0) as session:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            started = time.monotonic()
            with pytest.raises(_Interrupted):
                session.get_next("never", after=0, timeout=None)
            assert time.monotonic() - started < SOON
            assert session._channel is not None
            assert session._channel.closed
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert wait_for(lambda: publisher.held_waits == 0, SOON)


# ---------- older publishers and malformed frames -------------------------------------------------
def test_a_publisher_without_watch_gets_a_clear_error_not_a_hang(sock_dir: str) -> None:
    """A publisher whose WELCOME lists no "watch" would close the connection on a WAIT frame (or
    never answer it): the session refuses without sending and stays usable."""
    fake = FakePublisher(os.path.join(sock_dir, "old.sock"), features=["ping", "pool_fd"])
    with fake, aib.connect(fake.path, timeout=5.0) as session:
        started = time.monotonic()
        with pytest.raises(aib.BridgeError, match='"watch" feature'):
            session.get("x", wait=60.0)
        with pytest.raises(aib.BridgeError, match='"watch" feature'):
            session.get_next("x", after=0, timeout=60.0)
        assert time.monotonic() - started < SOON
        assert not session.closed


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x00" * 11, struct.pack("<QI", 0, 100), struct.pack("<QI", 0, 100) + b"\xff\xfe"],
    ids=["empty", "short", "no name", "name not UTF-8"],
)
def test_a_malformed_wait_is_a_protocol_error(publisher: aib.Publisher, payload: bytes) -> None:
    raw = transport.connect(publisher.path, timeout=5.0)
    try:
        raw_hello(raw)
        raw.send(protocol.WAIT, payload)
        with raw.recv(timeout=5.0) as answer:
            assert answer.kind == protocol.ERROR
            with pytest.raises(aib.ProtocolError):
                protocol.raise_error(answer.payload)
        with pytest.raises(aib.PeerClosedError):
            raw.recv(timeout=5.0)
    finally:
        raw.close()
    assert publisher.held_waits == 0


def test_a_wait_before_hello_is_a_protocol_error(publisher: aib.Publisher) -> None:
    raw = transport.connect(publisher.path, timeout=5.0)
    try:
        raw.send(protocol.WAIT, protocol.encode_wait(0, 100, b"x"))
        with raw.recv(timeout=5.0) as answer:
            assert answer.kind == protocol.ERROR
            with pytest.raises(aib.ProtocolError, match="before HELLO"):
                protocol.raise_error(answer.payload)
    finally:
        raw.close()


class _WatchFake:
    """A publisher listing "watch" that answers each WAIT with ``answer(conn)``."""

    def __init__(self, path: str, answer: Callable[[transport.Connection], None]) -> None:
        self.answer = answer
        welcome = {"protocol": protocol.PROTOCOL_VERSION, "wire": list(WIRE_VERSION)}
        self.welcome = protocol.encode_json(
            {**welcome, "publisher_id": "fake", "pid": 0, "features": ["watch"]}
        )
        self.server = transport.Server(path, self._handle, name="aib-watch-fake")
        self.path = self.server.path

    def _handle(self, conn: transport.Connection) -> None:
        while True:
            try:
                frame = conn.recv()
            except aib.PeerClosedError:
                return
            frame.close_fds()
            if frame.kind == protocol.HELLO:
                conn.send(protocol.WELCOME, self.welcome)
            elif frame.kind == protocol.WAIT:
                self.answer(conn)


@pytest.fixture
def watch_fake(sock_dir: str) -> Iterator[Callable[[Callable[[transport.Connection], None]], _WatchFake]]:
    made: list[_WatchFake] = []

    def make(answer: Callable[[transport.Connection], None]) -> _WatchFake:
        made.append(_WatchFake(os.path.join(sock_dir, f"fake{len(made)}.sock"), answer))
        return made[-1]

    yield make
    for fake in made:
        fake.server.close()


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        (protocol.VERSIONED_ITEM, b"\x01" * 15),  # shorter than lease id + version
        (protocol.VERSIONED_ITEM, struct.pack("<QQ", 1, 0)),  # version 0
        (protocol.VERSIONED_ITEM, struct.pack("<QQ", 1, 5)),  # not newer than after=5
        (protocol.ITEM, struct.pack("<Q", 1)),  # the wrong answer kind
        (protocol.ERROR, b"not json"),
    ],
    ids=["short", "version 0", "not newer", "ITEM", "bad ERROR"],
)
def test_a_malformed_answer_to_wait_is_a_protocol_error(
    watch_fake: Callable[[Callable[[transport.Connection], None]], _WatchFake], kind: int, payload: bytes
) -> None:
    fake = watch_fake(lambda conn: conn.send(kind, payload))
    with aib.connect(fake.path, timeout=5.0) as session:
        with pytest.raises(aib.ProtocolError):
            session.get_next("x", after=5, timeout=1.0)
        if kind != protocol.ERROR:
            assert session._channel is not None
            assert session._channel.closed


def test_a_publisher_that_never_answers_a_wait_times_out_and_closes(
    watch_fake: Callable[[Callable[[transport.Connection], None]], _WatchFake],
) -> None:
    """The session allows its request timeout past the wait's own; then it closes the connection
    (a late answer would be misread) and raises BridgeTimeoutError."""
    fake = watch_fake(lambda conn: None)
    with aib.connect(fake.path, timeout=0.3) as session:
        started = time.monotonic()
        with pytest.raises(aib.BridgeTimeoutError, match="did not answer a wait"):
            session.get("x", wait=0.2)
        assert 0.45 <= time.monotonic() - started < SOON
        assert session._channel is not None
        assert session._channel.closed


# ---------- GPU data ------------------------------------------------------------------------------
@pytest.mark.gpu
def test_get_next_of_cuda_columns(cuda_device: int, publisher: aib.Publisher) -> None:
    cupy = pytest.importorskip("cupy")
    with cupy.cuda.Device(cuda_device):
        first = cupy.arange(1000, dtype=cupy.float32)
        publisher.publish("cuda", aib.from_cuda_arrays({"v": first}))
        seen = publisher.version("cuda")
        with aib.connect(publisher.path, timeout=10.0) as session:
            second = cupy.full(1000, 2.0, dtype=cupy.float32)
            publishing = run_later(
                0.2, lambda: publisher.publish("cuda", aib.from_cuda_arrays({"v": second}))
            )
            with session.get_next("cuda", after=seen, timeout=30.0) as imported:
                assert imported.version == publisher.version("cuda")
                host = aib.to_host(imported)
                assert isinstance(host, pa.RecordBatch)
                assert host.column(0).to_pylist() == [2.0] * 1000
            publishing.join()
