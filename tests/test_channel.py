"""Tests of the frame codec, transport.channel.Channel (the C core's channel.c), over socketpairs:
round trips, descriptor passing, timeouts and closing, many frames queued. Hostile peers are
tests/test_channel_hostile.py's.

Every test that receives descriptors also checks that no descriptor leaks (the entries of /proc/self/fd
before and after). The frame format is docs/protocol.md's ("Frames").
"""

from __future__ import annotations

import array
import fcntl
import functools
import gc
import multiprocessing
import os
import queue
import random
import socket
import struct
import threading
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

from arrow_ipc_bridge._ffi import ffi, lib, new_error
from arrow_ipc_bridge.errors import (
    BridgeTimeoutError,
    PeerClosedError,
    ProtocolError,
)
from arrow_ipc_bridge.transport import Connection
from arrow_ipc_bridge.transport.channel import MAX_FDS, MAX_PAYLOAD, Channel, Frame


def fill_send_buffer(channel: Channel) -> int:
    """Send empty frames with timeout=0 until the socket buffer is full; return how many went out."""
    count = 0
    while True:
        try:
            channel.send(1, timeout=0)
        except BridgeTimeoutError:
            return count
        count += 1


# -- round trips -----------------------------------------------------------------------------------------


def test_round_trip_without_fds(channels: tuple[Channel, Channel]) -> None:
    """Kind and payload arrive unchanged, with an empty descriptor list; both directions work."""
    a, b = channels
    a.send(7, b"hello")
    frame = b.recv(timeout=5)
    assert frame == Frame(7, b"hello", [])
    assert isinstance(frame.payload, bytes)
    b.send(65535, b"back")
    assert a.recv(timeout=5) == Frame(65535, b"back", [])


def test_round_trip_empty_payload(channels: tuple[Channel, Channel]) -> None:
    """A frame with no payload (the default) arrives as b""; kind 0 is valid."""
    a, b = channels
    a.send(0)
    a.send(3, b"")
    assert b.recv(timeout=5) == Frame(0, b"", [])
    assert b.recv(timeout=5) == Frame(3, b"", [])


def test_round_trip_buffer_payloads(channels: tuple[Channel, Channel]) -> None:
    """bytearray and memoryview payloads (also of multi-byte items) are sent as their raw bytes."""
    a, b = channels
    doubles = array.array("d", [1.5, -2.25, 3.0])
    a.send(1, bytearray(b"abc"))
    a.send(2, memoryview(doubles))
    a.send(3, memoryview(b"0123456789")[2:5])
    assert b.recv(timeout=5).payload == b"abc"
    assert b.recv(timeout=5).payload == doubles.tobytes()
    assert b.recv(timeout=5).payload == b"234"


