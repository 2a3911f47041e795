"""The publisher's life: names, publish/unpublish/republish, validation, a restart on the same
path, close with hung and leasing clients, and the socket file (mode 0600, exclusive path, other
users shut out).

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import subprocess
import threading
import time
from typing import Any

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.session_rig import HEADER, sample_table, settle, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge.transport import protocol

pytestmark = pytest.mark.usefixtures("no_leaks")


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


def test_a_consumer_connecting_while_the_publisher_is_constructed(
    sock_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The server accepts from inside its constructor, before ``Publisher.__init__`` has it: a
    consumer already waiting for the path (``wait_for_publisher``) is served then. Here the
    construction is held right after the server started until that consumer's connection is being
    served: the serving waits for the construction, and the consumer is welcomed (it used to get
    PeerClosedError, the publisher logging AttributeError: no attribute '_server')."""
    path = os.path.join(sock_dir, "starting.sock")
    serving, served = threading.Event(), threading.Event()
    original_serve = aib.Publisher._serve

    def serve(self: aib.Publisher, conn: transport.Connection) -> object:
        serving.set()
        try:
            return original_serve(self, conn)
        finally:
            served.set()

    monkeypatch.setattr(aib.Publisher, "_serve", serve)
    outcome: list[object] = []

    def consume() -> None:
        try:
            with aib.connect(path, timeout=30.0) as session:
                outcome.append(session.publisher_info["publisher_id"])
        except aib.BridgeError as exc:
            outcome.append(exc)

    consumer = threading.Thread(target=consume)

    class Held(aib.Publisher):
        def _start_server(self, *args: Any) -> transport.Server:
            server = super()._start_server(*args)
            consumer.start()
            assert serving.wait(30.0)  # a thread serves the consumer's connection now
            served.wait(0.5)  # the serving failing at once, before this constructor returned
            return server

    caplog.set_level(logging.DEBUG, logger="arrow_ipc_bridge")
    with Held(path) as publisher:
        consumer.join(30.0)
        assert outcome == [publisher.publisher_id]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


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
    """Invalid names raise ValueError; publishing on a closed publisher raises ClosedError and leaves
    nothing behind (checked by the leak fixture); names() after close raises it too (it used to say
    [] while unpublish said "not published": tests/test_closed_state.py has every method)."""
    with pytest.raises(ValueError, match="name"):
        publisher.publish("", pa.array([1]))
    with pytest.raises(ValueError, match="name"):
        publisher.publish("n" * (protocol.MAX_NAME + 1), pa.array([1]))
    with pytest.raises(aib.InvalidArgumentError):
        publisher.publish("x", object())
    publisher.close()
    with pytest.raises(aib.ClosedError, match="closed"):
        publisher.publish("x", pa.array([1, 2, 3]))
    with pytest.raises(aib.ClosedError, match="closed"):
        publisher.names()


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
        assert time.monotonic() - started < 5.0
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
