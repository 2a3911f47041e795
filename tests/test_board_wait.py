"""get_next on the publisher's version board (feature "board_wake"): a session with standing leases
sleeps on the name's board slot instead of asking the publisher to hold a WAIT, once the name's
gets are local (a standing lease); the publisher's next publish of the name wakes it. Names whose
every version is new data go back to held WAITs. Also: timeouts, an unpublish, a publisher that
closes or dies, a session closed meanwhile, other threads using the session, an older publisher,
slots taken by other names, spinning, and the board's wait and wake themselves.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers import waiting_children
from helpers.session_rig import run_later, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.transport import protocol

pytestmark = pytest.mark.usefixtures("no_leaks")

SPAWN = mp.get_context("spawn")
SOON = 10.0  # generous (a loaded 2-core machine): what should happen takes milliseconds


def _values(imported: Any) -> list[Any]:
    return list(pa.array(imported).to_pylist())


def _counters() -> tuple[int, int]:
    waits = aib.stats().waits
    return waits.waits_sent, waits.board_waits


def _stand(session: aib.Session, name: str = "v") -> None:
    """Get ``name`` twice: its second get keeps a standing lease, whose board slot get_next sleeps on."""
    session.get(name).release()
    session.get(name).release()
    assert session._remembered.board_place(name.encode()) is not None


@pytest.fixture
def standing(publisher: aib.Publisher) -> Iterator[aib.Session]:
    """A session with standing leases (so with the board) whose gets of "v" are local."""
    publisher.publish("v", pa.array([0]))
    with aib.connect(publisher.path, timeout=5.0) as session:
        assert session._board_waits is not None
        _stand(session)
        yield session


def test_get_next_sleeps_on_the_board_and_sends_no_wait(
    publisher: aib.Publisher, standing: aib.Session
) -> None:
    seen = publisher.version("v")
    sent, slept = _counters()
    publishing = run_later(0.3, lambda: publisher.publish("v", pa.array([1])))
    started = time.monotonic()
    with standing.get_next("v", after=seen, timeout=30.0) as newer:
        assert time.monotonic() - started < SOON
        assert _values(newer) == [1]
        assert newer.version == publisher.version("v") > seen
        assert newer.publisher_id == publisher.publisher_id
    publishing.join()
    now_sent, now_slept = _counters()
    assert now_sent == sent  # no WAIT went to the publisher
    assert now_slept > slept
    assert publisher.held_waits == 0


def test_new_data_every_step_goes_back_to_held_waits(publisher: aib.Publisher, standing: aib.Session) -> None:
    """The producer publishes new host data (a new message) once the consumer took the last one:
    the first wait sleeps on the board, and its woken get is a round trip; from then on each wait
    is a held WAIT, whose answer brings the message with one wake-up less. Every value arrives, in
    order."""
    took = threading.Semaphore(0)
    steps = 100

    def produce() -> None:
        for value in range(1, steps + 1):
            if not took.acquire(timeout=SOON):
                return
            publisher.publish("v", pa.array([value]))

    producer = threading.Thread(target=produce)
    producer.start()
    sent, _ = _counters()
    try:
        after = publisher.version("v")
        for value in range(1, steps + 1):
            took.release()
            with standing.get_next("v", after=after, timeout=SOON) as item:
                assert _values(item) == [value]
                assert item.version is not None
                assert item.version > after
                after = item.version
    finally:
        producer.join(SOON)
    assert _counters()[0] == sent + steps - 1


def test_already_newer_answers_at_once_and_timeout_zero_does_not_wait(
    publisher: aib.Publisher, standing: aib.Session
) -> None:
    seen = publisher.version("v")
    publisher.publish("v", pa.array([1]))
    with standing.get_next("v", after=seen, timeout=0) as newer:
        assert _values(newer) == [1]
        current = newer.version
    assert current is not None
    started = time.monotonic()
    with pytest.raises(aib.BridgeTimeoutError, match="newer than"):
        standing.get_next("v", after=current, timeout=0)
    assert time.monotonic() - started < SOON


def test_a_timeout_on_the_board_is_clean_and_the_session_goes_on(
    publisher: aib.Publisher, standing: aib.Session
) -> None:
    seen = publisher.version("v")
    started = time.monotonic()
    with pytest.raises(aib.BridgeTimeoutError, match="newer than"):
        standing.get_next("v", after=seen, timeout=0.3)
    assert 0.25 <= time.monotonic() - started < SOON
    publisher.publish("v", pa.array([2]))
    with standing.get_next("v", after=seen, timeout=SOON) as newer:
        assert _values(newer) == [2]


def test_an_unpublish_while_asleep_waits_for_the_name_to_come_back(
    publisher: aib.Publisher, standing: aib.Session
) -> None:
    """The slot empties: the wait goes to the publisher, which holds it until the name is
    published again."""
    seen = publisher.version("v")

    def unpublish_then_republish() -> None:
        publisher.unpublish("v")
        assert wait_for(lambda: publisher.held_waits == 1, SOON)
        publisher.publish("v", pa.array([7]))

    changing = run_later(0.2, unpublish_then_republish)
    with standing.get_next("v", after=seen, timeout=30.0) as back:
        assert _values(back) == [7]
        assert back.version is not None
        assert back.version > seen
    changing.join()


def test_other_threads_use_the_session_while_one_sleeps_on_the_board(
    publisher: aib.Publisher, standing: aib.Session
) -> None:
    publisher.publish("other", pa.array([5]))
    seen = publisher.version("v")
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(standing.get_next("v", after=seen, timeout=30.0)))
    _, slept = _counters()
    waiter.start()
    try:
        assert wait_for(lambda: _counters()[1] > slept, SOON)
        started = time.monotonic()
        with standing.get("other") as other:  # a held WAIT would keep the request lock meanwhile
            assert _values(other) == [5]
        assert time.monotonic() - started < SOON
        publisher.publish("v", pa.array([1]))
    finally:
        waiter.join(SOON)
    assert len(got) == 1
    with got[0] as newer:
        assert _values(newer) == [1]


@pytest.mark.parametrize(
    ("spin", "counter"), [(0.0, "board_waits"), (600.0, "board_spins")], ids=["asleep", "spinning"]
)
def test_closing_the_session_wakes_its_waiter(publisher: aib.Publisher, spin: float, counter: str) -> None:
    """close() from another thread ends a wait on the board at once, asleep or polling, with the
    PeerClosedError a held WAIT would get; nothing stays leased."""
    publisher.publish("v", pa.array([0]))
    session = aib.connect(publisher.path, timeout=5.0)
    _stand(session)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            session.get_next("v", after=publisher.version("v"), timeout=None, spin=spin)
        except aib.BridgeError as exc:
            errors.append(exc)

    def waited() -> int:
        return int(getattr(aib.stats().waits, counter))

    before = waited()
    thread = threading.Thread(target=wait)
    thread.start()
    assert wait_for(lambda: waited() > before, SOON)
    started = time.monotonic()
    session.close()
    thread.join(SOON)
    assert time.monotonic() - started < SOON
    assert len(errors) == 1
    assert isinstance(errors[0], aib.PeerClosedError)
    assert "closed while waiting" in str(errors[0])
    assert wait_for(lambda: publisher.active_leases == 0, SOON)


def test_a_publisher_closing_while_a_session_sleeps_raises_peer_closed(sock_dir: str) -> None:
    pub = aib.Publisher(os.path.join(sock_dir, "closing.sock"))
    pub.publish("v", pa.array([0]))
    session = aib.connect(pub.path, timeout=5.0)
    try:
        _stand(session)
        closing = run_later(0.3, pub.close)
        started = time.monotonic()
        with pytest.raises(aib.PeerClosedError):
            session.get_next("v", after=pub.version("v"), timeout=None)
        assert time.monotonic() - started < SOON
        closing.join()
    finally:
        session.close()
        pub.close()


def test_a_publisher_killed_while_a_session_sleeps_raises_peer_closed(sock_dir: str) -> None:
    """A dead publisher wakes nobody: the sleeper sees its connection end within its nap."""
    path = os.path.join(sock_dir, "killed.sock")
    parent, child = SPAWN.Pipe()
    process = SPAWN.Process(target=waiting_children.republishing_publisher_main, args=(child, path))
    process.start()
    try:
        assert parent.poll(60)
        assert parent.recv() == ("ready",)
        with aib.connect(path, timeout=10.0) as session:
            _stand(session)
            with session.get("v") as first:
                after = first.version
            assert after is not None
            parent.send(("publish", 1))
            assert parent.recv()[0] == "published"
            with session.get_next("v", after=after, timeout=SOON) as newer:
                assert _values(newer) == [1]
                after = newer.version
            assert after is not None
            _stand(session)  # the new data replaced the standing lease: gets make one again
            _, slept = _counters()
            killing = run_later(0.3, process.kill)
            started = time.monotonic()
            with pytest.raises(aib.PeerClosedError):
                session.get_next("v", after=after, timeout=None)
            assert time.monotonic() - started < SOON
            assert _counters()[1] > slept  # it was asleep on the board when the publisher died
            killing.join()
    finally:
        process.kill()
        process.join(SOON)
        parent.close()
        child.close()


def test_a_publisher_without_board_wake_holds_the_wait(
    sock_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older publisher (a board, but no wake-ups) is asked to hold a WAIT, as before."""
    monkeypatch.setattr(protocol, "FEATURES", tuple(f for f in protocol.FEATURES if f != "board_wake"))
    with aib.Publisher(os.path.join(sock_dir, "older.sock")) as pub:
        pub.publish("v", pa.array([0]))
        with aib.connect(pub.path, timeout=5.0) as session:
            assert session._board is not None
            assert session._board_waits is None
            _stand(session)
            seen = pub.version("v")

            def publish_once_held() -> None:
                assert wait_for(lambda: pub.held_waits == 1, SOON)  # the publisher holds the WAIT
                pub.publish("v", pa.array([1]))

            publishing = run_later(0.2, publish_once_held)
            with session.get_next("v", after=seen, timeout=30.0) as newer:
                assert _values(newer) == [1]
            publishing.join()


