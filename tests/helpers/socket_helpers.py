"""Helpers of the socket tests (test_channel.py, test_server.py): raw frame bytes, hostile sends,
descriptor counting, threads."""

from __future__ import annotations

import array
import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

_HEADER = struct.Struct("<4sHHIHH")  # docs/protocol.md, "Frames"


def header(
    kind: int = 1,
    length: int = 0,
    nfds: int = 0,
    *,
    magic: bytes = b"AIBT",
    version: int = 1,
    reserved: int = 0,
) -> bytes:
    """A frame header as docs/protocol.md specifies it (any field may be made wrong)."""
    return _HEADER.pack(magic, version, kind, length, nfds, reserved)


def send_raw(sock: socket.socket, data: bytes, fds: list[int] | None = None) -> None:
    """Send bytes (and descriptors) the way a hostile peer might: no framing logic at all."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], anc)
    # A large send stops short when the receiver closes on what it got (the point of several tests:
    # seen on a busy 2-core CI machine, where the receiver is not slower than the sender): the
    # descriptors went with the first bytes; the rest follows while the receiver still reads.
    if sent < len(data):
        with contextlib.suppress(OSError):
            sock.sendall(data[sent:])


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def no_fd_leak(closes: int = 0) -> Iterator[None]:
    """Assert that the block leaves as many descriptors open as it found, less ``closes`` it is expected to
    close (a connection closed after a protocol error); threads get a moment to finish."""
    before = open_fd_count() - closes
    yield
    deadline = time.monotonic() + 2.0
    while open_fd_count() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert open_fd_count() == before, f"descriptor leak: {before} open before, {open_fd_count()} after"


def assert_hung_up(sock: socket.socket) -> None:
    """The other end closed ``sock``'s connection: EOF, or a reset when bytes sent to it were never read."""
    try:
        data = sock.recv(100)
    except ConnectionResetError:
        return
    assert data == b""


def memfd_with(content: bytes) -> int:
    fd = os.memfd_create("aib-test", os.MFD_CLOEXEC)
    os.write(fd, content)
    return fd


def read_fd(fd: int, size: int) -> bytes:
    return os.pread(fd, size, 0)


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def run_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    """Start ``target`` on a thread; exceptions are collected in the returned list."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, errors
