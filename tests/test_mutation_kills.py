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
import wire_craft as wc

from arrow_ipc_bridge import transport
from arrow_ipc_bridge.channel import Channel
from arrow_ipc_bridge.errors import BridgeTimeoutError, WireFormatError
from arrow_ipc_bridge.metadata import Decoded

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


# ---------- wire.c: the decoder's checks of an untrusted message ----------------------------------------
def _decodes(schema: wc.Node, nodes: list[wc.ArrayNode], regions: list[wc.Region] | None = None) -> bool:
    """True when the message decodes; the decoder's WireFormatError propagates."""
    decoded = Decoded(wc.message(schema, [nodes], regions), 1)
    decoded.close()
    return True


def test_a_buffer_ending_one_byte_past_its_region_is_refused() -> None:
    """Kills ``wire-buffer-past-region-end``: a buffer may end exactly at its region's end, not one
    byte beyond (a consumer would read the byte after the mapping)."""
    region = [wc.Region(size=40)]
    assert _decodes(wc.Node("l"), [wc.ArrayNode(4, 0, 0, [wc.NULL_BUFFER, (2, 8, 32)])], region)
    with pytest.raises(WireFormatError, match="outside region"):
        _decodes(wc.Node("l"), [wc.ArrayNode(4, 0, 0, [wc.NULL_BUFFER, (2, 8, 33)])], region)


@pytest.mark.parametrize(("n_ends", "n_values"), [(3, 2), (2, 3)])
def test_run_ends_and_values_of_different_lengths_are_refused(n_ends: int, n_values: int) -> None:
    """Kills ``wire-run-end-lengths``: a run-end array has one value per run, so its two children
    have one length; more run ends than values would send a reader past the values."""
    schema = wc.Node("+r", children=[wc.Node("i", "run_ends", flags=0), wc.Node("l", "values")])

    def nodes(ends: int, values: int) -> list[wc.ArrayNode]:
        return [
            wc.ArrayNode(4, 0, 0, []),
            wc.ArrayNode(ends, 0, 0, [wc.NULL_BUFFER, (2, 0, 4 * ends)]),
            wc.ArrayNode(values, 0, 0, [wc.NULL_BUFFER, (2, 64, 8 * values)]),
        ]

    assert _decodes(schema, nodes(2, 2))
    with pytest.raises(WireFormatError, match="differ in length"):
        _decodes(schema, nodes(n_ends, n_values))
