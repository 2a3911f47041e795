"""The Flight front: a publisher's publications and live streams served to Arrow Flight clients.

The front is a consumer of the publisher through the bridge's own :class:`~arrow_ipc_bridge.Session`
(``docs/flight.md`` says why): it serves any running publisher by its socket path, or a
:class:`~arrow_ipc_bridge.Publisher` of this process (then ``do_put`` can publish into it and its
live streams are listed). Each ``do_get`` gets the publication under a lease, builds pyarrow objects
over the session's mappings (no copy) and lets gRPC send them; the lease ends when gRPC drops the
last batch (GPU data is staged through a pinned pool first, ``staging.py``). Live streams are
subscriptions whose credit goes back only as gRPC sends a host batch, or as a GPU batch is copied
to the pool (whose few buffers per client then wait on gRPC), so a slow Flight client slows the
producer exactly as a slow local subscriber does.

Errors go to clients with the gRPC status that says what went wrong: an unknown name NOT_FOUND
(``pyarrow.ArrowKeyError`` in a pyarrow client), a malformed ticket, descriptor, device or upload,
or a publication Arrow IPC cannot carry (a dictionary of dictionaries, ``_unsendable``)
INVALID_ARGUMENT (``pyarrow.ArrowInvalid``), a gone publisher or an upload past
``max_put_total_bytes`` UNAVAILABLE (``FlightUnavailableError``), a missing or wrong token
UNAUTHENTICATED (``FlightUnauthenticatedError``), a refused ``do_put`` PERMISSION_DENIED
(``FlightUnauthorizedError``). pyarrow sends the last frames of a NOT_FOUND or INVALID_ARGUMENT
exception with it (it formats every exception a handler raises that is not a Flight error): those
are raised by the handler itself (:func:`_answering`), so the client sees pyarrow's frame and the
handler's ``raise`` line, nothing of the front's work behind it.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pyarrow as pa
from pyarrow import flight

from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream
from arrow_ipc_bridge.consumer.session import Session
from arrow_ipc_bridge.consumer.socket_connect import connect_socket
from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    NotPublishedError,
    PeerClosedError,
    TransportError,
)
from arrow_ipc_bridge.flight.auth import TokenAuthMiddlewareFactory
from arrow_ipc_bridge.flight.locations import LOCAL_ACTION, LocalLocation
from arrow_ipc_bridge.flight.staging import (
    CHUNK_BYTES,
    MAX_STAGING_BYTES,
    CudaCopier,
    Prefetcher,
    StagedPublication,
    StagingCancelledError,
    StagingPool,
    stage_live_batch,
)
from arrow_ipc_bridge.flight.tables import flight_schema, host_table, nested_dictionary
from arrow_ipc_bridge.producer.publisher import Publisher
from arrow_ipc_bridge.transport.protocol import encode_name
from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA

__all__ = ["FlightFront", "serve"]

REUSE_CONNECTION = "arrow-flight-reuse-connection://?"  # the Flight spec's "this same server"
_POLL_S = 0.25  # how often a waiting live stream looks whether its Flight client went away
_SCHEMES_PLAIN = ("grpc", "grpc+tcp")
_SCHEME_TLS = "grpc+tls"


class _Refused(Exception):
    """A request the front refuses: raised where the refusal is found, answered by the handler."""

    def __init__(self, status: type[pa.ArrowException], message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _batch_stream(schema: pa.Schema, batches: Iterator[pa.RecordBatch]) -> flight.FlightDataStream:
    """Batches pulled one at a time as gRPC sends them. Through a RecordBatchReader, not
    ``flight.GeneratorStream``: pyarrow's GeneratorStream sends no dictionary batches, so a client
    reading a dictionary-encoded column fails ("did not have the expected number (1) of
    dictionaries at the start of the stream"); a reader's stream writes them (and replacements)."""
    return flight.RecordBatchStream(pa.RecordBatchReader.from_batches(schema, batches))


def _not_found(name: str) -> _Refused:
    return _Refused(pa.ArrowKeyError, f"no publication or live stream named {name!r}")


def _invalid(message: str) -> _Refused:
    return _Refused(pa.ArrowInvalid, message)


_Handler = TypeVar("_Handler", bound=Callable[..., Any])


def _answering(handler: _Handler) -> _Handler:
    """Answer a refusal with its gRPC status (pyarrow maps ``KeyError`` to NOT_FOUND and
    ``ValueError`` to INVALID_ARGUMENT), raised here, outside the ``except`` block: the exception
    carries no context and one frame of ours, the ``raise`` below, whatever raised the refusal."""

    @functools.wraps(handler)
    def answer(*args: Any) -> Any:
        try:
            return handler(*args)
        except _Refused as refused:
            status, message = refused.status, refused.message
        raise status(message)

    return answer  # type: ignore[return-value]


def _name_of_ticket(raw: bytes) -> str:
    try:
        name = raw.decode("utf-8")
        encode_name(name)  # the bridge's own limits on names
    except (UnicodeDecodeError, ValueError, TypeError, BridgeError):
        raise _invalid("a ticket is the UTF-8 name of a publication or live stream") from None
    return name


def _name_of_descriptor(descriptor: flight.FlightDescriptor) -> tuple[str, str | None]:
    """``(name, device)`` of a descriptor: path ``[name]`` or ``[name, "cuda:N"]`` (do_put), or a
    command holding the UTF-8 name."""
    if descriptor.descriptor_type == flight.DescriptorType.PATH:
        parts = [p.decode("utf-8", "replace") if isinstance(p, bytes) else str(p) for p in descriptor.path]
        if len(parts) not in (1, 2):
            raise _invalid("a descriptor path is [name] or [name, 'cuda:N']")
        name = _name_of_ticket(parts[0].encode("utf-8"))
        return name, parts[1] if len(parts) == 2 else None
    return _name_of_ticket(bytes(descriptor.command)), None


def _unsendable(name: str, schema: pa.Schema) -> str | None:
    """Why ``name``, of ``schema``, cannot be sent over Flight, or None when it can. Found from the
    schema alone, before anything is sent: a client must not get wrong values."""
    found = nested_dictionary(schema)
    if found is None:
        return None
    path, dtype = found
    return (
        f"column {path[:200]!r} of {name!r} is a dictionary whose values are a dictionary "
        f"({str(dtype)[:300]}): Arrow IPC, which Flight sends, cannot carry it (pyarrow reads it "
        "back as one dictionary of wrong values); publish its values decoded to serve it over Flight"
    )


def _cuda_ordinal(device: str) -> int:
    prefix = "cuda:"
    if not device.startswith(prefix) or not device[len(prefix) :].isdigit():
        raise _invalid(f"device must be 'cuda:N', not {device[:40]!r}")
    return int(device[len(prefix) :])


class _Uploads:
    """The uploads a front takes at once: each may hold up to ``max_put_bytes`` before it is
    published, and all together no more than ``max_put_total_bytes``, so ``total // share`` of
    them run at once and one more is refused before it reads a batch (``docs/flight.md``,
    "Uploads"). A share is taken whole at the start: gRPC receives a message whole before the
    front can see its size, so what an upload will hold is only known as it arrives."""

    def __init__(self, share: int, total: int) -> None:
        self.share = share
        self.total = total
        self.at_once = total // share
        self._lock = threading.Lock()
        self._running = 0

    @property
    def running(self) -> int:
        """Uploads in progress now."""
        return self._running

    def take(self) -> None:
        with self._lock:
            if self._running < self.at_once:
                self._running += 1
                return
        uploads = "upload" if self.at_once == 1 else "uploads"
        raise flight.FlightUnavailableError(
            f"the front is taking {self.at_once} {uploads} already, as many as max_put_total_bytes "
            f"({self.total} bytes) allows at max_put_bytes ({self.share} bytes) each: try again "
            "when one is published"
        )

    def give_back(self) -> None:
        with self._lock:
            self._running -= 1


def _held_bytes(batch: pa.RecordBatch, roots: dict[tuple[int, int], int]) -> int:
    """Bytes of memory ``batch`` keeps alive that ``roots`` (those an upload holds already, by
    address and size) does not count yet. A batch read from IPC is slices of its message's body, and
    a slice keeps its whole body alive: each buffer is counted by its outermost parent, once. Not
    ``nbytes``: a crafted message may describe a few bytes of a body of any size."""
    added = 0
    for column in batch.columns:
        for array in _with_dictionaries(column):
            for buffer in array.buffers():
                if buffer is None:
                    continue
                root = buffer
                while root.parent is not None:
                    root = root.parent
                key = (root.address, root.size)
                if key not in roots:
                    roots[key] = root.size
                    added += root.size
    return added


def _with_dictionaries(array: pa.Array) -> Iterator[pa.Array]:
    """``array`` and every dictionary in it, at any depth (``buffers()`` covers an array's children
    but not dictionaries)."""
    yield array
    pending = [array]
    while pending:
        current = pending.pop()
        if isinstance(current, pa.ExtensionArray):
            current = current.storage
        dtype = current.type
        if pa.types.is_dictionary(dtype):
            yield current.dictionary
            pending.append(current.dictionary)
        elif isinstance(current, (pa.StructArray, pa.UnionArray)):
            pending.extend(current.field(i) for i in range(dtype.num_fields))
        elif isinstance(
            current,
            (
                pa.ListArray,
                pa.LargeListArray,
                pa.FixedSizeListArray,
                pa.ListViewArray,
                pa.LargeListViewArray,
                pa.RunEndEncodedArray,
            ),
        ):
            pending.append(current.values)


@dataclass(frozen=True)
class _Facts:
    kind: str
    schema: pa.Schema
    rows: int
    nbytes: int
    device: str
    refusal: str | None = None  # why it cannot be sent over Flight (``_unsendable``)


class _BridgeFlightServer(flight.FlightServerBase):  # type: ignore[misc]
    """The pyarrow Flight server whose handlers read through the front's session."""

    def __init__(self, front: FlightFront, location: str, **kwargs: Any) -> None:
        self._front = front
        super().__init__(location, **kwargs)

    # ---------- listing --------------------------------------------------------------------------
    def list_flights(self, context: Any, criteria: bytes) -> Iterator[flight.FlightInfo]:
        prefix = criteria.decode("utf-8", "replace") if criteria else ""
        front = self._front
        for name in front.publication_names():
            if name.startswith(prefix):
                facts = front.facts(name)
                # What cannot be sent is left out: its schema would be listed wrong (IPC writes
                # it), and get_flight_info, get_schema and do_get of it say why.
                if facts is not None and facts.refusal is None:
                    yield front.flight_info(name, facts)
        for name in front.stream_names():
            if name.startswith(prefix):
                yield front.flight_info(name, front.stream_facts())

    @_answering
    def get_flight_info(self, context: Any, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        name, _ = _name_of_descriptor(descriptor)
        return self._front.flight_info(name, self._front.facts_or_stream(name))

    @_answering
    def get_schema(self, context: Any, descriptor: flight.FlightDescriptor) -> flight.SchemaResult:
        name, _ = _name_of_descriptor(descriptor)
        return flight.SchemaResult(self._front.facts_or_stream(name).schema)

    # ---------- data -----------------------------------------------------------------------------
    @_answering
    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.FlightDataStream:
        name = _name_of_ticket(ticket.ticket)
        return self._front.data_stream(name, context.is_cancelled)

    @_answering
    def do_put(
        self,
        context: Any,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.FlightMetadataWriter,
    ) -> None:
        name, device = _name_of_descriptor(descriptor)
        self._front.put(name, device, reader, context.is_cancelled)

    # ---------- actions --------------------------------------------------------------------------
    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [(LOCAL_ACTION, "the publisher's Unix socket as a location, for consumers on this host")]

    @_answering
    def do_action(self, context: Any, action: flight.Action) -> Iterator[bytes]:
        # Not a generator: a refusal must be raised by the call, where _answering sees it.
        if action.type != LOCAL_ACTION:
            raise _invalid(f"unknown action {action.type[:60]!r} (see list_actions)")
        location = self._front.local_location
        return iter([json.dumps({"location": location.uri if location else None}).encode()])


class FlightFront:
    """A running Flight front (made by :func:`serve`). ``location``: the gRPC address it listens on
    (the port filled in); ``local_location``: the publisher's socket as a location
    (:class:`~arrow_ipc_bridge.flight.locations.LocalLocation`); ``close()`` or the ``with`` block
    stops it."""

    def __init__(
        self,
        source: Publisher | str | os.PathLike[str],
        location: str,
        *,
        server_options: dict[str, Any],
        streams: Iterable[str],
        max_in_flight: int,
        allow_put: bool,
        max_put_bytes: int,
        max_put_total_bytes: int,
        advertise: str | None,
        timeout: float,
        staging_bytes: int = MAX_STAGING_BYTES,
    ) -> None:
        self._publisher = source if isinstance(source, Publisher) else None
        path = source.path if isinstance(source, Publisher) else os.fspath(source)
        self._socket_path = os.path.abspath(path)
        self._streams = list(streams)
        for name in self._streams:
            encode_name(name)
        self._max_in_flight = max_in_flight
        self._allow_put = allow_put
        self._max_put_bytes = max_put_bytes
        self._uploads = _Uploads(max(max_put_bytes, 1), max_put_total_bytes)
        self._timeout = timeout
        self._staging_bytes = staging_bytes
        self._pools: dict[int, StagingPool] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._session: Session | None = connect_socket(self._socket_path, timeout=timeout)
        publisher_id = str(self._session.publisher_info.get("publisher_id", ""))
        self.local_location: LocalLocation | None = LocalLocation.this_host(self._socket_path, publisher_id)
        try:
            self._server = _BridgeFlightServer(self, location, **server_options)
        except BaseException:
            self._session.close()
            raise
        parts = urlsplit(location)
        host = parts.hostname or "localhost"
        self.location = f"{parts.scheme}://{_bracketed(host)}:{self._server.port}"
        """The gRPC address the front listens on, its port filled in."""
        self._advertised = advertise or (REUSE_CONNECTION if _unspecified(host) else self.location)

    # ---------- the publisher, through the session -----------------------------------------------
    def _current_session(self) -> Session:
        """The front's session; a publisher that restarted at the same path is connected again."""
        with self._lock:
            if self._closed:
                raise flight.FlightUnavailableError("the Flight front is closed")
            if self._session is not None and not self._session.closed:
                return self._session
            try:
                self._session = connect_socket(self._socket_path, timeout=self._timeout)
            except (BridgeError, OSError) as exc:
                raise flight.FlightUnavailableError(f"the publisher is not reachable: {exc}") from None
            # A restarted publisher has another id: the local location names the one served now.
            publisher_id = str(self._session.publisher_info.get("publisher_id", ""))
            self.local_location = LocalLocation.this_host(self._socket_path, publisher_id)
            return self._session

    def _call(self, work: Callable[[Session], Any]) -> Any:
        """Run ``work`` with the session; a publisher gone away is FlightUnavailableError (and the
        next call connects again)."""
        session = self._current_session()
        try:
            return work(session)
        except (PeerClosedError, TransportError, BridgeTimeoutError) as exc:
            session.close()
            raise flight.FlightUnavailableError(f"the publisher is not reachable: {exc}") from None

    def publication_names(self) -> list[str]:
        names: list[str] = self._call(lambda s: s.list())
        return sorted(names)

    def stream_names(self) -> list[str]:
        if self._publisher is not None:
            return self._publisher.stream_names()
        return list(self._streams)

    def _get(self, name: str) -> ImportedArray | ImportedStream | None:
        """The publication ``name`` under a lease, or None when nothing is published as it."""
        try:
            imported: ImportedArray | ImportedStream = self._call(lambda s: s.get(name))
        except NotPublishedError:
            return None
        return imported

    def facts(self, name: str) -> _Facts | None:
        """What ``name`` holds, read from its message (a get released at once), or None."""
        imported = self._get(name)
        if imported is None:
            return None
        with imported:
            kind = (
                "table"
                if isinstance(imported, ImportedStream)
                else ("record batch" if imported.root_format == "+s" else "array")
            )
            schema = flight_schema(imported)
            return _Facts(
                kind, schema, imported.num_rows, imported.nbytes, imported.device, _unsendable(name, schema)
            )

    def stream_facts(self) -> _Facts:
        # A live stream's schema comes with its first batch: do_get sends it; the listing cannot.
        return _Facts("live stream", pa.schema([]), -1, -1, "")

    def facts_or_stream(self, name: str) -> _Facts:
        """What ``name`` holds, to describe it to a client; refused when it cannot be sent."""
        facts = self.facts(name)
        if facts is not None and facts.refusal is not None:
            raise _invalid(facts.refusal)
        if facts is not None:
            return facts
        if name in self.stream_names():
            return self.stream_facts()
        raise _not_found(name)

    def flight_info(self, name: str, facts: _Facts) -> flight.FlightInfo:
        locations = [flight.Location(self._advertised)]
        if self.local_location is not None and facts.kind != "live stream":
            locations.append(flight.Location(self.local_location.uri))
        metadata = {"kind": facts.kind, "device": facts.device}
        return flight.FlightInfo(
            facts.schema,
            flight.FlightDescriptor.for_path(name),
            [flight.FlightEndpoint(name.encode("utf-8"), locations)],
            total_records=facts.rows,
            total_bytes=facts.nbytes,
            ordered=True,
            app_metadata=json.dumps(metadata).encode(),
        )

    # ---------- do_get ---------------------------------------------------------------------------
    def data_stream(self, name: str, cancelled: Callable[[], bool]) -> flight.FlightDataStream:
        imported = self._get(name)
        if imported is not None:
            self._refuse_unsendable(name, imported)
        if imported is not None and self._needs_staging(imported):
            return self._staged_stream(imported, cancelled)
        if imported is not None:
            try:
                table = host_table(imported)  # over the mappings; holds the lease, not `imported`
            finally:
                imported.release()
            return flight.RecordBatchStream(table)
        if self._publisher is None and name not in self._streams:
            raise _not_found(name)
        return self._live_stream(name, cancelled)

    @staticmethod
    def _refuse_unsendable(name: str, imported: ImportedArray | ImportedStream) -> None:
        """Refuse (and release) ``imported`` when it cannot be sent over Flight."""
        try:
            refusal = _unsendable(name, flight_schema(imported))
        except BaseException:
            imported.release()
            raise
        if refusal is not None:
            imported.release()
            raise _invalid(refusal)

    def _needs_staging(self, imported: ImportedArray | ImportedStream) -> bool:
        """Whether ``imported`` is device data, which gRPC cannot send from where it is."""
        return imported.device_type == DEVICE_CUDA

    def _staging_pool(self, device: int) -> StagingPool:
        """The front's pinned staging pool for ``device``, made on the first GPU ``do_get``."""
        with self._lock:
            if self._closed:
                raise flight.FlightUnavailableError("the Flight front is closed")
            pool = self._pools.get(device)
            if pool is None:
                chunk = min(CHUNK_BYTES, self._staging_bytes // 2)
                pool = StagingPool(CudaCopier(device), buffer_bytes=chunk, max_bytes=self._staging_bytes)
                self._pools[device] = pool
            return pool

    def _staged_stream(
        self, imported: ImportedArray | ImportedStream, cancelled: Callable[[], bool]
    ) -> flight.FlightDataStream:
        """A GPU publication sent chunk by chunk from pinned buffers (``staging.py``)."""
        try:
            pool = self._staging_pool(imported.device_id)
            staged = StagedPublication(imported, pool, chunk_bytes=pool.buffer_bytes, cancelled=cancelled)
        except BaseException:
            imported.release()
            raise
        batches = iter(staged)
        try:
            first = next(batches, None)
        except BaseException as exc:
            staged.close()
            raise _flight_error(exc) from None
        held = [] if first is None else [first]
        schema = first.schema if first is not None else staged.schema
        del first

        return _batch_stream(schema, _handed_over(held, batches, "staging the GPU data", staged.close))

    def _live_stream(self, name: str, cancelled: Callable[[], bool]) -> flight.FlightDataStream:
        """A live stream, batch by batch as the producer writes them. Host batches are sent over
        the session's mappings (their lease, the producer's credit, held until gRPC drops them);
        device batches are staged through the pinned pool as publications are, their lease given
        back once copied. Either way a worker thread (``Prefetcher``) prepares the next batch while
        gRPC sends the current one."""
        try:
            live = self._call(lambda s: s.subscribe(name, max_in_flight=self._max_in_flight))
        except NotPublishedError:
            raise _not_found(name) from None
        stop = threading.Event()

        def gone() -> bool:
            return stop.is_set() or cancelled()

        try:
            first = _next_import(live, gone)
            if first is not None:
                # The writer gives every batch of a stream the first one's schema: checked once.
                self._refuse_unsendable(name, first)
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
                batch = _next_import(live, gone)
                if batch is None:
                    return
                yield batch
                del batch

        def record_batches() -> Iterator[pa.RecordBatch]:
            # Runs on the worker thread, which closes it when it stops (Prefetcher).
            source = imports()
            try:
                for imported in source:
                    if self._needs_staging(imported):
                        staged = self._staged_live_batch(imported, gone)
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
            raise _flight_error(exc, f"live stream {name!r}") from None
        if head is None:
            finish()
            raise flight.FlightCancelledError(f"live stream {name!r} ended before its first batch")
        schema = head.schema
        held = [head]
        del head

        return _batch_stream(schema, _handed_over(held, batches, f"live stream {name!r}", finish))

    def _staged_live_batch(self, imported: ImportedArray, gone: Callable[[], bool]) -> StagedPublication:
        """A device batch of a live stream through the front's pinned pool for its GPU."""
        try:
            pool = self._staging_pool(imported.device_id)
        except BaseException:
            imported.release()
            raise
        return stage_live_batch(imported, pool, cancelled=gone)

    # ---------- do_put ---------------------------------------------------------------------------
    def put(
        self,
        name: str,
        device: str | None,
        reader: flight.MetadataRecordBatchReader,
        cancelled: Callable[[], bool],
    ) -> None:
        if not self._allow_put or self._publisher is None:
            raise flight.FlightUnauthorizedError(
                "this Flight front does not take do_put (serve(publisher, allow_put=True) does)"
            )
        ordinal = _cuda_ordinal(device) if device is not None else None
        # Taken before the first batch is read: until the front reads, gRPC holds no more of the
        # stream than its flow-control window, so a refused upload's batches stay with its client.
        self._uploads.take()
        try:
            table = self._received(reader)
            if cancelled():
                # The reader ends the same way when the client finished and when it went away
                # (its process died, its connection broke): only the call tells them apart.
                raise flight.FlightCancelledError(
                    "the client went away before the end of its upload: nothing was published"
                )
            if ordinal is not None:
                from arrow_ipc_bridge.arrays.device import to_device

                self._publisher.publish(name, to_device(table, ordinal))
            else:
                self._publisher.publish(name, table)
            del table
        finally:
            self._uploads.give_back()

    def _received(self, reader: flight.MetadataRecordBatchReader) -> pa.Table:
        """The upload as a table, refused as soon as a batch puts what it holds over
        ``max_put_bytes``. Each batch is counted by the memory it keeps alive (``_held_bytes``), not
        by what it describes."""
        batches: list[pa.RecordBatch] = []
        roots: dict[tuple[int, int], int] = {}
        held = 0
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            if chunk.data is None:
                continue
            held += _held_bytes(chunk.data, roots)
            if held > self._max_put_bytes:
                # Dropped before the refusal travels: the exception's frames would hold them.
                batches.clear()
                del chunk
                raise _invalid(
                    f"the upload is over max_put_bytes ({self._max_put_bytes} bytes): its batches "
                    f"hold {held} bytes"
                )
            batches.append(chunk.data)
        return pa.Table.from_batches(batches, schema=reader.schema)

    @property
    def uploads_in_progress(self) -> int:
        """``do_put`` calls in progress now, each holding a share of ``max_put_total_bytes``."""
        return self._uploads.running

    # ---------- lifetime -------------------------------------------------------------------------
    @property
    def port(self) -> int:
        port: int = self._server.port
        return port

    @property
    def closed(self) -> bool:
        return self._closed

    def serve_forever(self) -> None:
        """Block until the front is closed (``close()`` from another thread, or a signal)."""
        self._server.serve()

    def close(self) -> None:
        """Stop serving: calls in progress end, then the session closes (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()
        self._server.wait()
        with self._lock:
            session, self._session = self._session, None
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:  # buffers gRPC still holds are freed when they come back
            pool.close()
            pool.copier.close()
        if session is not None:
            session.close()

    def __enter__(self) -> FlightFront:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "serving"
        return f"<FlightFront {self.location} for {self._socket_path} ({state})>"


def _handed_over(
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
                raise _flight_error(exc, what) from None
            held.append(batch)
            del batch
            yield held.pop()
    finally:
        finish()


def _flight_error(exc: BaseException, what: str = "staging the GPU data") -> BaseException:
    """A failure while sending (``what``), as a Flight error (one line, no traceback) for the
    client."""
    error: BaseException = exc
    if isinstance(exc, StagingCancelledError):
        error = flight.FlightCancelledError(str(exc))
    elif isinstance(exc, BridgeError):
        error = flight.FlightServerError(f"{what} failed: {exc}")
    return error


def _same(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


def _next_import(live: Any, gone: Callable[[], bool]) -> ImportedArray | None:
    """The live stream's next batch; None at its end or once the client is ``gone()`` (looked at
    every ``_POLL_S``)."""
    while not gone():
        try:
            batch: ImportedArray | None = live.next_batch(timeout=_POLL_S)
        except BridgeTimeoutError:
            continue
        return batch
    return None


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def serve(
    source: Publisher | str | os.PathLike[str],
    location: str = "grpc://127.0.0.1:0",
    *,
    tokens: Iterable[str] | None = None,
    tls_certificates: list[tuple[bytes, bytes]] | None = None,
    verify_client: bool = False,
    root_certificates: bytes | None = None,
    allow_unauthenticated: bool = False,
    allow_put: bool = False,
    streams: Iterable[str] = (),
    max_in_flight: int = 8,
    max_put_bytes: int = 4 << 30,
    max_put_total_bytes: int | None = None,
    advertise: str | None = None,
    timeout: float = 5.0,
    staging_bytes: int = MAX_STAGING_BYTES,
) -> FlightFront:
    """Serve a publisher's publications (and live streams) to Arrow Flight clients.

    Parameters
    ----------
    source
        A :class:`~arrow_ipc_bridge.Publisher` of this process, or the socket path of a running
        publisher (any process of a uid it admits).
    location
        Where to listen: ``grpc://HOST:PORT`` or ``grpc+tls://HOST:PORT`` (port 0: any free one,
        see ``FlightFront.location``).
    tokens
        Bearer tokens a client must send (``authorization: Bearer <token>``), each at least 16
        characters.
    tls_certificates, verify_client, root_certificates
        TLS: ``[(certificate_chain_pem, private_key_pem)]`` (needs a ``grpc+tls://`` location);
        ``verify_client=True`` asks every client for a certificate signed by
        ``root_certificates`` (PEM), which then authenticates it.
    allow_unauthenticated
        Serve without tokens or client certificates. Without it, a front that authenticates
        nobody is refused (``ValueError``): anyone who can reach the port could read everything.
    allow_put
        Let clients publish through ``do_put`` (descriptor path ``[name]``, or ``[name,
        "cuda:N"]`` to upload to that GPU); needs ``source`` to be a ``Publisher``.
    streams
        Names of live streams to list and serve when ``source`` is a socket path (the publisher's
        protocol lists publications only); a ``Publisher``'s own streams are found by themselves.
    max_in_flight
        Batches of a live stream the front holds per Flight client before the client's pace
        holds the producer back (the publisher's slow-consumer policy then applies).
    max_put_bytes
        The largest upload ``do_put`` takes (it is held in memory before it is published),
        counted as the memory its record batches keep alive.
    max_put_total_bytes
        The most all uploads in progress may hold together (default: ``max_put_bytes``, one
        upload at a time). Each upload takes a share of ``max_put_bytes`` when it starts, so the
        front runs ``max_put_total_bytes // max_put_bytes`` uploads at once and refuses one more
        (``FlightUnavailableError``) before reading its batches (``docs/flight.md``, "Uploads").
    advertise
        The gRPC location endpoints name; default: the listening one, or the Flight spec's
        "reuse this connection" when listening on all addresses.
    timeout
        Seconds for each request to the publisher.
    staging_bytes
        Pinned host memory per GPU for staging GPU publications (``docs/flight.md``, "GPU data"):
        the bound of all ``do_get`` calls together; chunks are ``min(64 MiB, staging_bytes / 2)``.
        At least 2 MiB.
    """
    scheme = urlsplit(location).scheme
    if scheme not in (*_SCHEMES_PLAIN, _SCHEME_TLS):
        raise ValueError(f"location must be grpc://, grpc+tcp:// or grpc+tls://, not {location!r}")
    if (scheme == _SCHEME_TLS) != bool(tls_certificates):
        raise ValueError("a grpc+tls:// location needs tls_certificates, and tls_certificates need it")
    if verify_client and not root_certificates:
        raise ValueError("verify_client needs root_certificates (the CA that signs client certificates)")
    # Client certificates are checked only during a TLS handshake: over plain gRPC verify_client
    # would authenticate nobody while this front took it as its authentication.
    if (verify_client or root_certificates) and not tls_certificates:
        raise ValueError(
            "verify_client and root_certificates need TLS (a grpc+tls:// location and tls_certificates): "
            "without it no client certificate is asked for"
        )
    token_list = list(tokens) if tokens is not None else []
    if not token_list and not verify_client and not allow_unauthenticated:
        raise ValueError(
            "this front would let anyone who reaches it read every publication: pass tokens=, "
            "verify_client=True with root_certificates=, or allow_unauthenticated=True"
        )
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"max_in_flight must be an int >= 1, not {max_in_flight!r}")
    if isinstance(max_put_bytes, bool) or not isinstance(max_put_bytes, int) or max_put_bytes < 0:
        raise ValueError(f"max_put_bytes must be an int >= 0, not {max_put_bytes!r}")
    share = max(max_put_bytes, 1)
    if max_put_total_bytes is None:
        max_put_total_bytes = share
    if (
        isinstance(max_put_total_bytes, bool)
        or not isinstance(max_put_total_bytes, int)
        or max_put_total_bytes < share
    ):
        raise ValueError(
            f"max_put_total_bytes must be an int >= max_put_bytes ({share}), not {max_put_total_bytes!r}"
        )
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 2 << 20:
        raise ValueError(f"staging_bytes must be an int >= 2 MiB, not {staging_bytes!r}")
    if allow_put and not isinstance(source, Publisher):
        raise ValueError("allow_put needs a Publisher of this process as the source")
    options: dict[str, Any] = {}
    if token_list:
        options["middleware"] = {"auth": TokenAuthMiddlewareFactory(token_list)}
    if tls_certificates:
        options["tls_certificates"] = [flight.CertKeyPair(cert, key) for cert, key in tls_certificates]
        options["verify_client"] = verify_client
        if root_certificates:
            options["root_certificates"] = root_certificates
    return FlightFront(
        source,
        location,
        server_options=options,
        streams=streams,
        max_in_flight=max_in_flight,
        allow_put=allow_put,
        max_put_bytes=max_put_bytes,
        max_put_total_bytes=max_put_total_bytes,
        advertise=advertise,
        timeout=timeout,
        staging_bytes=staging_bytes,
    )
