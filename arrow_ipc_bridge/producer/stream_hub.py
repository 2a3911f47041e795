"""The publisher's side of live streams: each stream's subscribers, their credit, the slow-consumer
policies and the batches' lifetime (docs/streams.md).

A subscription has a connection of its own. After SUBSCRIBE the publisher's serving thread for that
connection stays in :meth:`StreamHub.serve_subscription` for the subscription's life, reading the
RELEASE frames that give credit back; BATCH frames are sent by whichever thread commits the batch
(the producer's ``write``), or, for batches queued under ``"drop_oldest"``, by the serving thread
when credit comes back. One condition per stream guards all of its state, so a subscriber's frames
leave in sequence order and credit is counted exactly.

A batch is held by the writer while it is committed and by every subscriber that has it queued or
leased; when the last lets go its ``on_free`` runs (an export is closed, a reserved slot becomes
free for reuse). A subscriber whose connection closes (cleanly, by a crash or SIGKILL) lets go of
everything it held at once.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Collection

from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    ClosedError,
    LimitError,
    NotPublishedError,
    PeerClosedError,
    ProtocolError,
    TransportError,
    no_stream_message,
)
from arrow_ipc_bridge.process_stats import stream_counters
from arrow_ipc_bridge.transport import protocol, stream_frames
from arrow_ipc_bridge.transport.channel import Channel, Frame

__all__ = ["MAX_SUBSCRIPTIONS", "Batch", "LiveStreamState", "StreamHub"]

_log = logging.getLogger("arrow_ipc_bridge")

SEND_TIMEOUT = 10.0
"""Seconds a BATCH may wait for room in a consumer's socket. Credit bounds what a consumer has
unreleased, so its socket holds at most ``max_in_flight`` frames: this fires only for a consumer
that stopped reading altogether, which is then disconnected."""
WRITER_ACTIVE_S = 0.02
"""While the producer wrote within this many seconds, subscribers' serving threads stay off their
sockets and the writer reads the RELEASEs it needs itself (see :meth:`LiveStreamState.commit`): a
thread asleep on a subscriber's socket is woken by every RELEASE, and on a machine of few cores
that wake-up takes the consumer's core from it. Once the writer is idle this long, the serving
threads read again (releases, a consumer gone)."""
SPIN_S = 0.0005
"""How long a write short of credit looks for it without sleeping (a RELEASE sent to a thread that
is not asleep wakes nobody) before it sleeps on the slow subscriber's socket."""
_SLEEP_S = 0.005  # the longest sleep of a write short of credit between two looks at the stream's state
_monotonic = time.monotonic
_batch_header = stream_frames.encode_batch_header
_NO_SLOT = stream_frames.NO_SLOT
_FLAG_RING = stream_frames.FLAG_RING
_FLAG_SLOT_AGAIN = stream_frames.FLAG_SLOT_AGAIN
_BATCH_KIND = int(protocol.BATCH)
MAX_SUBSCRIPTIONS = 128
"""Default ``max_subscriptions``: live-stream subscriptions a publisher serves at once (each holds
one of its threads and one of its ``max_connections``)."""


class Batch:
    """One committed batch: the message (encoded once) and its descriptors, shared by every
    subscriber it is sent to. ``on_free`` runs when the last holder lets go. ``slot``: the
    reserved slot or ring segment (``ring``) whose memory the batch lies in, ``generation``: which
    file of that slot (a ring segment replaced by a larger one is another file)."""

    __slots__ = ("fds", "generation", "message", "on_free", "refs", "ring", "sequence", "slot")

    def __init__(
        self,
        message: bytes,
        fds: list[int],
        on_free: Callable[[], None],
        slot: int = stream_frames.NO_SLOT,
        *,
        ring: bool = False,
        generation: int = 0,
    ) -> None:
        self.slot = slot
        self.ring = ring
        self.generation = generation
        self.message = message
        self.fds = fds
        self.on_free = on_free
        self.refs = 1  # the writer's, until its commit returns
        self.sequence = -1

    def unref(self) -> None:
        """Called with the stream's condition held."""
        self.refs -= 1
        if self.refs == 0:
            try:
                self.free()
            except Exception:  # a failing close must not break the stream for everyone else
                _log.exception("arrow_ipc_bridge: freeing stream batch %d failed", self.sequence)

    def free(self) -> None:
        """The last holder let go (the stream's condition held): runs ``on_free``. A batch that
        lives in reusable memory of its own (a ring segment) gives that memory back instead."""
        self.on_free()


