"""The session checks every reply of the publisher: nothing from another process is trusted.

A scripted publisher (on ``transport.Server``) answers HELLO, LIST, PING and GET with the frames each
test gives it: of the wrong kind, malformed, or an ERROR. The session must raise a clear exception
of the package's hierarchy, give back any lease the reply carried, and leave no descriptor open.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers.wire_craft import encode_item

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge._ffi import WIRE_VERSION
from arrow_ipc_bridge.transport import protocol

Reply = tuple[int, bytes] | tuple[int, bytes, list[int]]


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return predicate()
        time.sleep(0.02)
    return True


def welcome_payload(**changes: object) -> bytes:
    info: dict[str, object] = {
        "protocol": protocol.PROTOCOL_VERSION,
        "wire": list(WIRE_VERSION),
        "publisher_id": "scripted",
        "pid": os.getpid(),
        "features": ["ping"],
    }
    info.update(changes)
    return protocol.encode_json(info)


class ScriptedPublisher:
    """Answers HELLO with ``welcome`` and every other request with the next of ``replies`` (sending
    their descriptors, then closing its own copies); records the lease ids of RELEASE frames."""

    def __init__(
        self, path: str, *, welcome: Reply | None = None, replies: list[Reply] | None = None
    ) -> None:
        self.welcome: Reply = welcome or (protocol.WELCOME, welcome_payload())
        self.replies = list(replies or [])
        self.releases: queue.Queue[int] = queue.Queue()
        self.server = transport.Server(path, self._handle, name="aib-scripted")
        self.path = self.server.path

    def _send(self, conn: transport.Connection, reply: Reply) -> None:
        kind, payload, *rest = reply
        fds = rest[0] if rest else []
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
                self._send(conn, self.welcome)
            elif frame.kind == protocol.RELEASE:
                self.releases.put(protocol.decode_lease(frame.payload))
            elif self.replies:
                self._send(conn, self.replies.pop(0))

    def close(self) -> None:
        self.server.close()
        for reply in self.replies:  # descriptors of replies never sent
            for fd in reply[2] if len(reply) == 3 else []:
                os.close(fd)


@pytest.fixture(scope="module", autouse=True)
def warm_scripted_sessions() -> None:
    """Open once what the library keeps open for the life of the process (the reaper's pipe, its
    thread), so that the descriptor counts below see only what a test leaves."""
    aib.export(pa.table({"a": [1]})).close()  # the host placement's /proc/self files
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-replies-")
    try:
        publisher = ScriptedPublisher(os.path.join(directory, "warm.sock"))
        with aib.connect(publisher.path, timeout=5.0):
            pass
        publisher.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def scripted(sock_dir: str) -> Iterator[Callable[..., ScriptedPublisher]]:
    """Makes scripted publishers; after the test, checks that no descriptor of ours is left open."""
    made: list[ScriptedPublisher] = []
    base = fd_count()

    def make(**kwargs: object) -> ScriptedPublisher:
        publisher = ScriptedPublisher(os.path.join(sock_dir, f"p{len(made)}.sock"), **kwargs)  # type: ignore[arg-type]
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close()
    assert wait_for(lambda: fd_count() == base), f"descriptors left open: {fd_count()} vs {base}"


def a_file() -> int:
    fd = os.memfd_create("aib-reply", os.MFD_CLOEXEC)
    os.write(fd, b"x" * 4096)
    return fd


# --- WELCOME ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("welcome", "error", "match"),
    [
        pytest.param(
            (protocol.ERROR, protocol.encode_json({"type": "ProtocolError", "message": "go away"})),
            aib.ProtocolError,
            "publisher: go away",
            id="error-reply",
        ),
        pytest.param(
            (protocol.ERROR, protocol.encode_json({"type": "NotPublishedError", "message": "odd"})),
            aib.NotPublishedError,
            "publisher: odd",
            id="error-reply-keeps-its-type",
        ),
        pytest.param(
            (protocol.PONG, b""), aib.ProtocolError, "expected WELCOME, got frame kind 10", id="pong"
        ),
        pytest.param(
            (protocol.WELCOME, welcome_payload(wire=[WIRE_VERSION[0]])),
            aib.ProtocolError,
            "major versions must match",
            id="wire-of-one-number",
        ),
        pytest.param(
            (protocol.WELCOME, welcome_payload(wire=[WIRE_VERSION[0] + 1, WIRE_VERSION[1]])),
            aib.ProtocolError,
            "major versions must match",
            id="next-wire-major",
        ),
        pytest.param(
            (protocol.WELCOME, welcome_payload(wire="1.0")),
            aib.ProtocolError,
            "major versions must match",
            id="wire-as-text",
        ),
        pytest.param((protocol.WELCOME, b'"hello"'), aib.ProtocolError, "not an object", id="json-string"),
    ],
)
def test_bad_welcome_fails_connect_cleanly(
    scripted: Callable[..., ScriptedPublisher], welcome: Reply, error: type[Exception], match: str
) -> None:
    """connect raises the precise error for an ERROR, a frame of another kind, or a WELCOME of another
    wire major version, and closes its connection (the fixture checks no descriptor is left)."""
    with pytest.raises(error, match=match):
        aib.connect(scripted(welcome=welcome).path, timeout=5.0)


def test_welcome_descriptors_are_closed(scripted: Callable[..., ScriptedPublisher]) -> None:
    """Descriptors riding on a WELCOME are closed (the session never uses them)."""
    publisher = scripted(welcome=(protocol.WELCOME, welcome_payload(), [a_file(), a_file()]))
    with aib.connect(publisher.path, timeout=5.0) as session:
        assert session.publisher_info["publisher_id"] == "scripted"


def test_newer_minor_wire_version_is_accepted(scripted: Callable[..., ScriptedPublisher]) -> None:
    """Only the major version must match: a publisher of a later minor version is welcome."""
    publisher = scripted(
        welcome=(protocol.WELCOME, welcome_payload(wire=[WIRE_VERSION[0], WIRE_VERSION[1] + 7]))
    )
    with aib.connect(publisher.path, timeout=5.0) as session:
        assert session.publisher_info["wire"] == [WIRE_VERSION[0], WIRE_VERSION[1] + 7]


# --- LIST and PING ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "error", "match"),
    [
        pytest.param((protocol.PONG, b""), aib.ProtocolError, "expected NAMES", id="wrong-kind"),
        pytest.param((protocol.NAMES, b"{}"), aib.ProtocolError, "not a list of strings", id="object"),
        pytest.param((protocol.NAMES, b'["a", 1]'), aib.ProtocolError, "not a list of strings", id="number"),
        pytest.param((protocol.NAMES, b"[oops"), aib.ProtocolError, "not valid JSON", id="bad-json"),
        pytest.param(
            (protocol.ERROR, protocol.encode_json({"type": "BridgeError", "message": "busy"})),
            aib.BridgeError,
            "publisher: busy",
            id="error",
        ),
        pytest.param(
            (protocol.ERROR, b"[]"), aib.ProtocolError, "not {type, message}", id="error-not-object"
        ),
    ],
)
def test_bad_names_reply_raises(
    scripted: Callable[..., ScriptedPublisher], reply: Reply, error: type[Exception], match: str
) -> None:
    """list() checks the reply's kind and shape; an ERROR reply raises the publisher's error."""
    publisher = scripted(replies=[reply])
    with aib.connect(publisher.path, timeout=5.0) as session, pytest.raises(error, match=match):
        session.list()


def test_names_reply_descriptors_are_closed(scripted: Callable[..., ScriptedPublisher]) -> None:
    """A NAMES (or ERROR) reply carrying descriptors is answered; its descriptors are closed."""
    publisher = scripted(
        replies=[
            (protocol.NAMES, protocol.encode_json(["a", "b"]), [a_file()]),
            (protocol.ERROR, protocol.encode_json({"type": "BridgeError", "message": "x"}), [a_file()]),
        ]
    )
    with aib.connect(publisher.path, timeout=5.0) as session:
        assert session.list() == ["a", "b"]
        with pytest.raises(aib.BridgeError, match="publisher: x"):
            session.list()


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param((protocol.PONG, b"other"), id="other-payload"),
        pytest.param((protocol.NAMES, b"ping"), id="wrong-kind"),
    ],
)
def test_bad_pong_raises(scripted: Callable[..., ScriptedPublisher], reply: Reply) -> None:
    """A PONG must echo the PING's payload exactly."""
    publisher = scripted(replies=[reply])
    with (
        aib.connect(publisher.path, timeout=5.0) as session,
        pytest.raises(aib.ProtocolError, match="expected PONG with the PING's payload"),
    ):
        session.ping(b"ping")


