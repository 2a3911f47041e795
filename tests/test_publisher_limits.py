"""The publisher's limits: one client cannot block the others (docs/protocol.md, Limits).

HELLO first, the handshake timeout, the connection limit, leases and unread answers per connection,
parked idle connections (no thread each), ``allowed_uids`` with another uid (a child that switches
to uid 65534), and the lease table of one connection holding many leases.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import random
import resource
import shutil
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pyarrow as pa
import pytest
from helpers import socket_helpers
from helpers.counting import SessionCounts

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge.errors import (
    BridgeTimeoutError,
    LimitError,
    PeerClosedError,
    ProtocolError,
    TransportError,
)
from arrow_ipc_bridge.host import SharedHostBuffer, allocate_shared
from arrow_ipc_bridge.transport import protocol

SPAWN = multiprocessing.get_context("spawn")
NOBODY = 65534


# socket_helpers' poll, with these tests' longer bound (publisher threads on busy cores)
wait_until = functools.partial(socket_helpers.wait_until, timeout=10.0)


def small_batch() -> pa.RecordBatch:
    return pa.record_batch({"x": pa.array(range(100), pa.int64())})


def hello(raw: transport.Connection) -> None:
    raw.send(protocol.HELLO, protocol.encode_hello())
    with raw.recv(timeout=5.0) as welcome:
        assert welcome.kind == protocol.WELCOME


def expect_error(raw: transport.Connection, cls: type[Exception], **attributes: object) -> None:
    """The next frame is ERROR naming ``cls`` with ``attributes`` (the family's, which tell the cause)."""
    with raw.recv(timeout=10.0) as frame:
        assert frame.kind == protocol.ERROR, frame
        with pytest.raises(cls) as raised:
            protocol.raise_error(frame.payload)
    for key, value in attributes.items():
        assert getattr(raised.value, key) == value, (key, raised.value.details)


def expect_closed(raw: transport.Connection) -> None:
    with pytest.raises(PeerClosedError):
        raw.recv(timeout=10.0)


# -- the handshake --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [protocol.GET, protocol.LIST, protocol.PING, protocol.RELEASE])
def test_requests_before_hello_are_refused(sock_dir: str, kind: int) -> None:
    """GET, LIST, PING or RELEASE before HELLO: ERROR ProtocolError and the connection is closed;
    nothing is leased."""
    with aib.Publisher(os.path.join(sock_dir, "p.sock")) as pub:
        pub.publish("t", small_batch())
        payload = {protocol.GET: b"t", protocol.RELEASE: protocol.encode_lease(1)}.get(kind, b"")
        with transport.connect(pub.path) as raw:
            raw.send(kind, payload)
            expect_error(raw, ProtocolError)
            expect_closed(raw)
        assert pub.active_leases == 0
        with aib.connect(pub.path) as session, session.get("t"):
            assert pub.active_leases == 1


def test_silent_connection_is_closed_at_the_handshake_timeout(sock_dir: str) -> None:
    """A connection that says nothing, or half a frame, is closed with ERROR BridgeTimeoutError
    once handshake_timeout passed; sessions are served meanwhile."""
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), handshake_timeout=0.5) as pub:
        pub.publish("t", small_batch())
        with transport.connect(pub.path) as silent, transport.connect(pub.path) as half:
            os.write(half.fileno(), b"AIBT\x01\x00")  # a header begun, never finished: holds a thread a while
            with aib.connect(pub.path) as session, session.get("t"):
                pass
            expect_error(silent, BridgeTimeoutError, waiting_for="handshake")
            expect_closed(silent)
            expect_error(half, ProtocolError)  # a frame begun and not finished in time
            expect_closed(half)
        assert wait_until(lambda: pub.active_sessions == 0)
        assert pub._server.handshake_timeouts >= 1


def test_second_hello_is_a_protocol_error(sock_dir: str) -> None:
    with aib.Publisher(os.path.join(sock_dir, "p.sock")) as pub, transport.connect(pub.path) as raw:
        hello(raw)
        raw.send(protocol.HELLO, protocol.encode_hello())
        expect_error(raw, ProtocolError)
        expect_closed(raw)


# -- connections --------------------------------------------------------------------------------------


def test_connection_over_the_limit_gets_connection_limit_error(sock_dir: str) -> None:
    """max_connections sessions are served; one more raises LimitError from connect, and
    one closing makes room again."""
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), max_connections=2) as pub:
        pub.publish("t", small_batch())
        first, second = aib.connect(pub.path), aib.connect(pub.path)
        try:
            with pytest.raises(LimitError, match="max_connections") as raised:
                aib.connect(pub.path)
            assert raised.value.limit == "max_connections"
            with second.get("t"):
                pass
        finally:
            second.close()
        assert wait_until(lambda: pub.active_sessions == 1)
        with aib.connect(pub.path) as again, again.get("t"):
            pass
        with first.get("t"):
            pass
        first.close()
        assert pub._server.refused_over_limit == 1


