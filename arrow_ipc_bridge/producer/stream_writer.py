"""The producer's handle on a live stream: :class:`StreamWriter` (``Publisher.open_stream``) and the
pump behind ``Publisher.publish_stream`` (docs/streams.md)."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

import pyarrow as pa

from arrow_ipc_bridge._ffi import ffi, lib, new_error
from arrow_ipc_bridge.errors import BridgeError, BridgeTimeoutError, ClosedError, StreamError
from arrow_ipc_bridge.producer.exporter import CopyPolicy, export_captured
from arrow_ipc_bridge.producer.stream_hub import Batch, LiveStreamState, StreamHub
from arrow_ipc_bridge.producer.stream_ring import HostRing, RingSegment
from arrow_ipc_bridge.producer.stream_slots import SlotLayout, StreamSlot, make_slot
from arrow_ipc_bridge.runtime import arguments
from arrow_ipc_bridge.transport import stream_frames
from arrow_ipc_bridge.wire.capsules import (
    _CAPSULE_ADDRESS,
    DEVICE_CPU,
    ArrowInput,
    CapturedData,
    TableExporter,
    _capture_pair,
    _CapturedSource,
    capsule_struct,
    capture,
    new_capsule,
)
from arrow_ipc_bridge.wire.metadata import Decoded

__all__ = ["StreamWriter", "batches_of", "check_source", "pump"]

_log = logging.getLogger("arrow_ipc_bridge")
_CHECKED_MESSAGES = 256


def _address_of(capsule: object, kind: str) -> int:
    """The struct a producer's capsule of ``kind`` holds, by address (its name checked)."""
    address = _CAPSULE_ADDRESS[kind](capsule)
    if address:
        return address
    # Not a capsule of that name: capsule_struct raises the error that names what it is.
    return int(ffi.cast("uintptr_t", capsule_struct(capsule, kind)))


