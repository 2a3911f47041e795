"""Arrow Flight for publications: one address for consumers on this host and on others.

``serve(publisher_or_socket, "grpc://0.0.0.0:PORT", tokens=[...])`` puts a Flight front before a
publisher (``server.py``); any Flight client reads its publications and live streams.
``connect("grpc://host:port", token=...)`` (also reached through ``arrow_ipc_bridge.connect``)
returns a :class:`~arrow_ipc_bridge.Session` over the publisher's socket when this process can reach
it (same host, admitted uid: zero-copy) and a :class:`FlightSession` with the same methods otherwise
(``client.py``). ``docs/flight.md`` describes both.

Importing this package imports ``pyarrow.flight``; ``import arrow_ipc_bridge`` does not import it.
"""

from arrow_ipc_bridge.flight.auth import TokenAuthMiddlewareFactory, bearer_header, call_options
from arrow_ipc_bridge.flight.locations import LocalLocation
from arrow_ipc_bridge.flight.server import FlightFront, serve

__all__ = [
    "FlightFront",
    "LocalLocation",
    "TokenAuthMiddlewareFactory",
    "bearer_header",
    "call_options",
    "serve",
]
