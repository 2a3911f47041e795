"""The publisher facing hostile or broken clients: protocol violations, raw-client edge cases,
garbage bytes and descriptors attached to rejected frames. Well-behaved sessions keep being served.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.session_rig import HEADER, JOIN_S, fd_count, raw_hello, sample_table, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge.transport import protocol

pytestmark = pytest.mark.usefixtures("no_leaks")


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
