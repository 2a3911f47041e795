"""Tests of arrow_ipc_bridge.transport: connections and connect(), the server (socket file, uid
admission, parking lot, limits, farewell, handler failures) and peers that die.

The frames themselves are tests/test_channel.py's. Child processes use the "spawn" start method, so
that they never inherit this process's threads or descriptors by accident.
"""

from __future__ import annotations

import errno
import functools
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.socket_helpers import assert_hung_up, memfd_with, no_fd_leak, read_fd, run_thread, wait_until

from arrow_ipc_bridge.errors import (
    BridgeError,
    PeerClosedError,
    ProtocolError,
    TransportError,
)
from arrow_ipc_bridge.transport import PARK, Connection, Server, connect, socket_path
from arrow_ipc_bridge.transport.channel import Frame


def echo_handler(conn: Connection) -> None:
    """Server handler: send every frame back (descriptors included) until the peer goes away."""
    while True:
        with conn.recv() as frame:
            conn.send(frame.kind, frame.payload, frame.fds)


@pytest.fixture
def sock_path(tmp_path: Path) -> Iterator[str]:
    """A socket path in a fresh directory, short enough for AF_UNIX (about 107 bytes)."""
    if len(str(tmp_path)) < 80:
        yield str(tmp_path / "s.sock")
        return
    directory = tempfile.mkdtemp(prefix="aib-", dir="/tmp")
    try:
        yield os.path.join(directory, "s.sock")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def pair() -> Iterator[tuple[Connection, Connection]]:
    """Two connected Connections over a socketpair."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ca, cb = Connection(a), Connection(b)
    yield ca, cb
    ca.close()
    cb.close()


@pytest.fixture
def server(sock_path: str) -> Iterator[Server]:
    """An echo server."""
    srv = Server(sock_path, echo_handler)
    yield srv
    srv.close()


# -- connections ----------------------------------------------------------------------------------------


def test_peer_credentials(pair: tuple[Connection, Connection]) -> None:
    """peer_pid/uid/gid come from SO_PEERCRED; across a socketpair the peer is this process."""
    a, _ = pair
    assert (a.peer_pid, a.peer_uid, a.peer_gid) == (os.getpid(), os.getuid(), os.getgid())
    assert a.fileno() >= 0


def test_connection_needs_connected_unix_stream() -> None:
    """Connection refuses sockets that are not connected AF_UNIX SOCK_STREAM sockets."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unconnected, pytest.raises(TransportError):
        Connection(unconnected)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as dgram, pytest.raises(TransportError):
        Connection(dgram)
    a, b = socket.socketpair()
    with a, b, pytest.raises(ProtocolError):
        Connection(a, max_payload=2**32)


# -- connect and the server ------------------------------------------------------------------------------


def test_connect_to_missing_path(sock_path: str) -> None:
    """connect() to a path where nothing exists fails at once with TransportError naming the path and
    saying no publisher runs there."""
    start = time.monotonic()
    with pytest.raises(TransportError) as info:
        connect(sock_path, timeout=5)
    assert time.monotonic() - start < 0.5
    assert sock_path in str(info.value)
    assert "no publisher" in str(info.value)
    assert info.value.path == sock_path  # type: ignore[attr-defined]


def test_connect_to_stale_socket(sock_path: str) -> None:
    """connect() to a socket file nobody listens on fails with TransportError mentioning the stale file."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()
    with pytest.raises(TransportError, match="stale socket file"):
        connect(sock_path, timeout=5)


def test_server_round_trip_and_peer_credentials(server: Server) -> None:
    """A client connected with connect() talks to the handler; both ends see each other's credentials."""
    with connect(server.path) as conn:
        assert conn.peer_pid == os.getpid()
        conn.send(1, b"echo me")
        assert conn.recv(timeout=5) == Frame(1, b"echo me", [])
        assert wait_until(lambda: server.active_connections() == 1)
    assert wait_until(lambda: server.active_connections() == 0)


