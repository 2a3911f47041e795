"""The session's side of waiting (feature ``"watch"``, docs/protocol.md "Waiting and versions").

A session waits for a name to be published, or for a version of it newer than one it has seen, with
one WAIT frame that the publisher holds open until it can answer: with a VERSIONED_ITEM (the newest
version, leased like a GET's ITEM) or with ERROR (:class:`~arrow_ipc_bridge.errors.BridgeTimeoutError`
when the wait's time ran out, the connection staying usable;
:class:`~arrow_ipc_bridge.errors.PeerClosedError` when the publisher closes). Nothing polls: the
session sends one frame and reads one answer.

The session's request lock is held for the whole wait (requests are answered in order, one at a
time), the channel's send lock only while the WAIT goes out, so the lease releases of objects
dropped meanwhile still reach the publisher. The session allows the publisher ``grace`` seconds (its
request timeout) past the wait's own timeout to answer; a publisher silent longer is taken for
stuck: the connection is closed (a late answer would be misread) and
:class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` raised.

With standing leases (any session but one with ``pool_linger=0``) and a publisher offering
``"board_wake"``, :class:`BoardWaits` serves
``get_next`` for names whose gets are local without a WAIT: it sleeps on the name's slot of the
publisher's version board (``transport/board.py``), which the publisher's next write of the slot wakes, then
gets the name (docs/lifetime.md, "Waiting on the version board").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from arrow_ipc_bridge.consumer import region_import
from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    NotPublishedError,
    PeerClosedError,
    ProtocolError,
)
from arrow_ipc_bridge.process_stats import wait_counters
from arrow_ipc_bridge.runtime import arguments
from arrow_ipc_bridge.transport import protocol
from arrow_ipc_bridge.transport.channel import Channel, Frame

if TYPE_CHECKING:
    from arrow_ipc_bridge.consumer.remembered import RememberedMessages
    from arrow_ipc_bridge.transport.board import SessionBoard

__all__ = ["MAX_WAIT", "BoardWaits", "Versioned", "check_after", "check_wait", "wait_for_version"]

MAX_WAIT = (protocol.WAIT_FOREVER - 1) / 1000
"""The longest finite wait, in seconds (~49.7 days: the WAIT frame's u32 milliseconds); ``None``
waits without a limit."""
_U64_MAX = (1 << 64) - 1


def check_wait(seconds: object, what: str) -> float | None:
    """``seconds`` as a wait's timeout: a number in [0, MAX_WAIT] or None (no limit); ``ValueError``
    / ``TypeError`` for anything else (negative, NaN, infinite, a bool, not a number)."""
    return arguments.optional_seconds(seconds, what, maximum=MAX_WAIT)


def check_after(after: object) -> int:
    """``after`` as a version to wait past: an int in [0, 2**64 - 1] (0: any version)."""
    return arguments.count(after, "after", least=0, most=_U64_MAX)


class Versioned:
    """What a wait's answer carried: the lease, the version and the message (``frame`` holds its fds)."""

    __slots__ = ("frame", "lease_id", "message", "version")

    def __init__(self, lease_id: int, version: int, message: bytes, frame: Frame) -> None:
        self.lease_id = lease_id
        self.version = version
        self.message = message
        self.frame = frame


def wait_for_version(
    channel: Channel,
    request_lock: threading.Lock,
    raw_name: bytes,
    *,
    after: int,
    timeout: float | None,
    grace: float | None,
) -> Versioned:
    """Send WAIT and read its answer; raises what the publisher answered instead of a version."""
    timeout_ms = protocol.WAIT_FOREVER if timeout is None else int(timeout * 1000 + 0.999)
    payload = protocol.encode_wait(after, timeout_ms, raw_name)
    with request_lock:
        channel.send(protocol.WAIT, payload, timeout=grace)
        next(wait_counters.waits_sent)
        read_for = None if timeout is None or grace is None else timeout + grace
        try:
            frame = _read_answer(channel, read_for)
        except BridgeTimeoutError as exc:
            channel.close()  # the publisher may still answer: that answer must not be misread
            raise BridgeTimeoutError(
                f"the publisher did not answer a wait of {timeout} s within {grace} s more "
                "(connection closed)",
                waiting_for="answer",
                timeout=read_for,
            ) from exc
        except BaseException:
            channel.close()  # interrupted (KeyboardInterrupt): the held wait's answer would be misread
            raise
    if frame.kind == protocol.ERROR:
        frame.close_fds()
        protocol.raise_error(frame.payload)
    try:
        if frame.kind != protocol.VERSIONED_ITEM:
            raise ProtocolError(f"expected VERSIONED_ITEM answering WAIT, got frame kind {frame.kind}")
        lease_id, version, message = protocol.decode_versioned_item(frame.payload)
        if version <= after:
            raise ProtocolError(f"WAIT after version {after} answered with version {version}")
    except BridgeError:
        frame.close_fds()
        channel.close()  # out of step with the publisher
        raise
    return Versioned(lease_id, version, message, frame)


def _read_answer(channel: Channel, timeout: float | None) -> Frame:
    """The answer, read in slices of at most :data:`_SLICE` seconds: the C receive does not return
    for signals, and a wait may be long, so Python gets a chance to run its signal handlers (Ctrl-C)
    between slices. A slice that ends before the answer's first byte leaves the channel in step."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _SLICE if deadline is None else min(_SLICE, max(deadline - time.monotonic(), 0.0))
        try:
            return channel.recv(timeout=left)
        except BridgeTimeoutError:
            if channel.closed or (deadline is not None and time.monotonic() >= deadline):
                raise


_SLICE = 1.0


# ---------- waits on the version board ------------------------------------------------------------
# A sleep on the board lasts at most this long before the connection is checked: a publisher that
# dies or closes wakes no sleeper, its socket tells.
_BOARD_NAP = 0.05
_BOARD_NAMES_MAX = 4096


class _Got(Protocol):
    """What a session's get returns, as a board wait uses it."""

    version: int | None

    def release(self) -> None: ...


_GotT = TypeVar("_GotT", bound=_Got)


class BoardWaits:
    """A session's ``get_next`` waits on the publisher's version board (feature ``"board_wake"``).

    Only names whose gets are local sleep there: their remembered message holds a standing lease
    on the entry in a board slot. Names whose last two WAIT answers named the same memory (renewed
    in place, or not republished) are *candidates*: one get gives them a standing lease. Names
    whose every version is new data stay on held WAITs, whose answer brings the message with one
    wake-up less than a board wake followed by a get."""

    def __init__(self, board: SessionBoard, remembered: RememberedMessages) -> None:
        self._board = board
        self._remembered = remembered
        self._candidates: set[bytes] = set()
        self._answer_digests: dict[bytes, int] = {}  # of each name's last WAIT answer

    def note_answer(self, raw_name: bytes, message: bytes, fds: Sequence[int]) -> None:
        """A WAIT answered ``raw_name`` with ``message`` and ``fds``: the name becomes a candidate when
        the answer before named the same memory (the same bytes and the same files: host data
        published anew has the same bytes in new files), and stops being one otherwise."""
        digest = hash((message, region_import.file_identities(fds)))
        if len(self._answer_digests) >= _BOARD_NAMES_MAX and raw_name not in self._answer_digests:
            self._answer_digests.clear()
            self._candidates.clear()
        if self._answer_digests.get(raw_name) == digest:
            self._candidates.add(raw_name)
        else:
            self._candidates.discard(raw_name)
        self._answer_digests[raw_name] = digest

    def next_version(
        self,
        name: str,
        raw_name: bytes,
        *,
        after: int,
        timeout: float | None,
        spin: float,
        channel: Channel,
        get: Callable[[], _GotT],
        closed: Callable[[], bool],
        local_gets: Callable[[], int],
    ) -> tuple[_GotT | None, float | None]:
        """A version of ``name`` over ``after``. While the name's slot shows the entry its standing
        lease is on at a version not over ``after``, sleep until the publisher writes the slot (poll
        it instead for the first ``spin`` seconds of the call); anything else (a newer version,
        another entry) is ``get()``, the session's get of the name. A candidate without a standing
        lease gets one get first, which gives it one. ``closed()`` and ``local_gets()``: the
        session's state and its count of gets answered from the board.

        ``(the import, None)``, or ``(None, time left)`` when a held WAIT serves better: no standing
        lease, the name is not published, two gets in a row brought nothing newer, or a woken get
        was a round trip (new data: the name stops being a candidate). BridgeTimeoutError when the
        time runs out asleep; PeerClosedError when the session is closed meanwhile (as a held WAIT
        would) or the publisher leaves (its farewell, if it sent one)."""
        board = self._board
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        spin_until = started + spin

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        fruitless_gets = 0
        while True:
            if closed():  # close() wakes the sleepers
                raise PeerClosedError(
                    f"the session was closed while waiting for a version of {name!r}", closed_locally=True
                )
            place = self._remembered.board_place(raw_name)
            if place is None and (fruitless_gets or raw_name not in self._candidates):
                return None, left()
            seen = None if place is None else board.peek(place[0])
            if place is not None and seen is not None and seen[1] == place[1] and seen[2] <= after:
                remaining = left()
                if remaining == 0.0:
                    what = f"a version of {name!r} newer than {after}"
                    raise BridgeTimeoutError(
                        f"waited {timeout} s for {what}", waiting_for="version", timeout=timeout
                    )
                nap = _BOARD_NAP if remaining is None else min(remaining, _BOARD_NAP)
                spinning = spin > 0 and time.monotonic() < spin_until
                if spinning:
                    nap = min(nap, max(0.0, spin_until - time.monotonic()))
                next(wait_counters.board_spins if spinning else wait_counters.board_waits)
                if not board.wait_for_change(place[0], seen[0], nap, spin=spinning) and not channel.quiet():
                    _meet_unasked(channel)  # a dead publisher's end of file, a farewell
                continue
            if fruitless_gets == 2:
                return None, left()  # the board and the answers disagree: the publisher decides
            local_before = local_gets()
            try:
                imported = get()
            except NotPublishedError:
                return None, left()  # the publisher holds a WAIT until the name is published
            if imported.version is not None and imported.version > after:
                if place is not None and local_gets() == local_before:
                    self._candidates.discard(raw_name)  # new data came: WAITs serve it better
                return imported, None
            imported.release()
            fruitless_gets += 1


def _meet_unasked(channel: Channel) -> None:
    """Read what a publisher sent unasked (nothing is, but its farewell ERROR before it drops the
    connection) and raise it; the end of file of a dead one raises PeerClosedError. The connection
    is closed either way."""
    frame = channel.recv(timeout=5.0)
    frame.close_fds()
    channel.close()
    if frame.kind == protocol.ERROR:
        protocol.raise_error(frame.payload)
    raise ProtocolError(f"the publisher sent frame kind {frame.kind} unasked")