def test_a_name_whose_waits_bring_the_same_message_moves_to_the_board(publisher: aib.Publisher) -> None:
    """Two WAIT answers of the same message (a name renewed in place, or not republished) make the
    name a candidate: its next get_next gets it once (a standing lease) and sleeps on the board. A
    woken get that brought new data (a round trip) sends the next wait to the publisher again."""
    publisher.publish("v", pa.array([0]))
    with aib.connect(publisher.path, timeout=5.0) as session:
        session.get("v", wait=0).release()
        with session.get("v", wait=0) as again:
            seen = again.version
        assert seen is not None
        sent, slept = _counters()
        publishing = run_later(0.3, lambda: publisher.publish("v", pa.array([1])))
        with session.get_next("v", after=seen, timeout=SOON) as newer:
            assert _values(newer) == [1]
            after = newer.version
        publishing.join()
        assert _counters()[0] == sent  # no WAIT: it slept on the board
        assert _counters()[1] > slept
        assert after is not None
        publishing = run_later(0.3, lambda: publisher.publish("v", pa.array([2])))
        with session.get_next("v", after=after, timeout=SOON) as newest:
            assert _values(newest) == [2]
        publishing.join()
        assert _counters()[0] == sent + 1  # new data last time: a held WAIT


def test_the_board_wait_times_out_and_wakes_on_a_write(
    publisher: aib.Publisher, standing: aib.Session
) -> None:
    """SessionBoard.wait_for_change: False after its timeout when nothing was written; True (at
    once) when the slot was written after the peek; a publish wakes a sleeper."""
    board = standing._board
    assert board is not None
    place = standing._remembered.board_place(b"v")
    assert place is not None
    slot = place[0]
    seen = board.peek(slot)
    assert seen is not None
    seq, serial, version = seen
    assert serial == place[1]
    assert version == publisher.version("v")
    started = time.monotonic()
    assert board.wait_for_change(slot, seq, 0.2) is False
    assert 0.15 <= time.monotonic() - started < SOON
    publisher.publish("v", pa.array([1]))
    assert board.wait_for_change(slot, seq, SOON) is True  # written since the peek: no sleep
    later = board.peek(slot)
    assert later is not None
    assert later[0] != seq
    assert later[2] > version
    writing = run_later(0.2, lambda: publisher.publish("v", pa.array([2])))
    started = time.monotonic()
    assert board.wait_for_change(slot, later[0], 30.0) is True
    assert time.monotonic() - started < SOON
    writing.join()