class StreamWriter:
    """Write batches to a live stream (made by :meth:`Publisher.open_stream`).

    Every subscriber gets every batch committed after it subscribed, in order, each under a lease
    of its own; the stream's policy says what happens when one has ``max_in_flight`` batches
    unreleased. ``close()`` ends the stream cleanly, ``fail(exc)`` with an error; both let
    consumers read what they already received first. Use it from one thread at a time.
    """

    def __init__(
        self,
        state: LiveStreamState,
        hub: StreamHub,
        *,
        copy: CopyPolicy,
        slots: SlotLayout | None,
        check_open: Callable[[], None],
    ) -> None:
        self._state = state
        self._hub = hub
        self._copy: CopyPolicy = copy
        self._check_open = check_open
        self._schema: pa.Field | None = None
        self._layout = slots
        self._slots: list[StreamSlot] = []
        self._free: list[StreamSlot] = []
        self._allocator: Any = None
        self._ring = HostRing(state.name)
        # Messages whose schema was checked already: a message's bytes hold its schema, and a ring
        # segment's batches of one layout repeat theirs (bounded; cleared when full).
        self._checked: set[bytes] = set()
        state.on_finished = self._close_free_slots
        if slots is not None:
            slots.check()
            self._schema = pa.field("", pa.struct(list(slots.schema)), nullable=False)

    @property
    def name(self) -> str:
        return self._state.name

    @property
    def policy(self) -> str:
        return self._state.policy

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def subscribers(self) -> int:
        """Consumers subscribed now."""
        return self._state.subscribers

    @property
    def leases(self) -> int:
        """Batches subscribers hold (sent, not released yet); 0 once every consumer released all."""
        return self._state.leases

    @property
    def batches_written(self) -> int:
        """Batches committed so far (the next batch's sequence number)."""
        return self._state.next_sequence

    @property
    def dropped(self) -> int:
        """Batches dropped for slow consumers (policy ``"drop_oldest"``), all consumers together."""
        return self._state.dropped

    # ---------- writing any Arrow object ------------------------------------------------------------
    def write(self, obj: ArrowInput | CapturedData) -> int:
        """Export ``obj`` (an array or record batch, any Arrow PyCapsule producer) and send it to
        every subscriber; returns its sequence number.

        Raises :class:`~arrow_ipc_bridge.errors.StreamError` (``reason="schema"``) when its
        schema differs from the stream's (the first batch's),
        :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` (``waiting_for="credit"``) when policy
        ``"block"`` waited ``block_timeout`` for a slow consumer (nothing sent), and
        :class:`~arrow_ipc_bridge.errors.ClosedError` once the stream is closed.
        """
        try:
            self._check_writable()
        except BaseException:
            if isinstance(obj, CapturedData):  # ours to close (a batch of publish_stream's source)
                obj.close()
            raise
        if isinstance(obj, CapturedData):  # a batch of a C device stream (publish_stream): ours
            captured = obj
        elif isinstance(obj, _CapturedSource):  # captured already (from_cuda_arrays, ...): share it
            captured = CapturedData.sharing(obj._live())
        elif self._copy == "if_needed" and not isinstance(obj, TableExporter):
            # The default path: the producer's capsules, and a small host batch copied from them
            # into the ring (nothing of the producer's is moved or kept); else captured from them.
            # Its capsules, tried as capture() tries them: the device array first.
            export = getattr(obj, "__arrow_c_device_array__", None)
            device = export is not None
            if not device:
                export = getattr(obj, "__arrow_c_array__", None)
            if export is None:  # a stream, a capsule pair, ...: capture takes it as it is
                captured = capture(obj)
            else:
                pair = export(None)
                segment = self._ring.place_at(
                    _address_of(pair[0], "schema"),
                    _address_of(pair[1], "device_array" if device else "array"),
                    device,
                )
                if segment is not None:
                    return self._commit_ring(segment)
                captured = _capture_pair(pair[0], pair[1], host=not device)
        else:
            captured = capture(obj)
        if captured.device_type == DEVICE_CPU and self._copy == "if_needed" and not captured.is_stream:
            try:
                segment = self._ring.place(captured)
            except BaseException:
                captured.close()
                raise
            if segment is not None:
                captured.close()  # copied into the segment: the source's buffers go now
                return self._commit_ring(segment)
        # Anything else is exported as aib.export does (CUDA data, a large host batch: shared as it
        # is or one sealed copy, copy="never"/"always"). Pool fds are attached (the default): a
        # subscription's connection carries nothing but batches.
        exported = export_captured(captured, copy=self._copy)
        try:
            self._check_schema(exported.message, len(exported.fds))
        except BaseException:
            exported.close()
            raise
        return self._state.commit(Batch(exported.message, list(exported.fds), exported.close))

    def _commit_ring(self, segment: RingSegment) -> int:
        """Send the batch placed in ``segment`` (the segment is the batch: no object per write)."""
        if segment.message not in self._checked:
            try:
                self._check_schema(segment.message, 1)
            except BaseException:
                self._ring.free(segment)
                raise
        return self._state.commit(segment)

    def _check_writable(self) -> None:
        self._check_open()
        if self._state.closed:
            raise ClosedError(f"the stream {self.name!r} is closed", what="stream")

    def _check_schema(self, message: bytes, n_fds: int) -> None:
        if message in self._checked:
            return
        field, is_stream = _message_field(message, n_fds)
        if is_stream:
            raise StreamError(
                "a stream's batch is one array or record batch, not a table or stream (write its "
                "batches one by one, or publish_stream it)",
                reason="schema",
            )
        if self._schema is None:
            self._schema = field
        elif not field.equals(self._schema, check_metadata=True):
            if field.equals(self._schema, check_metadata=False):
                # The types print alike: name what differs, or the message reads "x differs from x".
                raise StreamError(
                    f"batch schema metadata {_metadata_of(field)} differs from the stream {self.name!r}'s "
                    f"{_metadata_of(self._schema)} (the types are the same): a stream has one schema, "
                    "its metadata included (open another stream for the new one); nothing was sent",
                    reason="schema",
                )
            raise StreamError(
                f"batch schema {field.type} differs from the stream {self.name!r}'s {self._schema.type}: "
                "a stream has one schema (open another stream for the new one); nothing was sent",
                reason="schema",
            )
        if len(self._checked) >= _CHECKED_MESSAGES:
            self._checked.clear()
        self._checked.add(message)

    # ---------- reserved slots ----------------------------------------------------------------------
    def reserve(self, timeout: float | None = None) -> StreamSlot:
        """A free slot to fill in place (streams opened with ``slots=``). Waits up to ``timeout``
        seconds (None: the stream's ``block_timeout``) until consumers released one; then
        :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` (``waiting_for="credit"``)."""
        self._check_writable()
        timeout = arguments.optional_seconds(timeout, "timeout")
        layout = self._layout
        if layout is None:
            raise StreamError(f"the stream {self.name!r} has no reserved slots (open it with slots=...)")
        count = layout.count or 2 * self._state.max_in_flight
        cond = self._state.cond
        wait = self._state.block_timeout if timeout is None else timeout
        deadline = None if wait is None else time.monotonic() + wait
        with cond:
            while not self._free and len(self._slots) >= count:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise BridgeTimeoutError(
                        f"reserve on stream {self.name!r}: all {count} slots are held by consumers "
                        f"after {wait} s",
                        waiting_for="credit",
                        timeout=wait,
                    )
                cond.wait(remaining)
                if self._state.closed:
                    raise ClosedError(
                        f"the stream {self.name!r} was closed while reserve waited", what="stream"
                    )
            slot = self._free.pop() if self._free else None
        if slot is None:
            slot = self._new_slot(layout)
        slot.reserved = True
        slot._writer = self
        return slot

    def _new_slot(self, layout: SlotLayout) -> StreamSlot:
        if layout.device == "cuda" and self._allocator is None:
            from arrow_ipc_bridge.cuda.allocators import CupySlabAllocator

            self._allocator = CupySlabAllocator(layout.device_id)
        slot = make_slot(len(self._slots), layout, self.name, self._allocator)
        with self._state.cond:
            self._slots.append(slot)
        return slot

    def _commit_slot(self, slot: StreamSlot, rows: int, stream: Any) -> int:
        slot.reserved = False
        try:
            self._check_writable()
        except BaseException:
            self._abandon_slot(slot)  # the stream ended: the slot's memory goes now
            raise
        fixed = slot.fixed_message if rows == slot.layout.rows else None
        if fixed is not None:
            slot.before_send(stream)
            message, fds = fixed
            batch = Batch(message, fds, lambda: self._slot_free(slot), slot.index)
        else:
            exported = slot.export(rows)

            def free() -> None:
                exported.close()
                self._slot_free(slot)

            batch = Batch(exported.message, list(exported.fds), free, slot.index)
        return self._state.commit(batch)

    def _slot_free(self, slot: StreamSlot) -> None:
        """Every holder let go of the slot's batch (the stream's condition is held)."""
        if self._state.closed and slot not in self._free:
            slot.close()
            return
        self._free.append(slot)
        self._state.cond.notify_all()

    def _abandon_slot(self, slot: StreamSlot) -> None:
        slot.reserved = False
        with self._state.cond:
            self._slot_free(slot)

    # ---------- ending ------------------------------------------------------------------------------
    def close(self) -> None:
        """End the stream cleanly (idempotent): subscribers get every batch sent or queued, then
        the end (their iteration stops). New subscriptions are refused."""
        self._end(None, "the producer closed the stream")

    def fail(self, error: BaseException | str) -> None:
        """End the stream with an error: subscribers raise
        :class:`~arrow_ipc_bridge.errors.StreamError` (``reason="failed"``) naming it, after the batches they
        already received."""
        if not isinstance(error, BaseException | str):
            arguments.fail_type("error", "an exception or a str", error)
        if isinstance(error, BaseException):
            self._end(type(error).__name__, str(error) or type(error).__name__)
        else:
            self._end(stream_frames.END_FAILED, str(error))

    def _end(self, error_type: str | None, message: str) -> None:
        self._hub.remove(self._state)
        self._state.finish(error_type, message)  # then _close_free_slots

    def _close_free_slots(self) -> None:
        """The stream ended (closed, failed, or its publisher closed): free slots go now; slots
        consumers still hold go when released, a reserved one at its commit or abandon."""
        with self._state.cond:
            for slot in self._free:
                slot.close()
            self._free.clear()
        self._ring.close()

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None and not isinstance(exc, GeneratorExit):
            self.fail(exc)
        else:
            self.close()


