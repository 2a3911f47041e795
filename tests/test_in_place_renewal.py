"""The publisher table's in-place renewal (``aib_pubtable_renew``), which a publish of CUDA columns
updated in place uses (``Publisher._renew``; the GPU side is tests/test_gpu_fastpath.py): a new,
larger version for the same entry, its message and leases kept, and waits for a newer version
answered with it."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator

import pyarrow as pa
import pytest
from helpers.counting import SessionCounts

import arrow_ipc_bridge as aib
from arrow_ipc_bridge._ffi import lib


@pytest.fixture
def publisher() -> Iterator[aib.Publisher]:
    with aib.Publisher(os.path.join(tempfile.mkdtemp(dir="/tmp"), "renew.sock")) as pub:
        yield pub


def _renew(publisher: aib.Publisher, name: str) -> int:
    """What Publisher._renew does once record_in_place found a CUDA version in place."""
    with publisher._lock:
        waiting = publisher._renew_version_locked(name.encode())
    if waiting:
        publisher._watch.deliver(waiting)
    return publisher.version(name)


def test_a_renewal_is_a_new_version_of_the_same_entry(publisher: aib.Publisher) -> None:
    """The version grows past every earlier one (of any name); the message is the same bytes, so a
    session's get is its remembered message; a lease on the older version stays valid."""
    counts = SessionCounts()
    publisher.publish("t", pa.table({"x": [1, 2, 3]}))
    publisher.publish("other", pa.table({"y": [1]}))
    before = publisher.version("t")
    with aib.connect(publisher.path, timeout=10.0) as session:
        held = session.get("t")
        remembered = counts.remembered_gets
        renewed = _renew(publisher, "t")
        assert renewed > publisher.version("other") > before
        assert publisher.version("t") == renewed
        with session.get("t") as again:
            assert again.to_host().column("x").to_pylist() == [1, 2, 3]
        assert counts.remembered_gets == remembered + 1  # the same message: nothing new imported
        assert held.to_host().column("x").to_pylist() == [1, 2, 3]
        held.release()
    deadline = time.monotonic() + 10.0  # the session's releases reach the publisher asynchronously
    while publisher.active_leases and time.monotonic() < deadline:
        time.sleep(0.01)
    assert publisher.active_leases == 0


def test_a_wait_for_a_newer_version_is_answered_by_a_renewal(publisher: aib.Publisher) -> None:
    """get_next after the current version gets the renewed one, with its version number."""
    publisher.publish("t", pa.table({"x": [1.0]}))
    with aib.connect(publisher.path, timeout=10.0) as session:
        first = session.get("t", wait=5.0)
        version = first.version
        first.release()
        renewed = _renew(publisher, "t")
        with session.get_next("t", after=version, timeout=5.0) as imported:
            assert imported.version == renewed > version


def test_renewing_a_name_not_published_does_nothing(publisher: aib.Publisher) -> None:
    """The C table answers 0 for a name it does not hold (none, or unpublished) and changes nothing."""
    raw = b"t"
    assert lib.aib_pubtable_renew(publisher._table, raw, len(raw)) == 0
    publisher.publish("t", pa.table({"x": [1]}))
    publisher.unpublish("t")
    assert lib.aib_pubtable_renew(publisher._table, raw, len(raw)) == 0
    assert publisher.version("t") == 0


def test_a_held_wait_is_answered_by_a_renewal(publisher: aib.Publisher) -> None:
    """A get_next held for a newer version is answered when the entry is renewed."""
    import threading

    publisher.publish("t", pa.table({"x": [1.0]}))
    version = publisher.version("t")
    timer = threading.Timer(0.3, _renew, (publisher, "t"))
    timer.start()
    try:
        with (
            aib.connect(publisher.path, timeout=10.0) as session,
            session.get_next("t", after=version, timeout=10.0) as imported,
        ):
            assert imported.version > version
    finally:
        timer.join()