# --- GET --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "reply",
    [
        pytest.param((protocol.NAMES, encode_item(3, b"x" * 40), [a_file]), id="names"),
        pytest.param((protocol.PONG, b""), id="pong"),
    ],
)
def test_get_answered_with_another_kind_raises(
    scripted: Callable[..., ScriptedPublisher], reply: tuple[int, bytes] | tuple[int, bytes, list[Any]]
) -> None:
    """A GET answered with a frame that is not ITEM (even one whose payload would pass for an ITEM's)
    is a ProtocolError; its descriptors are closed and no lease is assumed."""
    if len(reply) == 3:
        reply = (reply[0], reply[1], [make() for make in reply[2]])
    publisher = scripted(replies=[reply])
    with aib.connect(publisher.path, timeout=5.0) as session:
        with pytest.raises(aib.ProtocolError, match=f"expected ITEM, got frame kind {reply[0]}"):
            session.get("t")
        assert publisher.releases.empty()


def test_item_shorter_than_its_lease_id_raises(scripted: Callable[..., ScriptedPublisher]) -> None:
    """An ITEM without its 8-byte lease id is a ProtocolError; its descriptor is closed."""
    publisher = scripted(replies=[(protocol.ITEM, b"\x01\x02\x03", [a_file()])])
    with (
        aib.connect(publisher.path, timeout=5.0) as session,
        pytest.raises(aib.ProtocolError, match="shorter than its lease id"),
    ):
        session.get("t")


