"""Tests of the frame codec (transport.channel.Channel, the C core's channel.c) against a hostile
peer: a raw socket writing bad headers, truncated frames, descriptors that do not add up to the
header's count or that the kernel had to truncate. Every error must close what came with it.

The round trips, timeouts and closing are tests/test_channel.py's; the frame format is
docs/protocol.md's ("Frames").
"""

from __future__ import annotations

import os
import queue
import resource
import socket
import time

import pytest
from helpers.socket_helpers import (
    assert_hung_up,
    header,
    memfd_with,
    no_fd_leak,
    read_fd,
    run_thread,
    send_raw,
)

from arrow_ipc_bridge.errors import PeerClosedError, ProtocolError
from arrow_ipc_bridge.transport.channel import MAX_FDS, Channel, Frame

# -- hostile peers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw_header", "field"),
    [
        (header(magic=b"XXXX"), "magic"),
        (header(magic=b"\0\0\0\0"), "magic"),
        (header(version=2), "version"),
        (header(version=0), "version"),
        (header(reserved=1), "reserved"),
        (header(length=1024 * 1024 + 1), "length"),
        (header(length=0xFFFFFFFF), "length"),
        (header(nfds=MAX_FDS + 1), "fds"),
        (header(nfds=0xFFFF), "fds"),
    ],
)
@pytest.mark.parametrize("with_fds", [False, True])
def test_bad_header_rejected(
    hostile: tuple[Channel, socket.socket], raw_header: bytes, field: str, with_fds: bool
) -> None:
    """A bad header raises ProtocolError naming the field, before any payload is allocated; descriptors
    that came with it are closed and the connection is closed (the stream is out of sync)."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mine = [memfd_with(b"a"), memfd_with(b"b")] if with_fds else []
        send_raw(peer, raw_header + b"payload bytes", mine)
        for fd in mine:
            os.close(fd)
        with pytest.raises(ProtocolError) as info:
            conn.recv(timeout=5)
        assert getattr(info.value, "field", None) == field
        assert conn.closed
    with pytest.raises(PeerClosedError):
        conn.recv(timeout=1)
    assert_hung_up(peer)


@pytest.mark.parametrize("cut", [1, 8, 15])
def test_truncated_header_then_eof(hostile: tuple[Channel, socket.socket], cut: int) -> None:
    """EOF in the middle of a header raises ProtocolError and closes descriptors that came with it."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mem = memfd_with(b"x")
        send_raw(peer, header(nfds=1)[:cut], [mem])
        os.close(mem)
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError, match="middle of a frame"):
            conn.recv(timeout=5)
    assert conn.closed


@pytest.mark.parametrize("length", [100, 500_000])
def test_truncated_payload_then_eof(hostile: tuple[Channel, socket.socket], length: int) -> None:
    """EOF before the announced payload is complete raises ProtocolError; its descriptor is closed."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mem = memfd_with(b"x")
        send_raw(peer, header(length=length, nfds=1) + b"only this much", [mem])
        os.close(mem)
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError):
            conn.recv(timeout=5)
    assert conn.closed


def test_eof_at_frame_boundary_is_peer_closed(hostile: tuple[Channel, socket.socket]) -> None:
    """EOF between frames is a clean close: PeerClosedError, also on every later recv."""
    conn, peer = hostile
    send_raw(peer, header(length=3) + b"abc")
    peer.close()
    assert conn.recv(timeout=5).payload == b"abc"
    with pytest.raises(PeerClosedError):
        conn.recv(timeout=5)
    with pytest.raises(PeerClosedError):
        conn.recv(timeout=5)


def test_more_fds_than_announced(hostile: tuple[Channel, socket.socket]) -> None:
    """Two descriptors attached to a header announcing one: ProtocolError, both closed."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mine = [memfd_with(b"a"), memfd_with(b"b")]
        send_raw(peer, header(length=2, nfds=1) + b"hi", mine)
        for fd in mine:
            os.close(fd)
        with pytest.raises(ProtocolError, match="announced"):
            conn.recv(timeout=5)
    assert conn.closed


