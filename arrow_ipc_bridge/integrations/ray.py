"""The bridge as a Ray tensor transport: Arrow data returned by one actor's method reaches another
actor (or the driver) through a publisher of the sending process, not through Ray's object store.

::

    import ray
    from arrow_ipc_bridge.integrations import ray as aib_ray

    aib_ray.register()                              # in the driver, before the classes below

    @ray.remote(enable_tensor_transport=True)
    class Producer:
        @ray.method(tensor_transport=aib_ray.TRANSPORT)
        def table(self):
            return aib_ray.ArrowPayload(pa_table)   # host or GPU Arrow data

    @ray.remote(enable_tensor_transport=True)      # receivers need it too
    class Consumer:
        def last(self, payload):                    # an ArrowPayload over the import
            return pa.table(payload)["x"][-1]       # zero-copy: the sender's shared memory

How it works (``docs/consumers/ray.md``): Ray 2.60's pluggable transport
(``ray.experimental.rdt.register_tensor_transport``) hands the manager the objects of its
``data_type`` found in a method's return value. Ray looks that type up exactly (a pickler dispatch
table keyed by class), and one transport has one type, so the transport carries
:class:`ArrowPayload`, a box around any Arrow PyCapsule producer (pyarrow tables, record batches
and arrays, ``aib.to_device`` data, pylibcudf tables, ...), rather than pyarrow's classes
themselves. On the sender, :meth:`ArrowBridgeTransport.extract_tensor_transport_metadata` publishes
each payload under a name of its own in the process's one :class:`~arrow_ipc_bridge.Publisher`;
what Ray ships is :class:`BridgeTransportMetadata` (socket, names, versions, node). The receiver
gets each name through a :class:`~arrow_ipc_bridge.Session` it keeps per publisher, or over the
sender's Flight front when the sender runs on another machine; Ray's free of the ``ObjectRef``
unpublishes the names (``garbage_collect``), and each receiver's lease keeps what it holds alive.

Every receive is recorded (:func:`transfers`, :func:`stats`, ``ArrowPayload.route``), so the route
each one took is visible.

This module is the integration's public face and Ray's entry point: the transport manager Ray calls,
:func:`register`, :func:`close`, :func:`stats` and :func:`transfers`, with every public name of the
modules below it, which import one way (``ray_sender`` and ``ray_receiver`` import only
``ray_payload``, and none of them imports this one): ``ray_payload`` (what travels and what both
sides share: ray's loading, names, errors, :class:`ArrowPayload`, the metadata, the counters),
``ray_sender`` (the process's publisher, its socket directory and Flight front) and
``ray_receiver`` (the route, and the gets through sessions kept per sender).
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from typing import Any

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.integrations import ray_sender as _sending
from arrow_ipc_bridge.integrations.ray_payload import (
    FLIGHT_ENV,
    NODE_ID_ENV,
    TRANSPORT,
    ArrowPayload,
    BridgeTransportMetadata,
    RouteError,
    SourceGoneError,
    TransferRecord,
    TransportStats,
    _counters,
    _lock,
    _manager_base,
    _NoCommunicator,
    _place,
    _rdt,
    _records,
)
from arrow_ipc_bridge.integrations.ray_receiver import (
    _get_by_flight,
    _get_by_socket,
    _take_sessions,
    choose_route,
)
from arrow_ipc_bridge.integrations.ray_sender import (
    _kind,
    _take_sender,
    _the_sender,
    local_publisher,
    serve_flight,
)

__all__ = [
    "TRANSPORT",
    "NODE_ID_ENV",
    "FLIGHT_ENV",
    "ArrowPayload",
    "ArrowBridgeTransport",
    "BridgeTransportMetadata",
    "TransferRecord",
    "TransportStats",
    "RouteError",
    "SourceGoneError",
    "register",
    "serve_flight",
    "local_publisher",
    "close",
    "choose_route",
    "transfers",
    "stats",
]


def close() -> None:
    """Close this process's transport publisher (and Flight front) and its receiving sessions.

    As a sender: publications not yet received then raise :class:`SourceGoneError` at their
    receivers, while what receivers hold stays valid; the next send makes a new publisher. As a
    receiver: the payloads this process received are released (``payload.data`` raises
    ``ClosedError``; pyarrow objects already made from them stay valid). Runs at exit by itself.
    """
    with _lock:
        sender = _take_sender()
        sessions = _take_sessions()
    if sender is not None and sender.pid == os.getpid():
        sender.close()
    for session in sessions:
        # At exit or on request: a session's close releases what it handed out, which at exit no
        # one uses any more; a caller of close() asked for exactly that.
        session.close()


atexit.register(close)


class ArrowBridgeTransport(_manager_base):  # type: ignore[misc]  # ray's class, seen as Any
    """The ``TensorTransportManager`` Ray calls (one per process): extract publishes on the sender,
    receive gets on the receiver, garbage_collect unpublishes on the sender."""

    @property
    def tensor_transport_backend(self) -> str:
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        # The receiver reads the publication on its own; the sender's publisher threads answer.
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        # A receive never blocks past its session's timeout, so a timed-out transfer has nothing to
        # interrupt: Ray may abort it (a no-op here) instead of killing both actors.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        # Any actor that can import this module has it; Ray registers it on every actor it starts.
        return True

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any, backend: str | None = None) -> Any:
        return _NoCommunicator()

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> BridgeTransportMetadata:
        if not rdt_object:
            # Ray hands the manager only ArrowPayload objects: anything else the method returned
            # (a bare pyarrow table) would go through Ray's object store without a word.
            raise TypeError(
                f"a method with tensor_transport={TRANSPORT!r} returned no ArrowPayload: wrap the Arrow data "
                "it returns (aib_ray.ArrowPayload(table)), or drop tensor_transport for it"
            )
        sender = _the_sender()
        names: list[str] = []
        versions: list[int] = []
        tensor_meta: list[tuple[tuple[int, ...], str]] = []
        devices: set[str] = set()
        for index, payload in enumerate(rdt_object):
            if not isinstance(payload, ArrowPayload):
                raise TypeError(
                    f"the {TRANSPORT} transport carries ArrowPayload objects, not {type(payload).__name__}"
                )
            name = f"ray/{obj_id}/{index}"
            try:
                stats = sender.publisher.publish(name, payload.data, copy=payload.copy)
            except BaseException:
                for done in names:  # nothing of a failed send stays published
                    sender.publisher.unpublish(done)
                raise
            names.append(name)
            versions.append(sender.publisher.version(name))
            kind, device = _kind(payload.data)
            tensor_meta.append(((), kind))
            devices.add(device)
            payload.name, payload.version = name, versions[-1]
            with _lock:
                _counters["published"] += 1
                _counters["copied_bytes"] += stats.copied_bytes
        node, machine = _place()
        for payload in rdt_object:
            payload.source_node = node
        return BridgeTransportMetadata(
            tensor_meta=tensor_meta,
            tensor_device="cuda" if "cuda" in devices else "cpu",
            socket_path=str(sender.publisher.path),
            publisher_id=str(sender.publisher.publisher_id),
            names=names,
            versions=versions,
            node_id=node,
            boot_id=machine,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            flight_location=sender.flight_location,
            flight_token=sender.flight_token,
        )

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: BridgeTransportMetadata,
        communicator_metadata: Any,
        target_buffers: list[Any] | None = None,
    ) -> list[ArrowPayload]:
        meta = tensor_transport_metadata
        if target_buffers:
            raise ValueError(
                f"the {TRANSPORT} transport hands over the sender's memory and receives into no buffer: "
                "do not set target buffers or a target device on its ObjectRefs"
            )
        node, machine = _place()
        try:
            route, reason = choose_route(meta, node, machine)
            payloads: list[ArrowPayload] = []
            for index, name in enumerate(meta.names):
                started = time.perf_counter()
                if route == "socket":
                    try:
                        data = _get_by_socket(meta, index)
                    except (aib.TransportError, PermissionError) as exc:
                        # Same machine, yet the socket failed here (another container or uid, or
                        # the publisher gone): its Flight front, when there is one, either serves
                        # it or says that it is gone.
                        if not meta.flight_location:
                            raise
                        route, reason = "flight", f"the sender's socket failed here ({exc})"
                        data = _get_by_flight(meta, name)
                else:
                    data = _get_by_flight(meta, name)
                payload = ArrowPayload(data)
                payload.route, payload.route_reason = route, reason
                payload.name, payload.version, payload.source_node = name, meta.versions[index], meta.node_id
                payloads.append(payload)
                device = getattr(data, "device", "cpu")
                with _lock:
                    _counters[f"received_{route}"] += 1
                    _records.append(
                        TransferRecord(
                            object_id=obj_id,
                            name=name,
                            route=route,
                            reason=reason,
                            source_node=meta.node_id,
                            node=node,
                            device=device if isinstance(device, str) else "cpu",
                            seconds=time.perf_counter() - started,
                        )
                    )
        except BaseException:
            with _lock:
                _counters["receive_errors"] += 1
            raise
        return payloads

    def send_multiple_tensors(
        self, tensors: list[Any], tensor_transport_metadata: Any, communicator_metadata: Any
    ) -> None:
        raise NotImplementedError(
            f"the {TRANSPORT} transport is one-sided: Ray never asks its sender to send"
        )

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: BridgeTransportMetadata, tensors: list[Any]
    ) -> None:
        # Ray's free of the ObjectRef: the names go; leases of receivers keep what they hold.
        sender = _sending._sender
        if sender is None or sender.pid != os.getpid() or sender.publisher.closed:
            return  # closed by close(): nothing published any more
        for name in tensor_transport_meta.names:
            try:
                sender.publisher.unpublish(name)
            except aib.NotPublishedError:
                continue
            with _lock:
                _counters["freed"] += 1

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        # Nothing runs that could be interrupted (can_abort_transport); the receive in progress, if
        # any, ends by itself within its timeout and Ray discards it.
        return


def transfers() -> list[TransferRecord]:
    """The last 1024 receives of this process, oldest first: which route each took and why."""
    with _lock:
        return list(_records)


def stats() -> TransportStats:
    """This process's counters (:class:`TransportStats`)."""
    with _lock:
        sender = _sending._sender
        live = len(sender.publisher.names()) if sender is not None and not sender.publisher.closed else 0
        return TransportStats(
            published=_counters["published"],
            freed=_counters["freed"],
            live=live,
            copied_bytes=_counters["copied_bytes"],
            received_socket=_counters["received_socket"],
            received_flight=_counters["received_flight"],
            receive_errors=_counters["receive_errors"],
            pickled=_counters["pickled"],
        )


_registered = False


def register() -> str:
    """Register the transport with Ray, in the driver, before the actors that use it are created
    (Ray hands registrations to the actors it starts afterwards); returns :data:`TRANSPORT`.
    Idempotent. The actors need ``@ray.remote(enable_tensor_transport=True)``."""
    global _registered
    with _lock:
        if not _registered:
            try:
                _rdt.register_tensor_transport(TRANSPORT, ["cpu", "cuda"], ArrowBridgeTransport, ArrowPayload)
            except ValueError as exc:
                # Ray registers it by itself in the actors it starts after the driver did.
                if "already registered" not in str(exc):
                    raise
            _registered = True
    return TRANSPORT
