"""Request frames are bounded by kind (docs/protocol.md, Limits): the publisher refuses a frame that
announces more than its kind may carry from the header alone, before and after HELLO, with ERROR
ProtocolError, and closes the connection without waiting for (or keeping) the payload.

A client announcing a 64 MiB GET used to be read whole (the channel allocated the payload and waited
for it), so a few connections could make the publisher hold gigabytes.
"""

from __future__ import annotations

import os
import struct
import time

import pyarrow as pa
import pytest
from helpers.socket_helpers import wait_until

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge._ffi import lib
from arrow_ipc_bridge.errors import BridgeTimeoutError, NotPublishedError, PeerClosedError, ProtocolError
from arrow_ipc_bridge.transport import protocol, stream_frames
from arrow_ipc_bridge.transport.channel import MAX_PAYLOAD

# The most payload each request kind carries (docs/protocol.md, "Frame kinds").
EXPECTED_LIMITS = {
    protocol.HELLO: 2,
    protocol.LIST: 0,
    protocol.GET: protocol.MAX_NAME,
    protocol.RELEASE: 8,
    protocol.PING: protocol.MAX_PING,
    protocol.POOL_FD: protocol.POOL_IDENTITY_SIZE,
    protocol.SUBSCRIBE: 4 + protocol.MAX_NAME,
    protocol.RELEASE_MANY: 8 * stream_frames.MAX_IN_FLIGHT,
    protocol.WAIT: 12 + protocol.MAX_NAME,
    protocol.BOARD_FD: 0,
}
CHANNEL_BUFFER = 64 * 1024  # channel.c's receive buffer (docs/protocol.md, "Receiving")
HEADER = 16


def header(kind: int, length: int) -> bytes:
    """A frame header (docs/protocol.md, "Frames") announcing ``length`` payload bytes, no fds."""
    return struct.pack("<4sHHIHH", b"AIBT", 1, kind, length, 0, 0)


def hello(raw: transport.Connection) -> None:
    raw.send(protocol.HELLO, protocol.encode_hello())
    with raw.recv(timeout=5.0) as welcome:
        assert welcome.kind == protocol.WELCOME


def expect_refused(raw: transport.Connection, match: str) -> None:
    """ERROR ProtocolError matching ``match`` (well before the publisher's park_after of 60 s), then
    the end of the connection."""
    with raw.recv(timeout=10.0) as frame:
        assert frame.kind == protocol.ERROR, frame
        with pytest.raises(ProtocolError, match=match):
            protocol.raise_error(frame.payload)
    with pytest.raises(PeerClosedError):
        raw.recv(timeout=10.0)


def write_refused(fd: int) -> bool:
    """Whether writing to ``fd`` fails within 10 s: the publisher closed its end."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        try:
            os.write(fd, b"x" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            return True
        except BlockingIOError:
            pass
        time.sleep(0.01)
    return False


@pytest.fixture
def pub(sock_dir: str) -> aib.Publisher:
    # park_after far above the tests' waits: a publisher that waited for an announced payload would
    # still be waiting when they give up.
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), park_after=60) as publisher:
        publisher.publish("t", pa.record_batch({"x": pa.array([1, 2, 3])}))
        yield publisher


def test_the_request_limits_are_the_protocols() -> None:
    """The C table the channel enforces says what transport/protocol.py and the stream frames allow, and every
    request fits the channel's buffer (so a server connection never allocates a payload buffer)."""
    welcomed = {kind: lib.aib_request_limit(kind, 1) for kind in range(1 << 16)}
    assert {kind: limit for kind, limit in welcomed.items() if limit} == {
        kind: limit for kind, limit in EXPECTED_LIMITS.items() if limit
    }
    assert max(welcomed.values()) + HEADER <= CHANNEL_BUFFER
    before_hello = {kind: lib.aib_request_limit(kind, 0) for kind in range(1 << 16)}
    assert {kind: limit for kind, limit in before_hello.items() if limit} == {protocol.HELLO: 2}


def test_a_large_get_is_refused_from_its_header(pub: aib.Publisher) -> None:
    """A GET announcing almost 64 MiB, of which 16 KiB are sent: ERROR ProtocolError at once and the
    connection closed, the rest of the payload never read; the publisher serves others as before."""
    with transport.connect(pub.path) as raw:
        hello(raw)
        os.write(raw.fileno(), header(protocol.GET, MAX_PAYLOAD - 1) + b"n" * 16384)
        fd = os.dup(raw.fileno())
        try:
            expect_refused(raw, f"kind 5 announces a payload of {MAX_PAYLOAD - 1} bytes, over the 4096")
            assert write_refused(fd)  # what is left of the 64 MiB has nowhere to go
        finally:
            os.close(fd)
    with aib.connect(pub.path) as session, session.get("t") as batch:
        assert batch.num_rows == 3
    # The publisher gives the session's leases back when it sees the connection go (its thread).
    assert wait_until(lambda: pub.active_leases == 0)