def test_server_passes_fds_both_ways(server: Server) -> None:
    """Descriptors go to the server's handler and come back through it, still pointing at the same file."""
    with no_fd_leak():
        mem = memfd_with(b"round trip")
        with connect(server.path) as conn:
            conn.send(2, b"", [mem])
            with conn.recv(timeout=5) as frame:
                assert read_fd(frame.fds[0], 100) == b"round trip"
        os.close(mem)
        assert wait_until(lambda: server.active_connections() == 0)


def test_server_socket_mode_is_0600(sock_path: str) -> None:
    """The socket file is created with mode 0600 even under a permissive umask."""
    old = os.umask(0)
    try:
        srv = Server(sock_path, echo_handler)
    finally:
        os.umask(old)
    with srv:
        st = os.stat(sock_path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600


def test_server_replaces_stale_socket(sock_path: str) -> None:
    """A socket file left behind by a dead server is replaced."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()
    with Server(sock_path, echo_handler) as srv, connect(srv.path) as conn:
        conn.send(1, b"x")
        assert conn.recv(timeout=5).payload == b"x"


def test_server_refuses_live_path(server: Server) -> None:
    """A second server on the path of a live one raises TransportError and leaves the first serving."""
    with pytest.raises(TransportError, match="already listening"):
        Server(server.path, echo_handler)
    with connect(server.path) as conn:
        conn.send(1, b"still here")
        assert conn.recv(timeout=5).payload == b"still here"


def test_concurrent_servers_on_one_stale_path(sock_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several servers started at once on one stale path: exactly one gets it, the others are refused
    (none of them unlinks the winner's fresh socket). Removing the stale file is slowed down here so that,
    without the directory lock, all of them would find the path stale and steal it from each other."""
    unlink = socket_path._unlink_quietly

    def slow_unlink(path: str) -> None:
        time.sleep(0.05)
        unlink(path)

    monkeypatch.setattr(socket_path, "_unlink_quietly", slow_unlink)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()
    barrier = threading.Barrier(4)
    servers: list[Server] = []
    refused: list[BaseException] = []
    lock = threading.Lock()

    def start() -> None:
        barrier.wait(5)
        try:
            srv = Server(sock_path, echo_handler)
        except TransportError as exc:
            with lock:
                refused.append(exc)
        else:
            with lock:
                servers.append(srv)

    started = [run_thread(start) for _ in range(4)]
    for thread, errors in started:
        thread.join(10)
        assert not errors
    try:
        assert len(servers) == 1
        assert len(refused) == 3
        with connect(sock_path) as conn:
            conn.send(1, b"winner")
            assert conn.recv(timeout=5).payload == b"winner"
    finally:
        for srv in servers:
            srv.close()


def test_server_refuses_non_socket_path(sock_path: str) -> None:
    """A path that exists and is not a socket is never replaced."""
    Path(sock_path).write_text("precious")
    with pytest.raises(TransportError, match="not a socket"):
        Server(sock_path, echo_handler)
    assert Path(sock_path).read_text() == "precious"


def test_server_bind_failure(tmp_path: Path) -> None:
    """Binding where it cannot (no such directory) raises TransportError naming the path."""
    path = str(tmp_path / "missing" / "s.sock")
    with pytest.raises(TransportError, match="cannot bind"):
        Server(path, echo_handler)


def test_server_close_unlinks_and_is_idempotent(sock_path: str) -> None:
    """close() removes the socket file and may be called again; afterwards connect() fails."""
    srv = Server(sock_path, echo_handler)
    assert os.path.exists(sock_path)
    srv.close()
    assert not os.path.exists(sock_path)
    assert srv.closed
    srv.close()
    with pytest.raises(TransportError):
        connect(sock_path, timeout=1)


def test_server_close_leaves_a_replaced_path_alone(sock_path: str) -> None:
    """If the socket file was replaced by someone else's, close() does not remove the newcomer."""
    srv = Server(sock_path, echo_handler)
    os.unlink(sock_path)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(sock_path)
    try:
        srv.close()
        assert os.path.exists(sock_path)
    finally:
        other.close()


def test_server_rejects_disallowed_uid(sock_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """With include_owner=False, allowed_uids is the whole list: a client whose uid is not in it is
    disconnected (it sees PeerClosedError on its first recv) and counted in rejected_connections; its
    handler never runs."""
    calls: list[Connection] = []
    with Server(sock_path, calls.append, allowed_uids=[], include_owner=False) as srv:
        assert srv.allowed_uids == frozenset()
        with (
            caplog.at_level(logging.WARNING, logger="arrow_ipc_bridge.transport"),
            connect(sock_path) as conn,
        ):
            with pytest.raises(PeerClosedError):
                conn.recv(timeout=5)
            assert wait_until(lambda: srv.rejected_connections == 1)
        assert "rejected" in caplog.text
        assert srv.active_connections() == 0
    assert calls == []


def test_server_allowed_uids_default_includes_owner(sock_path: str) -> None:
    """By default the owner's uid is allowed in addition to allowed_uids."""
    with Server(sock_path, echo_handler, allowed_uids=[12345]) as srv:
        assert srv.allowed_uids == frozenset({12345, os.getuid()})
        with connect(sock_path) as conn:
            conn.send(1, b"hi")
            assert conn.recv(timeout=5).payload == b"hi"
        assert srv.rejected_connections == 0


@pytest.mark.parametrize(
    "exc",
    [ProtocolError("bad"), BridgeError("bridge"), OSError(errno.EIO, "io"), ValueError("bug in handler")],
)
def test_handler_error_closes_only_its_connection(
    sock_path: str, exc: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that raises has its connection closed and the error logged; the server keeps serving."""

    def handler(conn: Connection) -> None:
        frame = conn.recv()
        if frame.payload == b"fail":
            raise exc
        conn.send(1, frame.payload)
        conn.recv()

    with Server(sock_path, handler) as srv:
        with caplog.at_level(logging.DEBUG, logger="arrow_ipc_bridge.transport"), connect(sock_path) as bad:
            bad.send(1, b"fail")
            with pytest.raises(PeerClosedError):
                bad.recv(timeout=5)
        assert type(exc).__name__ in caplog.text
        with connect(sock_path) as good:
            good.send(1, b"fine")
            assert good.recv(timeout=5).payload == b"fine"
        assert wait_until(lambda: srv.active_connections() == 0)


def test_server_survives_garbage_client(server: Server) -> None:
    """A client sending garbage gets disconnected; other clients, old and new, are served as before."""
    with connect(server.path) as good:
        good.send(1, b"before")
        assert good.recv(timeout=5).payload == b"before"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(server.path)
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
            raw.settimeout(5)
            assert_hung_up(raw)
        good.send(1, b"after")
        assert good.recv(timeout=5).payload == b"after"
    with connect(server.path) as new:
        new.send(1, b"new")
        assert new.recv(timeout=5).payload == b"new"


def test_many_clients_at_once(server: Server) -> None:
    """32 clients connected at the same time, each doing 100 round trips, all get their own answers."""
    clients, rounds = 32, 100
    barrier = threading.Barrier(clients)

    def client(cid: int) -> None:
        with connect(server.path, timeout=10) as conn:
            barrier.wait(10)
            for i in range(rounds):
                payload = struct.pack("<II", cid, i)
                conn.send(cid, payload)
                frame = conn.recv(timeout=10)
                assert (frame.kind, frame.payload) == (cid, payload)

    started = [run_thread(functools.partial(client, cid)) for cid in range(clients)]
    for thread, errors in started:
        thread.join(30)
        assert not thread.is_alive()
        assert not errors, errors
    assert wait_until(lambda: server.active_connections() == 0)


def test_server_close_unblocks_blocked_handlers(sock_path: str) -> None:
    """Server.close() while handlers are blocked in recv: every handler is woken with PeerClosedError,
    all threads end within the timeout, and the clients see their connections end."""
    outcomes: queue.Queue[BaseException | None] = queue.Queue()

    def handler(conn: Connection) -> None:
        try:
            conn.recv()
            outcomes.put(None)
        except BaseException as exc:
            outcomes.put(exc)
            raise

    srv = Server(sock_path, handler, name="aib-close-test")
    clients = [connect(sock_path) for _ in range(5)]
    assert wait_until(lambda: srv.active_connections() == 5)
    time.sleep(0.05)
    start = time.monotonic()
    srv.close(timeout=3)
    assert time.monotonic() - start < 3
    assert srv.active_connections() == 0
    for _ in clients:
        assert isinstance(outcomes.get(timeout=1), PeerClosedError)
    alive = [t.name for t in threading.enumerate() if t.name.startswith("aib-close-test")]
    assert alive == []
    for conn in clients:
        with pytest.raises(PeerClosedError):
            conn.recv(timeout=5)
        conn.close()


def test_server_close_from_a_handler(sock_path: str) -> None:
    """A handler may close its own server (a "shut down" request): no deadlock, the server ends."""
    done = threading.Event()
    srv: Server | None = None

    def handler(conn: Connection) -> None:
        conn.recv()
        assert srv is not None
        srv.close(timeout=2)
        done.set()

    srv = Server(sock_path, handler)
    with connect(sock_path) as conn:
        conn.send(1, b"shut down")
        assert done.wait(5)
        with pytest.raises(PeerClosedError):
            conn.recv(timeout=5)
    assert srv.closed
    assert not os.path.exists(sock_path)


def test_client_sees_peer_closed_when_server_closes(server: Server) -> None:
    """recv on the client after the server shut down raises PeerClosedError."""
    conn = connect(server.path)
    conn.send(1, b"x")
    assert conn.recv(timeout=5).payload == b"x"
    server.close()
    with pytest.raises(PeerClosedError):
        conn.recv(timeout=5)
    conn.close()


# -- other processes -------------------------------------------------------------------------------------


def _child_connect_and_wait(path: str) -> None:
    """Child process: connect, pass a memfd, then wait forever (until killed)."""
    conn = connect(path)
    fd = os.memfd_create("child", 0)
    os.write(fd, b"from the child")
    conn.send(1, b"ready", [fd])
    conn.recv()  # blocks: the parent kills us here


def test_peer_death_seen_by_handler(sock_path: str) -> None:
    """A client process killed with SIGKILL: its handler's recv raises PeerClosedError. The descriptor it
    passed before dying still works in the server."""
    events: queue.Queue[object] = queue.Queue()

    def handler(conn: Connection) -> None:
        with conn.recv() as frame:
            events.put((frame.payload, conn.peer_pid, read_fd(frame.fds[0], 100)))
        try:
            conn.recv()
        except BaseException as exc:
            events.put(exc)
            raise

    ctx = multiprocessing.get_context("spawn")
    with Server(sock_path, handler) as srv:
        child = ctx.Process(target=_child_connect_and_wait, args=(sock_path,), daemon=True)
        child.start()
        try:
            assert events.get(timeout=30) == (b"ready", child.pid, b"from the child")
            assert child.pid is not None
            os.kill(child.pid, signal.SIGKILL)
            assert isinstance(events.get(timeout=5), PeerClosedError)
        finally:
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join(5)
        assert child.exitcode == -signal.SIGKILL
        assert wait_until(lambda: srv.active_connections() == 0)


# -- the server's parking lot, limits and farewell ----------------------------------------------------------


def test_server_parks_connections_and_calls_on_close_once(sock_path: str) -> None:
    """With park=True a handler that returns PARK gives its thread back; the connection gets a thread
    again when it sends, and on_close runs once when it ends, for parked ones too at close()."""
    calls: list[int] = []
    closed: list[Connection] = []

    def handler(conn: Connection) -> object:
        conn.send(1, conn.recv().payload)  # one frame per activation, then park
        calls.append(1)
        return PARK

    srv = Server(sock_path, handler, park=True, on_close=closed.append)
    try:
        with connect(sock_path) as first, connect(sock_path) as second:
            assert wait_until(lambda: srv.active_connections() == 2)
            assert srv.serving_connections() == 0  # nothing said yet: no thread
            for i in range(3):
                first.send(1, b"x%d" % i)
                assert first.recv(timeout=5).payload == b"x%d" % i
            assert wait_until(lambda: srv.serving_connections() == 0)
            assert len(calls) == 3
            second.send(1, b"y")
            assert second.recv(timeout=5).payload == b"y"
        assert wait_until(lambda: len(closed) == 2)  # each ended while parked or being woken
        with connect(sock_path):
            assert wait_until(lambda: srv.active_connections() == 1)
    finally:
        srv.close()
    assert len(closed) == 3
    assert len(set(map(id, closed))) == 3


def test_server_limits_and_farewell(sock_path: str) -> None:
    """Over max_connections, and past handshake_timeout while parked, the farewell is called with
    the error and the connection is closed; a handler's established() lifts the deadline."""
    farewells: list[str] = []

    def farewell(conn: Connection, error: BridgeError) -> None:
        farewells.append(type(error).__name__)
        conn.send(9, error.message.encode(), timeout=0)

    def handler(conn: Connection) -> object:
        frame = conn.recv()
        srv.established(conn)
        conn.send(1, frame.payload)
        return PARK

    srv = Server(sock_path, handler, park=True, max_connections=2, handshake_timeout=0.3, farewell=farewell)
    try:
        with connect(sock_path) as greeted, connect(sock_path) as silent:
            greeted.send(1, b"hi")
            assert greeted.recv(timeout=5).payload == b"hi"
            with connect(sock_path) as third:
                frame = third.recv(timeout=5)
                assert frame.kind == 9
                assert b"max_connections" in frame.payload
            frame = silent.recv(timeout=5)
            assert frame.kind == 9
            assert b"handshake" in frame.payload
            with pytest.raises(PeerClosedError):
                silent.recv(timeout=5)
            time.sleep(0.5)  # past the deadline: the greeted one stays
            greeted.send(1, b"still")
            assert greeted.recv(timeout=5).payload == b"still"
        assert sorted(farewells) == ["BridgeTimeoutError", "LimitError"]
        assert srv.refused_over_limit == 1
        assert srv.handshake_timeouts == 1
    finally:
        srv.close()


def test_close_waits_for_an_on_close_already_running(sock_path: str) -> None:
    """A connection whose peer left is being finished on its handler thread (on_close running: a
    publisher giving its leases back) when close() is called: close() returns only after that
    on_close is done, so a publisher's close() never leaves a lease counted."""
    started = threading.Event()
    release = threading.Event()
    finished: list[Connection] = []

    def slow_on_close(conn: Connection) -> None:
        started.set()
        release.wait(10)
        finished.append(conn)

    srv = Server(sock_path, echo_handler, on_close=slow_on_close)
    try:
        with connect(sock_path) as client:
            client.send(1, b"x")
            assert client.recv(timeout=5).payload == b"x"
        assert started.wait(10)  # the handler thread is inside on_close now
        closer = threading.Thread(target=srv.close, kwargs={"timeout": 10.0})
        closer.start()
        closer.join(0.3)
        assert closer.is_alive(), "close() returned while on_close was still running"
        release.set()
        closer.join(10)
        assert not closer.is_alive()
        assert len(finished) == 1
    finally:
        release.set()
        srv.close()
