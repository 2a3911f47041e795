"""A :class:`~arrow_ipc_bridge.consumer.session.Session` connected to a publisher's socket, and a
subscription to a live stream over one: the socket half of :func:`arrow_ipc_bridge.connect` (the
address that picks the socket or Arrow Flight is read one floor up, in ``addresses.py``).
"""

from __future__ import annotations

import os
import time

from arrow_ipc_bridge import transport
from arrow_ipc_bridge.consumer.live_stream import LiveStream, open_subscription
from arrow_ipc_bridge.consumer.session import Session
from arrow_ipc_bridge.errors import BridgeTimeoutError, PeerClosedError
from arrow_ipc_bridge.runtime import arguments
from arrow_ipc_bridge.transport import protocol
from arrow_ipc_bridge.transport.stream_frames import MAX_IN_FLIGHT

__all__ = ["connect_socket", "subscribe"]


def connect_socket(
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
) -> Session:
    """A new :class:`Session` connected to the publisher's socket at ``path``: the arguments are
    :func:`arrow_ipc_bridge.connect`'s (``addresses.py``), which documents them."""
    path = arguments.path(path)
    timeout = arguments.seconds(timeout, "timeout")
    arguments.boolean(wait_for_publisher, "wait_for_publisher")
    deadline = time.monotonic() + timeout
    delay = _RETRY_FIRST
    while True:
        session = Session(
            pool_linger=pool_linger,
            remembered_messages=remembered_messages,
            check=check,
            reader_device=reader_device,
            cross_device=cross_device,
            copy_stream=copy_stream,
        )
        session._path = os.fspath(path)
        try:
            left = max(deadline - time.monotonic(), 0.0) if wait_for_publisher else timeout
            conn = transport.connect(path, timeout=left, wait_for_server=wait_for_publisher)
            session._attach(conn, timeout)
            return session
        except PeerClosedError as exc:
            session.close()
            # The publisher closed the connection before the session was set up: one going down
            # (its listening socket still took the connection) or coming up and failing. Waiting
            # for a publisher waits through that, as through a missing or refusing socket.
            if not wait_for_publisher:
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise BridgeTimeoutError(
                    f"no publisher at {path!r} completed a handshake within {timeout} s "
                    f"(last: {exc.message})",
                    waiting_for="publisher",
                    path=os.fspath(path),
                    timeout=timeout,
                ) from exc
            time.sleep(min(delay, left))
            delay = min(delay * 2, _RETRY_MOST)
        except BaseException:
            session.close()  # closes the connection too
            raise


# connect(wait_for_publisher=True)'s backoff between handshakes a publisher closed (seconds), as
# transport.connect's while no socket is there.
_RETRY_FIRST = 0.001
_RETRY_MOST = 0.05


def subscribe(
    path: str | os.PathLike[str],
    name: str,
    *,
    max_in_flight: int = 8,
    timeout: float | None = None,
    connect_timeout: float = 5.0,
    check: str | None = None,
) -> LiveStream:
    """Subscribe to the live stream ``name`` of the publisher at ``path`` (from now on).

    ``max_in_flight``: batches this consumer may hold unreleased (the publisher may grant fewer);
    ``timeout``: seconds each batch is waited for (None: forever); ``check``: see
    :class:`~arrow_ipc_bridge.Session`. Raises :class:`~arrow_ipc_bridge.errors.NotPublishedError`
    when no such stream is open.
    """
    path = arguments.path(path)
    protocol.encode_name(name)
    max_in_flight = arguments.count(max_in_flight, "max_in_flight", least=1, most=MAX_IN_FLIGHT)
    timeout = arguments.optional_seconds(timeout, "timeout")
    connect_timeout = arguments.seconds(connect_timeout, "connect_timeout")
    # The subscription's own connection; remembered_messages: one per reserved slot of the stream.
    session = connect_socket(path, timeout=connect_timeout, remembered_messages=1024, check=check)
    return open_subscription(
        session, name, max_in_flight=max_in_flight, timeout=timeout, request_timeout=connect_timeout
    )
