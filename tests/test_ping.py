"""PING: answered in C with its payload, refused without sending to a publisher that does not
announce it, PeerClosedError from a dead publisher.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
from helpers.session_rig import FakePublisher, sample_table

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.transport import protocol

pytestmark = pytest.mark.usefixtures("no_leaks")


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