def _metadata_of(field: pa.Field) -> str:
    """The metadata of a batch's root field (the schema's) and of each column, for an error message."""
    parts = {"(schema)": field.metadata or {}}
    if isinstance(field.type, pa.StructType):  # a record batch's columns (deeper fields not shown)
        for child in field.type:
            parts[child.name] = child.metadata or {}
    return repr({name: metadata for name, metadata in parts.items() if metadata})


def _message_field(message: bytes, n_fds: int) -> tuple[pa.Field, bool]:
    """The root field a message describes (a record batch's: a struct of its columns), and whether
    it is a table/stream message. Read from the message, so every producer object is checked alike."""
    decoded = Decoded(message, n_fds)
    try:
        capsule, out = new_capsule("schema")
        decoded.rebuild_schema(out)
        is_stream = bool(decoded.is_stream)
    finally:
        decoded.close()
    return pa.Field._import_from_c_capsule(capsule), is_stream


# ---------- publish_stream: a background pump ---------------------------------------------------------
class _Pump:
    """One pump's part in the interpreter's exit: whether it is writing a batch (the bridge's code:
    export, commit, the release of what it let go) and whether it may start another."""

    def __init__(self, writer: StreamWriter) -> None:
        self.writer = writer
        self.cond = threading.Condition()
        self.writing = False
        self.stopped = False

    def start_writing(self) -> bool:
        with self.cond:
            if self.stopped:
                return False
            self.writing = True
            return True

    def done_writing(self) -> None:
        with self.cond:
            self.writing = False
            self.cond.notify_all()

    def stop(self, deadline: float) -> bool:
        """Let the pump start no more batches; wait (until ``deadline``) for the one it writes."""
        with self.cond:
            self.stopped = True
            return self.cond.wait_for(lambda: not self.writing, max(deadline - time.monotonic(), 0.0))