def test_fds_without_announcement_in_payload(hostile: tuple[Channel, socket.socket]) -> None:
    """Descriptors smuggled in with the payload bytes of a frame that announced none: ProtocolError,
    closed."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mem = memfd_with(b"a")
        send_raw(peer, header(length=10))
        send_raw(peer, b"0123456789", [mem])
        os.close(mem)
        with pytest.raises(ProtocolError, match="announced"):
            conn.recv(timeout=5)
    assert conn.closed


@pytest.mark.parametrize("late", [False, True])
def test_fds_smuggled_into_large_frame(hostile: tuple[Channel, socket.socket], late: bool) -> None:
    """Descriptors attached to the payload of a frame too large for the receive buffer that announced
    none: ProtocolError, closed, whether they come with its first bytes or after the receiver switched to
    the frame's own buffer."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mem = memfd_with(b"a")
        send_raw(peer, header(length=200_000) + bytes(100))
        if not late:
            send_raw(peer, bytes(100), [mem])
        reader, errors = run_thread(lambda: conn.recv(timeout=5))
        if late:
            time.sleep(0.05)  # the receiver is now reading into the frame's own buffer
            send_raw(peer, bytes(100_000), [mem])
        os.close(mem)
        reader.join(5)
        assert len(errors) == 1
        assert isinstance(errors[0], ProtocolError)
        assert "announced 0" in str(errors[0])


def test_descriptor_flood_before_frame_completes(hostile: tuple[Channel, socket.socket]) -> None:
    """A peer piling up descriptors on the bytes of an incomplete frame is cut off once more are pending
    than any legal stream could have (2 * MAX_FDS); all of them are closed."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mine = [memfd_with(b"x") for _ in range(MAX_FDS)]
        send_raw(peer, header(length=60_000))
        for _ in range(3):
            send_raw(peer, b"z", mine)
        for fd in mine:
            os.close(fd)
        with pytest.raises(ProtocolError, match="more than a frame may carry"):
            conn.recv(timeout=5)


def test_fewer_fds_than_announced(hostile: tuple[Channel, socket.socket]) -> None:
    """A header announcing three descriptors that arrives with one: ProtocolError, the one is closed."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mem = memfd_with(b"a")
        send_raw(peer, header(length=1, nfds=3) + b"z", [mem])
        os.close(mem)
        with pytest.raises(ProtocolError, match="announced 3"):
            conn.recv(timeout=5)
    assert conn.closed


def test_valid_frame_with_fds_then_garbage(hostile: tuple[Channel, socket.socket]) -> None:
    """A good frame with descriptors is delivered; the garbage after it then raises ProtocolError."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mem = memfd_with(b"good")
        send_raw(peer, header(kind=4, length=2, nfds=1) + b"ok", [mem])
        send_raw(peer, b"garbage garbage garbage", [mem])
        os.close(mem)
        with conn.recv(timeout=5) as frame:
            assert (frame.kind, frame.payload) == (4, b"ok")
            assert read_fd(frame.fds[0], 4) == b"good"
        with pytest.raises(ProtocolError, match="magic"):
            conn.recv(timeout=5)
    assert conn.closed


def test_header_split_into_single_bytes(hostile: tuple[Channel, socket.socket]) -> None:
    """A frame trickling in one byte per send is reassembled (partial reads are normal)."""
    conn, peer = hostile
    data = header(kind=2, length=5, nfds=1) + b"hello"
    with no_fd_leak():
        mem = memfd_with(b"m")
        result: queue.Queue[Frame] = queue.Queue()
        reader, errors = run_thread(lambda: result.put(conn.recv(timeout=5)))
        for i, byte in enumerate(data):
            send_raw(peer, bytes([byte]), [mem] if i == 0 else None)
            time.sleep(0.001)
        os.close(mem)
        reader.join(5)
        assert not errors
        with result.get_nowait() as frame:
            assert (frame.kind, frame.payload, len(frame.fds)) == (2, b"hello", 1)


def test_descriptors_truncated_by_kernel(hostile: tuple[Channel, socket.socket]) -> None:
    """When the receiver is out of descriptor slots the kernel truncates SCM_RIGHTS (MSG_CTRUNC): recv
    raises ProtocolError and closes the descriptors that did get through."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mine = [memfd_with(b"x") for _ in range(20)]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        used = {int(name) for name in os.listdir("/proc/self/fd")}
        # Leave room for 3 of the 20 only: new descriptors take the lowest free numbers, which must stay
        # below the soft limit.
        free = [fd for fd in range(max(used) + 10) if fd not in used]
        limit = free[3]
        send_raw(peer, header(nfds=20), mine)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            with pytest.raises(ProtocolError, match="truncated"):
                conn.recv(timeout=5)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in mine:
            os.close(fd)
    assert conn.closed
