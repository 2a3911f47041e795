"""The consumer's side of a live stream: :class:`LiveStream` (``Session.subscribe``,
``aib.subscribe``), docs/streams.md.

A subscription has a connection (and a session) of its own, so the batches the publisher pushes
never interleave with the replies of a session's requests. Each batch is imported as the session
imports a GET's answer, under a lease of its own: releasing the batch (``release()``, the ``with``
block, collection, and every struct built from it released) sends RELEASE, which gives the
producer its credit and, for reserved slots, its memory back.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from types import EllipsisType, TracebackType
from typing import Any, NoReturn

from arrow_ipc_bridge._ffi import ffi, lib, new_error, raise_for
from arrow_ipc_bridge.consumer.content_check import check_code
from arrow_ipc_bridge.consumer.imported import ImportedArray
from arrow_ipc_bridge.consumer.message_import import track
from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    ClosedError,
    InvalidArgumentError,
    PeerClosedError,
    ProtocolError,
    RegionError,
    StreamError,
)
from arrow_ipc_bridge.process_stats import import_counters, stream_counters
from arrow_ipc_bridge.runtime import arguments, reaper
from arrow_ipc_bridge.transport import protocol, stream_frames
from arrow_ipc_bridge.transport.channel import Channel, Frame
from arrow_ipc_bridge.wire.capsules import DEVICE_CPU, _check_kwargs

__all__ = ["LiveStream", "open_subscription"]

_LEASE_LIMIT = 1 << reaper.FAMILY_VALUE_BITS
SPIN_S = 0.0005
"""How long a consumer with no batch at hand looks for one without sleeping (see ``_spin_ns``)."""
_NOTHING = int(lib.AIB_STREAM_NOTHING)
_BATCH = int(lib.AIB_STREAM_BATCH)
_NEW = int(lib.AIB_STREAM_NEW)
_REFUSED = int(lib.AIB_STREAM_REFUSED)
_BROKEN = int(lib.AIB_STREAM_BROKEN)


class _Credit:
    """Gives batches' leases back, a few at a time (RELEASE_MANY): under policy "block" a released
    batch's lease waits until half the window is released, or until the producer may be waiting
    for it (see :meth:`may_block`), or this consumer is about to sleep for a batch. One frame per
    few batches spares both processes a frame and a wake-up per batch. Runs on any thread (the
    reaper's, a consumer's)."""

    def __init__(self, channel: Channel, rx: Any, window: int, policy: str) -> None:
        self._channel = channel
        # The stream's receive state (aib_stream_rx): a lease's ring segment is free there before
        # its RELEASE can go, and it counts the leases received.
        self._rx = rx
        self._counts = ffi.new("aib_stream_counts *")
        self._lock = threading.Lock()
        self._pending: list[int] = []
        self._window = window
        # Only where the producer waits for credit: under "drop_oldest" and "error" a lease held
        # back here would make a consumer that keeps up look slow (dropped batches, ended).
        self._threshold = max(1, window // 2) if policy == "block" else 1
        self._receiving = False
        # Leases whose RELEASE went out; the receive state counts those received: the producer
        # counts the difference against the window (it may count more, while RELEASEs are on
        # their way).
        self._sent = 0

    @property
    def may_block(self) -> bool:
        """Whether the producer may be out of credit for this consumer: every lease of the window
        received and not given back (released and held back here, or still held). Otherwise the
        producer has room, and a consumer waiting for a batch holds its releases back a while."""
        if not self._pending:
            return False
        lib.aib_stream_rx_counts(self._rx, self._counts)
        return int(self._counts.got) - self._sent >= self._window

    def released(self, lease_id: int) -> None:
        """A batch's owner died (the reaper family's callback)."""
        lib.aib_stream_rx_released(self._rx, lease_id)
        with self._lock:
            ids = self._pending
            ids.append(lease_id)
            if not self._receiving and len(ids) < self._threshold:
                return
            self._pending = []
        self._send(ids)

    def waiting(self, waiting: bool) -> None:
        """The consumer starts (True) or stops sleeping for a batch; starting sends what is held back."""
        with self._lock:
            self._receiving = waiting
            ids, self._pending = (self._pending, []) if waiting else ([], self._pending)
        if ids:
            self._send(ids)

    def flush(self) -> None:
        """Send every lease held back now (before the connection closes)."""
        with self._lock:
            ids, self._pending = self._pending, []
        if ids:
            self._send(ids)

    def give_back(self, ids: list[int]) -> None:
        """Send these leases' RELEASE now."""
        for lease_id in ids:
            lib.aib_stream_rx_released(self._rx, lease_id)
        self._send(ids)

    def _send(self, ids: list[int]) -> None:
        self._sent += len(ids)
        if self._channel.closed:
            return  # the publisher ended this connection's leases when it closed
        with contextlib.suppress(PeerClosedError, BridgeTimeoutError, OSError):
            if len(ids) == 1:
                self._channel.send(protocol.RELEASE, protocol.encode_lease(ids[0]), timeout=5.0)
            else:
                self._channel.send(protocol.RELEASE_MANY, stream_frames.encode_release_many(ids), timeout=5.0)


