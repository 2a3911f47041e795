"""The version board (``transport/board.py``, ``cffi_build/board.c``) and standing leases: a session re-gets a
name it remembers without a round trip while the publisher's board shows the same entry, and asks
the publisher otherwise (a new publish, an unpublish, a closed or dead publisher, anything waiting
on the connection). docs/protocol.md ("The version board") and docs/lifetime.md ("Standing
leases") describe what is tested here."""

from __future__ import annotations

import fcntl
import mmap
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from helpers.counting import SessionCounts

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.errors import NotPublishedError, PeerClosedError, ProtocolError
from arrow_ipc_bridge.producer import publisher as publisher_module
from arrow_ipc_bridge.transport import board as board_module
from arrow_ipc_bridge.transport import protocol
from tests.helpers.fault_children import producer_main, table_for
from tests.helpers.session_rig import settle, wait_for

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def path() -> str:
    return os.path.join(tempfile.mkdtemp(dir="/tmp"), "board.sock")


@pytest.fixture
def publisher(path: str) -> Iterator[aib.Publisher]:
    with aib.Publisher(path) as pub:
        yield pub


def _values(imported: aib.ImportedArray | aib.ImportedStream) -> list[int]:
    values: list[int] = imported.to_host().column("x").to_pylist()
    return values


def test_a_remembered_name_is_got_from_the_board_after_its_standing_lease(publisher: aib.Publisher) -> None:
    """The first get imports, the second (remembered) takes the standing lease, the rest are local:
    the same data, the publisher's version, counted per session and per process."""
    counts = SessionCounts()
    publisher.publish("t", pa.table({"x": [1, 2, 3]}))
    before = aib.stats().session.local_gets
    with aib.connect(publisher.path, timeout=10.0) as session:
        features = session.publisher_info["features"]
        assert isinstance(features, list)
        assert "board" in features
        for _ in range(2):
            with session.get("t") as imported:
                assert _values(imported) == [1, 2, 3]
        assert counts.local_gets == 0
        for _ in range(5):
            with session.get("t") as imported:
                assert _values(imported) == [1, 2, 3]
                assert imported.version == publisher.version("t")
        assert counts.local_gets == 5
        assert counts.remembered_gets == 6
    assert aib.stats().session.local_gets - before == 5


def test_a_new_publish_is_seen_at_once_not_the_remembered_data(publisher: aib.Publisher) -> None:
    """After a publish of other data, the next get is a round trip that returns it (the board's
    serial changed), and the name's later gets are local again, over the new message."""
    counts = SessionCounts()
    with aib.connect(publisher.path, timeout=10.0) as session:
        for value in range(1, 6):
            publisher.publish("t", pa.table({"x": [value]}))
            for _ in range(3):
                with session.get("t") as imported:
                    assert _values(imported) == [value]
                    assert imported.version == publisher.version("t")
        assert counts.local_gets == 5  # the third get of each version


def test_an_in_place_renewal_is_got_locally_with_its_new_version(publisher: aib.Publisher) -> None:
    """A renewal (the in-place fast path: the same entry, a new version) keeps the serial: gets stay
    local and report the new version."""
    counts = SessionCounts()
    publisher.publish("t", pa.table({"x": [7]}))
    with aib.connect(publisher.path, timeout=10.0) as session:
        for _ in range(2):
            session.get("t").release()
        for _ in range(3):
            with publisher._lock:
                waiting = publisher._renew_version_locked(b"t")
            assert not waiting
            local = counts.local_gets
            with session.get("t") as imported:
                assert imported.version == publisher.version("t")
                assert _values(imported) == [7]
            assert counts.local_gets == local + 1


def test_an_unpublished_name_is_not_got_from_the_board(publisher: aib.Publisher) -> None:
    counts = SessionCounts()
    publisher.publish("t", pa.table({"x": [1]}))
    with aib.connect(publisher.path, timeout=10.0) as session:
        for _ in range(3):
            session.get("t").release()
        assert counts.local_gets == 1
        publisher.unpublish("t")
        with pytest.raises(NotPublishedError):
            session.get("t")
        publisher.publish("t", pa.table({"x": [2]}))
        with session.get("t") as imported:
            assert _values(imported) == [2]