@pytest.mark.parametrize("n_fds", [0, 2], ids=["no-fds", "two-fds"])
def test_item_with_a_garbage_message_gives_its_lease_back(
    scripted: Callable[..., ScriptedPublisher], n_fds: int
) -> None:
    """An ITEM whose message does not decode raises ProtocolError; the lease it carried is given back
    at once (a RELEASE with its id) and the descriptors that came with it are closed."""
    fds = [a_file() for _ in range(n_fds)]
    publisher = scripted(replies=[(protocol.ITEM, encode_item(41, b"not a message"), fds)])
    with aib.connect(publisher.path, timeout=5.0) as session:
        with pytest.raises(aib.ProtocolError):
            session.get("t")
        assert publisher.releases.get(timeout=5.0) == 41
        assert not session.closed  # a bad message is not a broken connection


def test_item_of_an_unknown_device_type_gives_its_lease_back(
    scripted: Callable[..., ScriptedPublisher],
) -> None:
    """A well-formed message for a device this build cannot import raises RegionError and ends the
    lease."""
    exported = aib.export(pa.table({"a": [1, 2, 3]}))
    try:
        message = exported.message
        fds = [os.dup(fd) for fd in exported.fds]
    finally:
        exported.close()
    patched = _with_device_type(message, 7)
    publisher = scripted(replies=[(protocol.ITEM, encode_item(9, patched), fds)])
    with aib.connect(publisher.path, timeout=5.0) as session:
        with pytest.raises(aib.UnsupportedFormatError, match="device type 7"):
            session.get("t")
        assert publisher.releases.get(timeout=5.0) == 9


def _with_device_type(message: bytes, device_type: int) -> bytes:
    """``message`` with its device type changed (the byte that encodes the CPU device, found by
    decoding each candidate: the wire format's varint for 1 is the byte 0x01)."""
    from arrow_ipc_bridge.wire.metadata import Decoded

    for i in range(len(message)):
        if message[i] != 1:
            continue
        candidate = message[:i] + bytes([device_type]) + message[i + 1 :]
        try:
            decoded = Decoded(candidate, 1)
        except aib.BridgeError:
            continue
        try:
            if decoded.device().device_type == device_type:
                return candidate
        finally:
            decoded.close()
    raise AssertionError("no device-type byte found in the message")
