"""Tests written for mutants of ``tests/mutation/mutants.toml`` that no other test caught
(docs/reliability.md, "Mutation testing"): each names the mutant it kills."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers import wire_craft as wc
from helpers.counting import SessionCounts
from helpers.session_rig import raw_hello, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.consumer import array_cache
from arrow_ipc_bridge.errors import PeerClosedError, ProtocolError
from arrow_ipc_bridge.transport import protocol
from arrow_ipc_bridge.transport.board import PublisherBoard
from arrow_ipc_bridge.wire.metadata import Decoded

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


# ---------- wire.c: the decoder's checks of an untrusted message --------------------------------------------
def _decodes(schema: wc.Node, nodes: list[wc.ArrayNode], regions: list[wc.Region] | None = None) -> bool:
    """True when the message decodes; the decoder's ProtocolError propagates."""
    decoded = Decoded(wc.message(schema, [nodes], regions), 1)
    decoded.close()
    return True


def test_a_buffer_ending_one_byte_past_its_region_is_refused() -> None:
    """Kills ``wire-buffer-past-region-end``: a buffer may end exactly at its region's end, not one
    byte beyond (a consumer would read the byte after the mapping)."""
    region = [wc.Region(size=40)]
    assert _decodes(wc.Node("l"), [wc.ArrayNode(4, 0, 0, [wc.NULL_BUFFER, (2, 8, 32)])], region)
    with pytest.raises(ProtocolError, match="outside region"):
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
    with pytest.raises(ProtocolError, match="differ in length"):
        _decodes(schema, nodes(n_ends, n_values))


# ---------- serve.c: one connection's lease table -----------------------------------------------------------
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


# ---------- producer/publisher.py: the handshake ------------------------------------------------------------
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


# ---------- board.c: the version board's sequence lock ------------------------------------------------------
_SEQ, _SERIAL, _VERSION = 0, 1, 2  # a slot's 64-bit words (board.c's board_slot)


def _board_read(board: PublisherBoard, slot: int = 0) -> tuple[int, int] | None:
    """(serial, version) as a session reads them (aib_board_read); None when the read gave up."""
    serial, version = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    if not lib.aib_board_read(board.address, slot, serial, version):
        return None
    return int(serial[0]), int(version[0])


def test_a_board_slot_left_mid_write_is_never_read() -> None:
    """Kills ``board-read-mid-write``: a slot whose sequence word is odd is being written (or its
    writer died mid-write): its serial and version may be one old and one new, so a read gives up
    (the session asks the publisher) instead of returning them."""
    board = PublisherBoard(n_slots=1)
    try:
        words = ffi.cast("uint64_t *", board.address)
        lib.aib_board_write(board.address, 0, 7, 7)
        assert _board_read(board) == (7, 7)
        words[_SEQ] += 1  # a writer's first store: odd
        words[_SERIAL] = 8  # ... and its second; the version is still 7
        assert _board_read(board) is None
        words[_VERSION] = 8
        words[_SEQ] += 1
        assert _board_read(board) == (8, 8)
    finally:
        board.close()


def test_board_readers_racing_a_writer_never_see_a_torn_pair() -> None:
    """Kills ``board-read-mid-write``: reader threads (the C read, the GIL released) race a writer
    that follows the board's protocol (sequence odd, serial, version, sequence even) but lets other
    threads run between its stores, as a preempted publisher would. Every read that succeeds shows
    a serial and a version written together (here always equal)."""
    board = PublisherBoard(n_slots=1)
    words = ffi.cast("uint64_t *", board.address)
    stop = threading.Event()
    torn: list[tuple[int, int]] = []
    seen: set[int] = set()

    def read() -> None:
        while not stop.is_set():
            got = _board_read(board)
            if got is None:
                continue
            seen.add(got[0])
            if got[0] != got[1]:
                torn.append(got)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for reader in readers:
        reader.start()
    try:
        for value in range(1, 2001):
            # time.sleep(0) between the stores gives the readers the GIL (and orders the stores: the
            # GIL's hand-over is a full barrier)
            words[_SEQ] += 1
            time.sleep(0)
            words[_SERIAL] = value
            time.sleep(0)
            words[_VERSION] = value
            time.sleep(0)
            words[_SEQ] += 1
            time.sleep(0)
            if torn:
                break
    finally:
        stop.set()
        for reader in readers:
            reader.join()
        board.close()
    assert not torn, f"torn reads (serial, version): {torn[:5]}"
    assert len(seen) > 20  # the readers did read between the writes