class _Subscriber:
    """One consumer's subscription: its connection, credit window, leases and queue."""

    __slots__ = (
        "channel",
        "detached",
        "dropped",
        "end",
        "ended",
        "leases",
        "next_lease",
        "pending",
        "poller",
        "sent_slots",
        "window",
    )

    def __init__(self, channel: Channel, window: int) -> None:
        self.channel = channel
        self.poller = select.poll()  # the writer's look at this socket (RELEASEs come)
        self.poller.register(channel.fileno(), select.POLLIN)
        self.detached = False  # its connection is gone (or was dropped): its serving thread ends
        self.window = window
        self.leases: dict[int, Batch] = {}  # sent and not released yet
        self.pending: collections.deque[Batch] = collections.deque()  # "drop_oldest": not sent yet
        self.next_lease = 1
        self.dropped = 0
        self.end: stream_frames.StreamEnd | None = None  # to send once the queue is empty
        self.ended = False  # STREAM_END sent (or the connection is gone): nothing more goes out
        # (ring, slot) -> (generation, message) of the last BATCH sent in full for that slot: a
        # batch in the same slot with the same message and file goes as the slot's name alone
        self.sent_slots: dict[tuple[bool, int], tuple[int, bytes]] = {}

    @property
    def has_room(self) -> bool:
        return len(self.leases) < self.window