_pumps: set[_Pump] = set()
_kept_at_exit: list[object] = []  # batches pumps got from their sources after they were stopped
_pumps_lock = threading.Lock()
# How long the exit waits for the pumps' writes: far longer than a write takes (its waits for slow
# consumers end when the stream is closed first), bounded so that a stuck one cannot hang the exit.
_EXIT_WAIT_S = 10.0


def _stop_pumps_at_exit() -> None:
    """Stop every pump before the interpreter finalizes (atexit). A pump is a daemon thread: one
    still writing once finalization started would release the batches it let go (pyarrow's
    NumPy-backed and foreign buffers take the GIL in their C++ destructor) and be ended there by
    ``pthread_exit``, whose unwinding through that destructor aborts the process ("terminate called
    without an active exception"). A pump in its source's code is not waited for: it writes
    nothing more once the source gives it a batch."""
    with _pumps_lock:
        pumps = list(_pumps)
    deadline = time.monotonic() + _EXIT_WAIT_S
    for each in pumps:
        with each.cond:
            each.stopped = True
        each.writer.close()  # wakes a write waiting for a slow consumer (policy "block")
    for each in pumps:
        if not each.stop(deadline):
            _log.warning("arrow_ipc_bridge: stream %r: the pump still writes at exit", each.writer.name)


# Registered after _reaper's hook (this module imports it through the exporter), so it runs before:
# atexit runs the last registered first, and what the pumps' last writes let go reaches the reaper
# before it stops.
atexit.register(_stop_pumps_at_exit)


