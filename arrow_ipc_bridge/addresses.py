"""Where a consumer connects: a publisher's socket file, or an Arrow Flight front's ``grpc://``
address (which uses the publisher's socket when this process can reach it, Flight otherwise).

The one place that knows both transports, above each of them: ``consumer/`` knows only the socket,
``flight/`` the Flight client and server.
"""

from __future__ import annotations

import os
from typing import Any

from arrow_ipc_bridge.consumer.session import Session
from arrow_ipc_bridge.consumer.socket_connect import connect_socket
from arrow_ipc_bridge.runtime import arguments

__all__ = ["connect"]


def connect(
    path: str | os.PathLike[str],
    *,
    timeout: float = 5.0,
    wait_for_publisher: bool = False,
    pool_linger: float = 1.0,
    remembered_messages: int = 64,
    check: str | None = None,
    reader_device: int | None = None,
    cross_device: str = "peer",
    copy_stream: object = None,
    **flight_options: Any,
) -> Session:
    """Connect a new :class:`Session` to the publisher at ``path``.

    ``path`` may be a Flight front's address (``grpc://``, ``grpc+tls://``): then the publisher's
    socket is used when this process can reach it, Arrow Flight otherwise (a ``FlightSession``),
    and ``flight_options`` are those of :func:`arrow_ipc_bridge.flight.client.connect` (``token``,
    TLS, ``prefer``); ``docs/flight.md``.

    Parameters
    ----------
    path
        The publisher's socket file.
    timeout
        Seconds for the connection and for every request after it. With ``wait_for_publisher``
        it also bounds the wait for the publisher to appear.
    wait_for_publisher
        Wait for a publisher to appear at ``path`` (the socket file missing, or refusing: one that
        is starting or restarting), retrying with a short backoff, instead of raising
        :class:`~arrow_ipc_bridge.errors.TransportError` at once; a publisher that takes the
        connection and closes it before welcoming the session (going down or coming up) is tried
        again too, instead of raising :class:`~arrow_ipc_bridge.errors.PeerClosedError`. When
        ``timeout`` passes first: :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError`.
    pool_linger
        See :class:`Session`: how long the session keeps one lease per re-got name after its last
        get (re-gets without a round trip meanwhile); 0 keeps none.
    remembered_messages
        See :class:`Session`: how many messages (one per name) re-gets find remembered.
    check
        See :class:`Session`: how far buffer contents are checked (default: ``"full"`` for host
        data, ``"none"`` for CUDA data).
    reader_device, cross_device, copy_stream
        See :class:`Session`: GPU data living on a GPU other than the consumer's, read in place
        (``"peer"``) or copied (``"copy"``).

    Examples
    --------
    >>> with aib.connect("/tmp/demo.sock") as session:  # doctest: +SKIP
    ...     table = pa.table(session.get("trades"))
    """
    if "standing_leases" in flight_options:
        arguments.refuse_removed({"standing_leases": flight_options["standing_leases"]}, "connect()")
    if isinstance(path, str) and path.startswith(("grpc://", "grpc+tcp://", "grpc+tls://")):
        from arrow_ipc_bridge.flight.client import connect as connect_flight

        # The socket session, when the Flight front names a socket this process can reach.
        session_options = {
            "pool_linger": pool_linger,
            "remembered_messages": remembered_messages,
            "check": check,
            "reader_device": reader_device,
            "cross_device": cross_device,
            "copy_stream": copy_stream,
        }
        return connect_flight(  # type: ignore[no-any-return]  # a Session, or a FlightSession (same methods)
            path, connect_socket, timeout=timeout, session_options=session_options, **flight_options
        )
    if flight_options:
        raise TypeError(f"connect() got unexpected keyword arguments {sorted(flight_options)}")
    return connect_socket(
        path,
        timeout=timeout,
        wait_for_publisher=wait_for_publisher,
        pool_linger=pool_linger,
        remembered_messages=remembered_messages,
        check=check,
        reader_device=reader_device,
        cross_device=cross_device,
        copy_stream=copy_stream,
    )
