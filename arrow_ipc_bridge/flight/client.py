"""One address for every consumer: ``connect("grpc://host:port")`` takes the publisher's Unix socket
when this process can use it, Arrow Flight otherwise.

The front names the publisher's socket (``locations.py``); the socket is taken when the front runs
on this host (same boot id), the socket is reachable and admits this uid, and the publisher there
is the one the front serves (same ``publisher_id``). Then the result is a plain
:class:`~arrow_ipc_bridge.Session` (zero-copy, ``route == "local"``); otherwise a
:class:`FlightSession` with the same methods over gRPC (``route == "flight"``). Either way
``route_reason`` says why. ``prefer="local"`` raises instead of falling back, ``prefer="flight"``
never tries the socket.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import pyarrow as pa
from pyarrow import flight

from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    ClosedError,
    NotPublishedError,
    PeerClosedError,
    ProtocolError,
    TransportError,
)
from arrow_ipc_bridge.flight.auth import call_options
from arrow_ipc_bridge.flight.locations import LOCAL_ACTION, LocalLocation

__all__ = ["FLIGHT_SCHEMES", "FlightImported", "FlightLiveStream", "FlightSession", "connect"]

FLIGHT_SCHEMES = ("grpc://", "grpc+tcp://", "grpc+tls://")
_PREFER = ("auto", "local", "flight")
# What a Flight call raises for a status the server sent: Flight's own errors, and pyarrow's for
# the statuses gRPC shares with Arrow (NOT_FOUND is ArrowKeyError, INVALID_ARGUMENT ArrowInvalid).
_FLIGHT_ERRORS = (flight.FlightError, pa.ArrowException)


def _bridge_error(exc: BaseException, name: str | None = None) -> BridgeError:
    """A Flight error as the bridge's exception (the message kept)."""
    text = str(exc).split(". Detail:", 1)[0]
    if isinstance(exc, flight.FlightUnauthenticatedError | flight.FlightUnauthorizedError):
        return TransportError(f"the Flight server refused this client: {text}", reason="rejected")
    if isinstance(exc, flight.FlightTimedOutError):
        return BridgeTimeoutError(f"the Flight server did not answer in time: {text}", waiting_for="flight")
    if isinstance(exc, flight.FlightUnavailableError | flight.FlightCancelledError):
        return PeerClosedError(f"the Flight server is not reachable: {text}")
    if isinstance(exc, KeyError):  # NOT_FOUND
        # The server's message is kept whole: the bridge's front names the closest names it serves.
        if text:
            return NotPublishedError(text)
        return NotPublishedError(f"nothing is published as {name!r}" if name is not None else "not found")
    return TransportError(f"the Flight call failed: {text}")


class FlightImported:
    """A publication got over Flight: a host table (or one batch of a live stream) with the
    methods of an imported object that apply to host data (Arrow PyCapsule stream and schema,
    ``schema``, ``num_rows``, ``nbytes``, ``device``, ``to_host()``, ``release()``)."""

    def __init__(self, table: pa.Table, name: str) -> None:
        self._table: pa.Table | None = table
        self.name = name
        self.device = "cpu"
        self.version = None
        self.publisher_id = None

    def _data(self) -> pa.Table:
        if self._table is None:
            raise ClosedError(f"{self.name!r} was released", reason="released")
        return self._table

    @property
    def released(self) -> bool:
        return self._table is None

    @property
    def schema(self) -> pa.Schema:
        return self._data().schema

    @property
    def num_rows(self) -> int:
        rows: int = self._data().num_rows
        return rows

    @property
    def nbytes(self) -> int:
        size: int = self._data().nbytes
        return size

    def to_host(self) -> pa.Table:
        return self._data()

    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object:
        return self._data().__arrow_c_stream__(requested_schema)

    def __arrow_c_schema__(self) -> object:
        return self._data().schema.__arrow_c_schema__()

    def release(self) -> None:
        self._table = None

    def __enter__(self) -> FlightImported:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        if self._table is None:
            return f"<FlightImported {self.name!r} released>"
        return f"<FlightImported {self.name!r} {self._table.num_rows} rows, cpu, over Flight>"


