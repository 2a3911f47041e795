"""Timeouts and unreachable publishers: connecting to nothing fails fast; a silent server or
publisher times out and closes the session's connection; a frame arriving in pieces is read within
the session's deadline.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable

import pytest
from helpers.session_rig import FakePublisher

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge.transport import protocol

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_connect_without_publisher_fails_fast(sock_dir: str) -> None:
    """No socket file, a stale socket file and a regular file all raise TransportError promptly, well before
    the 5 s timeout."""
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
        assert time.monotonic() - started < 3.0


def test_silent_server_times_out(sock_dir: str) -> None:
    """A server that accepts but never answers HELLO makes ``connect`` raise BridgeTimeoutError after
    about the timeout; one that welcomes but never answers GET makes ``get`` raise it, after which the
    session's connection is closed (the next request raises TransportError at once)."""
    with FakePublisher(os.path.join(sock_dir, "mute.sock"), welcome=False) as mute:
        started = time.monotonic()
        with pytest.raises(aib.BridgeTimeoutError):
            aib.connect(mute.path, timeout=0.5)
        assert 0.45 <= time.monotonic() - started < 3.0
    with FakePublisher(os.path.join(sock_dir, "slow.sock")) as slow:
        session = aib.connect(slow.path, timeout=0.5)
        try:
            started = time.monotonic()
            with pytest.raises(aib.BridgeTimeoutError):
                session.get("t")
            assert 0.45 <= time.monotonic() - started < 3.0
            started = time.monotonic()
            with pytest.raises(aib.TransportError):
                session.get("t")
            assert time.monotonic() - started < 2.0
        finally:
            session.close()


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
    still trickling at the deadline times out then: the read that starts at 1.4 s, with 0.1 s left,
    must not wait for the piece due at 2.8 s (a receive timeout restarted per read would wait for it)."""
    fake = FakePublisher(os.path.join(sock_dir, "t.sock"), replies=[trickle(4, 0.05), trickle(3, 1.4)])
    with fake, aib.connect(fake.path, timeout=1.5) as session:
        with pytest.raises(aib.NotPublishedError, match="trickled"):
            session.get("x")
        started = time.monotonic()
        with pytest.raises(aib.BridgeTimeoutError):
            session.get("x")
        assert 1.4 < time.monotonic() - started < 2.5