class LiveStream:
    """A live stream of batches, as they are committed (made by :meth:`Session.subscribe`).

    Iterate it (each item an :class:`~arrow_ipc_bridge.ImportedArray` holding its own lease: release
    it, or use it in a ``with`` block, to give the producer its credit back), call
    :meth:`next_batch`, or hand it to any Arrow consumer through ``__arrow_c_stream__`` (host
    data). Iteration stops at the producer's clean end; a producer error raises
    :class:`~arrow_ipc_bridge.errors.StreamError` (``reason="failed"``), a publisher gone
    mid-stream :class:`~arrow_ipc_bridge.errors.PeerClosedError` (``stream`` and ``received``
    set), and the ``"error"`` policy :class:`~arrow_ipc_bridge.errors.StreamError`
    (``reason="slow_consumer"``). Batches already received stay valid.
    Receive from one thread at a time; batches may be released from any thread.
    """

    def __init__(
        self, session: Any, name: str, subscribed: stream_frames.Subscribed, timeout: float | None
    ) -> None:
        self._session = session  # private to this stream: its connection carries only this stream
        self.name = name
        self.max_in_flight = subscribed.max_in_flight
        self.policy = subscribed.policy
        self._timeout = timeout
        self._end: stream_frames.StreamEnd | None = None
        # The ProtocolError that ended the subscription (its connection closed): raised again by
        # every later call, as the end's errors are (docs/streams.md), not a "closed" of its own.
        self._broken: ProtocolError | None = None
        self._peeked: ImportedArray | None = None
        self._slot_names = [f"{name}#batch"]
        # The receive state in C (cffi_build/stream_consume.c): the next sequence expected, each
        # reserved slot's and ring segment's last message with copies of its descriptors (for the
        # BATCH frames that repeat them), the ring segments this consumer holds (a BATCH in one
        # still held is refused: the producer must wait for its release), and the counts. Freed
        # with the last of this stream and its credit (a release on another thread may come late).
        rx = lib.aib_stream_rx_new(subscribed.next_sequence)
        if rx == ffi.NULL:
            raise MemoryError("allocating a live stream's receive state")
        self._rx = ffi.gc(rx, lib.aib_stream_rx_free)
        self._out = ffi.new("aib_stream_batch *")  # used by the receiving thread only
        self._err = new_error()
        self._counts_out = ffi.new("aib_stream_counts *")
        self._channel: Channel = session._connection()
        self._credit = _Credit(self._channel, self._rx, subscribed.max_in_flight, subscribed.policy)
        # Leases are a reaper family of this stream's: a batch's owner dying gives its credit back.
        self._lease_tokens = reaper.register_family(self._credit.released)
        weakref.finalize(self, reaper.unregister_family, self._lease_tokens)
        # What every receive passes the C core besides its wait (Channel.recv_batch).
        self._rx_call = (
            self._rx,
            session._remembered.table,
            self._lease_tokens,
            session._lease_keeper,
            check_code(session._host_check),
        )
        self._spinning = True  # whether the next wait for a batch spins first (see _spin_ns)

    # ---------- receiving ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[ImportedArray]:
        return self

    def __next__(self) -> ImportedArray:
        batch = self.next_batch()
        if batch is None:
            raise StopIteration
        return batch

    def next_batch(self, timeout: float | EllipsisType | None = ...) -> ImportedArray | None:
        """The next batch, waiting up to ``timeout`` seconds (default: the subscription's); None at
        the stream's clean end. A wait past the timeout raises
        :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` and the stream stays usable. After
        a :class:`~arrow_ipc_bridge.errors.ProtocolError` every call raises it again (a new one
        of the same type, message and details, caused by the first); after :meth:`close`:
        :class:`~arrow_ipc_bridge.errors.ClosedError`."""
        session = self._session
        if session._closed:
            raise ClosedError(f"the live stream {self.name!r} is closed: subscribe again", what="live stream")
        if not isinstance(timeout, EllipsisType):
            timeout = arguments.optional_seconds(timeout, "timeout")
        if self._peeked is not None:
            batch, self._peeked = self._peeked, None
            return batch
        if self._broken is not None:
            broken = self._broken
            raise type(broken)(broken.message, **broken.details) from broken
        if self._end is not None:
            self._finished()
            return None
        session._check_open()
        wait = self._timeout if isinstance(timeout, EllipsisType) else timeout
        # A frame already here (in the channel's buffer or the socket) is taken at once. Else the
        # consumer looks for one a while without sleeping (see _spin_ns), holding its released
        # leases back unless the producer may be waiting for them, and sends them all before it
        # sleeps (see _Credit).
        try:
            rc, frame = self._channel.recv_batch(self._rx_call, 0, wait, self._out, self._err)
            if rc == _NOTHING:
                credit = self._credit
                if credit.may_block:
                    credit.flush()
                spin_ns = self._spin_ns(wait)
                if spin_ns > 0:
                    rc, frame = self._receive(spin_ns, wait)
                if rc == _NOTHING:
                    self._spinning = False
                    credit.waiting(True)
                    try:
                        slept = time.monotonic()
                        rc, frame = self._receive(-1, wait)
                        # Spin again before the next wait only if this one was short: a producer
                        # that sends less often than SPIN_S is waited for asleep, without spinning.
                        self._spinning = time.monotonic() - slept < SPIN_S
                    finally:
                        credit.waiting(False)
        except ProtocolError as exc:  # a malformed frame: the channel closed itself
            self._broken = exc
            raise
        except PeerClosedError as exc:
            if getattr(exc, "closed_locally", False) or session.closed:
                raise ClosedError(f"the live stream {self.name!r} is closed", what="live stream") from exc
            raise PeerClosedError(
                f"the publisher of stream {self.name!r} went away mid-stream (no end of stream) after "
                f"{self.received} batches; batches received stay valid",
                stream=self.name,
                received=self.received,
            ) from exc
        if rc == _BATCH:
            return self._adopt()
        if frame is None:
            self._failed_batch(rc)
        refused: _BatchRefused | None = None
        try:
            if rc == _NEW:
                try:
                    return self._import_new(frame)
                except _BatchRefused as exc:  # this batch only: the subscription goes on
                    refused = exc
            elif frame.fds:
                raise ProtocolError(f"frame kind {frame.kind} with descriptors on a subscription")
            elif frame.kind == protocol.STREAM_END:
                self._end = stream_frames.decode_stream_end(frame.payload)
                self._finished()
                return None
            elif frame.kind == protocol.ERROR:
                protocol.raise_error(frame.payload)
            else:
                raise ProtocolError(
                    f"frame kind {frame.kind} on a subscription (BATCH or STREAM_END expected)"
                )
        except ProtocolError as exc:
            self._channel.close()  # out of step with the publisher: this subscription is over
            self._broken = exc
            raise
        finally:
            frame.close_fds()  # the mappings keep what they need open
        assert refused is not None  # every other way out of the frame returned or raised
        error, refused = refused.error, None
        try:
            raise error from error.__cause__
        finally:
            del error  # no cycle through this frame: what the batch held goes with the last reference

    def _receive(self, spin_ns: int, wait: float | None) -> tuple[int, Frame | None]:
        """One call into the C core (``aib_stream_rx_next``): the next frame, and its batch
        imported when this subscription's session remembers its message (``spin_ns``: see
        :meth:`Channel.recv_batch`)."""
        return self._channel.recv_batch(self._rx_call, spin_ns, wait, self._out, self._err)

    def _spin_ns(self, wait: float | None) -> int:
        """How long the next wait for a batch looks for it without sleeping, in nanoseconds (-1:
        it sleeps at once). A producer in the middle of a run sends within a batch's time, and a
        frame sent to a process that is awake wakes nobody (a sleeping one is woken, and on a
        machine of few cores that wake-up takes the producer's core from it). Bounded: after a
        wait that took longer than ``SPIN_S`` (a producer slower than that, or idle) the next wait
        does not look, so a slow stream costs no CPU in looks; a short sleep turns the look on
        again."""
        if not self._spinning:
            return -1
        spin = SPIN_S if wait is None else min(SPIN_S, wait)
        return int(spin * 1e9)

    def _adopt(self) -> ImportedArray:
        """The batch the C core imported from a remembered message: its lease's owner wrapped by the
        remembered message's one builder (``RememberedMessage.adopt``)."""
        out = self._out
        owner = ffi.gc(out.owner, lib.aib_owner_unref)
        session = self._session
        hit = session._remembered.used_by_c_core(out.entry_id)
        if hit is None:  # the session was closed under this receive (its set emptied)
            ffi.release(owner)
            raise ClosedError(f"the live stream {self.name!r} is closed", what="live stream")
        imported = hit.adopt(owner, out.sync_slot, self.name, out.owner_address)
        if not isinstance(imported, ImportedArray):
            imported.release()
            error = ProtocolError("a stream's BATCH holds a table/stream message (one batch expected)")
            self._channel.close()
            self._broken = error
            raise error
        track(session._imported, imported)
        next(import_counters.remembered_gets)
        next(stream_counters.batches_received)
        return imported

    def _failed_batch(self, rc: int) -> NoReturn:
        """A BATCH the C core refused (that batch only: its lease is given back and the stream goes
        on) or found breaking the stream's protocol (the subscription ends)."""
        err = self._err
        message = ffi.string(err.message).decode("utf-8", "replace")
        if rc == _BROKEN:
            error = ProtocolError(message)
            self._channel.close()  # out of step with the publisher: this subscription is over
            self._broken = error
            raise error
        self._credit.give_back([int(self._out.lease_id)])  # refused: the producer gets it back
        code = int(err.code)
        if code == _REFUSED:
            raise ProtocolError(message)
        if code == lib.AIB_E_OS:
            raise RegionError(message)
        raise_for(code, err, "checking buffer contents", wire=code == lib.AIB_E_WIRE)

    def _import_new(self, frame: Frame) -> ImportedArray:
        """A batch whose message this subscription's session has not remembered (a slot's or ring
        segment's first batch, a written batch of no slot): imported by the session's own path
        (decode, full check, map), which remembers it, so the next batch there is the C core's."""
        out = self._out
        session = self._session
        lease_id, slot, ring = int(out.lease_id), int(out.slot), bool(out.ring)
        message = frame.payload
        fds = frame.fds if out.fds_are_frames else [int(out.fds[i]) for i in range(out.n_fds)]
        token = self._lease_tokens | lease_id
        try:
            imported = None
            if slot == stream_frames.NO_SLOT and not fds:
                # A written batch, new each time: when it is CUDA data carved out of allocations
                # this process has open already (legacy handles, kept slabs), the C core imports it
                # as it does a GET's new message, without the Python decode and opens.
                imported = session._import_new_in_c(message, token, self._slot_names[0])
            if imported is None:
                # The session's own import (decode, full check, map), under this batch's lease; one
                # remembered message per slot, so a reused slot or segment costs a lookup. The
                # first sight of a ring segment's message checks its contents at the session's
                # level; later batches there are checked by the C core.
                imported = session._import(message, fds, name=self._slot_name(ring, slot), token=token)
        except ProtocolError as exc:  # the batch's message or regions: this batch is refused
            self._credit.give_back([lease_id])  # if no owner came to life, nobody else would
            raise _BatchRefused(exc) from None
        except BaseException:
            self._credit.give_back([lease_id])  # if no owner came to life, nobody else would
            raise
        if not isinstance(imported, ImportedArray):
            imported.release()
            raise ProtocolError("a stream's BATCH holds a table/stream message (one batch expected)")
        if ring and imported.device_type != DEVICE_CPU:
            # A segment is host memory, whose contents the C receive checks with every later batch.
            imported.release()  # its lease ends: the credit goes back
            raise _BatchRefused(ProtocolError("a BATCH in the producer's ring describes device memory"))
        imported.name = self.name
        lib.aib_stream_rx_accept(self._rx, out)
        next(stream_counters.batches_received)
        return imported

    def _slot_name(self, ring: bool, slot: int) -> str:
        if slot == stream_frames.NO_SLOT:
            return self._slot_names[0]
        return f"{self.name}#{'ring' if ring else 'slot'}{slot}"

    def _counts(self) -> Any:
        counts = self._counts_out
        lib.aib_stream_rx_counts(self._rx, counts)
        return counts

    @property
    def received(self) -> int:
        """Batches received so far."""
        return int(self._counts().received)

    @property
    def dropped(self) -> int:
        """Batches the producer dropped for this consumer (gaps in the sequence numbers; policy
        ``"drop_oldest"``)."""
        return max(int(self._counts().dropped), self._end.dropped if self._end is not None else 0)

    @property
    def last_sequence(self) -> int:
        """The sequence number of the last batch received (-1: none yet)."""
        return int(self._counts().last_sequence)

    @property
    def repeated(self) -> int:
        """Batches that came as a reserved slot's (or ring segment's) message again, without message
        or descriptors."""
        return int(self._counts().repeated)

    def _finished(self) -> None:
        """Raise the error the stream ended with, if any."""
        end = self._end
        assert end is not None
        if end.error_type is None:
            return
        text = f"stream {self.name!r}: {end.message}"
        # The end's type is a wire token (the names of the retired classes, which older
        # publishers send too): stream_frames.END_SLOW_CONSUMER and END_INTERRUPTED.
        if end.error_type == stream_frames.END_SLOW_CONSUMER:
            raise StreamError(text, reason="slow_consumer")
        if end.error_type == stream_frames.END_INTERRUPTED:
            raise PeerClosedError(text, stream=self.name, received=self.received)
        raise StreamError(
            f"stream {self.name!r} failed in the producer: {end.error_type}: {end.message}",
            reason="failed",
            producer_error=end.error_type,
        )

    @property
    def ended(self) -> bool:
        """Whether the end of the stream (clean or not) has been received."""
        return self._end is not None

    # ---------- the Arrow C stream interface --------------------------------------------------------
    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object:
        """An ``ArrowArrayStream`` whose ``get_next`` waits for the next batch: the end of the
        stream ends it, an error (producer failure, publisher gone) is its ``get_last_error``.
        Host data (``pa.RecordBatchReader.from_stream(live)``); waits for the first batch, whose
        schema it offers. ``requested_schema`` is not supported (None only)."""
        return self._c_stream(requested_schema, device=False)

    def __arrow_c_device_stream__(self, requested_schema: object | None = None, **kwargs: object) -> object:
        """An ``ArrowDeviceArrayStream`` like :meth:`__arrow_c_stream__`, for host or CUDA data:
        each ``ArrowDeviceArray`` carries its batch's ``sync_event`` while the producer's work on
        it may be pending. Keywords of later versions of the interface must be None."""
        _check_kwargs(kwargs)
        return self._c_stream(requested_schema, device=True)

    def _c_stream(self, requested_schema: object | None, *, device: bool) -> object:
        from arrow_ipc_bridge.consumer.c_stream import stream_capsule

        if requested_schema is not None:
            raise InvalidArgumentError(
                "a live stream offers its own schema: requested_schema must be None",
                argument="requested_schema",
            )
        first = self._peek()
        if first is None:
            raise StreamError(f"stream {self.name!r} ended before its first batch: no schema to offer")
        if not device and first.device_type != DEVICE_CPU:
            raise StreamError(
                f"stream {self.name!r} holds device data: use __arrow_c_device_stream__ or iterate it"
            )
        self._peeked = None  # the C stream hands it out first
        return stream_capsule(self, first, device=device)

    def _peek(self) -> ImportedArray | None:
        if self._peeked is None:
            self._peeked = self.next_batch()
        return self._peeked

    # ---------- lifetime ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return bool(self._session.closed)

    def close(self) -> None:
        """Unsubscribe (idempotent): the batches handed out are released and the connection closes,
        which ends this consumer's leases at the publisher. Structs consumers built from host batches
        stay mapped; reserved slots may then be refilled by the producer. The RELEASE of every batch
        released before the call is sent before the connection closes (also of one whose release
        notice the reaper thread was delivering, and of those held back to send a few at a time)."""
        if self._peeked is not None:
            self._peeked.release()
            self._peeked = None
        if not self._session.closed:
            reaper.settle()
            self._credit.flush()
        self._session.close()
        lib.aib_stream_rx_forget_slots(self._rx)

    def __enter__(self) -> LiveStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<LiveStream {self.name!r} received={self.received} dropped={self.dropped}>"