def test_idle_connections_are_parked_without_a_thread(sock_dir: str) -> None:
    """Connections that say nothing, and sessions silent for park_after, hold no thread; a parked
    session keeps its leases and is served again when it sends."""
    n_idle = 200
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), park_after=0.2) as pub:
        pub.publish("t", small_batch())
        threads_before = threading.active_count()
        with contextlib.ExitStack() as stack:
            for _ in range(n_idle):
                stack.enter_context(transport.connect(pub.path))
            session = stack.enter_context(aib.connect(pub.path))
            held = stack.enter_context(session.get("t"))
            assert wait_until(lambda: pub.active_sessions == n_idle + 1)
            assert wait_until(lambda: pub.serving_sessions == 0)
            assert threading.active_count() <= threads_before + 2
            assert pub.active_leases == 1  # parked with its lease
            with session.get("t") as again:  # wakes it
                assert pa.record_batch(again).equals(pa.record_batch(held))
                assert pub.active_leases == 2
        assert wait_until(lambda: pub.active_sessions == 0)
        assert pub.active_leases == 0


# -- leases and unread answers per connection ---------------------------------------------------------


def test_lease_limit_refuses_the_get_and_the_session_goes_on(sock_dir: str) -> None:
    """``pool_linger=0``: every get asks and takes a lease of its own, so held gets meet the limit.
    A session with standing leases (the default) holds its re-gets of a name under one lease."""
    counts = SessionCounts()
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), max_leases_per_connection=3) as pub:
        pub.publish("t", small_batch())
        with aib.connect(pub.path) as standing:
            held = [standing.get("t") for _ in range(5)]
            assert counts.local_gets == 3
            assert pub.active_leases == 2  # the first get's, and the standing lease
            for imported in held:
                imported.release()
        assert wait_until(lambda: pub.active_leases == 0)
        with aib.connect(pub.path, pool_linger=0) as session, aib.connect(pub.path) as other:
            held = [session.get("t") for _ in range(3)]
            with pytest.raises(LimitError, match="max_leases_per_connection") as raised:
                session.get("t")
            assert raised.value.limit == "max_leases_per_connection"
            assert pub.active_leases == 3
            with other.get("t"):  # another connection has leases of its own
                pass
            held.pop().release()
            assert wait_until(lambda: pub.active_leases == 2)
            held.append(session.get("t"))
            for imported in held:
                imported.release()
        assert wait_until(lambda: pub.active_leases == 0)


@pytest.fixture
def many_fds_batch() -> Iterator[pa.RecordBatch]:
    """A batch of 32 columns, each in a shared buffer of its own: 32 descriptors per ITEM."""
    buffers: list[SharedHostBuffer] = [allocate_shared(800, name=f"aib-col{i}") for i in range(32)]
    columns = [pa.Array.from_buffers(pa.int64(), 100, [None, b.as_pyarrow()]) for b in buffers]
    yield pa.record_batch(columns, names=[f"c{i}" for i in range(32)])
    for b in buffers:
        b.close()


def test_client_that_does_not_read_is_refused_and_others_are_served(
    sock_dir: str, many_fds_batch: pa.RecordBatch
) -> None:
    """A client that sends GETs without reading the ITEMs gets LimitError once its unread
    answers carry max_unread_fds descriptors (no more descriptors go in flight to it); a session
    next to it is served throughout."""
    pub = aib.Publisher(os.path.join(sock_dir, "p.sock"), max_unread_fds=256, copy="never", park_after=0.2)
    with pub:
        pub.publish("wide", many_fds_batch)
        with transport.connect(pub.path) as greedy, aib.connect(pub.path) as session:
            hello(greedy)
            for _ in range(12):
                greedy.send(protocol.GET, b"wide")
            with session.get("wide") as imported:
                assert pa.record_batch(imported).num_columns == 32
            # Parked once every GET was handled; only then does the client read (reading earlier
            # would let the publisher see the answers read and serve more).
            assert wait_until(lambda: pub.serving_sessions == 0)
            assert pub.active_leases == 8  # 8 x 32 = 256 descriptors unread
            answers = []
            for _ in range(12):
                with greedy.recv(timeout=10.0) as frame:
                    answers.append(frame.kind)
                    assert len(frame.fds) == (32 if frame.kind == protocol.ITEM else 0)
            assert answers == [protocol.ITEM] * 8 + [protocol.ERROR] * 4
            greedy.send(protocol.GET, b"wide")  # read everything: served again
            with greedy.recv(timeout=10.0) as frame:
                assert frame.kind == protocol.ITEM
        assert wait_until(lambda: pub.active_leases == 0)
        # both connections' counts are given back when they close
        assert wait_until(lambda: int(aib._ffi.lib.aib_pubtable_fds_unread(pub._table)) == 0)