def test_round_trip_one_fd(channels: tuple[Channel, Channel]) -> None:
    """A passed descriptor is a new, close-on-exec descriptor for the same file: data written through it
    is seen through the sender's descriptor and vice versa."""
    a, b = channels
    with no_fd_leak():
        mem = memfd_with(b"shared memory")
        r, w = os.pipe()
        try:
            a.send(5, b"meta", [mem, w])
            with b.recv(timeout=5) as frame:
                assert frame.kind == 5
                assert frame.payload == b"meta"
                assert len(frame.fds) == 2
                got_mem, got_w = frame.fds
                assert got_mem not in (mem, w)
                assert fcntl.fcntl(got_mem, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
                assert fcntl.fcntl(got_w, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
                assert read_fd(got_mem, 100) == b"shared memory"
                os.pwrite(got_mem, b"SHARED", 0)
                assert read_fd(mem, 100) == b"SHARED memory"
                os.write(got_w, b"through the pipe")
                assert os.read(r, 100) == b"through the pipe"
            assert frame.fds == []
        finally:
            for fd in (mem, r, w):
                os.close(fd)


def test_round_trip_max_fds(channels: tuple[Channel, Channel]) -> None:
    """MAX_FDS descriptors in one frame arrive complete and in the order they were sent."""
    a, b = channels
    with no_fd_leak():
        mine = [memfd_with(f"file {i}".encode()) for i in range(MAX_FDS)]
        try:
            a.send(9, b"many", mine)
            with b.recv(timeout=5) as frame:
                assert len(frame.fds) == MAX_FDS
                for i, fd in enumerate(frame.fds):
                    assert read_fd(fd, 100) == f"file {i}".encode()
        finally:
            for fd in mine:
                os.close(fd)


@pytest.mark.parametrize("size", [1, 64, 65536 - 16, 65536 - 15, 200_000, 5 * 1024 * 1024 + 7])
def test_round_trip_payload_sizes(channels: tuple[Channel, Channel], size: int) -> None:
    """Payloads from one byte to several MiB (more than a socket buffer, so sent and received in pieces)
    arrive intact, with the descriptor that came with them."""
    a, b = channels
    payload = os.urandom(size)
    with no_fd_leak():
        mem = memfd_with(b"x")
        try:
            sender, errors = run_thread(lambda: a.send(1, payload, [mem]))
            with b.recv(timeout=10) as frame:
                assert frame.payload == payload
                assert read_fd(frame.fds[0], 1) == b"x"
            sender.join(10)
            assert not errors
        finally:
            os.close(mem)


def test_fds_stay_with_their_frames(channels: tuple[Channel, Channel]) -> None:
    """Frames of mixed sizes, some with descriptors and some without, queued back to back: every frame
    gets exactly its own descriptors, however the receiver's reads happen to cut the stream."""
    a, b = channels
    rng = random.Random(1234)
    plan = [(rng.choice([0, 1, 17, 5000, 40_000, 70_000]), rng.choice([0, 0, 1, 3])) for _ in range(300)]

    def produce() -> None:
        for i, (size, nfds) in enumerate(plan):
            mine = [memfd_with(f"{i}/{j}".encode()) for j in range(nfds)]
            a.send(i % 65536, bytes([i % 251]) * size, mine)
            for fd in mine:
                os.close(fd)

    with no_fd_leak():
        sender, errors = run_thread(produce)
        time.sleep(0.05)  # let frames pile up, so that reads span several of them
        for i, (size, nfds) in enumerate(plan):
            with b.recv(timeout=10) as frame:
                assert frame.kind == i
                assert frame.payload == bytes([i % 251]) * size
                assert [read_fd(fd, 20) for fd in frame.fds] == [f"{i}/{j}".encode() for j in range(nfds)]
        sender.join(10)
        assert not errors


def test_small_receive_buffer_frames_straddling_its_end() -> None:
    """With a small max_payload the receive buffer is small too: frames and headers that straddle its end
    are moved to the front and completed, in order, descriptors included."""
    a, b = socket.socketpair()
    with Connection(a, max_payload=100) as ca, Connection(b, max_payload=100) as cb, no_fd_leak():
        sender, receiver = ca.channel, cb.channel
        mem = memfd_with(b"m")
        plan = [(i % 4) * 33 for i in range(40)]
        for i, size in enumerate(plan):
            sender.send(i, bytes([i]) * size, [mem] if i % 5 == 0 else [])
        os.close(mem)
        for i, size in enumerate(plan):
            with receiver.recv(timeout=5) as frame:
                assert (frame.kind, frame.payload) == (i, bytes([i]) * size)
                assert len(frame.fds) == (1 if i % 5 == 0 else 0)


def test_send_waits_for_room_then_passes_fds(channels: tuple[Channel, Channel]) -> None:
    """A timed send that finds the socket buffer full waits for room and then sends the frame with its
    descriptors."""
    a, b = channels
    with no_fd_leak():
        frames = fill_send_buffer(a)
        mem = memfd_with(b"after the wait")
        sender, errors = run_thread(lambda: a.send(2, b"late", [mem], timeout=5))
        time.sleep(0.1)
        for _ in range(frames):
            assert b.recv(timeout=5).kind == 1
        with b.recv(timeout=5) as frame:
            assert (frame.kind, frame.payload) == (2, b"late")
            assert read_fd(frame.fds[0], 100) == b"after the wait"
        sender.join(5)
        assert not errors
        os.close(mem)


def test_lock_waits_honour_the_timeout(channels: tuple[Channel, Channel]) -> None:
    """recv/send with a timeout give up in time while another thread holds the connection's receive or
    send side, without disturbing that thread's call."""
    a, b = channels
    received: queue.Queue[Frame] = queue.Queue()
    reader, reader_errors = run_thread(lambda: received.put(a.recv(timeout=10)))
    big = bytes(8 * 1024 * 1024)
    writer, writer_errors = run_thread(lambda: a.send(1, big, timeout=10))
    time.sleep(0.1)  # the reader is blocked in recv, the writer in send (b reads nothing yet)
    start = time.monotonic()
    with pytest.raises(BridgeTimeoutError, match="another receiver"):
        a.recv(timeout=0.1)
    with pytest.raises(BridgeTimeoutError, match="another sender"):
        a.send(2, b"x", timeout=0.1)
    assert time.monotonic() - start < 1.0
    assert not a.closed
    assert b.recv(timeout=10).payload == big
    b.send(3, b"for the reader")
    assert received.get(timeout=5).payload == b"for the reader"
    for thread, errors in ((reader, reader_errors), (writer, writer_errors)):
        thread.join(5)
        assert not errors


def test_payload_at_limit_accepted_and_over_limit_refused() -> None:
    """A payload of exactly max_payload bytes goes through; one byte more is refused by send() before
    anything is written, and the connection stays usable."""
    a, b = socket.socketpair()
    with Connection(a, max_payload=1000) as conn_a, Connection(b, max_payload=1000) as conn_b:
        ca, cb = conn_a.channel, conn_b.channel
        ca.send(1, bytes(1000))
        assert len(cb.recv(timeout=5).payload) == 1000
        with pytest.raises(ProtocolError):
            ca.send(1, bytes(1001))
        ca.send(2, b"still fine")
        assert cb.recv(timeout=5) == Frame(2, b"still fine", [])
    assert MAX_PAYLOAD == 64 * 1024 * 1024


def test_many_frames_in_a_row(channels: tuple[Channel, Channel]) -> None:
    """Thousands of frames sent back to back (more than the socket buffer holds) arrive in order."""
    a, b = channels
    count = 3000

    def produce() -> None:
        for i in range(count):
            a.send(i % 65536, struct.pack("<I", i) * (i % 7))

    sender, errors = run_thread(produce)
    for i in range(count):
        frame = b.recv(timeout=10)
        assert frame.kind == i % 65536
        assert frame.payload == struct.pack("<I", i) * (i % 7)
    sender.join(10)
    assert not errors


def test_concurrent_senders_never_interleave(channels: tuple[Channel, Channel]) -> None:
    """Several threads sending on one connection at once: every frame arrives whole (its payload is one
    sender's pattern throughout) and each sender's frames arrive in the order it sent them."""
    a, b = channels
    threads, per_thread = 4, 60
    sizes = [10, 70_000, 300_000, 1, 150_000]

    def produce(tid: int) -> None:
        for seq in range(per_thread):
            size = sizes[(seq + tid) % len(sizes)]
            a.send(tid, struct.pack("<II", tid, seq) + bytes([tid]) * size)

    started = [run_thread(functools.partial(produce, tid)) for tid in range(threads)]
    next_seq = [0] * threads
    for _ in range(threads * per_thread):
        frame = b.recv(timeout=20)
        tid, seq = struct.unpack_from("<II", frame.payload)
        assert frame.kind == tid
        assert seq == next_seq[tid]
        next_seq[tid] += 1
        body = frame.payload[8:]
        assert len(body) == sizes[(seq + tid) % len(sizes)]
        assert body == bytes([tid]) * len(body)
    for thread, errors in started:
        thread.join(10)
        assert not errors
    assert next_seq == [per_thread] * threads


def test_reader_and_writer_threads_share_a_connection(channels: tuple[Channel, Channel]) -> None:
    """One thread blocked in recv() does not stop another thread from sending on the same connection."""
    a, b = channels
    received: queue.Queue[Frame] = queue.Queue()
    reader, errors = run_thread(lambda: received.put(a.recv(timeout=5)))
    time.sleep(0.05)  # the reader is now blocked holding the receive lock
    a.send(1, b"ping")
    assert b.recv(timeout=5).payload == b"ping"
    b.send(2, b"pong")
    assert received.get(timeout=5).payload == b"pong"
    reader.join(5)
    assert not errors


def test_frame_close_fds_idempotent() -> None:
    """Frame.close_fds closes every descriptor once; a second call does nothing."""
    with no_fd_leak():
        r, w = os.pipe()
        frame = Frame(1, b"", [r, w])
        frame.close_fds()
        assert frame.fds == []
        frame.close_fds()
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(r)


@pytest.mark.parametrize(
    ("kind", "fds"),
    [(-1, ()), (65536, ()), (True, ()), ("1", ()), (1, [-1]), (1, ["x"]), (1, list(range(MAX_FDS + 1)))],
)
def test_send_rejects_invalid_frames(channels: tuple[Channel, Channel], kind: object, fds: object) -> None:
    """An invalid kind or descriptor list raises ProtocolError (a ValueError) and sends nothing; the
    connection stays usable."""
    a, b = channels
    with pytest.raises(ProtocolError) as info:
        a.send(kind, b"x", fds)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    a.send(1, b"ok")
    assert b.recv(timeout=5) == Frame(1, b"ok", [])


def test_send_closed_descriptor(channels: tuple[Channel, Channel]) -> None:
    """Passing a descriptor that is not open raises ProtocolError; nothing was sent, so the connection
    is still in sync."""
    a, b = channels
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(ProtocolError, match="not open"):
        a.send(1, b"x", [r])
    a.send(1, b"ok")
    assert b.recv(timeout=5) == Frame(1, b"ok", [])


def test_kind_accepts_int_subclasses(channels: tuple[Channel, Channel]) -> None:
    """An IntEnum member works as a frame kind."""
    import enum

    class Kind(enum.IntEnum):
        HELLO = 12

    a, b = channels
    a.send(Kind.HELLO, b"")
    assert b.recv(timeout=5).kind == 12


# -- timeouts and closing --------------------------------------------------------------------------------


def test_recv_timeout_on_silent_peer(channels: tuple[Channel, Channel]) -> None:
    """recv(timeout=t) on a peer that sends nothing raises BridgeTimeoutError (a TimeoutError) after about
    t seconds; the connection stays usable."""
    a, b = channels
    start = time.monotonic()
    with pytest.raises(BridgeTimeoutError) as info:
        b.recv(timeout=0.2)
    elapsed = time.monotonic() - start
    assert 0.19 <= elapsed < 1.0
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(BridgeTimeoutError):
        b.recv(timeout=0)
    assert not b.closed
    a.send(1, b"late")
    assert b.recv(timeout=5).payload == b"late"


def test_recv_timeout_is_for_the_whole_frame(hostile: tuple[Channel, socket.socket]) -> None:
    """A peer that trickles a frame more slowly than the timeout cannot keep recv waiting past it."""
    conn, peer = hostile
    stop = threading.Event()

    def trickle() -> None:
        data = header(length=1000) + bytes(1000)
        for byte in data:
            if stop.wait(0.02):
                return
            send_raw(peer, bytes([byte]))

    thread, _ = run_thread(trickle)
    start = time.monotonic()
    with pytest.raises(BridgeTimeoutError):
        conn.recv(timeout=0.3)
    assert time.monotonic() - start < 0.8
    stop.set()
    thread.join(5)


def test_timeout_mid_frame_closes_connection_and_fds(hostile: tuple[Channel, socket.socket]) -> None:
    """A frame partly in when recv times out (descriptor included): BridgeTimeoutError, and the
    connection is closed with the descriptor (the stream position is lost); the peer sees it end."""
    conn, peer = hostile
    data = header(kind=3, length=6, nfds=1) + b"abcdef"
    with no_fd_leak(closes=1):
        mem = memfd_with(b"partial")
        send_raw(peer, data[:10], [mem])
        os.close(mem)
        with pytest.raises(BridgeTimeoutError):
            conn.recv(timeout=0.05)
        assert conn.closed
    with pytest.raises(PeerClosedError, match="closed"):
        conn.recv(timeout=1)
    assert_hung_up(peer)


@pytest.mark.parametrize("with_fd", [False, True])
def test_timeout_in_a_large_frame_closes_connection(
    hostile: tuple[Channel, socket.socket], with_fd: bool
) -> None:
    """A frame too large for the receive buffer that is partly in at the timeout: the connection is
    closed (its partial payload is gone), its descriptor too; without one, nothing else would tell
    that the stream is out of step."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mine = [memfd_with(b"big")] if with_fd else []
        send_raw(peer, header(length=300_000, nfds=len(mine)) + bytes(100_000), mine)
        for fd in mine:
            os.close(fd)
        with pytest.raises(BridgeTimeoutError):
            conn.recv(timeout=0.2)
        assert conn.closed


def test_close_closes_fds_of_partial_frame(hostile: tuple[Channel, socket.socket]) -> None:
    """Descriptors of a frame still incomplete when the connection is closed (from another thread,
    while a recv waits for the rest) are closed with it."""
    conn, peer = hostile
    with no_fd_leak(closes=1):
        mem = memfd_with(b"x")
        send_raw(peer, header(length=100, nfds=1)[:5], [mem])
        os.close(mem)
        reader, errors = run_thread(conn.recv)
        time.sleep(0.05)
        conn.close()
        reader.join(5)
        assert len(errors) == 1
        assert isinstance(errors[0], PeerClosedError)


def test_freed_channel_closes_fds_of_partial_frame() -> None:
    """The C channel freed with a frame half received closes that frame's descriptors (those still
    pending in aib_channel_free)."""
    a, b = socket.socketpair()
    with a, b, no_fd_leak():
        raw = lib.aib_channel_new(a.fileno(), 1024)
        frame = ffi.new("aib_frame *")
        err = new_error()
        mem = memfd_with(b"x")
        send_raw(b, header(length=100, nfds=1)[:5], [mem])
        os.close(mem)
        assert lib.aib_channel_recv(raw, 50, frame, err) == lib.AIB_E_TIMEOUT
        assert lib.aib_channel_mid_frame(raw) == 1
        lib.aib_channel_free(raw)


def test_send_timeout_when_nothing_fits_keeps_connection(hostile: tuple[Channel, socket.socket]) -> None:
    """send(timeout=0) into a full socket buffer raises BridgeTimeoutError without sending anything, so the
    connection stays open and every frame sent before is intact."""
    conn, peer = hostile
    sent = fill_send_buffer(conn)
    assert sent > 0
    assert not conn.closed
    peer_conn = Connection(peer).channel
    for _ in range(sent):
        assert peer_conn.recv(timeout=5) == Frame(1, b"", [])
    with pytest.raises(BridgeTimeoutError):
        peer_conn.recv(timeout=0)


def test_send_timeout_mid_frame_closes_connection(channels: tuple[Channel, Channel]) -> None:
    """A large send to a peer that does not read times out after about the timeout; half the frame is on
    the wire by then, so the connection is closed and the peer sees it end."""
    a, b = channels
    start = time.monotonic()
    with pytest.raises(BridgeTimeoutError):
        a.send(1, bytes(8 * 1024 * 1024), timeout=0.2)
    assert 0.19 <= time.monotonic() - start < 1.0
    assert a.closed
    with pytest.raises(ProtocolError, match="middle of a frame"):
        b.recv(timeout=5)


def test_close_from_another_thread_unblocks_recv(channels: tuple[Channel, Channel]) -> None:
    """close() from another thread wakes a recv() blocked without timeout: it raises PeerClosedError
    (closed_locally); the peer sees the connection end."""
    a, b = channels
    reader, errors = run_thread(a.recv)
    time.sleep(0.05)
    start = time.monotonic()
    a.close()
    reader.join(5)
    assert not reader.is_alive()
    assert time.monotonic() - start < 1.0
    assert len(errors) == 1
    assert isinstance(errors[0], PeerClosedError)
    assert errors[0].closed_locally is True  # type: ignore[attr-defined]
    assert a.closed
    assert a.fileno() == -1
    with pytest.raises(PeerClosedError):
        b.recv(timeout=5)


def test_close_from_another_thread_unblocks_send(channels: tuple[Channel, Channel]) -> None:
    """close() wakes a send() blocked on a peer that does not read; the send raises PeerClosedError."""
    a, _ = channels
    sender, errors = run_thread(lambda: a.send(1, bytes(8 * 1024 * 1024)))
    time.sleep(0.1)
    a.close()
    sender.join(5)
    assert not sender.is_alive()
    assert len(errors) == 1
    assert isinstance(errors[0], PeerClosedError)


def test_use_after_close(channels: tuple[Channel, Channel]) -> None:
    """close() is idempotent; send and recv on a closed connection raise PeerClosedError."""
    a, _ = channels
    a.close()
    a.close()
    assert a.closed
    with pytest.raises(PeerClosedError, match="closed"):
        a.send(1, b"x")
    with pytest.raises(PeerClosedError, match="closed"):
        a.recv(timeout=1)


def test_send_to_closed_peer_raises_without_sigpipe(channels: tuple[Channel, Channel]) -> None:
    """Sending to a peer that closed raises PeerClosedError (EPIPE); no SIGPIPE kills the process."""
    a, b = channels
    b.close()
    with pytest.raises(PeerClosedError):
        a.send(1, b"anyone there?")


def test_frame_sent_before_the_peer_left_is_still_received(hostile: tuple[Channel, socket.socket]) -> None:
    """A peer that sent a frame (a farewell ERROR) and closed: our send fails with PeerClosedError,
    which leaves the channel open, and the frame is still received; then PeerClosedError."""
    conn, peer = hostile
    send_raw(peer, header(kind=8, length=3) + b"bye")
    peer.close()
    with pytest.raises(PeerClosedError):
        conn.send(1, bytes(1000))  # EPIPE: the peer's end is closed
    assert not conn.closed
    assert conn.recv(timeout=5) == Frame(8, b"bye", [])
    with pytest.raises(PeerClosedError):
        conn.recv(timeout=5)


# -- descriptors and compaction, many frames queued -------------------------------------------------


def _frames_through_channel(frames: list[tuple[int, bytes, int]]) -> None:
    """Send ``frames`` (kind, payload, number of memfds), all before the receiver reads, and receive
    them: every frame comes out whole, with exactly
    its own descriptors (checked by inode), and nothing leaks."""
    sent_inodes: list[list[int]] = []
    with no_fd_leak():
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024 * 1024)
        sender, receiver = Connection(a), Connection(b)
        channel = receiver.channel

        def send_all() -> None:
            for kind, payload, n_fds in frames:
                fds = [os.memfd_create(f"f{len(sent_inodes)}-{i}", os.MFD_CLOEXEC) for i in range(n_fds)]
                sent_inodes.append([os.fstat(fd).st_ino for fd in fds])
                try:
                    sender.send(kind, payload, fds)
                finally:
                    for fd in fds:
                        os.close(fd)

        thread, errors = run_thread(send_all)
        thread.join(30)  # everything is in the socket before the first receive: reads then straddle frames
        assert not errors
        for index, (kind, payload, _n_fds) in enumerate(frames):
            frame = channel.recv(timeout=10)
            with frame:
                assert (frame.kind, len(frame.payload)) == (kind, len(payload)), index
                assert frame.payload == payload, index
                assert [os.fstat(fd).st_ino for fd in frame.fds] == sent_inodes[index], index
        sender.close()
        receiver.close()
        del channel
        gc.collect()


def test_channel_compaction_moves_pending_descriptors_with_their_bytes() -> None:
    """A large frame without descriptors, then a frame with descriptors that only partly fits in the
    64 KiB receive buffer: its descriptors arrive with the partial read and stay pending while the
    buffer is compacted to fit the frame; they must still be that frame's."""
    frames = []
    for i in range(6):
        frames.append((1, bytes([i]) * 50_000, 0))
        frames.append((2, bytes([100 + i]) * 20_000, 2))
    _frames_through_channel(frames)


def test_channel_many_frames_with_descriptors_and_varied_sizes() -> None:
    """Many frames of varied sizes (some over the buffer), a third with descriptors: compactions
    happen with descriptors pending at every offset; each frame keeps its own."""
    rng = random.Random(7)
    frames = []
    for i in range(300):
        size = rng.choice([0, 5, 100, 3000, 20_000, 40_000, 70_000])
        frames.append((3 + i % 5, rng.randbytes(size), rng.choice([0, 0, 1, 3])))
    _frames_through_channel(frames)


# -- speed ----------------------------------------------------------------------------------------------


def _child_echo(sock: socket.socket, mode: str) -> None:
    """Child process for the benchmark: echo frames (or raw bytes, with their descriptors) until the peer
    closes."""
    if mode.startswith("raw"):
        with sock:
            while True:
                data, ancdata, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(4))
                if not data:
                    return
                sock.sendmsg([data], ancdata)
                for _, _, cdata in ancdata:
                    os.close(int.from_bytes(cdata[:4], "little"))
    with Connection(sock) as conn:
        try:
            while True:
                with conn.channel.recv() as frame:
                    conn.channel.send(frame.kind, frame.payload, frame.fds)
        except PeerClosedError:
            pass


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6