class LiveStreamState:
    """The publisher's state of one live stream (made by ``Publisher.open_stream``)."""

    def __init__(self, name: str, *, max_in_flight: int, policy: str, block_timeout: float | None) -> None:
        self.name = name
        self.max_in_flight = max_in_flight
        self.policy = policy
        self.block_timeout = block_timeout
        # The condition's lock, entered directly where no wait follows (commit): a Condition's
        # own __enter__ is a Python call around it.
        self._mutex = threading.RLock()
        self.cond = threading.Condition(self._mutex)
        self._subscribers: list[_Subscriber] = []
        self._next_sequence = 0
        self.closed = False
        self.dropped = 0
        """Batches dropped for slow consumers (policy ``"drop_oldest"``), all consumers together."""
        self.slow_consumers_ended = 0
        """Subscriptions ended by the ``"error"`` policy."""
        self.on_finished: Callable[[], None] | None = None
        """Called once when the stream ends (the writer frees its reserved slots)."""
        self.last_write = 0.0
        """``time.monotonic()`` of the last commit (the serving threads' cue, ``WRITER_ACTIVE_S``)."""
        self._spinning = True  # whether a write short of credit looks before it sleeps

    @property
    def subscribers(self) -> int:
        with self.cond:
            return sum(1 for s in self._subscribers if not s.ended)

    @property
    def leases(self) -> int:
        """Batches sent to subscribers and not released yet, all subscribers together."""
        with self.cond:
            return sum(len(s.leases) for s in self._subscribers)

    @property
    def queued(self) -> int:
        """Batches queued for slow subscribers (policy ``"drop_oldest"``), not sent yet."""
        with self.cond:
            return sum(len(s.pending) for s in self._subscribers)

    @property
    def next_sequence(self) -> int:
        with self.cond:
            return self._next_sequence

    # ---------- the producer's side -----------------------------------------------------------------
    def commit(self, batch: Batch) -> int:
        """Offer ``batch`` to every subscriber (under the stream's policy); returns its sequence.
        The writer's reference on ``batch`` is given up here, sent or not."""
        with self._mutex:  # self.cond's lock
            try:
                if self.closed:
                    raise ClosedError(f"the stream {self.name!r} is closed", what="stream")
                self.last_write = _monotonic()
                # Credit the serving threads have not read (they stay off the sockets while the
                # writer is active): read here what a subscriber short of room has sent back, so a
                # consumer that keeps up is never taken for slow.
                short = False
                for sub in self._subscribers:
                    if not sub.ended and (sub.pending or len(sub.leases) >= sub.window):
                        self._collect(sub)
                        short = short or (not sub.ended and len(sub.leases) >= sub.window)
                if short and self.policy == "block":  # still short after the look: wait
                    self._wait_for_room()
                sequence = batch.sequence = self._next_sequence
                self._next_sequence = sequence + 1
                # A copy: _send may detach a subscriber (a connection gone), which removes it.
                for sub in tuple(self._subscribers):
                    if sub.ended:
                        continue
                    if not sub.pending and len(sub.leases) < sub.window:
                        self._send(sub, batch)  # the usual case: it has credit
                    else:
                        self._offer(sub, batch)
                return sequence
            finally:
                batch.unref()

    def _wait_for_room(self) -> None:
        """Wait (condition held) until every subscriber has credit. The writer reads the RELEASEs
        itself: first without sleeping for up to ``SPIN_S`` (the consumer is working through its
        window, and a RELEASE to a thread that is awake wakes nobody), then asleep on the slow
        subscriber's socket, so its RELEASE wakes this thread and no other. A serving thread that
        was receiving already takes the frame and notifies the condition instead. After a wait
        longer than ``SPIN_S`` (a consumer slower than that) the next one sleeps at once, so a slow
        consumer costs the producer no CPU in looks; a short wait turns the look on again."""
        slow = [s for s in self._subscribers if not s.ended and not s.has_room]
        if not slow:
            return
        started = time.monotonic()
        deadline = None if self.block_timeout is None else started + self.block_timeout
        spin_until = started + SPIN_S if self._spinning else started
        try:
            while True:
                if self.closed:
                    raise ClosedError(
                        f"the stream {self.name!r} was closed while a write waited", what="stream"
                    )
                if [s for s in slow if self._collect(s)]:
                    slow = [s for s in self._subscribers if not s.ended and not s.has_room]
                    if not slow:
                        return
                    continue
                now = time.monotonic()
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    raise BridgeTimeoutError(
                        f"write to stream {self.name!r} waited {self.block_timeout} s for "
                        f"{len(slow)} slow consumer(s) holding {slow[0].window} unreleased batches "
                        "(policy 'block'); nothing was sent",
                        waiting_for="credit",
                        timeout=self.block_timeout,
                    )
                sleep = (
                    0.0
                    if now < spin_until
                    else min(_SLEEP_S, remaining if remaining is not None else _SLEEP_S)
                )
                # The condition is let go while looking: releases, closes and new subscribers go on.
                self.cond.release()
                try:
                    if sleep == 0.0:
                        os.sched_yield()  # a consumer runnable on this core (a busy machine) runs first
                    slow[0].poller.poll(int(sleep * 1000))
                finally:
                    self.cond.acquire()
                slow = [s for s in self._subscribers if not s.ended and not s.has_room]
                if not slow:
                    return
        finally:
            self._spinning = time.monotonic() - started < SPIN_S

    def _collect(self, sub: _Subscriber) -> bool:
        """Read the RELEASEs ``sub`` has sent, without waiting (condition held); whether any
        credit came back or the subscriber is gone. A frame that breaks the protocol, or a
        connection that failed, ends the subscription as its serving thread would."""
        progressed = False
        while not sub.detached:
            try:
                frame = sub.channel.recv_ready(sub.poller)
            except BridgeError as exc:  # gone (or broken framing): the channel closed itself
                _log.info("arrow_ipc_bridge: stream %r: dropping a consumer: %s", self.name, exc)
                self._detach(sub)
                return True
            if frame is None:
                return progressed
            try:
                with frame:
                    lease_ids = release_frame_ids(frame)
            except ProtocolError as exc:
                _log.warning("arrow_ipc_bridge: stream %r: closing a subscriber: %s", self.name, exc)
                with contextlib.suppress(BridgeError):
                    sub.channel.send(protocol.ERROR, protocol.encode_error(exc), timeout=SEND_TIMEOUT)
                self._detach(sub)
                sub.channel.close()
                return True
            self._release(sub, lease_ids)
            progressed = True
        return progressed

    def _offer(self, sub: _Subscriber, batch: Batch) -> None:
        if sub.has_room and not sub.pending:
            self._send(sub, batch)
        elif self.policy == "drop_oldest":
            batch.refs += 1
            sub.pending.append(batch)
            if len(sub.pending) > sub.window:  # the queue holds one window; the oldest goes
                sub.pending.popleft().unref()
                sub.dropped += 1
                self.dropped += 1
                next(stream_counters.batches_dropped)
        elif self.policy == "error":
            self.slow_consumers_ended += 1
            self._end(
                sub,
                stream_frames.StreamEnd(
                    stream_frames.END_SLOW_CONSUMER,
                    f"this consumer held {sub.window} unreleased batches of stream {self.name!r} "
                    "when another was committed (policy 'error'): its subscription ended",
                    sub.dropped,
                ),
            )
        else:  # "block": _wait_for_room made room; a subscriber that joined meanwhile has room too
            self._send(sub, batch)

    def _send(self, sub: _Subscriber, batch: Batch) -> None:
        lease_id = sub.next_lease
        sub.next_lease = lease_id + 1
        slot = batch.slot
        message = batch.message
        fds: list[int] = batch.fds
        if slot == _NO_SLOT:
            header = _batch_header(batch.sequence, lease_id, slot, 0)
        else:
            key = (batch.ring, slot)
            flags = _FLAG_RING if batch.ring else 0
            sent = sub.sent_slots.get(key)
            # (A segment keeps one message object while its layout stays: mostly an identity test.)
            if sent is not None and sent[0] == batch.generation and sent[1] == message:
                # The subscriber has this slot's message and descriptors: name the slot, send
                # neither (no descriptor passing, no decode and no mapping for the consumer).
                flags |= _FLAG_SLOT_AGAIN
                message = b""
                fds = []
            else:
                sub.sent_slots[key] = (batch.generation, message)
            header = _batch_header(batch.sequence, lease_id, slot, flags)
        try:
            # The header and the message go as two parts of one frame (no joined copy).
            sub.channel.send(_BATCH_KIND, header, fds, timeout=SEND_TIMEOUT, tail=message)
        except (TransportError, BridgeTimeoutError) as exc:
            # Gone, or not reading for SEND_TIMEOUT: it gets nothing more. Its serving thread sees
            # the connection end and lets go of what it held.
            _log.info("arrow_ipc_bridge: stream %r: dropping a consumer: %s", self.name, exc)
            self._detach(sub)
            sub.channel.close()
            return
        batch.refs += 1
        sub.leases[lease_id] = batch
        next(stream_counters.batches_sent)

    def _end(self, sub: _Subscriber, end: stream_frames.StreamEnd) -> None:
        """End ``sub``'s subscription with ``end``: now, or after the batches it still has queued."""
        if sub.ended or sub.end is not None:
            return
        sub.end = end
        if not sub.pending:
            self._send_end(sub)

    def _send_end(self, sub: _Subscriber) -> None:
        end = sub.end
        assert end is not None
        sub.ended = True
        if end.dropped != sub.dropped:
            end = stream_frames.StreamEnd(end.error_type, end.message, sub.dropped)
        with contextlib.suppress(TransportError, BridgeTimeoutError):
            sub.channel.send(protocol.STREAM_END, stream_frames.encode_stream_end(end), timeout=SEND_TIMEOUT)
        self.cond.notify_all()  # a blocked writer no longer waits for this one

    def finish(self, error_type: str | None, message: str) -> None:
        """End the stream for every subscriber (after what each has queued) and refuse new writes."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.last_write = 0.0  # no more writes: the serving threads read their sockets again
            for sub in self._subscribers:
                self._end(sub, stream_frames.StreamEnd(error_type, message, sub.dropped))
            self.cond.notify_all()
        if self.on_finished is not None:
            self.on_finished()

    # ---------- the subscriber's side ---------------------------------------------------------------
    def attach(self, channel: Channel, asked: int) -> _Subscriber:
        """A new subscriber from now on (late join). SUBSCRIBED is sent under the condition, so no
        BATCH precedes it."""
        with self.cond:
            if self.closed:
                raise NotPublishedError(f"the stream {self.name!r} has ended")
            sub = _Subscriber(channel, min(asked, self.max_in_flight))
            answer = stream_frames.Subscribed(sub.window, self.policy, self._next_sequence)
            channel.send(protocol.SUBSCRIBED, stream_frames.encode_subscribed(answer), timeout=SEND_TIMEOUT)
            self._subscribers.append(sub)
            self.cond.notify_all()  # a pump may wait for subscribers
            return sub

    def wait_for_subscribers(self, count: int) -> bool:
        """Wait until ``count`` consumers are subscribed; False if the stream ended first."""
        with self.cond:
            while not self.closed and sum(1 for s in self._subscribers if not s.ended) < count:
                self.cond.wait()
            return not self.closed

    def wait_while_writing(self, sub: _Subscriber) -> bool:
        """The serving thread's wait before it receives: while the writer is active (it wrote in
        the last ``WRITER_ACTIVE_S``), it reads the RELEASEs it needs itself. False once ``sub``'s
        connection is gone (the writer found it closed or broken): nothing more to serve."""
        with self.cond:
            while not sub.detached:
                idle_in = self.last_write + WRITER_ACTIVE_S - time.monotonic()
                if idle_in <= 0:
                    return True
                self.cond.wait(idle_in)
            return False

    def release(self, sub: _Subscriber, lease_ids: tuple[int, ...]) -> None:
        """RELEASE (or RELEASE_MANY) of batches' leases: credit back; queued batches go out. An
        unknown or already released lease is ignored (releasing twice is harmless, as for GET
        leases)."""
        with self.cond:
            self._release(sub, lease_ids)

    def _release(self, sub: _Subscriber, lease_ids: tuple[int, ...]) -> None:
        """:meth:`release` with the condition held."""
        released = False
        for lease_id in lease_ids:
            batch = sub.leases.pop(lease_id, None)
            if batch is not None:
                batch.unref()
                released = True
        if not released:
            return
        while sub.pending and sub.has_room and not sub.ended:
            queued = sub.pending.popleft()
            self._send(sub, queued)
            queued.unref()  # the queue's reference (the lease holds its own now)
        if not sub.pending and sub.end is not None and not sub.ended:
            self._send_end(sub)
        # No notify here: nobody waits on the condition for credit (a blocked write looks at the
        # subscriber's socket, a reserve() for a slot is woken by the slot's own free), and the
        # subscriber's serving thread, which waits on it while the writer is active, would be woken
        # by every RELEASE only to wait again (a thread switch per RELEASE on the writer's GIL).

    def _detach(self, sub: _Subscriber) -> None:
        """``sub``'s connection is gone: let go of everything it held. Condition held."""
        sub.ended = True
        sub.detached = True
        leases, sub.leases = sub.leases, {}
        pending, sub.pending = sub.pending, collections.deque()
        for batch in (*leases.values(), *pending):
            batch.unref()
        with contextlib.suppress(ValueError):
            self._subscribers.remove(sub)
        self.cond.notify_all()

    def detach(self, sub: _Subscriber) -> None:
        with self.cond:
            self._detach(sub)


