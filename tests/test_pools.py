"""CUDA memory pools without a GPU: the POOL_FD exchange (both sides), pool regions without their
fd, the opener's bounded bookkeeping of imported pools and kept slabs, legacy regions, the kept-lease
decision, and the linger thread that gives idle pools back.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from helpers.session_rig import FakeKeptLeaseHolder, FakePublisher, Reply, fd_count, sample_table, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge._ffi import lib
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.transport import protocol

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_publisher_refuses_pool_fds_it_did_not_name_and_serves_on(publisher: aib.Publisher) -> None:
    """POOL_FD for an identity that names no pool of the publisher's process (a guess, another
    producer's nonce) is answered with NotPublishedError and the session goes on; a malformed identity is
    a protocol error that closes the connection. No descriptor is left behind either way."""
    from arrow_ipc_bridge.cuda import placer

    assert "pool_fd" in protocol.FEATURES
    publisher.publish("t", sample_table(10))
    base_fds = fd_count()
    with aib.connect(publisher.path, timeout=5.0) as session:
        assert "pool_fd" in session.publisher_info["features"]  # type: ignore[operator]
        ours = placer._NONCE + (1234).to_bytes(8, "little")  # our nonce, no such pool
        for identity in (b"\x00" * 24, ours):
            with pytest.raises(aib.NotPublishedError, match=r"publisher: .*pool"):
                session._fetch_pool_fd(identity)
        with session.get("t") as imported:
            assert pa.table(imported).num_rows == 10
        with pytest.raises(aib.ProtocolError, match="pool identity of 5 bytes"):
            session._request(protocol.POOL_FD, b"short")
        with pytest.raises(aib.BridgeError):
            session.list()  # the publisher closed the connection
    assert wait_for(lambda: publisher.active_sessions == 0, 5.0)
    assert fd_count() == base_fds


def test_session_checks_the_publishers_pool_fd_answer(sock_dir: str) -> None:
    """The session takes exactly one fd from a POOL answer that repeats the identity it asked for;
    anything else (another frame kind, no fd, two fds, another identity) is a ProtocolError and
    every descriptor that came is closed. A publisher that does not list "pool_fd" is not asked."""
    identity = bytes(range(24))

    def pool_frame(payload: bytes, n_fds: int) -> Callable[[transport.Connection], None]:
        def send(conn: transport.Connection) -> None:
            files = [os.open(os.devnull, os.O_RDONLY) for _ in range(n_fds)]
            try:
                conn.send(protocol.POOL, payload, files)
            finally:
                for fd in files:
                    os.close(fd)

        return send

    bad: list[Reply] = [
        (protocol.PONG, identity, []),
        pool_frame(identity, 0),
        pool_frame(identity, 2),
        pool_frame(bytes(24), 1),
    ]
    path = os.path.join(sock_dir, "fake-pool.sock")
    base_fds = fd_count()
    replies = [*bad, pool_frame(identity, 1)]
    with (
        FakePublisher(path, features=["pool_fd"], pool_replies=replies) as fake,
        aib.connect(fake.path, timeout=5.0) as session,
    ):
        for _ in bad:
            with pytest.raises(aib.ProtocolError, match="expected POOL"):
                session._fetch_pool_fd(identity)
        fd = session._fetch_pool_fd(identity)
        try:
            assert os.fstat(fd).st_ino == os.stat(os.devnull).st_ino
        finally:
            os.close(fd)
    old = os.path.join(sock_dir, "old-pool.sock")
    with FakePublisher(old, features=["ping"]) as fake, aib.connect(fake.path, timeout=5.0) as session:
        with pytest.raises(aib.ProtocolError, match="does not serve pool fds"):
            session._fetch_pool_fd(identity)
        assert not session.closed  # nothing was sent
    assert fd_count() == base_fds


def test_pool_region_without_its_fd_needs_a_known_pool_or_a_source() -> None:
    """A pool region with fd_index -1 (a publisher's message) imports only through a pool this
    process has imported or a way to ask for the fd; without either it is a RegionError, and a
    failing source leaves nothing cached. An index past the fds that came is refused too. None of
    this reaches the driver, so it runs without a GPU."""
    from arrow_ipc_bridge.cuda import opener as cuda_opener
    from arrow_ipc_bridge.wire.metadata import REGION_CUDA_POOL, Region

    opener = cuda_opener.CudaOpener()
    handle = bytes(range(88))
    region = Region(REGION_CUDA_POOL, 4096, fd_index=-1, handle=handle)
    with pytest.raises(aib.ProtocolError, match="without its pool's fd"):
        opener.open_pool_regions([region], [], 0)

    asked: list[bytes] = []

    def failing_source(identity: bytes) -> int:
        asked.append(identity)
        raise aib.PeerClosedError("the publisher went away")

    with pytest.raises(aib.PeerClosedError):
        opener.open_pool_regions([region], [], 0, failing_source)
    assert asked == [handle[:24]]
    assert opener._pools == {}
    assert opener._pool_pointers == {}
    past_end = Region(REGION_CUDA_POOL, 4096, fd_index=1, handle=handle)
    with pytest.raises(aib.ProtocolError, match="fd index 1 but 1 fds came"):
        opener.open_pool_regions([past_end], [0], 0)
    with pytest.raises(aib.ProtocolError, match="88-byte handle"):
        opener.open_pool_regions([Region(REGION_CUDA_POOL, 4096, fd_index=-1, handle=b"x")], [], 0)


class _FakeImportedPool:
    """Stands in for cuda.ImportedPool in the opener's bookkeeping tests (no driver)."""

    addresses = itertools.count(0x10000, 0x1000)

    def __init__(self) -> None:
        self.imported: set[int] = set()
        self.closed = False

    @property
    def imported_count(self) -> int:
        return len(self.imported)

    def import_pointers(self, export_datas: list[bytes]) -> list[int]:
        assert not self.closed, "imported through a closed pool"
        pointers = [next(self.addresses) for _ in export_datas]
        self.imported.update(pointers)
        return pointers

    def free_imported_many(self, pointers: list[int]) -> None:
        self.imported.difference_update(pointers)

    def close(self) -> None:
        self.closed = True


def test_imported_pools_beyond_the_bound_are_dropped_once_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The opener keeps at most max_pools imported pools: the least recently used ones with no
    pointer imported are destroyed when another is imported; a pool whose pointers are in use
    stays. A pool evicted under a message being imported is looked up again, and after three
    such evictions the import fails with RegionError."""
    from arrow_ipc_bridge.cuda import opener as cuda_opener
    from arrow_ipc_bridge.wire.metadata import REGION_CUDA_POOL, Region

    made: list[_FakeImportedPool] = []

    def fake_import_pool(fd: int, device: int) -> _FakeImportedPool:
        made.append(_FakeImportedPool())
        return made[-1]

    monkeypatch.setattr(cuda_opener, "import_pool", fake_import_pool)
    opener = cuda_opener.CudaOpener(max_pools=2)

    def region(pool: int, pointer: int) -> Region:
        handle = bytes([pool]) * 24 + bytes([pointer]) * 64
        return Region(REGION_CUDA_POOL, 4096, fd_index=0, handle=handle)

    def use(pool: int, pointer: int) -> Any:
        return opener.open_pool_regions([region(pool, pointer)], [0], 0)[1]

    def let_go(owner: Any) -> None:
        lib.aib_owner_unref(owner)
        reaper.settle()

    held = use(1, 1)  # pool 1 stays in use
    let_go(use(2, 1))  # pool 2 idle
    kept = use(3, 1)  # over the bound: pool 2 (idle) goes, pool 1 (in use) stays
    assert [p.closed for p in made] == [False, True, False]
    assert list(opener._pools) == [bytes([1]) * 24, bytes([3]) * 24]
    let_go(held)
    let_go(use(4, 1))  # pool 1 is idle now and the least recently used
    assert [p.closed for p in made] == [True, True, False, False]
    assert made[0].imported == set()
    let_go(kept)

    monkeypatch.setattr(opener, "_pool", lambda *args: _FakeImportedPool())  # never the cached one
    with pytest.raises(aib.CudaError, match="evicted three times"):
        use(5, 1)
    assert opener._pool_pointers == {}


def test_kept_slab_imports_outlive_their_leases_in_a_bounded_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pool regions flagged kept (slabs the producer never frees) are imported once and stay
    imported after the message using them ends, in an LRU the C get path sees too; a later message
    over the same slab imports nothing (pool_kept_hits). Unflagged pool pointers of the same
    message are still freed with it. Beyond max_kept the least recently used slab leaves the LRU
    and its import is freed once no message uses it; close() lets the rest go."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import opener as cuda_opener
    from arrow_ipc_bridge.wire.metadata import REGION_CUDA_POOL, REGION_FLAG_KEPT, Region

    pool = _FakeImportedPool()
    monkeypatch.setattr(cuda_opener, "import_pool", lambda fd, device: pool)
    opener = cuda_opener.CudaOpener(max_kept=2)

    def region(pointer: int, kept: bool = True) -> Region:
        return Region(
            REGION_CUDA_POOL,
            1 << 20,
            fd_index=0,
            handle=b"P" * 24 + bytes([pointer]) * 64,
            flags=REGION_FLAG_KEPT if kept else 0,
        )

    def let_go(owner: Any) -> None:
        lib.aib_owner_unref(owner)
        reaper.settle()

    tables_before = lib.aib_regions_count()
    stats = cuda.cuda_stats()
    bases, owner = opener.open_pool_regions([region(1), region(1), region(2, kept=False)], [0], 0)
    slab_1 = bases[0]
    assert bases[1] == slab_1
    assert len(pool.imported) == 2
    assert lib.aib_regions_count() == tables_before + 1  # the kept slab, for the C get path
    let_go(owner)
    assert pool.imported == {slab_1}  # the kept slab stays; the counted pointer went with its lease
    bases, owner = opener.open_pool_regions([region(1)], [0], 0)
    assert bases == [slab_1]
    assert len(pool.imported) == 1
    after = cuda.cuda_stats()
    assert after["pool_kept_hits"] - stats["pool_kept_hits"] == 1
    assert after["pool_pointer_imports"] - stats["pool_pointer_imports"] == 2
    held = owner  # a message still using slab 1
    let_go(opener.open_pool_regions([region(2)], [0], 0)[1])
    let_go(opener.open_pool_regions([region(3)], [0], 0)[1])  # over the bound: slab 1 leaves the LRU
    assert list(opener._kept) == [region(2).handle, region(3).handle]
    assert slab_1 in pool.imported  # still used
    let_go(held)
    assert slab_1 not in pool.imported
    assert len(pool.imported) == 2
    assert lib.aib_regions_count() == tables_before + 2
    opener.close()
    reaper.settle()
    assert pool.imported == set()
    assert opener._pool_pointers == {}
    assert lib.aib_regions_count() == tables_before


def test_legacy_regions_of_a_message_open_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message's legacy regions open under one owner: each handle once (a repeat is a cache
    hit), in order; the LRU still bounds what stays open, and a handle it pushes out closes only
    when the last message using it lets go. A handle that is not 64 bytes opens nothing."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import opener as cuda_opener
    from arrow_ipc_bridge.wire.metadata import REGION_CUDA_LEGACY, Region

    opened: list[bytes] = []
    closed: list[int] = []

    def fake_open(handle: bytes, device: int) -> int:
        opened.append(handle)
        return 0x1000 * len(opened)

    monkeypatch.setattr(cuda_opener, "ipc_open_mem_handle", fake_open)
    monkeypatch.setattr(cuda_opener, "ipc_close_mem_handle", lambda ptr, device=None: closed.append(ptr))
    opener = cuda_opener.CudaOpener(max_legacy=2)
    a, b, c = (bytes([i]) * 64 for i in (1, 2, 3))

    def message(*handles: bytes) -> tuple[list[int], Any]:
        return opener.open_legacy_regions([Region(REGION_CUDA_LEGACY, 64, handle=h) for h in handles], 0)

    def let_go(owner: Any) -> None:
        lib.aib_owner_unref(owner)
        reaper.settle()

    before = cuda.cuda_stats()
    bases, first = message(a, b, a)
    assert bases == [0x1000, 0x2000, 0x1000]
    assert opened == [a, b]
    after = cuda.cuda_stats()
    assert after["legacy_opens"] - before["legacy_opens"] == 2
    assert after["legacy_hits"] - before["legacy_hits"] == 1
    bases, second = message(c)  # pushes b (least recently used) out of the LRU
    assert bases == [0x3000]
    assert closed == []  # the first message still uses b
    let_go(first)
    let_go(second)
    assert closed == [0x2000]  # a and c stay open in the LRU
    with pytest.raises(aib.ProtocolError, match="64 bytes"):
        message(a, b"short")
    assert opened == [a, b, c]
    opener.close()  # the LRU lets go: every handle is closed once
    reaper.settle()
    assert sorted(closed) == [0x1000, 0x2000, 0x3000]


def test_pool_messages_are_kept_from_their_second_get_under_one_name() -> None:
    """The kept-lease decision (the GPU suite checks what follows from it): a get keeps its lease
    only for IPC-pool data (pool regions, legacy ones beside them allowed) got under the same name
    with the same bytes as that name's previous get; never without a lease (import_message), a
    name, or with pool_linger 0; a stream of new messages is never kept."""
    from arrow_ipc_bridge.wire.metadata import (
        REGION_CUDA_LEGACY,
        REGION_CUDA_POOL,
        REGION_CUDA_VMM,
        REGION_HOST_FD,
        Region,
    )

    pool = [Region(REGION_CUDA_POOL, 64), Region(REGION_CUDA_LEGACY, 64)]
    with aib.Session() as session:
        keeps = session._remembered.keeps_pool_lease
        assert not keeps(pool, b"m1", "x", 7)  # first get of m1 under x
        assert keeps(pool, b"m1", "x", 7)  # second: kept
        assert not keeps(pool, b"m1", "x", 7)  # kept already: the next is a first again
        for i in range(5):  # new data every time: never
            assert not keeps(pool, b"v%d" % i, "stream", 7)
        assert not keeps(pool, b"m2", "y", 7)
        assert not keeps(pool, b"m3", "y", 7)  # other bytes under y: starts over
        assert keeps(pool, b"m3", "y", 7)
        assert not keeps(pool, b"m4", "z", 7)
        assert not keeps(pool, b"m4", "w", 7)  # same bytes, other name
        for regions in (
            [Region(REGION_CUDA_LEGACY, 64)],
            [*pool, Region(REGION_CUDA_VMM, 64)],
            [Region(REGION_HOST_FD, 64)],
            [],
        ):
            assert not keeps(regions, b"k", "k", 7)
            assert not keeps(regions, b"k", "k", 7)
        for _ in range(2):
            assert not keeps(pool, b"t", "t", 0)  # no lease (import_message)
            assert not keeps(pool, b"n", None, 7)
        for i in range(300):  # the per-name memory is bounded
            keeps(pool, b"b", f"name{i}", 7)
        assert len(session._remembered._got_once) <= 256
    with aib.Session(pool_linger=0) as session:
        for _ in range(3):
            assert not session._remembered.keeps_pool_lease(pool, b"m1", "x", 7)


def test_linger_thread_keeps_each_sessions_next_deadline() -> None:
    """The linger thread asks a watched session again at the deadline it returned (not before, and
    not never), sleeps when nothing lingers, and a new watch() wakes it."""
    from arrow_ipc_bridge.consumer import linger

    session = FakeKeptLeaseHolder([0.2, None])
    linger.watch(session)
    assert wait_for(lambda: len(session.calls) >= 2, 5.0)
    assert session.calls[1] - session.calls[0] >= 0.19  # asked again at its deadline
    time.sleep(0.3)
    assert len(session.calls) == 2  # nothing lingers: not asked again
    session.deadlines = [0.05, None]
    linger.watch(session)
    assert wait_for(lambda: len(session.calls) == 4, 5.0)

    class Failing:
        def _expire_kept_leases(self, now: float) -> float | None:
            raise RuntimeError("boom")

    failing = Failing()
    other = FakeKeptLeaseHolder([None])
    linger.watch(failing)
    linger.watch(other)
    assert other.asked.wait(5.0)  # one session failing does not stop the others
    del failing
