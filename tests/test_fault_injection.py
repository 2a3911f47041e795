"""Fault injection: SIGKILL a consumer or a producer at known protocol phases, check what survives.

The guarantee (``lifetime.md``, Failures): a consumer that dies at any point gives back everything it
held in the publisher (leases, its connection, the connection's thread, descriptors in flight), and a
producer that dies leaves its consumers' imports readable and their next request failing with
:class:`~arrow_ipc_bridge.errors.PeerClosedError`, again leaking nothing in the survivor.

Each consumer child (``helpers.fault_children.consumer_phase_main``, spawn start method) reports the phase it
reached over a control pipe, and only then is it SIGKILLed, so every trial hits its phase. After
each trial the surviving process must be back to its baseline: open fds, threads (Python's and the
kernel's), mappings of bridge memfds, ``Publisher.active_leases`` and ``active_sessions``, within a
bounded wait for the connection handler and the reaper.

CI runs every phase a few times; ``AIB_LONG=1`` runs the long profile (1,000 consumer kills, 20
producer kills with 60 consumers each). ``AIB_FAULT_TRIALS`` overrides the consumer-kill count.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers.fault_children import (
    CONSUMER_PHASES,
    consumer_phase_main,
    producer_main,
    quiet_counts,
    resource_counts,
    settled,
    table_for,
)

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.errors import BridgeError, PeerClosedError

SPAWN = multiprocessing.get_context("spawn")
LONG = os.environ.get("AIB_LONG") == "1"
CONSUMER_TRIALS = int(os.environ.get("AIB_FAULT_TRIALS", "1000" if LONG else str(2 * len(CONSUMER_PHASES))))
PRODUCER_TRIALS, CONSUMERS_PER_PRODUCER = (20, 60) if LONG else (2, 8)
NAMES = ["alpha", "beta", "gamma"]
ROWS = 2_000
# Phases at which the child holds at least one lease when it is killed.
LEASING_PHASES = {"holding_lease", "holding_capsule", "holding_raw_capsule", "mid_release", "mid_get"}
STEP_TIMEOUT = 60.0  # seconds for a child to start or reach its phase (2 loaded cores)


def _expect(conn: Any, what: str) -> tuple[Any, ...]:
    if not conn.poll(STEP_TIMEOUT):
        raise AssertionError(f"child did not answer {what!r} within {STEP_TIMEOUT} s")
    reply: tuple[Any, ...] = conn.recv()
    assert reply[0] == what, f"child answered {reply!r}, expected {what!r}"
    return reply


def _kill_and_reap(process: Any) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=30)
    assert process.exitcode == -signal.SIGKILL, f"child exit code {process.exitcode}, expected SIGKILL"


def _publisher_state(publisher: aib.Publisher, *, quiet: bool = False) -> dict[str, int]:
    counts = quiet_counts(publisher) if quiet else resource_counts()
    return {**counts, "leases": publisher.active_leases, "sessions": publisher.active_sessions}


def _run_consumer_kills(publisher: aib.Publisher, phases: list[str], batch: int = 10) -> dict[str, int]:
    """SIGKILL one consumer child per entry of ``phases``; assert the publisher's state after each."""
    per_phase: dict[str, int] = dict.fromkeys(CONSUMER_PHASES, 0)
    for start in range(0, len(phases), batch):
        children = []
        for _ in phases[start : start + batch]:  # start a batch ahead: start-up dominates a trial
            parent_end, child_end = SPAWN.Pipe()
            process = SPAWN.Process(target=consumer_phase_main, args=(child_end, publisher.path, NAMES))
            process.start()
            child_end.close()
            children.append((process, parent_end))
        try:
            for (process, conn), phase in zip(children, phases[start : start + batch], strict=True):
                _expect(conn, "ready")
                baseline = _publisher_state(publisher, quiet=True)
                assert baseline["leases"] == 0
                assert baseline["sessions"] == 0
                conn.send(("go", phase))
                reply = conn.recv() if conn.poll(STEP_TIMEOUT) else ("timeout",)
                assert reply == ("reached", phase), f"phase {phase}: child answered {reply!r}"
                if phase in LEASING_PHASES:
                    assert publisher.active_leases >= 1, f"phase {phase}: no lease taken"
                if phase == "many_leases":
                    assert publisher.active_leases == 48
                _kill_and_reap(process)
                after = settled(lambda: _publisher_state(publisher), baseline)
                assert after == baseline, f"after a kill at phase {phase}: {after} != baseline {baseline}"
                per_phase[phase] += 1
        finally:
            for process, conn in children:  # killed and reaped already, or left by a failure
                if process.is_alive():
                    process.kill()
                process.join(timeout=30)
                process.close()
                conn.close()
    return per_phase


@pytest.fixture
def loaded_publisher(tmp_path: Path) -> Any:
    """A publisher with every name of NAMES published (conftest.py's ``publisher`` starts empty)."""
    with aib.Publisher(tmp_path / "fault.sock") as pub:
        for k, name in enumerate(NAMES):
            pub.publish(name, table_for(ROWS, k))
        yield pub


