"""Processes killed mid-flight: a consumer killed while it holds a lease gives it back; data of a
producer killed while we hold it stays valid; a get in flight fails when the producer dies.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pytest
from helpers import session_children as children
from helpers.arrow_equality import assert_arrays_equal
from helpers.session_rig import (
    JOIN_S,
    ProducerRig,
    all_threads_stopped,
    child_env,
    read_line,
    sample_table,
    settle,
    wait_for,
)

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_killed_consumer_gives_its_lease_back(publisher: aib.Publisher) -> None:
    """A consumer process that holds a lease (and a pyarrow table built from it) and is killed with
    SIGKILL loses its lease within 5 s: ``active_leases`` returns to 0 and ``active_sessions`` drops."""
    publisher.publish("t", sample_table(5000))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, helpers.session_children as c; c.hold_lease_main(sys.argv[1], sys.argv[2])",
            publisher.path,
            "t",
        ],
        stdout=subprocess.PIPE,
        env=child_env(),
    )
    try:
        assert read_line(proc.stdout, 60.0) == "held 5000"
        assert publisher.active_leases == 1
        assert publisher.active_sessions == 1
        killed_at = time.monotonic()
        proc.kill()
        assert wait_for(lambda: publisher.active_leases == 0, 5.0), "lease still held 5 s after SIGKILL"
        assert wait_for(lambda: publisher.active_sessions == 0, 5.0)
        assert time.monotonic() - killed_at < 5.0
        assert proc.wait(JOIN_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(JOIN_S)
        assert proc.stdout is not None
        proc.stdout.close()
    # the publisher still serves
    with aib.connect(publisher.path, timeout=5.0) as session, session.get("t") as imported:
        assert pa.table(imported).num_rows == 5000


def test_consumer_keeps_data_after_producer_is_killed(
    producer: ProducerRig, caplog: pytest.LogCaptureFixture
) -> None:
    """After SIGKILL of the producer, everything we imported stays readable and correct (the table built
    before, and a new table built from the imported object after), releasing it raises nothing (not even on
    the reaper thread), and a new ``get`` on the dead session raises TransportError at once, not a hang."""
    caplog.set_level(logging.WARNING, logger="arrow_ipc_bridge")
    expected = sample_table(20_000, batches=3)
    kind, payload = children.to_ipc(expected)
    producer.child.call("ipc", "big", kind, payload, None)
    imported = producer.session.get("big")
    before_kill = pa.table(imported)
    producer.child.kill()
    assert_arrays_equal(before_kill, expected)
    after_kill = pa.table(imported)
    assert_arrays_equal(after_kill, expected)
    imported.release()
    imported.release()
    assert_arrays_equal(after_kill, expected)
    del before_kill, after_kill
    settle()
    started = time.monotonic()
    with pytest.raises(aib.TransportError):
        producer.session.get("big")
    assert time.monotonic() - started < 5.0
    with pytest.raises(aib.TransportError):
        producer.session.list()
    settle()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_get_in_flight_fails_when_producer_dies(producer: ProducerRig) -> None:
    """A ``get`` waiting on a stopped producer (SIGSTOP) raises TransportError as soon as the producer is
    killed, long before the session's 20 s timeout."""
    producer.child.call("ipc", "t", *children.to_ipc(sample_table(100)), None)
    waiting = aib.connect(producer.path, timeout=20.0)
    outcome: list[BaseException | None] = []
    try:
        os.kill(producer.child.pid, signal.SIGSTOP)
        # A group stop takes effect when the thread picked for the signal runs, which may be a few ms
        # later: until every thread of the child is stopped, it could still answer.
        assert wait_for(lambda: all_threads_stopped(producer.child.pid), 5.0)

        def get() -> None:
            try:
                waiting.get("t").release()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=get, name="in-flight-get")
        thread.start()
        time.sleep(0.3)
        assert not outcome, "the stopped producer answered"
        killed_at = time.monotonic()
        producer.child.kill()
        thread.join(JOIN_S)
        assert not thread.is_alive()
        assert time.monotonic() - killed_at < 5.0
        assert len(outcome) == 1
        assert isinstance(outcome[0], aib.TransportError), outcome
    finally:
        waiting.close()