def test_a_spinning_get_next_polls_instead_of_sleeping(
    publisher: aib.Publisher, standing: aib.Session
) -> None:
    """spin=: the wait polls the slot (no sleep counted) and still answers the next version; once
    the spin time is over it sleeps as before."""
    seen = publisher.version("v")
    waits = aib.stats().waits
    publishing = run_later(0.2, lambda: publisher.publish("v", pa.array([1])))
    with standing.get_next("v", after=seen, timeout=30.0, spin=20.0) as newer:
        assert _values(newer) == [1]
        after = newer.version
    publishing.join()
    now = aib.stats().waits
    assert now.board_spins > waits.board_spins
    assert now.board_waits == waits.board_waits  # it never slept
    assert after is not None
    _stand(standing)  # new data replaced the standing lease: gets make one again
    publishing = run_later(0.4, lambda: publisher.publish("v", pa.array([2])))
    with standing.get_next("v", after=after, timeout=30.0, spin=0.1) as newest:
        assert _values(newest) == [2]
    publishing.join()
    assert aib.stats().waits.board_waits > now.board_waits  # slept after its 0.1 s of polling


@pytest.mark.parametrize("spin", [-1.0, float("nan"), float("inf")])
def test_a_bad_spin_is_refused_before_anything_is_sent(standing: aib.Session, spin: float) -> None:
    with pytest.raises(ValueError, match="spin"):
        standing.get_next("v", after=1, timeout=1.0, spin=spin)
    with pytest.raises(TypeError, match="spin"):
        standing.get_next("v", after=1, timeout=1.0, spin="1")  # type: ignore[arg-type]