@pytest.mark.parametrize("kind", [protocol.HELLO, protocol.GET, protocol.SUBSCRIBE, 999])
def test_a_large_frame_before_hello_is_refused_from_its_header(pub: aib.Publisher, kind: int) -> None:
    """Before HELLO only HELLO's 2 bytes are read: a frame announcing more, HELLO included, is refused
    from its header (ERROR ProtocolError, closed)."""
    with transport.connect(pub.path) as raw:
        os.write(raw.fileno(), header(kind, MAX_PAYLOAD - 1) + b"h" * 1024)
        expect_refused(raw, "before HELLO")


@pytest.mark.parametrize(
    "kind",
    [*EXPECTED_LIMITS, protocol.ITEM, protocol.ERROR, 18, 22, 99, 0xFFFF],
    ids=lambda kind: f"kind{kind}",
)
def test_each_request_kind_is_bounded(pub: aib.Publisher, kind: int) -> None:
    """After HELLO, a frame announcing one byte more than its kind carries (any payload for kinds a
    session never sends) is refused from the header: nothing of the payload is sent."""
    limit = EXPECTED_LIMITS.get(kind, 0)
    with transport.connect(pub.path) as raw:
        hello(raw)
        os.write(raw.fileno(), header(kind, limit + 1))
        expect_refused(raw, f"kind {kind} announces a payload of {limit + 1} bytes, over the {limit} bytes")


def test_requests_at_their_limits_are_served(pub: aib.Publisher) -> None:
    """Each limit is the protocol's largest request: a GET of a 4096-byte name, a 64-byte PING and a
    WAIT for a 4096-byte name are answered and the connection goes on."""
    with transport.connect(pub.path) as raw:
        hello(raw)
        raw.send(protocol.GET, b"n" * protocol.MAX_NAME)
        with raw.recv(timeout=5.0) as answer:
            assert answer.kind == protocol.ERROR
            with pytest.raises(NotPublishedError):
                protocol.raise_error(answer.payload)
        raw.send(protocol.PING, b"p" * protocol.MAX_PING)
        with raw.recv(timeout=5.0) as pong:
            assert (pong.kind, pong.payload) == (protocol.PONG, b"p" * protocol.MAX_PING)
        raw.send(protocol.WAIT, protocol.encode_wait(0, 0, b"w" * protocol.MAX_NAME))
        with raw.recv(timeout=5.0) as answer:
            assert answer.kind == protocol.ERROR
            with pytest.raises(BridgeTimeoutError):
                protocol.raise_error(answer.payload)
        raw.send(protocol.GET, b"t")
        with raw.recv(timeout=5.0) as item:
            assert item.kind == protocol.ITEM
            lease_id, _ = protocol.decode_item(item.payload)
        raw.send(protocol.RELEASE, protocol.encode_lease(lease_id))
        raw.send(protocol.PING, b"")  # answered after the RELEASE: the lease is given back by then
        with raw.recv(timeout=5.0) as pong:
            assert pong.kind == protocol.PONG
        assert pub.active_leases == 0


def test_a_subscription_bounds_its_release_frames(pub: aib.Publisher) -> None:
    """On a subscription RELEASE_MANY carries up to 4096 lease ids; a frame announcing more is refused
    from its header (ERROR ProtocolError, the subscription closed)."""
    writer = pub.open_stream("s")
    try:
        with transport.connect(pub.path) as raw:
            hello(raw)
            raw.send(protocol.SUBSCRIBE, stream_frames.encode_subscribe("s", 4))
            with raw.recv(timeout=5.0) as subscribed:
                assert subscribed.kind == protocol.SUBSCRIBED
            raw.send(protocol.RELEASE_MANY, stream_frames.encode_release_many(list(range(1, 4097))))
            os.write(raw.fileno(), header(protocol.RELEASE_MANY, 8 * 4097))
            expect_refused(raw, f"kind {protocol.RELEASE_MANY} announces a payload of {8 * 4097} bytes")
    finally:
        writer.close()
