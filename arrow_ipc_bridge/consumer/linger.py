"""Ends the leases sessions keep for re-gets, once they sat unused for the session's linger time.

A session remembers an IPC-pool message together with one lease on it (CUDA requires the importer
to free its pool imports before the exporter frees the memory, so the imports may only outlive the
user's release while a lease keeps the producer's memory). That lease must not be kept forever: the
producer may have replaced or unpublished the data. One daemon thread per process asks each watched
session's remembered messages to give back the kept leases unused for longer than its
``pool_linger`` (``RememberedMessages._expire_kept_leases``) and sleeps until the earliest next
deadline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Protocol

__all__ = ["watch", "BUSY_RETRY_S"]

BUSY_RETRY_S = 0.005  # a session busy with a request is asked again this much later


class HoldsKeptLeases(Protocol):
    def _expire_kept_leases(self, now: float) -> float | None:
        """Let go of what lingered too long; return the next deadline (monotonic), None when none."""


_log = logging.getLogger("arrow_ipc_bridge")
_cond = threading.Condition()
_sessions: weakref.WeakSet[HoldsKeptLeases] = weakref.WeakSet()
_changes = 0  # bumped by watch(): the thread does not sleep through a watch made during its scan
_thread: threading.Thread | None = None


def _after_fork_in_child() -> None:
    # Sessions the child inherited are its parent's (unusable here); the thread stayed there.
    global _cond, _sessions, _changes, _thread
    _cond = threading.Condition()
    _sessions = weakref.WeakSet()
    _changes = 0
    _thread = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def watch(watched: HoldsKeptLeases) -> None:
    """``watched`` (a session's remembered messages) holds a kept lease now: keep its deadline."""
    global _changes, _thread
    with _cond:
        _sessions.add(watched)
        _changes += 1
        if _thread is None:
            _thread = threading.Thread(target=_run, name="arrow_ipc_bridge-linger", daemon=True)
            _thread.start()
        _cond.notify()


def _run() -> None:
    while True:
        with _cond:
            seen = _changes
            sessions = list(_sessions)
        deadlines = _expire(sessions, time.monotonic())
        del sessions  # no strong references while sleeping: sessions stay collectable
        with _cond:
            if _changes == seen:
                _cond.wait(None if not deadlines else max(0.0, min(deadlines) - time.monotonic()))


def _expire(sessions: list[HoldsKeptLeases], now: float) -> list[float]:
    deadlines = []
    for session in sessions:
        try:
            deadline = session._expire_kept_leases(now)
        except Exception:  # one session's failure must not stop the others' expiry
            _log.exception("arrow_ipc_bridge: giving back a kept lease failed")
            deadline = now + 1.0
        if deadline is not None:
            deadlines.append(deadline)
    return deadlines