def test_unread_answers_error_is_what_the_client_reads(sock_dir: str, many_fds_batch: pa.RecordBatch) -> None:
    pub = aib.Publisher(os.path.join(sock_dir, "p.sock"), max_unread_fds=253, copy="never", park_after=0.2)
    with pub:
        pub.publish("wide", many_fds_batch)
        with transport.connect(pub.path) as greedy:
            hello(greedy)
            for _ in range(9):
                greedy.send(protocol.GET, b"wide")
            assert wait_until(lambda: pub.serving_sessions == 0)  # every GET handled
            for _ in range(7):  # 7 x 32 = 224; the 8th would make 256 > 253
                with greedy.recv(timeout=10.0) as frame:
                    assert frame.kind == protocol.ITEM
            expect_error(greedy, LimitError, limit="max_unread_fds")


# -- one connection holding many leases (the C lease table) -------------------------------------------


def test_many_leases_on_one_connection_released_in_varied_orders(sock_dir: str) -> None:
    """One connection takes 4,096 leases (the table grows to 8,192 slots at load 1/2, where lease ids'
    hashes collide: with fewer, consecutive ids spread without a collision and deletion never shifts)
    and gives them back in shuffled, reversed and interleaved orders, with re-gets between; after
    every step the publisher's count is exactly what is held, and releasing twice changes nothing."""
    rng = random.Random(1234)
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), max_leases_per_connection=5000) as pub:
        pub.publish("t", small_batch())
        with transport.connect(pub.path) as raw:
            hello(raw)

            def take(n: int) -> list[int]:
                ids = []
                for _ in range(n):
                    raw.send(protocol.GET, b"t")
                    with raw.recv(timeout=5.0) as item:
                        assert item.kind == protocol.ITEM
                        ids.append(protocol.decode_item(item.payload)[0])
                return ids

            def give_back(ids: list[int]) -> None:
                for lease in ids:
                    raw.send(protocol.RELEASE, protocol.encode_lease(lease))
                raw.send(protocol.PING, b"sync")  # answered after every RELEASE before it
                with raw.recv(timeout=5.0) as pong:
                    assert pong.kind == protocol.PONG

            held = take(4096)
            assert len(set(held)) == 4096
            assert pub.active_leases == 4096
            rng.shuffle(held)
            orders = [held[:1000], list(reversed(held[1000:1800])), held[1800:3000:2], held[1801:3000:2]]
            rest = held[3000:]
            expected = 4096
            for chunk in orders:
                for i in range(0, len(chunk), 50):
                    part = chunk[i : i + 50]
                    give_back(part)
                    expected -= len(part)
                    assert pub.active_leases == expected
                give_back(chunk[:10])  # twice: harmless
                assert pub.active_leases == expected
                more = take(50)
                rest += more
                expected += 50
                assert pub.active_leases == expected
            rng.shuffle(rest)
            for i in range(0, len(rest), 5):
                give_back(rest[i : i + 5])
                expected -= len(rest[i : i + 5])
                assert pub.active_leases == expected
        assert expected == 0
        assert wait_until(lambda: pub.active_leases == 0)


# -- allowed_uids with another uid --------------------------------------------------------------------


def _child_get(path: str, uid: int, out: Connection) -> None:
    """Spawned child: become ``uid`` and get ``t``; report the row count or the error's class name."""
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        with aib.connect(path, timeout=5.0) as session, session.get("t") as imported:
            out.send(("ok", pa.record_batch(imported).num_rows))
    except Exception as exc:  # reported to the parent, which asserts on it
        out.send(("error", type(exc).__name__, str(exc), getattr(exc, "reason", None)))


def _run_as(path: str, uid: int) -> tuple[object, ...]:
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_child_get, args=(path, uid, child))
    proc.start()
    try:
        assert parent.poll(60), "the child did not answer"
        result: tuple[object, ...] = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return result


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching a child to another uid needs root")


@needs_root
def test_allowed_uid_connects_through_the_socket_mode(sock_dir: str) -> None:
    """A uid in allowed_uids connects (the socket file is 0666 then) and gets data."""
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), allowed_uids=[NOBODY]) as pub:
        assert os.stat(pub.path).st_mode & 0o777 == 0o666
        pub.publish("t", small_batch())
        assert _run_as(pub.path, NOBODY) == ("ok", 100)


@needs_root
def test_uid_not_allowed_gets_peer_rejected_error(sock_dir: str) -> None:
    """A uid the publisher does not allow reaches the socket (0666 for another allowed uid) and is
    refused with ERROR TransportError, which connect raises."""
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), allowed_uids=[NOBODY - 1]) as pub:
        pub.publish("t", small_batch())
        result = _run_as(pub.path, NOBODY)
        assert result[:2] == ("error", TransportError.__name__), result
        assert result[3] == "rejected", result
        assert "not allowed" in str(result[2])
        assert pub._server.rejected_connections == 1


