"""Hostile peers of live streams: malformed stream frames from a client get ProtocolError and close
its subscription; malformed frames from a publisher get ProtocolError in the consumer; nothing leaks
(docs/protocol.md, the stream frames)."""

from __future__ import annotations

import os
import queue
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator

import pyarrow as pa
import pytest
from helpers.session_rig import fd_count, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge._ffi import WIRE_VERSION
from arrow_ipc_bridge.transport import protocol, stream_frames

Reply = tuple[int, bytes] | tuple[int, bytes, list[int]]


def batch(i: int) -> pa.RecordBatch:
    return pa.record_batch({"i": pa.array([i], pa.int64())})


@pytest.fixture
def sock_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-sh-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    """What the library keeps open for the process's life (reaper pipe, placement files) first."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-sh-")
    try:
        with aib.Publisher(os.path.join(directory, "w.sock")) as pub:
            writer = pub.open_stream("w")
            with aib.subscribe(pub.path, "w", timeout=10) as live:
                writer.write(batch(0))
                writer.close()
                for imported in live:
                    imported.release()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---------- a hostile client against a real publisher ---------------------------------------------
def raw_client(path: str) -> transport.Connection:
    conn = transport.connect(path, timeout=10)
    conn.send(protocol.HELLO, protocol.encode_hello())
    assert conn.recv(timeout=10).kind == protocol.WELCOME
    return conn


def expect_protocol_error_and_close(conn: transport.Connection, match: str) -> None:
    frame = conn.recv(timeout=10)
    assert frame.kind == protocol.ERROR
    with pytest.raises(aib.ProtocolError, match=match):
        protocol.raise_error(frame.payload)
    with pytest.raises(aib.PeerClosedError):
        conn.recv(timeout=10)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        pytest.param(b"", "SUBSCRIBE payload", id="empty"),
        pytest.param(struct.pack("<I", 4), "SUBSCRIBE payload", id="no-name"),
        pytest.param(struct.pack("<I", 0) + b"s", "max_in_flight 0", id="no-credit"),
        pytest.param(struct.pack("<I", 4097) + b"s", "max_in_flight 4097", id="too-much-credit"),
        pytest.param(struct.pack("<I", 4) + b"\xff\xfe", "not UTF-8", id="bad-name"),
        # Over SUBSCRIBE's 4100 bytes: refused from the frame's header (docs/protocol.md, Limits).
        pytest.param(
            struct.pack("<I", 4) + b"s" * 4097, "payload of 4101 bytes, over the 4100", id="long-name"
        ),
    ],
)
def test_malformed_subscribe_is_a_protocol_error(
    publisher: aib.Publisher, payload: bytes, match: str
) -> None:
    writer = publisher.open_stream("s")
    before = fd_count()
    conn = raw_client(publisher.path)
    conn.send(protocol.SUBSCRIBE, payload)
    expect_protocol_error_and_close(conn, match)
    conn.close()
    assert wait_for(lambda: fd_count() == before, 5)
    assert writer.subscribers == 0
    writer.close()


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        pytest.param((protocol.GET, b"s"), "only RELEASE", id="get-on-a-subscription"),
        pytest.param(
            (protocol.SUBSCRIBE, stream_frames.encode_subscribe("s", 1)), "only RELEASE", id="resubscribe"
        ),
        pytest.param((protocol.RELEASE, b"\x01\x00"), "RELEASE payload of 2 bytes", id="short-release"),
        pytest.param((protocol.RELEASE, struct.pack("<Q", 1), "fd"), "only RELEASE", id="release-with-fd"),
        pytest.param((protocol.RELEASE_MANY, b""), "RELEASE_MANY payload of 0 bytes", id="release-none"),
        pytest.param((protocol.RELEASE_MANY, b"\x01" * 12), "RELEASE_MANY payload of 12", id="release-odd"),
        pytest.param(
            (protocol.RELEASE_MANY, b"\x01" * 8 * 4097),
            "payload of 32776 bytes, over the 32768",  # refused from the header
            id="release-too-many",
        ),
    ],
)
def test_bad_frames_on_a_subscription_close_it_and_free_its_leases(
    publisher: aib.Publisher, frame: tuple[int, bytes] | tuple[int, bytes, str], match: str
) -> None:
    writer = publisher.open_stream("s")
    before = fd_count()
    conn = raw_client(publisher.path)
    conn.send(protocol.SUBSCRIBE, stream_frames.encode_subscribe("s", 4))
    assert conn.recv(timeout=10).kind == protocol.SUBSCRIBED
    writer.write(batch(1))
    with conn.recv(timeout=10) as pushed:
        assert pushed.kind == protocol.BATCH
        assert len(pushed.fds) == 1
    assert writer.leases == 1
    conn.send(protocol.RELEASE, struct.pack("<Q", 999))  # unknown lease: ignored, goes on
    if len(frame) == 3:
        fd = os.memfd_create("aib-hostile")
        conn.send(frame[0], frame[1], [fd])
        os.close(fd)
    else:
        conn.send(frame[0], frame[1])
    expect_protocol_error_and_close(conn, match)
    conn.close()
    assert wait_for(lambda: writer.leases == 0 and writer.subscribers == 0, 5)
    writer.write(batch(2))  # the stream goes on for everyone else
    writer.close()
    assert wait_for(lambda: fd_count() == before, 5)


def test_subscribe_before_hello_is_refused(publisher: aib.Publisher) -> None:
    publisher.open_stream("s").close()
    conn = transport.connect(publisher.path, timeout=10)
    conn.send(protocol.SUBSCRIBE, stream_frames.encode_subscribe("s", 1))
    expect_protocol_error_and_close(conn, "before HELLO")
    conn.close()


# ---------- a hostile publisher against a consumer --------------------------------------------------
RAW = -1
"""A pushed reply of this kind is written to the socket as it is: not a frame."""


class ScriptedStreamPublisher:
    """Answers HELLO with a WELCOME offering "stream", SUBSCRIBE with ``subscribed`` then every frame
    of ``pushed``; records RELEASEs."""

    def __init__(self, path: str, subscribed: Reply, pushed: list[Reply]) -> None:
        welcome = {
            "protocol": protocol.PROTOCOL_VERSION,
            "wire": list(WIRE_VERSION),
            "publisher_id": "scripted",
            "pid": os.getpid(),
            "features": ["ping", "stream"],
        }
        self.welcome = protocol.encode_json(welcome)
        self.subscribed = subscribed
        self.pushed = pushed
        self.releases: queue.Queue[int] = queue.Queue()
        self.server = transport.Server(path, self._handle, name="aib-scripted-stream")
        self.path = self.server.path

    def _send(self, conn: transport.Connection, reply: Reply) -> None:
        kind, payload, *rest = reply
        fds = rest[0] if rest else []
        if kind == RAW:
            os.write(conn.fileno(), payload)
            return
        try:
            conn.send(kind, payload, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _handle(self, conn: transport.Connection) -> None:
        while True:
            try:
                frame = conn.recv()
            except aib.TransportError:
                return
            frame.close_fds()
            if frame.kind == protocol.HELLO:
                conn.send(protocol.WELCOME, self.welcome)
            elif frame.kind == protocol.SUBSCRIBE:
                self._send(conn, self.subscribed)
                pushed, self.pushed = self.pushed, []
                for reply in pushed:
                    self._send(conn, reply)
            elif frame.kind == protocol.RELEASE:
                self.releases.put(protocol.decode_lease(frame.payload))
            elif frame.kind == protocol.RELEASE_MANY:
                for lease_id in stream_frames.decode_release_many(frame.payload):
                    self.releases.put(lease_id)

    def close(self) -> None:
        self.server.close()
        for reply in self.pushed:
            for fd in reply[2] if len(reply) == 3 else []:
                os.close(fd)


@pytest.fixture
def scripted(sock_dir: str) -> Iterator[Callable[..., ScriptedStreamPublisher]]:
    made: list[ScriptedStreamPublisher] = []
    # What a process opens once and keeps (the reaper's pipe, the /proc/self/maps reader of host
    # exports) is open before the count, so that only what a test leaks is left over whatever ran
    # before it.
    aib.export(batch(0)).close()
    base = fd_count()

    def make(subscribed: Reply | None = None, pushed: list[Reply] | None = None) -> ScriptedStreamPublisher:
        answer = subscribed or (
            protocol.SUBSCRIBED,
            stream_frames.encode_subscribed(stream_frames.Subscribed(4, "block", 0)),
        )
        pub = ScriptedStreamPublisher(os.path.join(sock_dir, f"p{len(made)}.sock"), answer, pushed or [])
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()
    assert wait_for(lambda: fd_count() == base, 5), f"descriptors left open: {fd_count()} vs {base}"


def good_batch(sequence: int, lease: int, slot: int = stream_frames.NO_SLOT) -> Reply:
    exported = aib.export(batch(sequence))
    fds = [os.dup(fd) for fd in exported.fds]
    payload = stream_frames.encode_batch_header(sequence, lease, slot) + exported.message
    exported.close()
    return (protocol.BATCH, payload, fds)


def test_a_scripted_stream_is_imported_and_released(
    scripted: Callable[..., ScriptedStreamPublisher],
) -> None:
    pub = scripted(pushed=[good_batch(0, 5), good_batch(3, 6), (protocol.STREAM_END, _end(None))])
    with aib.subscribe(pub.path, "s", timeout=10) as live:
        got = []
        for imported in live:
            with imported:
                got.append(pa.record_batch(imported).column(0)[0].as_py())
        assert got == [0, 3]
        assert live.dropped == 2
    assert sorted([pub.releases.get(timeout=5), pub.releases.get(timeout=5)]) == [5, 6]


def test_a_slot_repeated_without_message_or_descriptors(
    scripted: Callable[..., ScriptedStreamPublisher],
) -> None:
    again = (protocol.BATCH, stream_frames.encode_batch_header(1, 8, 2, stream_frames.FLAG_SLOT_AGAIN))
    pub = scripted(pushed=[good_batch(0, 7, slot=2), again, (protocol.STREAM_END, _end(None))])
    with aib.subscribe(pub.path, "s", timeout=10) as live:
        got = []
        for imported in live:
            with imported:
                got.append(pa.record_batch(imported).column(0)[0].as_py())
        assert got == [0, 0]  # the slot's message, imported again from its kept descriptors
        assert live.repeated == 1
    assert sorted([pub.releases.get(timeout=5), pub.releases.get(timeout=5)]) == [7, 8]


def test_close_sends_the_releases_held_back(scripted: Callable[..., ScriptedStreamPublisher]) -> None:
    """Under "block", released batches' leases wait to go a few at a time; closing the stream sends
    them before the connection ends (the publisher sees RELEASE, not only the disconnect)."""
    pub = scripted(
        subscribed=(
            protocol.SUBSCRIBED,
            stream_frames.encode_subscribed(stream_frames.Subscribed(8, "block", 0)),
        ),
        pushed=[good_batch(0, 3), good_batch(1, 4)],
    )
    with aib.subscribe(pub.path, "s", max_in_flight=8, timeout=10) as live:
        first = live.next_batch()
        second = live.next_batch()
        first.release()
        second.release()
        with pytest.raises(queue.Empty):  # 2 of a window of 8: held back while nothing waits
            pub.releases.get(timeout=0.3)
    assert sorted([pub.releases.get(timeout=5), pub.releases.get(timeout=5)]) == [3, 4]


def _end(error_type: str | None, message: str = "end", dropped: int = 0) -> bytes:
    return protocol.encode_json({"type": error_type, "message": message, "dropped": dropped})


@pytest.mark.parametrize(
    ("subscribed", "match"),
    [
        pytest.param((protocol.SUBSCRIBED, b"[]"), "not an object", id="not-object"),
        pytest.param(
            (protocol.SUBSCRIBED, stream_frames.encode_subscribed(stream_frames.Subscribed(9, "block", 0))),
            "grants max_in_flight 9",
            id="more-credit-than-asked",
        ),
        pytest.param(
            (protocol.SUBSCRIBED, stream_frames.encode_subscribed(stream_frames.Subscribed(1, "later", 0))),
            "unknown policy",
            id="policy",
        ),
        pytest.param(
            (protocol.SUBSCRIBED, stream_frames.encode_subscribed(stream_frames.Subscribed(1, "block", -1))),
            "next_sequence",
            id="sequence",
        ),
        pytest.param((protocol.NAMES, b"[]"), "expected SUBSCRIBED", id="wrong-kind"),
    ],
)
def test_malformed_subscribed_is_a_protocol_error(
    scripted: Callable[..., ScriptedStreamPublisher], subscribed: Reply, match: str
) -> None:
    pub = scripted(subscribed=subscribed)
    with pytest.raises(aib.ProtocolError, match=match):
        aib.subscribe(pub.path, "s", max_in_flight=4, timeout=10)


def _memfd() -> int:
    fd = os.memfd_create("aib-hostile")
    os.write(fd, b"x" * 4096)
    return fd


@pytest.mark.parametrize(
    ("pushed", "match"),
    [
        pytest.param((protocol.BATCH, b"\x00" * 24), "BATCH payload of 24 bytes", id="no-message"),
        pytest.param(
            (protocol.BATCH, struct.pack("<QQII", 0, 1, stream_frames.NO_SLOT, 4) + b"x"),
            "flags 0x4",
            id="flags",
        ),
        pytest.param(
            (
                protocol.BATCH,
                stream_frames.encode_batch_header(0, 1, stream_frames.NO_SLOT, stream_frames.FLAG_SLOT_AGAIN),
            ),
            "repeating its slot names a slot",
            id="again-without-slot",
        ),
        pytest.param(
            (
                protocol.BATCH,
                stream_frames.encode_batch_header(0, 1, 3, stream_frames.FLAG_SLOT_AGAIN) + b"x",
            ),
            "carries nothing after its header",
            id="again-with-message",
        ),
        pytest.param(
            (protocol.BATCH, stream_frames.encode_batch_header(0, 1, 3, stream_frames.FLAG_SLOT_AGAIN)),
            "repeats slot 3, which this subscription never received",
            id="again-unknown-slot",
        ),
        pytest.param(
            (
                protocol.BATCH,
                stream_frames.encode_batch_header(0, 1, 3, stream_frames.FLAG_SLOT_AGAIN),
                [_memfd],
            ),
            "repeating its slot carries descriptors",
            id="again-with-fd",
        ),
        pytest.param((protocol.BATCH, struct.pack("<QQII", 0, 1, 70000, 0) + b"x"), "slot 70000", id="slot"),
        pytest.param(
            (protocol.BATCH, stream_frames.encode_batch_header(0, 0) + b"x"), "lease id 0", id="lease-0"
        ),
        pytest.param(  # wider than a reaper token's value: its release would name another family
            (protocol.BATCH, stream_frames.encode_batch_header(0, 1 << 40) + b"x"),
            f"lease id {1 << 40} out of range",
            id="lease-too-wide",
        ),
        pytest.param((protocol.STREAM_END, b"{"), "not valid JSON", id="end-json"),
        pytest.param((protocol.STREAM_END, _end(None, dropped=-1)), "dropped", id="end-dropped"),
        pytest.param((protocol.STREAM_END, _end(7)), "type 7", id="end-type"),  # type: ignore[arg-type]
        pytest.param((protocol.STREAM_END, _end(None), [_memfd]), "descriptors", id="end-with-fd"),
        pytest.param((protocol.PONG, b""), "frame kind 10 on a subscription", id="unexpected-kind"),
        pytest.param((RAW, b"XXXX" + bytes(60)), "bad frame magic", id="not-a-frame"),
    ],
)
def test_malformed_stream_frames_are_protocol_errors(
    scripted: Callable[..., ScriptedStreamPublisher], pushed: tuple[object, ...], match: str
) -> None:
    kind, payload, *rest = pushed
    fds = [make() for make in rest[0]] if rest else []  # type: ignore[attr-defined]
    pub = scripted(pushed=[(kind, payload, fds)])
    with aib.subscribe(pub.path, "s", timeout=10) as live:
        with pytest.raises(aib.ProtocolError, match=match) as first:
            live.next_batch()
        for _ in range(2):  # its connection closed, and every later call raises the same error
            with pytest.raises(aib.ProtocolError, match=match) as again:
                live.next_batch()
            assert again.value.__cause__ is first.value
    with pytest.raises(aib.ClosedError):
        live.next_batch()  # closed by the caller: that is what it says then


def test_a_batch_whose_message_is_garbage_gives_its_lease_back(
    scripted: Callable[..., ScriptedStreamPublisher],
) -> None:
    bad = (protocol.BATCH, stream_frames.encode_batch_header(0, 1) + b"not a message", [_memfd()])
    pub = scripted(pushed=[bad, good_batch(1, 2), (protocol.STREAM_END, _end(None))])
    with aib.subscribe(pub.path, "s", timeout=10) as live:
        with pytest.raises(aib.ProtocolError, match="shorter than the header"):
            live.next_batch()
        assert pub.releases.get(timeout=5) == 1  # nothing was imported: the lease goes back now
        good = live.next_batch()  # the subscription goes on
        assert good is not None
        with good:
            assert pa.record_batch(good).column(0)[0].as_py() == 1
        assert live.next_batch() is None


def test_out_of_order_sequence_is_a_protocol_error(
    scripted: Callable[..., ScriptedStreamPublisher],
) -> None:
    pub = scripted(pushed=[good_batch(5, 1), good_batch(4, 2)])
    with aib.subscribe(pub.path, "s", timeout=10) as live:
        first = live.next_batch()
        assert first is not None
        first.release()
        with pytest.raises(aib.ProtocolError, match="out of order"):
            live.next_batch()
        with pytest.raises(aib.ProtocolError, match="out of order"):
            live.next_batch()  # raised again; the connection closed: the publisher ends every lease of it


def test_publisher_without_the_stream_feature(sock_dir: str) -> None:
    pub = ScriptedStreamPublisher(os.path.join(sock_dir, "old.sock"), (protocol.SUBSCRIBED, b"{}"), [])
    pub.welcome = pub.welcome.replace(b',"stream"', b"")
    try:
        with pytest.raises(aib.BridgeError, match="does not serve live streams"):
            aib.subscribe(pub.path, "s", timeout=10)
    finally:
        pub.close()