def test_a_closed_publisher_is_reported_not_answered_from_the_board(path: str) -> None:
    counts = SessionCounts()
    publisher = aib.Publisher(path)
    publisher.publish("t", pa.table({"x": [1]}))
    with aib.connect(path, timeout=10.0) as session:
        for _ in range(3):
            session.get("t").release()
        assert counts.local_gets == 1
        publisher.close()
        with pytest.raises(PeerClosedError):
            session.get("t")


def test_a_killed_publisher_is_reported_and_held_data_stays_readable(tmp_path: Path) -> None:
    """SIGKILL: the next get of a name the session holds a standing lease on raises
    PeerClosedError (no stale answer from the board); what it holds stays readable."""
    counts = SessionCounts()
    path = str(tmp_path / "killed.sock")
    parent_end, child_end = SPAWN.Pipe()
    process = SPAWN.Process(target=producer_main, args=(child_end, path, ["t"], 100))
    process.start()
    child_end.close()
    try:
        assert parent_end.poll(60)
        assert parent_end.recv()[0] == "ready"
        with aib.connect(path, timeout=10.0) as session:
            for _ in range(2):
                session.get("t").release()
            held = session.get("t")
            assert counts.local_gets == 1
            process.kill()
            process.join(30)
            with pytest.raises(PeerClosedError):
                session.get("t")
            assert pa.table(held).equals(table_for(100, 0))
            held.release()
    finally:
        if process.is_alive():
            process.kill()
        process.join(timeout=30)
        parent_end.close()


def test_the_standing_lease_is_given_back_after_the_linger_on_forget_and_on_close(
    publisher: aib.Publisher,
) -> None:
    counts = SessionCounts()
    publisher.publish("t", pa.table({"x": [1]}))
    with aib.connect(publisher.path, timeout=10.0, pool_linger=0.2) as session:
        for _ in range(2):
            session.get("t").release()
        assert wait_for(lambda: publisher.active_leases == 1, 10.0)  # the standing lease, nothing held
        assert wait_for(lambda: publisher.active_leases == 0, 10.0)  # linger seconds unused: given back
        # The message stays remembered: the next get is remembered, not a new import.
        remembered = counts.remembered_gets
        session.get("t").release()
        assert counts.remembered_gets == remembered + 1
        assert wait_for(lambda: publisher.active_leases == 1, 10.0)  # it took the standing lease again
    with aib.connect(publisher.path, timeout=10.0, pool_linger=60.0) as session:
        for _ in range(2):
            session.get("t").release()
        assert wait_for(lambda: publisher.active_leases == 1, 10.0)
        assert session.forget("t") == 1
        assert wait_for(lambda: publisher.active_leases == 0, 10.0)
        for _ in range(2):
            session.get("t").release()
        assert wait_for(lambda: publisher.active_leases == 1, 10.0)
    assert wait_for(lambda: publisher.active_leases == 0, 10.0)  # closed


def test_a_held_local_import_keeps_its_data_after_the_lease_expires(publisher: aib.Publisher) -> None:
    """A local import holds the standing lease: it outlives the linger and a republish."""
    counts = SessionCounts()
    publisher.publish("t", pa.table({"x": [5, 6]}))
    with aib.connect(publisher.path, timeout=10.0, pool_linger=0.05) as session:
        for _ in range(2):
            session.get("t").release()
        held = session.get("t")
        assert counts.local_gets == 1
        publisher.publish("t", pa.table({"x": [9]}))
        time.sleep(0.3)
        assert publisher.active_leases == 1  # the held import's (standing) lease
        assert _values(held) == [5, 6]
        held.release()
        assert wait_for(lambda: publisher.active_leases == 0, 10.0)


def test_a_session_with_no_options_keeps_standing_leases(publisher: aib.Publisher) -> None:
    """The default is the fast re-get: a session connected with no options takes the board, makes
    re-gets local from the second get on, and keeps one lease per re-got name after the user
    released everything (its standing lease) until ``pool_linger`` (1 s by default) passes."""
    counts = SessionCounts()
    publisher.publish("t", pa.table({"x": [1]}))
    with aib.connect(publisher.path) as session:
        assert session._board is not None
        assert session._kept_arrays is not None
        for _ in range(4):
            session.get("t").release()
        assert counts.local_gets == 2
        settle()  # the released leases' RELEASE frames are out,
        session.ping()  # and the publisher read them: it answers in order
        assert publisher.active_leases == 1  # the standing lease: nothing is held
        assert wait_for(lambda: publisher.active_leases == 0, 10.0)  # given back after the linger
    with aib.Session() as plain:
        assert plain._kept_arrays is not None


