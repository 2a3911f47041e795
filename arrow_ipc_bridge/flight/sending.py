"""What ``do_get`` hands gRPC: record batches pulled one at a time as gRPC sends them, each let go
as soon as it is handed over.

A host publication is sent as its table over the session's mappings (``server.py``). A GPU
publication comes from its staging (:func:`staged_publication_stream`). A live stream is a
subscription whose batches a worker thread (``prefetch.py``) takes and prepares one ahead of gRPC
(:func:`live_stream`): host batches over the mappings, their lease (the producer's credit) held
until gRPC drops them; device batches staged, their lease given back once copied. A reference kept
here to a batch already handed over would hold its lease or staging buffer until the next batch
came, so every batch is popped as it goes. A failure reaches the client as a Flight error that
names what failed (:func:`flight_error`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pyarrow as pa
from pyarrow import flight

from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream
from arrow_ipc_bridge.errors import BridgeError, BridgeTimeoutError, PeerClosedError
from arrow_ipc_bridge.flight.prefetch import Prefetcher
from arrow_ipc_bridge.flight.staging import StagedPublication
from arrow_ipc_bridge.flight.tables import host_table

__all__ = ["batch_stream", "flight_error", "live_stream", "staged_publication_stream"]

_POLL_S = 0.25  # how often a waiting live stream looks whether its Flight client went away


def batch_stream(schema: pa.Schema, batches: Iterator[pa.RecordBatch]) -> flight.FlightDataStream:
    """Batches pulled one at a time as gRPC sends them. Through a RecordBatchReader, not
    ``flight.GeneratorStream``: pyarrow's GeneratorStream sends no dictionary batches, so a client
    reading a dictionary-encoded column fails ("did not have the expected number (1) of
    dictionaries at the start of the stream"); a reader's stream writes them (and replacements)."""
    return flight.RecordBatchStream(pa.RecordBatchReader.from_batches(schema, batches))


def staged_publication_stream(staged: StagedPublication) -> flight.FlightDataStream:
    """A GPU publication sent chunk by chunk from pinned buffers (``staging.py``); ``staged`` is
    closed at the end, also when its first chunk cannot be staged."""
    batches = iter(staged)
    try:
        first = next(batches, None)
    except BaseException as exc:
        staged.close()
        raise flight_error(exc) from None
    held = [] if first is None else [first]
    schema = first.schema if first is not None else staged.schema
    del first

    return batch_stream(schema, handed_over(held, batches, "staging the GPU data", staged.close))


def live_stream(
    name: str,
    live: Any,
    cancelled: Callable[[], bool],
    *,
    refuse_unsendable: Callable[[str, ImportedArray | ImportedStream], None],
    needs_staging: Callable[[ImportedArray | ImportedStream], bool],
    stage_live_batch: Callable[[ImportedArray, Callable[[], bool]], StagedPublication],
) -> flight.FlightDataStream:
    """The live stream ``name`` from its subscription ``live``, batch by batch as the producer
    writes them, until the client goes away (``cancelled``) or the stream ends. The first batch is
    waited for here, so that a stream that cannot be sent is refused (``refuse_unsendable``) before
    anything is sent. Each batch that ``needs_staging`` goes through ``stage_live_batch``; the others
    are sent over the session's mappings."""
    stop = threading.Event()

    def gone() -> bool:
        return stop.is_set() or cancelled()

    try:
        first = next_import(live, gone)
        if first is not None:
            # The writer gives every batch of a stream the first one's schema: checked once.
            refuse_unsendable(name, first)
    except BaseException:
        live.close()
        raise
    if first is None:
        live.close()
        raise flight.FlightCancelledError(f"live stream {name!r} ended before its first batch")
    pending = [first]  # taken by the worker; released at the end if it never was
    del first

    def imports() -> Generator[ImportedArray, None, None]:
        while pending:
            yield pending.pop()
        while True:
            batch = next_import(live, gone)
            if batch is None:
                return
            yield batch
            del batch

    def record_batches() -> Iterator[pa.RecordBatch]:
        # Runs on the worker thread, which closes it when it stops (Prefetcher).
        source = imports()
        try:
            for imported in source:
                if needs_staging(imported):
                    staged = stage_live_batch(imported, gone)
                    try:
                        yield from staged
                    finally:  # also when the worker stops midway
                        staged.close()
                    continue
                with imported:  # the record batches hold the lease (credit) until gRPC drops them
                    host_batches = host_table(imported).to_batches()
                while host_batches:  # popped as handed over: a reference here would hold the lease
                    yield host_batches.pop(0)
        finally:
            source.close()

    batches: Prefetcher[pa.RecordBatch, pa.RecordBatch] = Prefetcher(
        record_batches(), _same, depth=1, name=f"aib-flight-{name[:40]}"
    )

    def finish() -> None:
        stop.set()
        batches.close()  # the worker stops: staging waited for and given back, imports released
        live.close()  # the leases of batches the producer sent and nobody took go back
        while pending:
            pending.pop().release()

    try:
        head = next(batches, None)
    except BaseException as exc:
        finish()
        raise flight_error(exc, f"live stream {name!r}") from None
    if head is None:
        finish()
        raise flight.FlightCancelledError(f"live stream {name!r} ended before its first batch")
    schema = head.schema
    held = [head]
    del head

    return batch_stream(schema, handed_over(held, batches, f"live stream {name!r}", finish))


def handed_over(
    held: list[pa.RecordBatch], batches: Iterator[pa.RecordBatch], what: str, finish: Callable[[], None]
) -> Iterator[pa.RecordBatch]:
    """The batches of a ``do_get``: ``held`` (the first, already taken), then the rest of
    ``batches``. Each is popped as it is handed to gRPC: a reference kept here would hold the
    batch's lease (host) or staging buffer (device) until the next batch came. A failure reaches
    the client as a Flight error naming ``what``; ``finish`` runs at the end, also when the client
    went away (the generator is closed)."""
    try:
        while held:
            yield held.pop()
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except BaseException as exc:
                raise flight_error(exc, what) from None
            held.append(batch)
            del batch
            yield held.pop()
    finally:
        finish()


def flight_error(exc: BaseException, what: str = "staging the GPU data") -> BaseException:
    """A failure while sending (``what``), as a Flight error (one line, no traceback) for the
    client."""
    error: BaseException = exc
    if isinstance(exc, PeerClosedError) and exc.reason == "client_gone":  # the staging pool's
        error = flight.FlightCancelledError(str(exc))
    elif isinstance(exc, BridgeError):
        error = flight.FlightServerError(f"{what} failed: {exc}")
    return error


def _same(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


def next_import(live: Any, gone: Callable[[], bool]) -> ImportedArray | None:
    """The live stream's next batch; None at its end or once the client is ``gone()`` (looked at
    every ``_POLL_S``)."""
    while not gone():
        try:
            batch: ImportedArray | None = live.next_batch(timeout=_POLL_S)
        except BridgeTimeoutError:
            continue
        return batch
    return None
