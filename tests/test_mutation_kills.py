"""Tests written for mutants of ``tests/mutation/mutants.toml`` that no other test caught
(docs/reliability.md, "Mutation testing"): each names the mutant it kills."""

from __future__ import annotations

import array
import gc
import os
import socket
import struct
import time

import pytest

from arrow_ipc_bridge import transport
from arrow_ipc_bridge.channel import Channel
from arrow_ipc_bridge.errors import BridgeTimeoutError

_HEADER = struct.Struct("<4sHHQII")  # docs/protocol.md: magic, version, kind, length, n_fds, reserved


def _memfds_named(name: str) -> int:
    """How many of this process's descriptors are memfds called ``name``."""
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        count += target.startswith(f"/memfd:{name} ")
    return count


def test_freeing_a_channel_closes_descriptors_of_a_half_received_frame() -> None:
    """Kills ``channel-free-leaks-pending``: descriptors that arrived with the first bytes of a frame
    that never completed are the C channel's; freeing it must close them (the Python connection's
    own close cannot see them)."""
    name = f"aib-pending-{os.getpid()}"
    ours, peer = socket.socketpair()
    conn = transport.Connection(ours)
    channel = Channel(conn)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        head = _HEADER.pack(transport.MAGIC, transport.PROTOCOL_VERSION, 3, 100, 1, 0)
        peer.sendmsg([head[:5]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    finally:
        os.close(fd)
    with pytest.raises(BridgeTimeoutError):
        channel.recv(timeout=0.05)  # reads the partial header and the descriptor, then gives up
    assert _memfds_named(name) == 1  # received, pending in the channel
    del channel
    gc.collect()
    deadline = time.monotonic() + 5.0
    while _memfds_named(name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _memfds_named(name) == 0, "the freed channel leaked the pending descriptor"
    conn.close()
    peer.close()