def test_a_board_read_stalled_between_its_loads_by_a_write_is_not_taken() -> None:
    """Kills ``board-read-not-rechecked``: a reader that is held up after it read the serial and
    before it read the version (preempted, or a page fault), while the publisher writes the slot,
    holds one old and one new word; only the sequence read again afterwards shows it, and the read
    is then retried or given up, never returned (a local get would report the old entry's data at
    the new version).

    The stall is made certain instead of waited for: the slot is placed across a page boundary
    (sequence and serial at the end of one page, version at the start of the next), and before
    every read the reader drops its mapping of the second page, so that loading the version takes a
    page fault (microseconds) while a writer process (C writes in a tight loop, in parallel) goes
    on. The real board never straddles pages; only the window is wider here."""
    page = mmap.PAGESIZE
    fd = os.memfd_create("aib-test-board-race", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 2 * page)
        writable = mmap.mmap(fd, 2 * page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        readable = mmap.mmap(fd, 2 * page, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    start = page - 2 * 8  # the slot's sequence and serial end the first page
    writer_slot = ffi.cast("char *", ffi.from_buffer(writable)) + start
    reader_slot = ffi.cast("char *", ffi.from_buffer(readable)) + start
    seconds = 1.0
    pid = os.fork()
    if pid == 0:  # the writer: C writes of (v, v) until the reader is done
        try:
            end = time.monotonic() + seconds
            value = 1
            while time.monotonic() < end:
                for _ in range(1000):
                    lib.aib_board_write(writer_slot, 0, value, value)
                    value += 1
        finally:
            os._exit(0)
    serial, version = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    torn: list[tuple[int, int]] = []
    reads = changes = last = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end and len(torn) < 5:
            for _ in range(100):
                readable.madvise(mmap.MADV_DONTNEED, page, page)  # the version's page faults again
                if not lib.aib_board_read(reader_slot, 0, serial, version):
                    continue  # gave up after colliding with writes: allowed
                reads += 1
                changes += serial[0] != last
                last = serial[0]
                if serial[0] != version[0]:
                    torn.append((int(serial[0]), int(version[0])))
    finally:
        os.waitpid(pid, 0)
        del writer_slot, reader_slot
        writable.close()
        readable.close()
    assert not torn, f"torn reads (serial, version) among {reads}: {torn[:5]}"
    assert changes > 20, f"the reads saw {changes} writes: no overlap to test"


# ---------- content_check.c: run ends of a sliced run-end-encoded array -------------------------------------
def _checked_import(level: str, schema: wc.Node, nodes: list[wc.ArrayNode], heap: wc.Heap) -> pa.Array:
    fd, region = wc.memfd_region(bytes(heap.data), size=max(len(heap.data), 64))
    try:
        message = wc.message(schema, [nodes], [region])
        with aib.Session(check=level) as session, session.import_message(message, [fd]) as imported:
            return pa.array(imported)
    finally:
        os.close(fd)


@pytest.mark.parametrize("level", ["full", "bounds"])
def test_the_run_ends_of_a_sliced_array_must_cover_its_offset_and_length(level: str) -> None:
    """Kills ``content-run-ends-slice-offset-ignored``: a run-end-encoded array of length 2 at
    offset 2 reads logical indices 2 and 3, so its last run end must reach 4: one of 3 covers the
    length but not the slice, and a reader's search for index 3 would land past the values."""
    schema = wc.Node("+r", children=[wc.Node("i", "run_ends", flags=0), wc.Node("l", "values")])

    def nodes(heap: wc.Heap, ends: list[int]) -> list[wc.ArrayNode]:
        return [
            wc.ArrayNode(2, 0, 2, []),
            wc.ArrayNode(len(ends), 0, 0, [wc.NULL_BUFFER, heap.ints(ends, "i")]),
            wc.ArrayNode(
                len(ends), 0, 0, [wc.NULL_BUFFER, heap.ints([10 * (i + 1) for i in range(len(ends))], "q")]
            ),
        ]

    heap = wc.Heap()
    assert _checked_import(level, schema, nodes(heap, [2, 4]), heap).to_pylist() == [20, 20]
    heap = wc.Heap()
    with pytest.raises(ProtocolError, match="does not cover the parent's 4 values"):
        _checked_import(level, schema, nodes(heap, [2, 3]), heap)


# ---------- producer/watch.py: held waits -------------------------------------------------------------------
def _versioned_answer(raw: transport.Connection) -> int:
    """The version of the VERSIONED_ITEM ``raw`` reads next; its lease is given back."""
    with raw.recv(timeout=10.0) as frame:
        assert frame.kind == protocol.VERSIONED_ITEM, frame
        lease, version, _ = protocol.decode_versioned_item(frame.payload)
    raw.send(protocol.RELEASE, protocol.encode_lease(lease))
    raw.send(protocol.PING, b"sync")  # answered after the RELEASE
    with raw.recv(timeout=10.0) as pong:
        assert pong.kind == protocol.PONG
    return version


def test_a_wait_after_the_version_the_next_publish_gets_is_kept_for_the_one_after(
    publisher: aib.Publisher,
) -> None:
    """Kills ``watch-wait-at-the-published-version-dropped``: two WAITs held on one name, one for
    any version, one for a version newer than V; the name is published at exactly V. The first is
    answered; the second is not due and stays held, and the publish after that answers it (not its
    timeout)."""
    publisher.publish("other", pa.array([0]))
    after = publisher.version("other") + 1  # the version the next publish gets
    first = transport.connect(publisher.path, timeout=10.0)
    second = transport.connect(publisher.path, timeout=10.0)
    try:
        raw_hello(first)
        raw_hello(second)
        first.send(protocol.WAIT, protocol.encode_wait(0, 60_000, b"t"))
        second.send(protocol.WAIT, protocol.encode_wait(after, 60_000, b"t"))
        assert wait_for(lambda: publisher.held_waits == 2, 10.0)
        publisher.publish("t", pa.array([1]))
        assert publisher.version("t") == after  # the premise: published at exactly `after`
        assert _versioned_answer(first) == after
        assert publisher.held_waits == 1, "the wait for a newer version was neither answered nor kept"
        publisher.publish("t", pa.array([2]))
        assert _versioned_answer(second) == after + 1
    finally:
        first.close()
        second.close()


# ---------- producer/stream_writer.py: one schema per stream, metadata included -----------------------------
def test_a_stream_batch_whose_metadata_differs_is_refused(publisher: aib.Publisher) -> None:
    """Kills ``streams-schema-metadata-unchecked``: a stream has one schema, its metadata included
    (docs/streams.md): a batch whose column says another unit, or whose schema metadata differs, is
    refused with StreamError, saying that the metadata differs, and nothing of it is sent;
    consumers read every batch with the stream's metadata."""

    def batch(value: float, *, unit: str = "m", calibration: str = "1") -> pa.RecordBatch:
        schema = pa.schema(
            [pa.field("d", pa.float64(), metadata={"unit": unit})], metadata={"calibration": calibration}
        )
        return pa.record_batch([pa.array([value])], schema=schema)

    writer = publisher.open_stream("s")
    with aib.subscribe(publisher.path, "s", timeout=30) as live:
        writer.write(batch(1.0))
        with pytest.raises(aib.StreamError, match=r"metadata .*'km'.* differs") as raised:
            writer.write(batch(2.0, unit="km"))
        assert raised.value.reason == "schema"
        with pytest.raises(aib.StreamError, match=r"metadata .*'2'.* differs") as raised:
            writer.write(batch(3.0, calibration="2"))
        assert raised.value.reason == "schema"
        writer.write(batch(4.0))
        writer.close()
        got = []
        while (item := live.next_batch()) is not None:
            with item:
                received = pa.record_batch(item)
                assert received.schema.equals(batch(0.0).schema, check_metadata=True), received.schema
                got.append(received.column(0)[0].as_py())
        assert got == [1.0, 4.0]  # nothing of the refused ones was sent


# ---------- consumer/array_cache.py: kept CuPy arrays' linger -----------------------------------------------
class _Clock:
    """A monotonic clock the test moves (from the real one's reading, so the linger thread, which
    passes the real time, finds nothing due while the test runs)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


class _Shaped:
    def __init__(self) -> None:
        self.shape = (3,)


def _build(facts: object, holder: object, device: int) -> tuple[tuple[Any, ...], ...]:
    """Stand-ins for CuPy's arrays, pointers and memories (only their references and shapes count)."""
    return (_Shaped(), _Shaped()), (object(), object()), (object(), object())


def test_handing_kept_arrays_out_again_restarts_their_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills ``kept-arrays-hand-out-not-a-use``: kept arrays are let go ``pool_linger`` seconds after
    their *last* hand-out, not after they were made: a consumer using them every step keeps them
    (and their lease) however long it runs."""
    clock = _Clock()
    monkeypatch.setattr(array_cache, "time", clock)
    linger = 100.0
    cache = array_cache.KeptCupyArrays(linger)
    key: array_cache.CacheKey = ("t", 0, None)
    message = object()
    facts = [("a", 0, 3, 0, 0x1000), ("b", 0, 3, 0, 0x2000)]
    made = cache.hand_out(key, message, facts, "lease 1", device=0, build=_build)
    first_ids = [id(array) for array in made.values()]
    del made
    clock.now += 0.8 * linger
    again = cache.hand_out(key, message, facts, "lease 2", device=0, build=_build)
    assert [id(array) for array in again.values()] == first_ids
    assert cache.handed_out_again == 1
    del again
    # Past the linger since they were made, within it since they were handed out again: still kept.
    assert cache._expire_kept_leases(clock.now + 0.5 * linger) == pytest.approx(clock.now + linger)
    assert len(cache) == 1
    assert cache._expire_kept_leases(clock.now + linger) is None
    assert len(cache) == 0
    cache.close()


def test_kept_arrays_are_not_handed_out_for_another_message_of_the_same_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kills ``kept-arrays-other-message``: kept arrays go only to imports of the remembered message
    they were made for. Another message whose columns have the same names, types, lengths and
    addresses (a GPU producer that republished into the same allocation: the consumer's open handle
    maps it at the same address) gets new arrays, kept for it, so that its next steps take the fast
    path (``facts_of``: only the lease and the event read) and are handed those out again. Handed
    the old message's arrays instead, every later step would pay the full column read, and the
    cache would keep the forgotten message alive."""
    clock = _Clock()
    monkeypatch.setattr(array_cache, "time", clock)
    cache = array_cache.KeptCupyArrays(100.0)
    key: array_cache.CacheKey = ("t", 0, None)
    facts = [("a", 0, 3, 0, 0x1000), ("b", 0, 3, 0, 0x2000)]
    old_message, new_message = object(), object()
    made = cache.hand_out(key, old_message, facts, "lease 1", device=0, build=_build)
    old_ids = [id(array) for array in made.values()]
    del made
    assert cache.facts_of(key, new_message) is None  # the new message's step reads its columns
    fresh = cache.hand_out(key, new_message, facts, "lease 2", device=0, build=_build)
    assert [id(array) for array in fresh.values()] != old_ids
    assert cache.handed_out_again == 0
    fresh_ids = [id(array) for array in fresh.values()]
    del fresh
    # The next step of the new message: the fast path, and the arrays made for it.
    known = cache.facts_of(key, new_message)
    assert known == tuple(facts)
    again = cache.hand_out(key, new_message, known, "lease 3", device=0, build=_build)
    assert [id(array) for array in again.values()] == fresh_ids
    assert cache.handed_out_again == 1
    assert cache.facts_of(key, old_message) is None
    del again
    cache.close()


# ---------- remembered.c: the standing lease's linger -------------------------------------------------------
def test_a_local_get_restarts_the_standing_leases_linger(publisher: aib.Publisher) -> None:
    """Kills ``remembered-local-get-not-a-use``: a standing lease is given back ``pool_linger``
    seconds after its last get, local gets included; one that lapsed in steady use would turn every
    later get into a round trip without a word."""
    counts = SessionCounts()
    linger = 100.0  # the linger thread gives nothing back during the test; the test asks itself
    publisher.publish("t", pa.record_batch({"x": pa.array([1, 2, 3], pa.int64())}))
    with aib.connect(publisher.path, timeout=10.0, pool_linger=linger) as session:
        for _ in range(2):  # the first get imports, the second takes the standing lease
            session.get("t").release()
        remembered = session._remembered
        assert remembered.board_place(b"t") is not None
        time.sleep(0.5)  # the local get below comes measurably later than the standing lease
        before = time.monotonic()
        session.get("t").release()
        assert counts.local_gets == 1
        # Due linger seconds after the local get, not after the lease was taken.
        assert remembered._expire_kept_leases(time.monotonic()) >= before + linger
        assert remembered._expire_kept_leases(before + linger - 0.01) is not None
        assert remembered.board_place(b"t") is not None, "the standing lease was given back in use"
        with session.get("t") as imported:
            assert pa.record_batch(imported).column(0).to_pylist() == [1, 2, 3]
        assert counts.local_gets == 2


def test_an_unused_standing_lease_is_given_back_at_its_linger(publisher: aib.Publisher) -> None:
    """Kills ``remembered-standing-lease-lingers-twice``: a standing lease no get used for
    ``pool_linger`` seconds is given back then (docs/lifetime.md, "Standing leases"), not later: the
    producer's entry is pinned by an idle consumer no longer than the linger it chose. The message
    stays remembered, and its next get takes a standing lease again."""
    counts = SessionCounts()
    linger = 100.0  # the linger thread gives nothing back during the test; the test asks itself
    publisher.publish("t", pa.record_batch({"x": pa.array([1, 2, 3], pa.int64())}))
    with aib.connect(publisher.path, timeout=10.0, pool_linger=linger) as session:
        session.get("t").release()
        taken = time.monotonic()
        session.get("t").release()  # remembered: its lease becomes the standing lease
        used = time.monotonic()
        remembered = session._remembered
        assert remembered.board_place(b"t") is not None
        assert wait_for(lambda: publisher.active_leases == 1, 10.0)
        assert remembered._expire_kept_leases(taken + linger - 0.01) is not None
        assert remembered.board_place(b"t") is not None, "given back before its linger"
        assert remembered._expire_kept_leases(used + linger) is None  # nothing left to give back
        assert remembered.board_place(b"t") is None, "kept past its linger"
        assert wait_for(lambda: publisher.active_leases == 0, 10.0)
        remembered_gets = counts.remembered_gets
        session.get("t").release()
        assert counts.remembered_gets == remembered_gets + 1
        assert remembered.board_place(b"t") is not None
        with session.get("t") as imported:
            assert pa.record_batch(imported).column(0).to_pylist() == [1, 2, 3]
        assert counts.local_gets == 1


def test_the_same_bytes_published_again_move_the_standing_lease(publisher: aib.Publisher) -> None:
    """Kills ``remembered-standing-lease-kept-on-old-serial``: a batch built in shared memory and
    published again (zero-copy: the same message bytes over the same file, so the same remembered
    message) is a new entry under a new serial. The first get after it asks the publisher and moves
    the standing lease to the new entry (the old entry's lease given back); the gets after that are
    local again, not round trips for as long as the session lives."""
    counts = SessionCounts()
    with aib.allocate_shared(4096, name="aib-test") as shared:
        view = shared.view().cast("q")
        for i in range(3):
            view[i] = i + 1
        view.release()
        data = pa.Array.from_buffers(pa.int64(), 3, [None, shared.as_pyarrow()])
        batch = pa.record_batch({"x": data})
        publisher.publish("t", batch)
        with aib.connect(publisher.path, timeout=10.0, pool_linger=100.0) as session:
            for _ in range(3):
                session.get("t").release()
            assert counts.local_gets == 1
            remembered = session._remembered
            first = remembered.board_place(b"t")
            assert first is not None
            publisher.publish("t", batch)  # a new entry: a new serial, the same bytes
            remembered_gets = counts.remembered_gets
            session.get("t").release()  # the board shows another serial: a round trip
            assert counts.remembered_gets == remembered_gets + 1  # the same message, remembered
            assert counts.local_gets == 1
            moved = remembered.board_place(b"t")
            assert moved is not None
            assert moved[1] != first[1], "the standing lease stayed on the entry published before"
            assert wait_for(lambda: publisher.active_leases == 1, 10.0)  # the old entry's was given back
            for expected_local in (2, 3):
                with session.get("t") as imported:
                    assert pa.record_batch(imported).column(0).to_pylist() == [1, 2, 3]
                    assert imported.version == publisher.version("t")
                assert counts.local_gets == expected_local
        publisher.unpublish("t")  # before the shared memory under it is closed
        del data, batch


# ---------- py_local_get.c: the C getter's locks ------------------------------------------------------------
def test_the_c_getter_gives_its_locks_back_on_every_path(publisher: aib.Publisher) -> None:
    """Kills ``local-getter-keeps-request-lock``, ``local-getter-miss-keeps-request-lock`` and
    ``local-getter-keeps-receive-lock``: after a local get (answered), a get the board
    cannot answer (asked of the publisher) and a get of a name nobody published, the session's
    request lock and its channel's receive lock are free. A lock kept would make the next get wait
    forever; the test fails at once instead and frees it, so that the session can close."""
    publisher.publish("t", pa.record_batch({"x": pa.array([1, 2, 3], pa.int64())}))
    publisher.publish("u", pa.record_batch({"y": pa.array([4], pa.int64())}))
    with aib.connect(publisher.path, timeout=10.0) as session:
        getter = session._local_getter
        assert getter is not None
        channel = session._channel
        assert channel is not None
        locks = {"request": session._request_lock, "receive": channel.locked()[0]}

        def held() -> list[str]:
            kept = [name for name, lock in locks.items() if lock.locked()]
            for name in kept:
                locks[name].release()
            return kept

        # Before any session.get: each one asks the C getter first, then (when it cannot answer)
        # takes the same locks in Python, so a lock the getter kept would hang the first of them.
        assert getter.get("t") is None  # nothing remembered yet
        assert held() == [], "after a get the board could not answer (the session's first)"
        for _ in range(2):
            session.get("t").release()
        local = getter.get("t")
        assert local is not None
        local.release()
        assert held() == [], "after a local get"
        assert getter.get("u") is None  # not remembered: the Python path asks the publisher
        assert held() == [], "after a get the board could not answer"
        assert getter.get("never") is None
        assert held() == [], "after a get of a name nobody published"
        with session.get("t") as imported:
            assert pa.record_batch(imported).column(0).to_pylist() == [1, 2, 3]
        assert getter.gets == 2
