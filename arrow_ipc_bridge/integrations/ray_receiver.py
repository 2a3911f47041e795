"""The receiving side of the Ray transport: the route from a sender to this process, and the gets
of a sender's publications, through a session per sender's socket (on the same machine) or per
sender's Flight front (from another machine), each kept for the process's later receives.
"""

from __future__ import annotations

import os
from typing import Any

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.integrations.ray_payload import (
    FLIGHT_ENV,
    BridgeTransportMetadata,
    RouteError,
    SourceGoneError,
    _lock,
)

# The receiver's sessions keep nothing after a get: every object crosses under a name of its own
# and is got once, so a remembered message would never be asked for again, while it would keep
# the mapping of a publication Ray has already freed (up to remembered_messages of them).
_SESSION_OPTIONS: dict[str, Any] = {"remembered_messages": 0, "pool_linger": 0.0}
_sessions: dict[str, Any] = {}  # socket path -> Session, this process's
_flight_sessions: dict[str, Any] = {}  # Flight location -> FlightSession
_sessions_pid = os.getpid()


def choose_route(meta: BridgeTransportMetadata, node: str, machine: str) -> tuple[str, str]:
    """The route from the sender of ``meta`` to a process on ``node`` / ``machine`` (boot id):
    ``("socket", why)`` on the same node, or another Ray node of the same machine; ``("flight",
    why)`` from another machine when the sender serves a Flight front; else :class:`RouteError`."""
    if meta.node_id == node:
        return "socket", "same Ray node"
    if meta.boot_id == machine:
        return "socket", f"another Ray node ({meta.node_id}) on this machine (same boot id)"
    if meta.flight_location:
        return "flight", f"the sender runs on another machine ({meta.hostname}, node {meta.node_id})"
    raise RouteError(
        f"the sender of {meta.names[0] if meta.names else 'this object'!r} runs on another machine "
        f"({meta.hostname}, node {meta.node_id}; this process: node {node}) and serves no Flight front: "
        f"call arrow_ipc_bridge.integrations.ray.serve_flight() in the sending actor (or set {FLIGHT_ENV} "
        "in its environment), or fetch through Ray's object store with ray.get(ref, _use_object_store=True)",
        source_node=meta.node_id,
        node=node,
    )


def _session_for(meta: BridgeTransportMetadata) -> Any:
    global _sessions_pid
    with _lock:
        if _sessions_pid != os.getpid():  # a fork's copies are the parent's
            _sessions.clear()
            _flight_sessions.clear()
            _sessions_pid = os.getpid()
        session = _sessions.get(meta.socket_path)
        if session is not None and not session.closed:
            return session
    try:
        session = aib.connect(meta.socket_path, **_SESSION_OPTIONS)
    except aib.TransportError as exc:
        if exc.reason == "rejected":
            raise  # a publisher answered: it is there, and said why not (a LimitError is not caught here)
        raise SourceGoneError(
            f"no publisher answers at {meta.socket_path} for {meta.names[0]!r}: the sending process (pid "
            f"{meta.pid} on {meta.hostname}) exited, was killed or closed its transport, or its socket is "
            f"not visible from this process (another container or mount namespace): {exc}",
            name=meta.names[0],
            path=meta.socket_path,
        ) from exc
    if session.publisher_info.get("publisher_id") != meta.publisher_id:
        session.close()
        raise SourceGoneError(
            f"the publisher of {meta.names[0]!r} is gone: another publisher now serves {meta.socket_path}",
            name=meta.names[0],
            path=meta.socket_path,
        )
    with _lock:
        # Two threads may have connected at once: keep one session, close the other.
        kept = _sessions.setdefault(meta.socket_path, session)
    if kept is not session:
        session.close()
    return kept


def _forget_session(path: str, session: Any) -> None:
    # Not closed: closing would release the imports this session handed out, which the receiver may
    # still hold (they stay valid without the connection); the session goes when they do.
    with _lock:
        if _sessions.get(path) is session:
            del _sessions[path]


def _get_by_socket(meta: BridgeTransportMetadata, index: int) -> Any:
    name = meta.names[index]
    session = _session_for(meta)
    try:
        # wait=0 answers at once, as a get does, but through the publisher's WAIT, whose answer
        # carries the version and publisher id: the receiver checks it got the very publication the
        # metadata names (a plain get of a name not got before knows neither).
        imported = session.get(name, wait=0)
    except (aib.NotPublishedError, aib.BridgeTimeoutError) as exc:
        if isinstance(exc, aib.BridgeTimeoutError) and exc.waiting_for not in ("name", "version"):
            raise  # the publisher did not answer at all: not a freed publication
        raise SourceGoneError(
            f"{name!r} is no longer published by the sender (pid {meta.pid} on {meta.hostname}): Ray freed "
            "its ObjectRef, or the sending process closed its transport",
            name=name,
            path=meta.socket_path,
        ) from exc
    except aib.PeerClosedError as exc:
        _forget_session(meta.socket_path, session)
        raise SourceGoneError(
            f"the publisher of {name!r} at {meta.socket_path} closed or died before the receive: the sending "
            f"process (pid {meta.pid} on {meta.hostname}) exited, was killed or closed its transport",
            name=name,
            path=meta.socket_path,
        ) from exc
    got = (imported.publisher_id, imported.version)
    if got != (meta.publisher_id, meta.versions[index]):
        imported.release()
        raise SourceGoneError(
            f"{name!r} is another publication than the one sent (publisher {got[0]}, version {got[1]}; "
            f"sent: publisher {meta.publisher_id}, version {meta.versions[index]}): it was published again",
            name=name,
            path=meta.socket_path,
        )
    return imported


def _get_by_flight(meta: BridgeTransportMetadata, name: str) -> Any:
    location = meta.flight_location
    assert location is not None
    with _lock:
        session = _flight_sessions.get(location)
    if session is None:
        try:
            session = aib.connect(location, token=meta.flight_token, prefer="flight")
        except aib.PeerClosedError as exc:  # the front does not answer
            raise SourceGoneError(
                f"the sender's Flight front at {location} does not answer: the sending process "
                f"({meta.hostname}, pid {meta.pid}) exited, was killed or closed its transport",
                name=name,
                path=location,
            ) from exc
        with _lock:
            kept = _flight_sessions.setdefault(location, session)
        if kept is not session:
            session.close()
            session = kept
    try:
        return session.get(name)
    except aib.NotPublishedError as exc:
        raise SourceGoneError(
            f"{name!r} is no longer published by the sender ({meta.hostname}): Ray freed its ObjectRef, or "
            "the sending process closed its transport",
            name=name,
            path=location,
        ) from exc
    except aib.PeerClosedError as exc:
        with _lock:
            if _flight_sessions.get(location) is session:
                del _flight_sessions[location]
        raise SourceGoneError(
            f"the sender's Flight front at {location} is gone: the sending process exited or was killed",
            name=name,
            path=location,
        ) from exc


def _take_sessions() -> list[Any]:
    """This process's receiving sessions, forgotten here. For
    :func:`~arrow_ipc_bridge.integrations.ray.close`, which closes them."""
    with _lock:
        sessions = [*_sessions.values(), *_flight_sessions.values()]
        _sessions.clear()
        _flight_sessions.clear()
    return sessions
