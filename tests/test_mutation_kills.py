"""Tests written for mutants of ``tests/mutation/mutants.toml`` that no other test caught
(docs/reliability.md, "Mutation testing"): each names the mutant it kills."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import wire_craft as wc

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import protocol, transport
from arrow_ipc_bridge.errors import PeerClosedError, ProtocolError, WireFormatError
from arrow_ipc_bridge.metadata import Decoded

_HEADER = struct.Struct("<4sHHIHH")  # docs/protocol.md: magic, version, kind, length, n_fds, reserved
_MAGIC = b"AIBT"  # the frame header (docs/protocol.md, Frames)
_FRAME_VERSION = 1


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


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"reserved": 1}, "reserved"),
        ({"reserved": 0x8000}, "reserved"),
        ({"magic": b"AIBX"}, "magic"),
        ({"version": 2}, "version"),
    ],
)
def test_the_c_channel_refuses_a_bad_frame_header(fields: dict[str, object], field: str) -> None:
    """Kills ``channel-reserved-unchecked``: the C channel (the publisher's serve loop and the
    session's requests read through it, not through ``transport.Connection``) refuses a header
    whose reserved field is not zero, like one with a wrong magic or version, naming the field in its
    message."""
    values: dict[str, object] = {
        "magic": _MAGIC,
        "version": _FRAME_VERSION,
        "reserved": 0,
    }
    values.update(fields)
    head = _HEADER.pack(values["magic"], values["version"], protocol.PING, 0, 0, values["reserved"])
    ours, peer = socket.socketpair()
    conn = transport.Connection(ours)
    channel = conn.channel
    try:
        peer.sendall(head)
        with pytest.raises(ProtocolError) as info:
            channel.recv(timeout=5.0)
        assert field in str(info.value)
    finally:
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


# ---------- serve.c: one connection's lease table ------------------------------------------------------
_TABLE_SLOTS = 64  # a connection's first lease table (serve.c); it holds 32 leases before it grows


def _home_slot(lease: int) -> int:
    """The slot a lease id hashes to in a table of _TABLE_SLOTS (serve.c's lease_index)."""
    return ((lease * 0x9E3779B97F4A7C15) % (1 << 64) >> 20) & (_TABLE_SLOTS - 1)


def test_a_lease_whose_probe_chain_wraps_the_table_end_is_released(tmp_path: Path) -> None:
    """Kills ``serve-lease-backward-shift-wrap``. Lease X sits in the last slot, lease Y at its home,
    slot 0. Releasing X empties the last slot; the backward shift then looks at slot 0 across the
    table's end: Y is at its home and must stay (moved to the last slot, a later lookup from slot 0
    would not find it, and its RELEASE would be lost). Every other lease is given back at once, so
    the table never grows past its first 64 slots."""
    path = str(tmp_path / "p.sock")
    with aib.Publisher(path) as pub:
        pub.publish("t", pa.record_batch({"x": pa.array(range(10), pa.int64())}))
        with transport.connect(pub.path) as raw:
            raw.send(protocol.HELLO, protocol.encode_hello())
            with raw.recv(timeout=5.0) as welcome:
                assert welcome.kind == protocol.WELCOME

            def sync() -> None:  # answered after every RELEASE sent before it
                raw.send(protocol.PING, b"sync")
                with raw.recv(timeout=5.0) as pong:
                    assert pong.kind == protocol.PONG

            last_slot, first_slot = None, None
            while first_slot is None:
                raw.send(protocol.GET, b"t")
                with raw.recv(timeout=5.0) as item:
                    assert item.kind == protocol.ITEM
                    lease = protocol.decode_item(item.payload)[0]
                home = _home_slot(lease)
                if last_slot is None and home == _TABLE_SLOTS - 1:
                    last_slot = lease
                elif last_slot is not None and home == 0:
                    first_slot = lease
                else:
                    raw.send(protocol.RELEASE, protocol.encode_lease(lease))
                assert lease < 10_000, "no lease ids of the wanted homes: has serve.c's lease_index changed?"
            sync()
            assert pub.active_leases == 2
            raw.send(protocol.RELEASE, protocol.encode_lease(last_slot))
            sync()
            assert pub.active_leases == 1
            raw.send(protocol.RELEASE, protocol.encode_lease(first_slot))
            sync()
            assert pub.active_leases == 0, "the lease at its home slot after the wrap was lost"


# ---------- publisher.py: the handshake ------------------------------------------------------------------
def test_a_first_hello_of_another_protocol_version_is_refused(tmp_path: Path) -> None:
    """Kills ``publisher-hello-version-unchecked``: a session's *first* HELLO naming another protocol
    version gets ERROR (ProtocolError) and a closed connection, never a WELCOME. (The session tests
    send the wrong version as a second HELLO, which the second-HELLO check refuses first.)"""
    with aib.Publisher(str(tmp_path / "p.sock")) as pub, transport.connect(pub.path) as raw:
        raw.send(protocol.HELLO, struct.pack("<H", protocol.PROTOCOL_VERSION + 98))
        with raw.recv(timeout=10.0) as frame:
            assert frame.kind == protocol.ERROR, frame
            with pytest.raises(ProtocolError, match=f"protocol {protocol.PROTOCOL_VERSION + 98}"):
                protocol.raise_error(frame.payload)
        with pytest.raises(PeerClosedError):
            raw.recv(timeout=10.0)