def test_a_slot_taken_by_another_name_sends_the_wait_to_the_publisher(
    publisher: aib.Publisher, standing: aib.Session
) -> None:
    """The name is unpublished and another name takes its freed slot: the board then shows that
    name's entry, so the wait does not sleep there (it would miss the name's return); it asks the
    publisher, which answers once the name is published again."""
    seen = publisher.version("v")
    place = standing._remembered.board_place(b"v")
    assert place is not None
    publisher.unpublish("v")
    publisher.publish("w", pa.array([9]))  # the freed slot is the next one handed out
    _stand(standing, "w")
    assert standing._remembered.board_place(b"w")[0] == place[0]  # type: ignore[index]
    sent = aib.stats().waits.waits_sent
    republishing = run_later(0.3, lambda: publisher.publish("v", pa.array([3])))
    with standing.get_next("v", after=seen, timeout=30.0) as back:
        assert _values(back) == [3]
    republishing.join()
    assert aib.stats().waits.waits_sent == sent + 1  # one WAIT, held by the publisher


def test_a_stale_slot_is_not_slept_on(publisher: aib.Publisher, standing: aib.Session) -> None:
    """The session's standing lease is on the name's entry in a slot another name holds now (the
    name was unpublished, the other name took its slot, the name came back in a new slot): the wait
    does not sleep on the old slot, whose entry is not the name's (the name's next version would
    never wake it there), but asks, and is answered."""
    assert standing._remembered.board_place(b"v") is not None
    publisher.unpublish("v")
    publisher.publish("w", pa.array([9]))  # takes the freed slot
    publisher.publish("v", pa.array([1]))  # back, in another slot, at a newer version
    current = publisher.version("v")
    publishing = run_later(0.3, lambda: publisher.publish("v", pa.array([2])))
    _, slept = _counters()
    with standing.get_next("v", after=current, timeout=SOON) as newer:
        assert _values(newer) == [2]
    publishing.join()
    assert _counters()[1] == slept  # never asleep on the old slot