def test_consumer_sigkill_at_every_phase_leaks_nothing_in_the_publisher(
    loaded_publisher: aib.Publisher,
) -> None:
    # One warm-up trial starts what lives for the process anyway (the reaper thread, pyarrow's pools),
    # so the per-trial baseline is a steady state.
    _run_consumer_kills(loaded_publisher, ["holding_lease"], batch=1)
    phases = [CONSUMER_PHASES[k % len(CONSUMER_PHASES)] for k in range(CONSUMER_TRIALS)]
    per_phase = _run_consumer_kills(loaded_publisher, phases)
    assert sum(per_phase.values()) == CONSUMER_TRIALS
    assert all(per_phase[phase] >= 1 for phase in CONSUMER_PHASES) or len(CONSUMER_PHASES) > CONSUMER_TRIALS
    # Still serving: a fresh session reads the right data.
    with aib.connect(loaded_publisher.path) as session, session.get(NAMES[1]) as imported:
        assert pa.table(imported).equals(table_for(ROWS, 1))
    print(f"consumer SIGKILL trials: {CONSUMER_TRIALS} ({per_phase})")


def _stop(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: kill() only queues the signal,
    and a serve thread that runs meanwhile would still answer the next request."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within {timeout} s")


def _get_in_thread(session: aib.Session, name: str) -> tuple[threading.Thread, list[BaseException]]:
    failures: list[BaseException] = []

    def get() -> None:
        try:
            session.get(name).release()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=get)
    thread.start()
    return thread, failures


def test_producer_sigkill_leaves_consumers_reading_and_failing_cleanly(tmp_path: Path) -> None:
    expected = [table_for(ROWS, k) for k in range(len(NAMES))]
    reading = 0
    for trial in range(PRODUCER_TRIALS):
        path = str(tmp_path / f"producer-{trial}.sock")
        parent_end, child_end = SPAWN.Pipe()
        process = SPAWN.Process(target=producer_main, args=(child_end, path, NAMES, ROWS))
        process.start()
        child_end.close()
        try:
            _expect(parent_end, "ready")
            baseline = resource_counts()
            # Consumers in every state a producer can die under: holding leases (an import and the
            # table built from it), holding only the table (import released), holding a remembered
            # message, idle after the handshake, and one blocked in a get.
            sessions = [aib.connect(path, timeout=10.0) for _ in range(CONSUMERS_PER_PRODUCER)]
            held: list[tuple[int, Any, pa.Table]] = []
            for c, session in enumerate(sessions[:-2]):
                k = c % len(NAMES)
                imported = session.get(NAMES[k])
                table = pa.table(imported)
                if c % 3 == 1:
                    imported.release()
                elif c % 3 == 2:  # remembered: got again, the first import released
                    imported.release()
                    imported = session.get(NAMES[k])
                held.append((k, imported, table))
            idle, blocked = sessions[-2], sessions[-1]
            _stop(process.pid)  # the get below then waits for an answer
            thread, failures = _get_in_thread(blocked, NAMES[0])
            time.sleep(0.2)
            _kill_and_reap(process)
            thread.join(timeout=30)
            assert not thread.is_alive()
            assert len(failures) == 1
            assert isinstance(failures[0], PeerClosedError), repr(failures[0])
            for k, imported, table in held:
                assert table.equals(expected[k]), "a consumer read wrong data after its producer died"
                if not imported.released:
                    assert pa.table(imported).equals(expected[k])
                reading += 1
            for session in sessions[:-1]:
                with pytest.raises(PeerClosedError):
                    session.get(NAMES[0])
            for entry in held:
                entry[1].release()
            del held, table, imported, entry  # the tables map the regions too
            for session in sessions:
                session.close()
            del sessions, idle, blocked
            after = settled(resource_counts, baseline)
            assert after == baseline, f"consumer process after its producer died: {after} != {baseline}"
        finally:
            if process.is_alive():
                process.kill()
            process.join(timeout=30)
            parent_end.close()
    assert reading == PRODUCER_TRIALS * (CONSUMERS_PER_PRODUCER - 2)
    print(f"producer SIGKILL trials: {PRODUCER_TRIALS}, consumers still reading correct data: {reading}")


def test_a_session_refuses_new_work_after_its_producer_died_with_a_bridge_error(tmp_path: Path) -> None:
    """The error a consumer sees is the documented one, whatever it asks for."""
    path = str(tmp_path / "gone.sock")
    parent_end, child_end = SPAWN.Pipe()
    process = SPAWN.Process(target=producer_main, args=(child_end, path, NAMES, 10))
    process.start()
    child_end.close()
    try:
        _expect(parent_end, "ready")
        with aib.connect(path, timeout=10.0) as session:
            _kill_and_reap(process)
            for call in (session.list, lambda: session.get(NAMES[0]), session.ping):
                with pytest.raises(PeerClosedError) as caught:
                    call()
                assert isinstance(caught.value, BridgeError)
    finally:
        if process.is_alive():
            process.kill()
        process.join(timeout=30)
        parent_end.close()