class _BatchRefused(Exception):
    """Internal: a batch's message or regions were refused (bad data in that batch only, its lease
    given back); :meth:`LiveStream.next_batch` raises the ProtocolError it carries and keeps the
    subscription, where a frame that breaks the stream's protocol ends it."""

    def __init__(self, error: ProtocolError) -> None:
        super().__init__(str(error))
        self.error = error


def open_subscription(
    session: Any, name: str, *, max_in_flight: int, timeout: float | None, request_timeout: float
) -> LiveStream:
    """Turn ``session``, freshly connected and used for nothing else, into the subscription to the
    live stream ``name`` (SUBSCRIBE, then SUBSCRIBED). The stream owns the session from then on; on
    any failure the session is closed. Raises :class:`~arrow_ipc_bridge.errors.NotPublishedError`
    when no such stream is open. (``Session.subscribe`` and ``arrow_ipc_bridge.subscribe`` connect;
    this module stays below the session module.)"""
    try:
        if isinstance(max_in_flight, bool) or not 1 <= max_in_flight <= stream_frames.MAX_IN_FLIGHT:
            raise ValueError(
                f"max_in_flight must be 1 to {stream_frames.MAX_IN_FLIGHT}, not {max_in_flight!r}"
            )
        features = session.publisher_info.get("features")
        if not isinstance(features, list) or "stream" not in features:
            raise BridgeError("this publisher does not serve live streams (an older version): upgrade it")
        channel = session._connection()
        frame = channel.request(
            protocol.SUBSCRIBE, stream_frames.encode_subscribe(name, max_in_flight), timeout=request_timeout
        )
        frame.close_fds()
        if frame.kind == protocol.ERROR:
            protocol.raise_error(frame.payload)
        if frame.kind != protocol.SUBSCRIBED:
            raise ProtocolError(f"expected SUBSCRIBED, got frame kind {frame.kind}")
        subscribed = stream_frames.decode_subscribed(frame.payload, max_in_flight)
    except BaseException:
        session.close()
        raise
    return LiveStream(session, name, subscribed, timeout)