@pytest.mark.parametrize("standing", [True, False])
def test_standing_leases_is_refused_naming_its_replacement(path: str, standing: bool) -> None:
    """The ``standing_leases`` switch is gone (standing leases are the default): passing it is a
    TypeError that says what to do instead, before anything is connected."""
    makers = [
        lambda: aib.Session(standing_leases=standing),  # type: ignore[call-arg]
        lambda: aib.connect(path, standing_leases=standing),
        lambda: aib.connect("grpc://127.0.0.1:1", standing_leases=standing),
    ]
    for make in makers:
        with pytest.raises(TypeError, match=r"standing_leases.*pool_linger=0"):
            make()
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['remembered'\\]"):
        aib.Session(remembered=3)  # type: ignore[call-arg]


def test_pool_linger_zero_takes_no_board_and_keeps_no_lease(publisher: aib.Publisher) -> None:
    counts = SessionCounts()
    publisher.publish("t", pa.table({"x": [1]}))
    with aib.connect(publisher.path, timeout=10.0, pool_linger=0) as session:
        for _ in range(4):
            session.get("t").release()
        assert counts.local_gets == 0
        assert counts.remembered_gets == 3
        assert wait_for(lambda: publisher.active_leases == 0, 10.0)


def test_the_board_cannot_be_written_by_a_session(publisher: aib.Publisher) -> None:
    """The page is sealed: no writable mapping, no write, no resize, by anyone but its first map."""
    board = publisher._board
    assert board is not None
    fd = os.open(f"/proc/self/fd/{board.fd}", os.O_RDWR)  # as a peer reopening it would
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, board.n_slots * board_module.SLOT_SIZE, mmap.MAP_SHARED, mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\xff" * 8, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)  # sealed against new seals: nothing can be undone
    finally:
        os.close(fd)


def test_the_board_arrives_read_only(publisher: aib.Publisher, monkeypatch: pytest.MonkeyPatch) -> None:
    """The descriptor a BOARD answer carries is a read-only open of the page (docs/security.md), not the
    publisher's read-write one: checked on the descriptor the session receives."""
    modes: list[int] = []
    session_board = board_module.SessionBoard

    def spy(fd: int, n_slots: int) -> board_module.SessionBoard:
        modes.append(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE)
        return session_board(fd, n_slots)

    monkeypatch.setattr(board_module, "SessionBoard", spy)
    publisher.publish("t", pa.table({"x": [1, 2, 3]}))
    counts = SessionCounts()
    with aib.connect(publisher.path, timeout=10.0) as session:
        for _ in range(3):
            with session.get("t"):
                pass
        assert counts.local_gets == 1  # the board was taken and used
    assert modes == [os.O_RDONLY]


def test_a_board_that_is_not_sealed_or_not_its_size_is_refused() -> None:
    fd = os.memfd_create("not-a-board", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4 * board_module.SLOT_SIZE)
        with pytest.raises(ProtocolError, match="sealed"):
            board_module.SessionBoard(fd, 4)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(ProtocolError, match="slots"):
            board_module.SessionBoard(fd, 5)
        board_module.SessionBoard(fd, 4).close()
    finally:
        os.close(fd)