class FlightLiveStream:
    """A live stream read over Flight (an endless ``do_get``): one :class:`FlightImported` per
    batch; ``close()`` ends the call, which ends the front's subscription."""

    def __init__(self, reader: flight.FlightStreamReader, name: str) -> None:
        self._reader = reader
        self.name = name
        self.received = 0
        self.ended = False

    def __iter__(self) -> Iterator[FlightImported]:
        return self

    def __next__(self) -> FlightImported:
        batch = self.next_batch()
        if batch is None:
            raise StopIteration
        return batch

    def next_batch(self) -> FlightImported | None:
        """The next batch; None at the stream's clean end."""
        if self.ended:
            return None
        try:
            chunk = self._reader.read_chunk()
        except StopIteration:
            self.ended = True
            return None
        except _FLIGHT_ERRORS as exc:
            raise _bridge_error(exc, self.name) from None
        self.received += 1
        return FlightImported(pa.Table.from_batches([chunk.data]), self.name)

    def close(self) -> None:
        if not self.ended:
            self._reader.cancel()
            self.ended = True

    def __enter__(self) -> FlightLiveStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FlightSession:
    """A session with a publisher over Arrow Flight: ``list``, ``get`` and ``subscribe`` as a
    :class:`~arrow_ipc_bridge.Session` offers them, the data copied over gRPC."""

    route = "flight"

    def __init__(self, client: flight.FlightClient, token: str | None, timeout: float, reason: str) -> None:
        self._client = client
        self._token = token
        self._timeout = timeout
        self._closed = False
        self.route_reason = reason
        """Why the publisher's socket was not taken."""

    def _options(self, timeout: float | None) -> flight.FlightCallOptions:
        return call_options(self._token, timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise BridgeError("this session is closed")

    def list(self) -> list[str]:
        """Names of the publications served (live streams are left out, as a Session does)."""
        self._check_open()
        try:
            infos = list(self._client.list_flights(options=self._options(self._timeout)))
        except _FLIGHT_ERRORS as exc:
            raise _bridge_error(exc) from None
        names = []
        for info in infos:
            metadata = json.loads(info.app_metadata or b"{}")
            if metadata.get("kind") != "live stream":
                names.append(info.descriptor.path[0].decode("utf-8"))
        return sorted(names)

    def get(self, name: str, *, wait: float | None = None) -> FlightImported:
        """The publication ``name`` as a host table. ``wait``: seconds to wait for it to be
        published (asked again with a growing pause, up to 0.5 s, as Flight has no held wait)."""
        self._check_open()
        deadline = None if wait is None else time.monotonic() + wait
        pause = 0.01
        while True:
            try:
                # Streams with no timeout: a large table takes as long as the network needs.
                reader = self._client.do_get(flight.Ticket(name.encode("utf-8")), options=self._options(None))
                return FlightImported(reader.read_all(), name)
            except _FLIGHT_ERRORS as exc:
                error = _bridge_error(exc, name)
            if not isinstance(error, NotPublishedError) or deadline is None:
                raise error
            if time.monotonic() >= deadline:
                raise BridgeTimeoutError(
                    f"{name!r} was not published within {wait} s", waiting_for="name", timeout=wait
                )
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.5)

    def subscribe(
        self, name: str, *, max_in_flight: int = 8, timeout: float | None = None
    ) -> FlightLiveStream:
        """The live stream ``name`` from now on (the front's ``max_in_flight`` applies)."""
        self._check_open()
        try:
            reader = self._client.do_get(flight.Ticket(name.encode("utf-8")), options=self._options(timeout))
        except _FLIGHT_ERRORS as exc:
            raise _bridge_error(exc, name) from None
        return FlightLiveStream(reader, name)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> FlightSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FlightSession route=flight ({self.route_reason})>"


