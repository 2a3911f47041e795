"""The pyarrow Flight server of a front: each handler decodes its request and hands it to the
:class:`~arrow_ipc_bridge.flight.server.FlightFront`, which does the work through its session.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

from pyarrow import flight

from arrow_ipc_bridge.flight.locations import LOCAL_ACTION
from arrow_ipc_bridge.flight.refusals import answering, invalid
from arrow_ipc_bridge.flight.tickets import name_of_descriptor, name_of_ticket

__all__ = ["BridgeFlightServer", "Front"]


class Front(Protocol):
    """What the handlers ask of the front (``server.FlightFront``), which imports this module: the
    handlers name the front by what they call, not by its module."""

    local_location: Any

    def publication_names(self) -> list[str]: ...
    def stream_names(self) -> list[str]: ...
    def facts(self, name: str) -> Any: ...
    def stream_facts(self) -> Any: ...
    def facts_or_stream(self, name: str) -> Any: ...
    def flight_info(self, name: str, facts: Any) -> flight.FlightInfo: ...
    def data_stream(self, name: str, is_cancelled: Any) -> flight.FlightDataStream: ...
    def put(self, name: str, device: Any, reader: Any, is_cancelled: Any) -> None: ...


class BridgeFlightServer(flight.FlightServerBase):  # type: ignore[misc]
    """The pyarrow Flight server whose handlers read through the front's session."""

    def __init__(self, front: Front, location: str, **kwargs: Any) -> None:
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

    @answering
    def get_flight_info(self, context: Any, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        name, _ = name_of_descriptor(descriptor)
        return self._front.flight_info(name, self._front.facts_or_stream(name))

    @answering
    def get_schema(self, context: Any, descriptor: flight.FlightDescriptor) -> flight.SchemaResult:
        name, _ = name_of_descriptor(descriptor)
        return flight.SchemaResult(self._front.facts_or_stream(name).schema)

    # ---------- data -----------------------------------------------------------------------------
    @answering
    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.FlightDataStream:
        name = name_of_ticket(ticket.ticket)
        return self._front.data_stream(name, context.is_cancelled)

    @answering
    def do_put(
        self,
        context: Any,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.FlightMetadataWriter,
    ) -> None:
        name, device = name_of_descriptor(descriptor)
        self._front.put(name, device, reader, context.is_cancelled)

    # ---------- actions --------------------------------------------------------------------------
    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [(LOCAL_ACTION, "the publisher's Unix socket as a location, for consumers on this host")]

    @answering
    def do_action(self, context: Any, action: flight.Action) -> Iterator[bytes]:
        # Not a generator: a refusal must be raised by the call, where answering sees it.
        if action.type != LOCAL_ACTION:
            raise invalid(f"unknown action {action.type[:60]!r} (see list_actions)")
        location = self._front.local_location
        return iter([json.dumps({"location": location.uri if location else None}).encode()])