def test_socket_is_owner_only_without_other_uids(sock_dir: str) -> None:
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), allowed_uids=[os.getuid()]) as pub:
        assert os.stat(pub.path).st_mode & 0o777 == 0o600


def _child_fds_in_flight(directory: str, out: Connection) -> None:
    """Spawned child, as uid 65534 (no capability lifts the kernel's limit on descriptors in flight)
    with RLIMIT_NOFILE 200: eight clients each GET a 32-descriptor batch and do not read; the
    kernel refuses the descriptors past 200 in flight (ETOOMANYREFS). Reports what each client and
    a session next to them saw."""
    counts = SessionCounts()
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        buffers = [allocate_shared(800, name=f"aib-col{i}") for i in range(32)]
        columns = [pa.Array.from_buffers(pa.int64(), 100, [None, b.as_pyarrow()]) for b in buffers]
        batch = pa.record_batch(columns, names=[f"c{i}" for i in range(32)])
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))
        with aib.Publisher(os.path.join(directory, "p.sock"), copy="never", park_after=0.2) as pub:
            pub.publish("wide", batch)
            clients = [transport.connect(pub.path) for _ in range(8)]
            for client in clients:
                hello(client)
                client.send(protocol.GET, b"wide")
            assert wait_until(lambda: pub.serving_sessions == 0)  # every GET handled
            with aib.connect(pub.path) as session:
                try:
                    session.get("wide").release()
                    first = "ok"
                except Exception as exc:
                    first = f"{type(exc).__name__} {getattr(exc, 'limit', '')}"
                kinds = []
                for client in clients:
                    with client.recv(timeout=10.0) as frame:
                        kinds.append(frame.kind)
                    client.close()
                with session.get("wide") as imported:  # read: nothing in flight any more
                    then = pa.record_batch(imported).num_columns
                for _ in range(2):  # remembered, then local: the board came with the retry
                    session.get("wide").release()
                local = counts.local_gets
            out.send(("done", first, kinds, then, local))
    except Exception as exc:  # reported to the parent, which asserts on it
        out.send(("error", type(exc).__name__, str(exc), getattr(exc, "reason", None)))


@needs_root
def test_descriptors_refused_by_the_kernel_fail_only_that_answer(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Past RLIMIT_NOFILE descriptors in flight the kernel fails sendmsg (ETOOMANYREFS): the answer
    then is ERROR LimitError, nothing is leased, and every connection goes on (the
    session's next get, once the others read, succeeds). The session connected meanwhile was refused
    its version board's descriptor the same way: it connected all the same, asked for the board
    again before its gets, and re-gets once it came are local."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-")
    os.chown(directory, NOBODY, NOBODY)
    try:
        parent, child = SPAWN.Pipe()
        proc = SPAWN.Process(target=_child_fds_in_flight, args=(directory, child))
        proc.start()
        try:
            assert parent.poll(120), "the child did not answer"
            result = parent.recv()
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert result[0] == "done", result
    _, first, kinds, then, local = result
    if protocol.ERROR not in kinds and first == "ok":
        pytest.skip("this kernel passed 256 descriptors in flight past RLIMIT_NOFILE 200 (no ETOOMANYREFS)")
    assert first == "LimitError descriptors_in_flight"
    assert kinds.count(protocol.ITEM) >= 6, kinds
    assert protocol.ERROR in kinds, kinds
    assert then == 32
    assert local == 1


@pytest.mark.parametrize(
    ("cls", "attributes"),
    [
        (LimitError, {"limit": "max_connections", "value": 3}),
        (LimitError, {"limit": "max_leases_per_connection", "value": 3}),
        (LimitError, {"limit": "max_unread_fds", "value": 3}),
        (LimitError, {"limit": "descriptors_in_flight"}),
        (BridgeTimeoutError, {"waiting_for": "handshake", "timeout": 0.5}),
        (TransportError, {"reason": "rejected"}),
    ],
)
def test_limit_errors_cross_the_wire_and_pickle(
    cls: type[aib.BridgeError], attributes: dict[str, object]
) -> None:
    """Each error the publisher reports arrives as its family with the attributes that tell its
    cause (an ERROR frame), and pickles with them."""
    import pickle

    with pytest.raises(cls, match="over it") as caught:
        protocol.raise_error(protocol.encode_error(cls("over it", **attributes)))
    for key, value in attributes.items():
        assert getattr(caught.value, key) == value
    again = pickle.loads(pickle.dumps(cls("over it", **attributes)))
    assert type(again) is cls
    assert again.details == attributes
