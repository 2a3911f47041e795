"""What the Flight front tells a client about a name before it is read: its facts (kind, schema,
rows, bytes, device) and the ``FlightInfo`` whose endpoint names where to read it.

An endpoint names the front's gRPC location and, for a publication, the publisher's socket as a
local location (``locations.py``), which a consumer on the same host takes instead. A live stream's
schema comes with its first batch, so its facts say nothing of it.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

import pyarrow as pa
from pyarrow import flight

from arrow_ipc_bridge.flight.locations import LocalLocation

__all__ = [
    "LIVE_STREAM_FACTS",
    "REUSE_CONNECTION",
    "Facts",
    "advertised_location",
    "flight_info",
    "listening_location",
]

REUSE_CONNECTION = "arrow-flight-reuse-connection://?"  # the Flight spec's "this same server"


@dataclass(frozen=True)
class Facts:
    kind: str
    schema: pa.Schema
    rows: int
    nbytes: int
    device: str
    refusal: str | None = None  # why it cannot be sent over Flight (``tables.unsendable``)


# A live stream's schema comes with its first batch: do_get sends it; the listing cannot.
LIVE_STREAM_FACTS = Facts("live stream", pa.schema([]), -1, -1, "")


def flight_info(
    name: str, facts: Facts, advertised: str, local_location: LocalLocation | None
) -> flight.FlightInfo:
    """The ``FlightInfo`` of ``name``: one endpoint at ``advertised``, and at ``local_location``
    too for a publication (a live stream is served by the front alone)."""
    locations = [flight.Location(advertised)]
    if local_location is not None and facts.kind != "live stream":
        locations.append(flight.Location(local_location.uri))
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


def listening_location(requested: str, port: int) -> str:
    """The gRPC address a front listens on: ``requested`` with its port filled in."""
    host = urlsplit(requested).hostname or "localhost"
    return f"{urlsplit(requested).scheme}://{_bracketed(host)}:{port}"


def advertised_location(advertise: str | None, requested: str, listening: str) -> str:
    """The gRPC location endpoints name: ``advertise`` when given; else the Flight spec's "reuse
    this connection" when the front listens on every address (no one address reaches it from
    everywhere), else the address it listens on."""
    host = urlsplit(requested).hostname or "localhost"
    return advertise or (REUSE_CONNECTION if _unspecified(host) else listening)


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