@pytest.mark.slow
def test_benchmark_round_trip(capsys: pytest.CaptureFixture[str]) -> None:
    """Micro-benchmark (no time limit asserted): 64-byte round trips to an echo process, raw socket bytes
    (one sendmsg/recvmsg each way) versus frames, each without and with one descriptor; prints p50/p99 in
    microseconds."""
    ctx = multiprocessing.get_context("spawn")
    rounds, warmup = 5000, 500
    payload = b"x" * 64
    results = {}
    mem = memfd_with(b"x")
    for mode in ("raw socket", "frame", "raw socket + 1 fd", "frame + 1 fd"):
        a, b = socket.socketpair()
        child = ctx.Process(target=_child_echo, args=(b, mode), daemon=True)
        child.start()
        b.close()
        samples = []
        clock = time.perf_counter
        fds = [mem] if mode.endswith("fd") else []
        if mode.startswith("raw"):
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            for _ in range(rounds + warmup):
                start = clock()
                a.sendmsg([payload], anc)
                _, ancdata, _, _ = a.recvmsg(65536, socket.CMSG_SPACE(4))
                for _, _, cdata in ancdata:
                    os.close(int.from_bytes(cdata[:4], "little"))
                samples.append(clock() - start)
            a.close()
        else:
            with Connection(a) as conn:
                channel = conn.channel
                for _ in range(rounds + warmup):
                    start = clock()
                    channel.send(1, payload, fds)
                    channel.recv().close_fds()
                    samples.append(clock() - start)
        child.join(10)
        assert child.exitcode == 0
        results[mode] = _percentiles(samples[warmup:])
    os.close(mem)
    with capsys.disabled():
        print()
        for mode, (p50, p99) in results.items():
            print(f"    64-byte round trip, {mode:17s}: p50 {p50:6.1f} us   p99 {p99:6.1f} us")
