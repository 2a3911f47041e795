"""The reaper thread: owners that die in C reach Python through it (``reaper.py``)."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import pytest

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.runtime import reaper

# A process that already holds more than FD_SETSIZE (1024) descriptors when the reaper starts gets a
# reaper pipe numbered above 1024. The child checks that releases still reach the publisher then.
_MANY_FDS_CHILD = textwrap.dedent(
    """
    import os, resource, sys, tempfile, time
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        print("SKIP hard RLIMIT_NOFILE", hard)
        sys.exit(0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    import pyarrow as pa
    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge.runtime import reaper
    path = os.path.join(tempfile.mkdtemp(), "p.sock")
    with aib.Publisher(path) as pub:
        pub.publish("t", pa.table({"x": pa.array(range(1000))}))
        with aib.connect(path, timeout=10) as session:
            with session.get("t") as imported:
                assert pa.table(imported).num_rows == 1000
            deadline = time.monotonic() + 10
            while pub.active_leases and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pub.active_leases == 0, pub.active_leases
    assert reaper._thread is not None and reaper._thread.is_alive()
    print("OK")
    """
)


def test_reaper_runs_in_a_process_with_more_than_1024_descriptors() -> None:
    """The reaper waits with poll, so a descriptor number above FD_SETSIZE does not kill it and
    leases are still given back."""
    result = subprocess.run(
        [sys.executable, "-c", _MANY_FDS_CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    if result.stdout.startswith("SKIP"):
        pytest.skip(f"cannot raise the descriptor limit: {result.stdout.strip()}")
    assert result.stdout.strip().endswith("OK"), result.stdout + result.stderr


# ---------- draining: every dead owner's callback runs once ---------------------------------------------
def _kill_owners(tokens: list[int]) -> None:
    """Make one C owner per token and let it die at once: its token is queued for the reaper."""
    for token in tokens:
        owner = lib.aib_owner_new(token)
        assert owner != ffi.NULL
        lib.aib_owner_unref(owner)


def _wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Drain here too (the reaper thread may be the one that runs the callbacks); True once it holds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        reaper.drain()
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_every_dead_owner_runs_its_callback_once() -> None:
    """More owners die than one drain batch holds: each callback runs exactly once, and a callback
    that ran is forgotten (unregister says so, and it no longer counts as pending)."""
    ran: list[int] = []
    lock = threading.Lock()

    def record(i: int) -> None:
        with lock:
            ran.append(i)

    before = reaper.pending_callbacks()
    tokens = [reaper.register(functools.partial(record, i)) for i in range(3 * reaper._BATCH + 7)]
    assert reaper.pending_callbacks() == before + len(tokens)
    _kill_owners(tokens)
    assert _wait_for(lambda: len(ran) >= len(tokens)), f"{len(tokens) - len(ran)} callbacks never ran"
    assert sorted(ran) == list(range(len(tokens)))
    assert reaper.pending_callbacks() == before
    assert not any(reaper.unregister(token) for token in tokens)


def test_a_quiet_drain_runs_the_deaths_its_own_callbacks_cause() -> None:
    """On a quiet thread (a publish, a release: deaths queued without waking the reaper thread) a
    callback that lets another owner die queues that death quietly too: the same drain runs it,
    or nobody would until some later drain (a lease never given back)."""
    ran: list[str] = []
    inner = lib.aib_owner_new(reaper.register(lambda: ran.append("inner")))
    assert inner != ffi.NULL

    def outer_died() -> None:
        ran.append("outer")
        lib.aib_owner_unref(inner)  # dies here, on the quiet thread

    outer = lib.aib_owner_new(reaper.register(outer_died))
    assert outer != ffi.NULL
    reaper.settle()
    lib.aib_reaper_quiet(1)
    try:
        lib.aib_owner_unref(outer)
        reaper.drain()
        assert ran == ["outer", "inner"]
    finally:
        lib.aib_reaper_quiet(0)


def test_a_failing_callback_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    """A callback that raises is logged; the owners that died with it are still reported."""
    ran: list[int] = []

    def fail() -> None:
        raise RuntimeError("this notice fails")

    tokens = [reaper.register(fail)]
    tokens += [reaper.register(functools.partial(ran.append, i)) for i in range(5)]
    with caplog.at_level(logging.ERROR, logger="arrow_ipc_bridge"):
        _kill_owners(tokens)
        assert _wait_for(lambda: len(ran) == 5), ran
        # The failing notice may be drained after the others (the reaper thread and this one race).
        assert _wait_for(lambda: "owner release callback failed" in caplog.text), caplog.text
    assert sorted(ran) == list(range(5))


def test_a_family_callback_gets_the_value_of_the_token() -> None:
    """An owner dying with token base | value runs the family's callback with value alone."""
    got: list[int] = []
    base = reaper.register_family(got.append)
    try:
        _kill_owners([base | 5, base | 1, base | (1 << reaper.FAMILY_VALUE_BITS) - 1])
        assert _wait_for(lambda: len(got) == 3), got
        assert sorted(got) == [1, 5, (1 << reaper.FAMILY_VALUE_BITS) - 1]
    finally:
        reaper.unregister_family(base)
    _kill_owners([base | 7])  # unregistered: runs nothing
    reaper.drain()
    assert 7 not in got


def test_settle_waits_for_the_notice_the_reaper_thread_is_delivering() -> None:
    """A notice the reaper thread took out of the queue before another thread drained has run when
    settle() returns there (drain() alone would return while it is still being delivered)."""
    started = threading.Event()
    finished = threading.Event()

    def slow() -> None:
        started.set()
        time.sleep(0.3)
        finished.set()

    _kill_owners([reaper.register(slow)])  # not quiet: the reaper thread is woken and takes it
    assert started.wait(5), "the reaper thread never ran the notice"
    reaper.drain()
    assert not finished.is_set()  # drain() found nothing to run: the reaper thread has it
    reaper.settle()
    assert finished.is_set()


def test_settle_on_the_reaper_thread_does_not_wait_for_itself() -> None:
    """A callback that settles (a live stream closed from a release notice) returns at once."""
    took: list[float] = []

    def settle_inside() -> None:
        began = time.monotonic()
        reaper.settle(timeout=2.0)
        took.append(time.monotonic() - began)

    _kill_owners([reaper.register(settle_inside)])
    assert _wait_for(lambda: bool(took)), "the notice never ran"
    assert took[0] < 1.0, took


def test_a_forked_child_runs_none_of_the_parents_callbacks() -> None:
    """An owner inherited through fork that dies in the child runs nothing there (its callback acts
    on the parent's resources); the child's own registrations work."""
    ran: list[str] = []
    token = reaper.register(lambda: ran.append("parent's"))
    owner = lib.aib_owner_new(token)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 3
        try:
            lib.aib_owner_unref(owner)
            reaper.drain()
            own = reaper.register(lambda: ran.append("child's"))
            _kill_owners([own])
            reaper.drain()
            code = 0 if ran == ["child's"] else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child ran the parent's callback"
    lib.aib_owner_unref(owner)
    assert _wait_for(lambda: ran == ["parent's"]), ran