def pump(
    writer: StreamWriter, source: object, *, name: str, wait_for_subscribers: int = 0
) -> threading.Thread:
    """Start a daemon thread that writes every batch of ``source`` to ``writer``, then closes it
    (or fails it with the source's error). An infinite source runs until the stream is closed.
    ``wait_for_subscribers``: read nothing of the source before that many consumers subscribed.
    At interpreter exit the pump is stopped: the batch it writes is finished, no other is started."""
    state = _Pump(writer)

    def write_one(batch: ArrowInput | CapturedData | None) -> bool:
        """Write one batch of the source (None: its end); False once the pump is done. Errors of
        the write are handled here, so their tracebacks (which hold the batch) go here too."""
        if batch is None:
            writer.close()
            return False
        if writer.closed:
            if isinstance(batch, CapturedData):  # ours to close (a batch of a C device stream)
                batch.close()
            return False
        try:
            writer.write(batch)
        except (StreamError, ClosedError, BridgeTimeoutError) as exc:  # the write's: logged
            if not writer.closed:
                _log.warning("arrow_ipc_bridge: stream %r: %s", name, exc)
                writer.fail(exc)
            return False
        except BaseException as exc:
            writer.fail(exc)
            return False
        return True

    def write_all() -> None:
        batches = iter(batches_of(source))
        while True:
            try:
                batch: ArrowInput | CapturedData | None = next(batches)
            except StopIteration:
                batch = None
            if not state.start_writing():
                # Stopped at exit: the interpreter may be finalizing by now, so this thread lets go
                # of nothing (a release may take the GIL inside a C++ destructor); the exiting
                # thread drops the batch with this module.
                _kept_at_exit.append(batch)
                return
            try:
                if not write_one(batch):
                    return
            finally:
                batch = None  # let go while the exit waits for us: its release may run C++ code
                state.done_writing()

    def run() -> None:
        if wait_for_subscribers and not writer._state.wait_for_subscribers(wait_for_subscribers):
            return  # closed before they came
        try:
            write_all()
        except StreamError as exc:  # the source's
            if not writer.closed:
                _log.warning("arrow_ipc_bridge: stream %r: %s", name, exc)
                writer.fail(exc)
        except BaseException as exc:  # the source's
            writer.fail(exc)
        finally:
            with _pumps_lock:
                _pumps.discard(state)

    with _pumps_lock:
        _pumps.add(state)
    thread = threading.Thread(target=run, name=f"aib-stream-{name}", daemon=True)
    try:
        thread.start()
    except BaseException:
        with _pumps_lock:
            _pumps.discard(state)
        raise
    return thread


def check_source(source: object) -> None:
    """Refuse a ``publish_stream`` source :func:`batches_of` cannot read, before the pump starts
    (its thread would only log the error): not an Arrow stream nor an iterable, or a string."""
    if (
        hasattr(source, "__arrow_c_stream__")
        or hasattr(source, "__arrow_c_device_stream__")
        or (isinstance(source, Iterable) and not isinstance(source, str | bytes | bytearray))
    ):
        return
    arguments.fail_type(
        "source",
        "an Arrow stream (__arrow_c_stream__ / __arrow_c_device_stream__) or an iterable of arrays or "
        "record batches",
        source,
    )


def batches_of(source: object) -> Iterator[ArrowInput | CapturedData]:
    """One batch at a time from an Arrow stream (``__arrow_c_stream__`` through pyarrow,
    ``__arrow_c_device_stream__`` through its C functions) or an iterable of Arrow objects."""
    if hasattr(source, "__arrow_c_stream__"):
        reader = pa.RecordBatchReader.from_stream(source)
        yield from reader
    elif hasattr(source, "__arrow_c_device_stream__"):
        yield from _device_stream_batches(source.__arrow_c_device_stream__())
    elif isinstance(source, Iterable):
        yield from source
    else:
        raise TypeError(
            f"publish_stream needs an Arrow stream (__arrow_c_stream__ / __arrow_c_device_stream__) or an "
            f"iterable of arrays or record batches, not {type(source).__name__}"
        )


def _device_stream_batches(capsule: object) -> Iterator[CapturedData]:
    """Each batch of a producer's C device stream as captured data, read as it comes."""
    source = capsule_struct(capsule, "device_stream")
    if source.release == ffi.NULL:
        raise BridgeError("the device stream capsule was already consumed or released")
    owned, stream = new_capsule("device_stream")
    lib.aib_device_stream_move(source, stream)
    schema = lib.aib_schema_alloc()
    try:
        _call(stream, stream.get_schema(stream, schema), "get_schema")
        while True:
            target = lib.aib_device_array_alloc()
            try:
                _call(stream, stream.get_next(stream, target), "get_next")
            except BaseException:
                lib.aib_device_array_free(target)
                raise
            if target.array.release == ffi.NULL:
                lib.aib_device_array_free(target)
                return
            copy = lib.aib_schema_alloc()
            err = new_error()
            if lib.aib_schema_copy(schema, copy, err):
                lib.aib_schema_free(copy)
                lib.aib_device_array_free(target)
                raise MemoryError("copying a stream's schema")
            yield CapturedData(copy, [target], is_stream=False)
    finally:
        lib.aib_schema_free(schema)
        del owned


def _call(stream: Any, rc: int, what: str) -> None:
    if rc != 0:
        text = stream.get_last_error(stream)
        detail = ffi.string(text).decode("utf-8", "replace") if text != ffi.NULL else "no message"
        raise BridgeError(f"the source stream's {what} failed with errno {rc}: {detail}")
