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

This module holds the front itself (:class:`FlightFront`: its session, what it knows of each name,
which way each ``do_get`` goes, its staging pools, its lifetime) and :func:`serve`, which checks the
arguments and makes one. The rest of the front is in modules of their own: ``handlers.py`` (the
pyarrow server's handlers), ``tickets.py`` (what a request names), ``refusals.py`` (refusals and
their gRPC status), ``listing.py`` (facts and ``FlightInfo``), ``sending.py`` (the batches of a
``do_get``), ``uploads.py`` (``do_put``), ``auth.py`` (bearer tokens).

Errors go to clients with the gRPC status that says what went wrong: an unknown name NOT_FOUND
(``pyarrow.ArrowKeyError`` in a pyarrow client), a malformed ticket, descriptor, device or upload,
or a publication Arrow IPC cannot carry (a dictionary of dictionaries, ``tables.unsendable``)
INVALID_ARGUMENT (``pyarrow.ArrowInvalid``), a gone publisher or an upload past
``max_put_total_bytes`` UNAVAILABLE (``FlightUnavailableError``), a missing or wrong token
UNAUTHENTICATED (``FlightUnauthenticatedError``), a refused ``do_put`` PERMISSION_DENIED
(``FlightUnauthorizedError``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from pyarrow import flight

from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream
from arrow_ipc_bridge.consumer.session import Session
from arrow_ipc_bridge.consumer.socket_connect import connect_socket
from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    NotPublishedError,
    ProtocolError,
    TransportError,
)
from arrow_ipc_bridge.flight.auth import TokenAuthMiddlewareFactory
from arrow_ipc_bridge.flight.copier import CudaCopier
from arrow_ipc_bridge.flight.handlers import BridgeFlightServer
from arrow_ipc_bridge.flight.listing import (
    LIVE_STREAM_FACTS,
    Facts,
    advertised_location,
    flight_info,
    listening_location,
)
from arrow_ipc_bridge.flight.locations import LocalLocation
from arrow_ipc_bridge.flight.pinned_pool import CHUNK_BYTES, MAX_STAGING_BYTES, StagingPool
from arrow_ipc_bridge.flight.refusals import Refused, invalid, not_found
from arrow_ipc_bridge.flight.sending import live_stream, staged_publication_stream
from arrow_ipc_bridge.flight.staging import StagedPublication, stage_live_batch
from arrow_ipc_bridge.flight.tables import flight_schema, host_table, unsendable
from arrow_ipc_bridge.flight.uploads import Uploads
from arrow_ipc_bridge.producer.publisher import Publisher
from arrow_ipc_bridge.transport.protocol import encode_name
from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA

__all__ = ["FlightFront", "serve"]

_SCHEMES_PLAIN = ("grpc", "grpc+tcp")
_SCHEME_TLS = "grpc+tls"


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
        self._uploads = Uploads(
            self._publisher,
            allowed=allow_put,
            max_put_bytes=max_put_bytes,
            max_put_total_bytes=max_put_total_bytes,
        )
        self._timeout = timeout
        self._staging_bytes = staging_bytes
        self._pools: dict[int, StagingPool] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._session: Session | None = connect_socket(self._socket_path, timeout=timeout)
        publisher_id = str(self._session.publisher_info.get("publisher_id", ""))
        self.local_location: LocalLocation | None = LocalLocation.this_host(self._socket_path, publisher_id)
        try:
            self._server = BridgeFlightServer(self, location, **server_options)
        except BaseException:
            self._session.close()
            raise
        self.location = listening_location(location, self._server.port)
        """The gRPC address the front listens on, its port filled in."""
        self._advertised = advertised_location(advertise, location, self.location)

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
        except (TransportError, ProtocolError, BridgeTimeoutError) as exc:  # PeerClosedError included
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

    def facts(self, name: str) -> Facts | None:
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
            return Facts(
                kind, schema, imported.num_rows, imported.nbytes, imported.device, unsendable(name, schema)
            )

    def stream_facts(self) -> Facts:
        return LIVE_STREAM_FACTS

    def facts_or_stream(self, name: str) -> Facts:
        """What ``name`` holds, to describe it to a client; refused when it cannot be sent."""
        facts = self.facts(name)
        if facts is not None and facts.refusal is not None:
            raise invalid(facts.refusal)
        if facts is not None:
            return facts
        if name in self.stream_names():
            return self.stream_facts()
        raise self._not_found(name)

    def _not_found(self, name: str) -> Refused:
        """The refusal of an unknown ``name``, with the names served now and the closest one."""
        return not_found(name, self.publication_names(), self.stream_names())

    def flight_info(self, name: str, facts: Facts) -> flight.FlightInfo:
        return flight_info(name, facts, self._advertised, self.local_location)

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
            raise self._not_found(name)
        return self._live_stream(name, cancelled)

    @staticmethod
    def _refuse_unsendable(name: str, imported: ImportedArray | ImportedStream) -> None:
        """Refuse (and release) ``imported`` when it cannot be sent over Flight."""
        try:
            refusal = unsendable(name, flight_schema(imported))
        except BaseException:
            imported.release()
            raise
        if refusal is not None:
            imported.release()
            raise invalid(refusal)

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
        return staged_publication_stream(staged)

    def _live_stream(self, name: str, cancelled: Callable[[], bool]) -> flight.FlightDataStream:
        """A live stream, batch by batch as the producer writes them. Host batches are sent over
        the session's mappings (their lease, the producer's credit, held until gRPC drops them);
        device batches are staged through the pinned pool as publications are, their lease given
        back once copied. Either way a worker thread (``Prefetcher``) prepares the next batch while
        gRPC sends the current one."""
        try:
            live = self._call(lambda s: s.subscribe(name, max_in_flight=self._max_in_flight))
        except NotPublishedError:
            raise self._not_found(name) from None
        return live_stream(
            name,
            live,
            cancelled,
            refuse_unsendable=self._refuse_unsendable,
            needs_staging=self._needs_staging,
            stage_live_batch=self._staged_live_batch,
        )

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
        self._uploads.put(name, device, reader, cancelled)

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