def test_a_board_that_is_a_disk_file_or_unreadable_is_a_protocol_error(tmp_path: Path) -> None:
    """A regular file that cannot carry seals (F_GET_SEALS fails with EINVAL) is refused as any unsealed
    board is, with ProtocolError, not the OSError of the seal query; so is a sealed page the descriptor
    of which cannot be read (a write-only open)."""
    path = tmp_path / "board"
    path.write_bytes(bytes(4 * board_module.SLOT_SIZE))
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with pytest.raises(ProtocolError, match="not a sealed memfd"):
            board_module.SessionBoard(fd, 4)
    finally:
        os.close(fd)
    page = os.memfd_create("board", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(page, 4 * board_module.SLOT_SIZE)
        fcntl.fcntl(page, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        fd = os.open(f"/proc/self/fd/{page}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            with pytest.raises(ProtocolError, match="cannot be mapped"):
                board_module.SessionBoard(fd, 4)
        finally:
            os.close(fd)
    finally:
        os.close(page)


@pytest.mark.parametrize("slots", [0, board_module.MAX_SLOTS + 1])
def test_a_board_answer_with_a_bad_slot_count_is_refused(slots: int) -> None:
    with pytest.raises(ProtocolError):
        board_module.decode_board(board_module.encode_board(slots))
    with pytest.raises(ProtocolError):
        board_module.decode_board(b"\x01\x00")


@pytest.mark.parametrize(
    ("lease", "version", "serial", "slot", "zero", "error"),
    [
        (1, 0, 0, 0, 0, "version"),
        (1, 5, 6, 0, 0, "serial"),
        (1, 5, 0, 0, 0, "serial"),
        (1, 5, 5, 4, 0, "slot"),
        (1, 5, 5, 0, 1, "slot"),
    ],
)
def test_a_malformed_board_item_is_a_protocol_error(  # noqa: PLR0917 (the parametrised fields)
    lease: int, version: int, serial: int, slot: int, zero: int, error: str
) -> None:
    import struct

    payload = struct.pack("<QQQII", lease, version, serial, slot, zero) + b"message"
    with pytest.raises(ProtocolError, match=error):
        protocol.decode_board_item(payload, 4)
    with pytest.raises(ProtocolError):
        protocol.decode_board_item(payload[:31], 4)
    good = struct.pack("<QQQII", 3, 9, 4, protocol.NO_SLOT, 0) + b"message"
    assert protocol.decode_board_item(good, 4) == (3, 9, b"message")


def test_names_past_a_full_board_are_got_by_round_trips(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A board of two slots: a third name has none (its gets ask); a slot freed by an unpublish
    goes to the next name published."""
    counts = SessionCounts()
    monkeypatch.setattr(publisher_module, "PublisherBoard", lambda: board_module.PublisherBoard(2))
    with aib.Publisher(path) as publisher:
        for name in "abc":
            publisher.publish(name, pa.table({"x": [ord(name)]}))
        with aib.connect(path, timeout=10.0) as session:
            for name in "abc":
                for _ in range(3):
                    with session.get(name) as imported:
                        assert _values(imported) == [ord(name)]
            assert counts.local_gets == 2  # a and b
            publisher.unpublish("a")
            publisher.publish("d", pa.table({"x": [100]}))
            for _ in range(3):
                with session.get("d") as imported:
                    assert _values(imported) == [100]
            assert counts.local_gets == 3


def test_gets_racing_publishes_always_see_a_consistent_version(publisher: aib.Publisher) -> None:
    """A thread republishes (new data, new entry) and renews in place while this one gets: every
    import's data is the data of the version it reports, and versions never go back."""
    publisher.publish("t", pa.table({"x": [0]}))
    value_of_version = {publisher.version("t"): 0}
    stop = threading.Event()

    def publish() -> None:
        value = 0
        while not stop.is_set():
            value += 1
            if value % 3:
                publisher.publish("t", pa.table({"x": [value]}))
                value_of_version[publisher.version("t")] = value
            else:  # a renewal: the same data under a new version
                with publisher._lock:
                    publisher._renew_version_locked(b"t")
                    value_of_version[publisher.version("t")] = value_of_version[max(value_of_version)]
            time.sleep(0.0005)

    counts = SessionCounts()
    thread = threading.Thread(target=publish)
    thread.start()
    try:
        last = 0
        with aib.connect(publisher.path, timeout=10.0) as session:
            deadline = time.monotonic() + 3.0
            gets = 0
            while time.monotonic() < deadline:
                with session.get("t") as imported:
                    version = imported.version
                    assert version is not None
                    assert version >= last
                    last = version
                    # the writer records a version just after publishing it: wait for the record
                    for _ in range(1000):
                        if version in value_of_version:
                            break
                        time.sleep(0.001)
                    assert _values(imported) == [value_of_version[version]]
                gets += 1
            assert gets > 100
            assert counts.local_gets > 0
    finally:
        stop.set()
        thread.join()