def _local_location(client: flight.FlightClient, options: flight.FlightCallOptions) -> LocalLocation | None:
    try:
        results = list(client.do_action(flight.Action(LOCAL_ACTION, b""), options=options))
    except _FLIGHT_ERRORS as exc:
        raise _bridge_error(exc) from None
    if len(results) != 1:
        return None
    try:
        answer = json.loads(results[0].body.to_pybytes())
        uri = answer.get("location")
        return LocalLocation.parse(uri) if isinstance(uri, str) else None
    except (ValueError, AttributeError):
        return None  # a front of another kind, or a hostile one: Flight is the only way


def _try_socket(
    location: LocalLocation | None,
    connect_socket: Callable[..., Any],
    timeout: float,
    session_options: dict[str, Any],
) -> tuple[Any, str]:
    """The session over the publisher's socket, or None and why not."""
    if location is None:
        return None, "the server names no local socket"
    if not location.same_host():
        return None, "the server runs on another host"
    try:
        session = connect_socket(location.socket_path, timeout=timeout, **session_options)
    except TransportError as exc:
        if exc.reason == "rejected":
            return None, f"the publisher's socket refused this uid ({exc})"
        return None, f"the publisher's socket is not reachable ({exc})"
    except (ProtocolError, OSError) as exc:  # a socket that does not speak the protocol, or a limit
        return None, f"the publisher's socket is not reachable ({exc})"
    if session.publisher_info.get("publisher_id") != location.publisher_id:
        session.close()
        return None, "the socket at that path is another publisher"
    return session, f"same host and uid admitted: the publisher's socket {location.socket_path}"


def connect(
    uri: str,
    connect_socket: Callable[..., Any],
    *,
    session_options: dict[str, Any],
    token: str | None = None,
    tls_root_certs: bytes | None = None,
    cert_chain: bytes | None = None,
    private_key: bytes | None = None,
    prefer: str = "auto",
    timeout: float = 5.0,
) -> Any:
    """Connect to the publisher behind the Flight front at ``uri`` by the best path: what
    :func:`arrow_ipc_bridge.connect` does with a ``grpc://`` address (it passes itself as
    ``connect_socket``, which makes a :class:`~arrow_ipc_bridge.Session` for a socket path).

    ``token``: the bearer token the front asks for; ``tls_root_certs``, ``cert_chain``,
    ``private_key``: TLS (PEM) for ``grpc+tls://``. ``prefer``: ``"auto"`` (the socket when usable,
    else Flight), ``"local"`` (the socket or :class:`~arrow_ipc_bridge.errors.TransportError`),
    ``"flight"`` (never the socket). ``session_options``: ``connect_socket``'s keyword arguments
    for a socket session (``pool_linger``, ``check``, ...).
    The result's ``route`` is ``"local"`` or ``"flight"`` and ``route_reason`` says why.
    """
    if not isinstance(uri, str) or not uri.startswith(FLIGHT_SCHEMES):
        raise ValueError(f"a Flight address starts with one of {FLIGHT_SCHEMES}, not {uri!r}")
    if prefer not in _PREFER:
        raise ValueError(f"prefer must be one of {_PREFER}, not {prefer!r}")
    tls: dict[str, Any] = {}
    if tls_root_certs is not None:
        tls["tls_root_certs"] = tls_root_certs
    if cert_chain is not None or private_key is not None:
        tls["cert_chain"], tls["private_key"] = cert_chain, private_key
    client = flight.connect(uri, **tls)
    try:
        reason = "prefer='flight'"
        if prefer != "flight":
            location = _local_location(client, call_options(token, timeout))
            session, reason = _try_socket(location, connect_socket, timeout, session_options)
            if session is not None:
                client.close()
                session.route_reason = reason
                return session
            if prefer == "local":
                raise TransportError(f"cannot take the publisher's socket: {reason}")
        return FlightSession(client, token, timeout, reason)
    except BaseException:
        client.close()
        raise
