"""The publisher's versions and held waits (feature ``"watch"``, docs/protocol.md "Waiting and versions").

Every publish of a name gets a version from the C publication table (``serve.c``: the table's
publish counter, so versions only grow, across names and across unpublish / republish, and are never
reused while the publisher lives). A session's WAIT frame asks for the newest version of a name that
is over ``after`` (0: any, i.e. "wait until it is published"); when there is none yet, the wait is
*held*: the serving thread registers it here and goes back to serving, and whoever changes the name
answers it. :class:`Watch` is that book:

- ``publish`` (on the producer's thread) tells it the new version and answers every wait on the
  name at once (:meth:`Watch.published` then :meth:`Watch.deliver`);
- a clock thread, alive only while some held wait has a deadline, answers ERROR
  :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` when one runs out;
- ``close`` answers every held wait with ERROR :class:`~arrow_ipc_bridge.errors.PeerClosedError`;
- a connection that closes drops its waits (:meth:`Watch.forget`) before its lease table is freed.

Answers go out on the waiting connection from a thread that is not its serving thread, so
:class:`WaitingConnection` orders them with that thread's sends: Python's send lock for the frames
Python sends, the C connection's mutex (``aib_server_conn_lease_newer``) for the ones the C serve
loop sends and for its lease table, where the answer's lease lives like a GET's.

A publish never waits for a consumer. The publishing thread answers a held wait only when that
cannot block: the connection's locks are free, the client has read everything sent to it before
(``SIOCOUTQ`` 0, as a session blocked reading the answer has: it sends one request at a time) and
the answer fits the socket's buffer (:data:`FAST_ANSWER_BYTES`). A client that has not read what
it was sent is not reading: its connection is closed at once (counted in
``stats().waits.stalled_waiters_closed``). Any other answer (a busy connection, a large answer)
goes to the answering thread, alive only while it has answers to send, which waits up to
:data:`ANSWER_SEND_TIMEOUT` per answer and closes a connection that does not take it by then.

Lock order: the publisher's lock, then :class:`Watch`'s; a connection's answer lock, then the
channel's send lock, then the C mutex. No answer is sent while :class:`Watch`'s lock is held.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from arrow_ipc_bridge._ffi import ffi, lib, new_error
from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    LimitError,
    PeerClosedError,
)
from arrow_ipc_bridge.process_stats import wait_counters
from arrow_ipc_bridge.transport import protocol
from arrow_ipc_bridge.transport.channel import Channel, error_for, millis

__all__ = ["ANSWER_SEND_TIMEOUT", "FAST_ANSWER_BYTES", "HeldWait", "Watch", "WaitingConnection"]

_log = logging.getLogger("arrow_ipc_bridge")

ANSWER_SEND_TIMEOUT = 1.0
"""Seconds an answer may take to go out on the answering thread (or on the serving thread, for a
WAIT answered at once) before the connection is closed; the publishing thread waits for nothing."""

FAST_ANSWER_BYTES = 32 * 1024
"""The largest answer the publishing thread sends itself: it fits at once into the socket of a
client that read everything before (Linux's default Unix socket buffer is 208 KiB). Larger ones go
to the answering thread, since they take the client's reading to go out."""

_ANSWERED = "answered"
_NOT_DUE = "not due"  # the name changed under the answer (unpublished again): hold the wait again
_GONE = "gone"  # the connection closed; nothing to answer
_LATER = "later"  # it could not be answered without waiting: the answering thread will
# A VERSIONED_ITEM's bytes besides its message: the frame header and the lease and version.
_ANSWER_OVERHEAD = 16 + 16


class WaitingConnection:
    """One connection's end of its held waits: answers them from any thread until :meth:`close`.

    ``served`` is the connection's C lease table (``aib_server_conn``), which the publisher frees
    only after :meth:`close` returned, so no answer uses it afterwards.
    """

    __slots__ = ("_lock", "_open", "channel", "served", "waits")

    def __init__(self, channel: Channel, served: Any) -> None:
        self.channel = channel
        self.served = served
        self._lock = threading.Lock()
        self._open = True
        self.waits = 0  # its waits held in the Watch now (changed under the Watch's lock)

    def close(self) -> None:
        """No answer from now on (waits for one in progress)."""
        with self._lock:
            self._open = False

    @property
    def closed(self) -> bool:
        return not self._open

    def answer(
        self, raw_name: bytes, after: int, *, held: bool = False, answer_bytes: int | None = None
    ) -> str:
        """Lease and send the newest version of ``raw_name`` if it is over ``after``. ``held``: a
        held wait's answer, due now (the client must have read everything before; one that has not
        is closed). ``answer_bytes``: the answer's size, when it must go out without waiting
        (the publishing thread): ``_LATER`` when it cannot, and nothing was done."""
        version = ffi.new("uint64_t *")
        rc = self._call(
            lambda err: lib.aib_server_conn_lease_newer(
                self.served, raw_name, len(raw_name), after, millis(ANSWER_SEND_TIMEOUT), version, err
            ),
            unread_closes=held,
            answer_bytes=answer_bytes,
        )
        if isinstance(rc, str):  # _LATER
            return rc
        if rc is None:
            return _GONE
        if rc == lib.AIB_OK:
            return _ANSWERED
        if rc in (lib.AIB_SERVE_ABSENT, lib.AIB_SERVE_NOT_NEWER):
            return _NOT_DUE
        name = raw_name.decode("utf-8", "replace")
        limit_error = _limit_error(rc, name)
        if limit_error is None:
            return _GONE  # _call closed the connection
        self.fail(limit_error)
        return _ANSWERED

    def fail(self, error: BridgeError) -> None:
        """Answer the held wait with ERROR ``error``."""
        payload = protocol.encode_error(error)
        self._call(
            lambda err: lib.aib_server_conn_send(
                self.served, protocol.ERROR, payload, len(payload), millis(ANSWER_SEND_TIMEOUT), err
            )
        )

    def _call(
        self, send: Any, *, unread_closes: bool = False, answer_bytes: int | None = None
    ) -> int | str | None:
        """Run ``send(err)`` (a C call that may send on the connection) holding the answer lock and
        the channel's send lock; None when the connection is closed, or was closed because the
        call failed (out of step, or a client that does not read). ``unread_closes``: close the
        connection instead when the client has not read everything sent to it. ``answer_bytes``
        (not None): wait for nothing; ``_LATER`` (nothing done) when a lock is busy or an answer of
        that many bytes might not go out at once."""
        _, send_lock = self.channel.locked()
        failure: BridgeError | None = None
        at_once = answer_bytes is not None
        if not self._lock.acquire(blocking=not at_once):
            return _LATER  # another thread answers on this connection now
        try:
            if not self._open or self.channel.closed:
                return None
            if not send_lock.acquire(blocking=not at_once, timeout=-1 if at_once else ANSWER_SEND_TIMEOUT):
                if at_once:
                    return _LATER
                failure = BridgeError("answering a held wait: the connection's send lock stayed busy")
                rc: int | None = None
            else:
                try:
                    # Under the send lock: the channel closes its socket only holding it, so the
                    # descriptor asked is this connection's.
                    unread = int(lib.aib_channel_peer_unread(self.channel.raw)) if unread_closes else 0
                    if unread != 0:
                        next(wait_counters.stalled_waiters_closed)
                        failure = BridgeError(
                            "an answer to its held wait was due while it had not read what it was "
                            f"sent before ({unread} bytes unread): a client that does not read"
                        )
                        rc = None
                    elif answer_bytes is not None and answer_bytes > FAST_ANSWER_BYTES:
                        return _LATER
                    else:
                        err = new_error()
                        rc = int(send(err))
                        if rc not in _ANSWER_RETURNS:
                            failure = error_for(
                                rc, err, "answering a held wait", ANSWER_SEND_TIMEOUT, waiting_for="send"
                            )
                            rc = None
                finally:
                    send_lock.release()
        finally:
            self._lock.release()
        if failure is not None:
            # Closed outside the locks: close() takes the channel's locks itself. A client that
            # left meanwhile is no news; one that stopped reading is.
            level = logging.DEBUG if isinstance(failure, PeerClosedError) else logging.WARNING
            _log.log(level, "arrow_ipc_bridge: closing a waiting session: %s", failure)
            self.channel.close()
        return rc


def _limit_error(rc: int, name: str) -> BridgeError | None:
    """The error for an answer the C core refused at a limit (nothing leased or sent), else None."""
    if rc == lib.AIB_SERVE_LEASE_LIMIT:
        return LimitError(
            f"the wait for {name!r} ended: this connection holds as many leases as the publisher's "
            "max_leases_per_connection; release some and wait again",
            limit="max_leases_per_connection",
        )
    if rc == lib.AIB_SERVE_UNREAD_LIMIT:
        return LimitError(
            f"the wait for {name!r} ended: this connection has not read answers carrying descriptors",
            limit="max_unread_fds",
        )
    if rc == lib.AIB_SERVE_FDS_BUSY:
        return LimitError(
            f"the wait for {name!r} ended: the kernel refused to pass its descriptors (ETOOMANYREFS); "
            "nothing was leased, wait again",
            limit="descriptors_in_flight",
        )
    return None


_ANSWER_RETURNS = frozenset(
    {
        int(lib.AIB_OK),
        int(lib.AIB_SERVE_ABSENT),
        int(lib.AIB_SERVE_NOT_NEWER),
        int(lib.AIB_SERVE_LEASE_LIMIT),
        int(lib.AIB_SERVE_UNREAD_LIMIT),
        int(lib.AIB_SERVE_FDS_BUSY),
    }
)


class HeldWait:
    """One WAIT: answer ``conn`` with the newest version of ``raw_name`` over ``after``, or with an
    error at ``deadline`` (``time.monotonic()``; None: no limit)."""

    __slots__ = ("after", "conn", "deadline", "held", "raw_name", "timeout_ms")

    def __init__(self, conn: WaitingConnection, raw_name: bytes, after: int, timeout_ms: int) -> None:
        self.conn = conn
        self.raw_name = raw_name
        self.after = after
        self.timeout_ms = timeout_ms
        self.deadline = None if timeout_ms == protocol.WAIT_FOREVER else time.monotonic() + timeout_ms / 1000
        self.held = False  # registered in the Watch (under its lock)

    def timed_out(self) -> BridgeTimeoutError:
        name = self.raw_name.decode("utf-8", "replace")
        what = f"a version of {name!r} newer than {self.after}" if self.after else f"{name!r} to be published"
        seconds = self.timeout_ms / 1000
        waiting_for = "version" if self.after else "name"
        return BridgeTimeoutError(f"waited {seconds} s for {what}", waiting_for=waiting_for, timeout=seconds)


class Watch:
    """The publisher's book of published versions and held waits (see the module docstring)."""

    def __init__(
        self, name: str, message_bytes: Callable[[bytes], int] | None = None, max_waits: int | None = None
    ) -> None:
        self._name = name
        # Waits one connection may have held at once (None: no limit); one more gets LimitError.
        self._max_waits = max_waits
        # The size of the message a name's answer carries now (its current publication's), so that
        # the publishing thread leaves large answers to the answering thread; None: every answer
        # the publishing thread is due goes to the answering thread.
        self._message_bytes = message_bytes
        self._lock = threading.Lock()
        self._clock_wakes = threading.Condition(self._lock)
        self._current: dict[bytes, int] = {}  # name -> version published now
        self._waits: dict[bytes, list[HeldWait]] = {}
        self._deadlines: list[tuple[float, int, HeldWait]] = []  # heap; entries no longer held are skipped
        self._order = itertools.count()
        self._clock: threading.Thread | None = None
        # Held waits due that the publishing thread could not answer without waiting, and the
        # thread that answers them (alive while there are some).
        self._later: collections.deque[HeldWait] = collections.deque()
        self._answerer: threading.Thread | None = None
        self._closed = False

    # ---------- the producer's side ---------------------------------------------------------------------
    def published(self, raw_name: bytes, version: int) -> list[HeldWait]:
        """``raw_name`` is published at ``version`` now (call it under the publisher's lock, right
        after the C table took it); returns the waits to :meth:`deliver` (without that lock)."""
        with self._lock:
            self._current[raw_name] = version
            if raw_name not in self._waits:  # nobody waits for this name (a step loop's usual case)
                return []
            due = [w for w in self._waits.get(raw_name, ()) if w.after < version]
            if due:
                left = [w for w in self._waits[raw_name] if w.after >= version]
                if left:
                    self._waits[raw_name] = left
                else:
                    del self._waits[raw_name]
                for wait in due:
                    self._let_go(wait)
            return due

    def unpublished(self, raw_name: bytes) -> None:
        """``raw_name`` is going away (call it under the publisher's lock, before the C table drops it)."""
        with self._lock:
            self._current.pop(raw_name, None)

    def cleared(self) -> None:
        with self._lock:
            self._current.clear()

    # ---------- a session's WAIT ----------------------------------------------------------------------------
    def request(self, wait: HeldWait) -> None:
        """A WAIT arrived: answer it now if a version over ``after`` is published, else hold it."""
        self.deliver([wait], held=False)

    def deliver(self, waits: list[HeldWait], *, held: bool = True) -> None:
        """Answer each of ``waits`` (taken out of the book: ``held``, on the publishing thread, which
        waits for no consumer) with its name's newest version; what cannot go out at once goes to
        the answering thread. One whose name changed again before its answer went out (unpublished
        meanwhile) is held again. ``held=False``: a WAIT just received (the serving thread)."""
        for wait in waits:
            self._answer_or_hold(wait, due=held, at_once=held)

    def _answer_or_hold(self, wait: HeldWait, *, due: bool, at_once: bool) -> None:
        """Answer ``wait`` when ``due`` (a held wait: the client must have read everything before),
        else hold it, or answer it when its name has a newer version now (a WAIT just received,
        answered on its serving thread like any request). ``at_once``: wait for nothing; an answer
        that cannot go out at once is queued for the answering thread."""
        held = due
        while True:
            if due:
                answer_bytes = None
                if at_once:  # a size not known counts as large
                    sized = self._message_bytes
                    message_bytes = FAST_ANSWER_BYTES + 1 if sized is None else sized(wait.raw_name)
                    answer_bytes = _ANSWER_OVERHEAD + message_bytes
                outcome = wait.conn.answer(wait.raw_name, wait.after, held=held, answer_bytes=answer_bytes)
                if outcome == _LATER:
                    self._answer_later(wait)
                    return
                if outcome != _NOT_DUE:
                    return
            if not self._hold(wait):
                return
            due = True

    def _answer_later(self, wait: HeldWait) -> None:
        """Queue a due wait for the answering thread (started when it is not running)."""
        with self._lock:
            self._later.append(wait)
            if self._answerer is None:
                self._answerer = threading.Thread(
                    target=self._run_answerer, name=f"{self._name}-answers", daemon=True
                )
                self._answerer.start()

    def _run_answerer(self) -> None:
        while True:
            with self._lock:
                if not self._later:
                    self._answerer = None
                    return
                wait = self._later.popleft()
            try:
                self._answer_or_hold(wait, due=True, at_once=False)
            except Exception:  # one answer's failure must not strand the others queued
                _log.exception("arrow_ipc_bridge: answering a held wait failed")

    def join_answerer(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the answering thread to finish (the publisher's close, once
        its connections are closed: what is left to answer then ends at once)."""
        with self._lock:
            answerer = self._answerer
        if answerer is not None and answerer is not threading.current_thread():
            answerer.join(timeout)

    def _hold(self, wait: HeldWait) -> bool:
        """Register ``wait`` unless it is due now (True: answer it) or over (answered here); False
        when it was registered or answered."""
        error: BridgeError | None = None
        with self._lock:
            if wait.conn.closed:
                # Gone (Watch.forget ran or is about to: it closes the connection first, so a wait
                # registered here before that would still be dropped by it).
                return False
            if self._closed:
                error = _closing()
            elif self._current.get(wait.raw_name, 0) > wait.after:
                return True
            elif self._max_waits is not None and wait.conn.waits >= self._max_waits:
                error = _wait_limit(wait, self._max_waits)
            elif wait.deadline is not None and wait.deadline <= time.monotonic():
                error = wait.timed_out()
            else:
                next(wait_counters.waits_held)
                wait.held = True
                wait.conn.waits += 1
                self._waits.setdefault(wait.raw_name, []).append(wait)
                if wait.deadline is not None:
                    self._prune_deadlines()
                    heapq.heappush(self._deadlines, (wait.deadline, next(self._order), wait))
                    self._start_clock()
                return False
        wait.conn.fail(error)
        return False

    def forget(self, conn: WaitingConnection) -> None:
        """``conn`` closed: drop its held waits (call it before its lease table is freed)."""
        conn.close()
        with self._lock:
            for raw_name in list(self._waits):
                kept = [w for w in self._waits[raw_name] if w.conn is not conn]
                for wait in self._waits[raw_name]:
                    if wait.conn is conn:
                        self._let_go(wait)
                if kept:
                    self._waits[raw_name] = kept
                else:
                    del self._waits[raw_name]
            self._clock_wakes.notify()

    @property
    def held_waits(self) -> int:
        """Waits held now (all connections)."""
        with self._lock:
            return self._held_count()

    @property
    def pending_deadlines(self) -> int:
        """Deadlines in the clock's heap, answered ones not yet pruned included (a diagnostic)."""
        with self._lock:
            return len(self._deadlines)

    # ---------- deadlines ---------------------------------------------------------------------------------
    def _start_clock(self) -> None:
        """(Under the lock.) The clock thread runs while some held wait has a deadline."""
        if self._clock is None:
            self._clock = threading.Thread(target=self._run_clock, name=f"{self._name}-watch", daemon=True)
            self._clock.start()
        else:
            self._clock_wakes.notify()

    def _run_clock(self) -> None:
        while True:
            with self._lock:
                expired: list[HeldWait] = []
                while True:
                    while self._deadlines and not self._deadlines[0][2].held:
                        heapq.heappop(self._deadlines)  # answered or dropped already
                    if self._closed or not self._deadlines:
                        self._clock = None
                        return
                    now = time.monotonic()
                    while self._deadlines and self._deadlines[0][0] <= now:
                        wait = heapq.heappop(self._deadlines)[2]
                        if wait.held:
                            self._unhold(wait)
                            expired.append(wait)
                    if expired:
                        break
                    self._clock_wakes.wait(self._deadlines[0][0] - now)
            for wait in expired:  # answered outside the lock
                wait.conn.fail(wait.timed_out())

    def _prune_deadlines(self) -> None:
        """(Under the lock.) Waits answered before their deadline stay in the heap until it comes
        up; a consumer looping on get_next with a long timeout would pile them up, so the heap is
        rebuilt from the waits still held once most of it is stale (amortised O(1) per wait)."""
        if len(self._deadlines) < 64 or len(self._deadlines) < 2 * self._held_count():
            return
        self._deadlines = [entry for entry in self._deadlines if entry[2].held]
        heapq.heapify(self._deadlines)

    def _held_count(self) -> int:
        return sum(len(waits) for waits in self._waits.values())

    def _let_go(self, wait: HeldWait) -> None:
        """(Under the lock.) ``wait`` is no longer held (its connection holds one wait less)."""
        wait.held = False
        wait.conn.waits -= 1

    def _unhold(self, wait: HeldWait) -> None:
        """(Under the lock.) Take ``wait`` out of the book."""
        self._let_go(wait)
        waits = self._waits.get(wait.raw_name, [])
        waits.remove(wait)
        if not waits:
            self._waits.pop(wait.raw_name, None)

    # ---------- the publisher's close ----------------------------------------------------------------------
    def close(self) -> None:
        """Answer every held wait with ERROR PeerClosedError (the publisher is closing); later WAITs
        get the same answer at once."""
        with self._lock:
            self._closed = True
            waits = [w for held in self._waits.values() for w in held]
            self._waits.clear()
            self._deadlines.clear()
            for wait in waits:
                self._let_go(wait)
            self._clock_wakes.notify()
            clock = self._clock
        for wait in waits:
            wait.conn.fail(_closing())
        if clock is not None and clock is not threading.current_thread():
            clock.join()


def _wait_limit(wait: HeldWait, limit: int) -> LimitError:
    name = wait.raw_name.decode("utf-8", "replace")
    if len(name) > 64:
        name = name[:61] + "..."
    return LimitError(
        f"WAIT for {name!r} refused: this connection holds {limit} waits already (the publisher's "
        "max_waits_per_connection); a session waits for one thing at a time",
        limit="max_waits_per_connection",
        value=limit,
    )


def _closing() -> PeerClosedError:
    return PeerClosedError("the publisher is closing: connect again (wait_for_publisher=True) to a new one")