def release_frame_ids(frame: Frame) -> tuple[int, ...]:
    """The lease ids of a subscriber's RELEASE or RELEASE_MANY; ProtocolError for any other frame
    (a subscription's consumer sends nothing else, and never descriptors)."""
    if frame.kind not in (protocol.RELEASE, protocol.RELEASE_MANY) or frame.fds:
        raise ProtocolError(
            f"frame kind {frame.kind} with {len(frame.fds)} fds on a subscription "
            "(only RELEASE and RELEASE_MANY are allowed)"
        )
    if frame.kind == protocol.RELEASE:
        return (protocol.decode_lease(frame.payload),)
    return stream_frames.decode_release_many(frame.payload)


class StreamHub:
    """The publisher's live streams by name (a namespace of its own, beside published names), and
    the count of subscriptions served now, bounded by ``max_subscriptions``: each holds a serving
    thread for its whole life (it waits for its consumer's RELEASEs and is never parked), so the
    bound keeps streams from taking every thread the publisher's GETs need."""

    def __init__(
        self,
        max_subscriptions: int = MAX_SUBSCRIPTIONS,
        *,
        publications: Callable[[], Collection[str]] = tuple,
    ) -> None:
        self._lock = threading.Lock()
        # The publisher's names, for the error of a subscription to one of them (read it with get).
        self._publications = publications
        self._streams: dict[str, LiveStreamState] = {}
        self._max_subscriptions = max_subscriptions
        self._subscriptions = 0  # served now (under _lock)

    @property
    def subscriptions(self) -> int:
        """Subscriptions served now (all streams)."""
        with self._lock:
            return self._subscriptions

    def add(self, stream: LiveStreamState) -> None:
        with self._lock:
            if stream.name in self._streams:
                raise ValueError(f"a stream named {stream.name!r} is open already")
            self._streams[stream.name] = stream

    def remove(self, stream: LiveStreamState) -> None:
        with self._lock:
            if self._streams.get(stream.name) is stream:
                del self._streams[stream.name]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._streams)

    def close(self, message: str) -> None:
        """End every open stream (consumers raise PeerClosedError with ``message``)."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.finish(stream_frames.END_INTERRUPTED, message)

    def serve_subscription(self, channel: Channel, payload: bytes, peer_pid: int) -> None:
        """Serve one subscription for its whole life (the connection's serving thread). Returns when
        the consumer closes the connection or breaks the protocol; the caller then closes it."""
        counted = False
        try:
            name, asked = stream_frames.decode_subscribe(payload)
            with self._lock:
                stream = self._streams.get(name)
                if stream is not None and self._subscriptions >= self._max_subscriptions:
                    raise LimitError(
                        f"the publisher serves {self._subscriptions} subscriptions already (its "
                        f"max_subscriptions): subscribing to {name!r} was refused",
                        limit="max_subscriptions",
                        value=self._max_subscriptions,
                    )
                if stream is not None:
                    self._subscriptions += 1
                    counted = True
                    next(stream_counters.subscriptions_started)  # before SUBSCRIBED goes out
            if stream is None:
                raise NotPublishedError(no_stream_message(name, self.names(), self._publications()))
            sub = stream.attach(channel, asked)
        except (NotPublishedError, ProtocolError, LimitError) as exc:
            if counted:
                self._uncount()
            if isinstance(exc, LimitError):
                next(stream_counters.subscriptions_refused)
            with contextlib.suppress(BridgeError):
                channel.send(protocol.ERROR, protocol.encode_error(exc), timeout=SEND_TIMEOUT)
            return
        except BaseException:
            if counted:
                self._uncount()
            raise
        try:
            while stream.wait_while_writing(sub):
                frame = channel.recv(timeout=None)
                with frame:
                    lease_ids = release_frame_ids(frame)
                stream.release(sub, lease_ids)
        except PeerClosedError:
            pass  # the consumer closed or died: what it held is let go below
        except ProtocolError as exc:
            _log.warning("arrow_ipc_bridge: closing subscriber pid %s: %s", peer_pid, str(exc))
            with contextlib.suppress(BridgeError):
                channel.send(protocol.ERROR, protocol.encode_error(exc), timeout=SEND_TIMEOUT)
        except BridgeError as exc:
            _log.warning("arrow_ipc_bridge: subscriber pid %s: %s", peer_pid, str(exc))
        finally:
            stream.detach(sub)
            self._uncount()

    def _uncount(self) -> None:
        with self._lock:
            self._subscriptions -= 1
        next(stream_counters.subscriptions_ended)
