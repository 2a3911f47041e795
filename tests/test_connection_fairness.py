"""One client cannot take every connection slot (docs/protocol.md, Limits; docs/security.md).

A process may hold ``max_connections_per_process`` connections, the processes of another admitted
uid ``max_connections_per_uid`` together; and when ``max_connections`` are taken, a new client
takes the slot of an idle connection that holds nothing (no lease, no held wait) of the process
holding the most, whose client gets LimitError. Before, one process holding every slot
with idle connections made every new consumer fail with LimitError.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
from multiprocessing.connection import Connection

import pyarrow as pa
import pytest
from helpers import socket_helpers

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge.errors import (
    InvalidArgumentError,
    LimitError,
    PeerClosedError,
)
from arrow_ipc_bridge.transport import protocol

SPAWN = multiprocessing.get_context("spawn")
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching a child to another uid needs root")


# socket_helpers' poll, with these tests' longer bound (publisher threads on busy cores)
wait_until = functools.partial(socket_helpers.wait_until, timeout=10.0)


def small_batch() -> pa.RecordBatch:
    return pa.record_batch({"x": pa.array(range(10), pa.int64())})


def _child(path: str, uid: int | None, sessions: int, out: Connection) -> None:
    """Spawned child: as ``uid`` (None: this one), open ``sessions`` sessions and get ``t`` on each;
    report ("ok", rows) or the first error's class name and message, then hold them until told."""
    try:
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        with contextlib.ExitStack() as stack:
            rows = 0
            for _ in range(sessions):
                session = stack.enter_context(aib.connect(path, timeout=5.0))
                with session.get("t") as imported:
                    rows += pa.record_batch(imported).num_rows
            out.send(("ok", rows))
            out.poll(60)
    except Exception as exc:  # reported to the parent, which asserts on it
        out.send(("error", type(exc).__name__, str(exc)))


@contextlib.contextmanager
def child(path: str, *, uid: int | None = None, sessions: int = 1):  # type: ignore[no-untyped-def]
    """A consumer process; yields its report (the connections stay open until the block ends)."""
    parent, end = SPAWN.Pipe()
    proc = SPAWN.Process(target=_child, args=(path, uid, sessions, end))
    proc.start()
    try:
        assert parent.poll(60), "the child did not answer"
        yield parent.recv()
    finally:
        with contextlib.suppress(OSError):
            parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_idle_sessions_of_one_process_make_room_for_another_consumer(sock_dir: str) -> None:
    """One process holds every slot with idle sessions: a consumer of another process still gets
    in, the idle session parked longest is closed for it and its next get says why; a session of
    the process holding them all is refused instead (it would take from itself)."""
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), max_connections=6, park_after=0.2) as pub:
        pub.publish("t", small_batch())
        with contextlib.ExitStack() as stack:
            hogs = [stack.enter_context(aib.connect(pub.path)) for _ in range(6)]
            assert wait_until(lambda: pub.serving_sessions == 0)  # all idle, parked
            with child(pub.path) as report:
                assert report == ("ok", 10)
                assert pub._server.evicted_connections == 1
                errors: list[str] = []
                closed = []
                for session in hogs:  # one was closed, and says why; the others were not touched
                    try:
                        with session.get("t") as batch:
                            assert batch.num_rows == 10
                    except LimitError as exc:
                        errors.append(str(exc))
                        closed.append(session)
                assert len(closed) == 1
                assert "closed to make room" in errors[0]
                with pytest.raises(PeerClosedError):
                    closed[0].get("t")
                with pytest.raises(LimitError, match="none is idle") as raised:
                    aib.connect(pub.path)
                assert raised.value.limit == "max_connections"


def test_silent_connections_make_room_before_their_handshake_timeout(sock_dir: str) -> None:
    """Connections that never said HELLO are the first to go for a new consumer."""
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), max_connections=4, handshake_timeout=60) as pub:
        pub.publish("t", small_batch())
        with contextlib.ExitStack() as stack:
            silent = [stack.enter_context(transport.connect(pub.path)) for _ in range(4)]
            assert wait_until(lambda: pub.active_sessions == 4)
            with child(pub.path) as report:
                assert report == ("ok", 10)
            with silent[0].recv(timeout=5.0) as farewell:
                assert farewell.kind == protocol.ERROR
                with pytest.raises(LimitError, match="closed to make room") as raised:
                    protocol.raise_error(farewell.payload)
                assert raised.value.limit == "max_connections"


def test_a_connection_holding_a_lease_or_a_wait_is_not_closed_to_make_room(sock_dir: str) -> None:
    """Only connections holding nothing go: one with a lease, one with a held wait and one being
    served stay, and a consumer that finds no idle connection gets LimitError."""
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), max_connections=3, park_after=0.2) as pub:
        pub.publish("t", small_batch())
        with aib.connect(pub.path) as leasing, transport.connect(pub.path) as waiting:
            held = leasing.get("t")
            waiting.send(protocol.HELLO, protocol.encode_hello())
            with waiting.recv(timeout=5.0) as welcome:
                assert welcome.kind == protocol.WELCOME
            waiting.send(protocol.WAIT, protocol.encode_wait(10**9, protocol.WAIT_FOREVER, b"t"))
            assert wait_until(lambda: pub.held_waits == 1 and pub.serving_sessions == 0)
            with child(pub.path) as report:  # the third slot: free
                assert report == ("ok", 10)
                with child(pub.path) as refused:
                    assert refused[:2] == ("error", LimitError.__name__), refused
            assert pub._server.evicted_connections == 0
            with held:
                assert pa.record_batch(held).num_rows == 10
            assert pub.held_waits == 1


def test_one_process_is_capped(sock_dir: str) -> None:
    """A process may hold max_connections_per_process connections; one more is refused with the
    cap named, and another process still gets in."""
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), max_connections_per_process=3) as pub:
        pub.publish("t", small_batch())
        with contextlib.ExitStack() as stack:
            for _ in range(3):
                stack.enter_context(aib.connect(pub.path))
            with pytest.raises(LimitError, match="max_connections_per_process") as raised:
                aib.connect(pub.path)
            assert raised.value.limit == "max_connections_per_process"
            with child(pub.path) as report:
                assert report == ("ok", 10)
        assert pub._server.refused_over_limit == 1


@needs_root
def test_another_uid_is_capped_and_the_owners_is_not(sock_dir: str) -> None:
    """The processes of an admitted uid may hold max_connections_per_uid connections together; the
    publisher's own uid is not capped so."""
    with aib.Publisher(
        os.path.join(sock_dir, "p.sock"), allowed_uids=[NOBODY], max_connections_per_uid=2
    ) as pub:
        pub.publish("t", small_batch())
        with child(pub.path, uid=NOBODY, sessions=2) as report:
            assert report == ("ok", 20)
            with child(pub.path, uid=NOBODY) as refused:
                assert refused[:2] == ("error", LimitError.__name__), refused
                assert "max_connections_per_uid" in str(refused[2])
            with child(pub.path, sessions=3) as owners:
                assert owners == ("ok", 30)


@pytest.mark.parametrize(
    "argument", ["max_connections_per_process", "max_connections_per_uid"], ids=lambda a: a
)
@pytest.mark.parametrize("value", [0, -1, 1.5, "3", None])
def test_the_caps_are_checked(sock_dir: str, argument: str, value: object) -> None:
    with pytest.raises((InvalidArgumentError, InvalidArgumentError), match=f"{argument} must be an int >= 1"):
        aib.Publisher(os.path.join(sock_dir, "p.sock"), **{argument: value})
