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
"""

from __future__ import annotations

import atexit
import collections
import importlib
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import pyarrow as pa

import arrow_ipc_bridge as aib

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

# Ray is loaded by name: this module is the one place that needs it, and loading it through
# importlib keeps the type checker's view of the package the same whether or not ray is installed
# (the classes below subclass ray's, which it then sees as Any).
try:
    ray: Any = importlib.import_module("ray")
    _rdt: Any = importlib.import_module("ray.experimental.rdt")
    _rdt.register_tensor_transport  # noqa: B018 -- older rays lack it: refused below
except (ImportError, AttributeError) as exc:
    raise ImportError(
        "arrow_ipc_bridge.integrations.ray needs ray>=2.60 (its pluggable tensor transports, "
        "ray.experimental.rdt.register_tensor_transport): pip install 'arrow_ipc_bridge[ray]'"
    ) from exc

#: The transport's name, for ``@ray.method(tensor_transport=TRANSPORT)`` and
#: ``ray.put(..., _tensor_transport=TRANSPORT)`` (Ray upper-cases transport names).
TRANSPORT = "ARROW_IPC_BRIDGE"

#: Environment variable that makes a process count as running on the node it names, for routing
#: only: two processes whose values differ take the route between machines (the Flight front, or a
#: :class:`RouteError`), whatever node they really run on. For tests and trials of a cluster on one
#: machine; set it per actor with ``runtime_env={"env_vars": {NODE_ID_ENV: "..."}}``.
NODE_ID_ENV = "AIB_RAY_NODE_ID"

#: Environment variable naming a gRPC location (``grpc://0.0.0.0:0``) where every sending process
#: serves a Flight front as soon as it publishes, so receivers on other machines can read it
#: (:func:`serve_flight` does the same from code).
FLIGHT_ENV = "AIB_RAY_FLIGHT"

# The receiver's sessions keep nothing after a get: every object crosses under a name of its own
# and is got once, so a remembered message would never be asked for again, while it would keep
# the mapping of a publication Ray has already freed (up to remembered_messages of them).
_SESSION_OPTIONS: dict[str, Any] = {"remembered_messages": 0, "pool_linger": 0.0}
_Copy = Literal["never", "if_needed", "always"]
_COPY_CHOICES = ("never", "if_needed", "always")
_CAPSULE_METHODS = frozenset(
    {
        "__arrow_c_schema__",
        "__arrow_c_array__",
        "__arrow_c_stream__",
        "__arrow_c_device_array__",
        "__arrow_c_device_stream__",
    }
)
_MAX_RECORDS = 1024


class RouteError(aib.TransportError):
    """No route from the sender to this process: the sender runs on another machine and serves no
    Flight front (:func:`serve_flight`, :data:`FLIGHT_ENV`). ``.source_node`` and ``.node`` name
    both ends."""


class SourceGoneError(aib.TransportError):
    """The sender's publication cannot be got any more: its process exited or was killed, its
    publisher was closed (:func:`close`), or Ray already freed the object. ``.name`` and ``.path``
    say which publication and where; the cause is chained."""


class ArrowPayload:
    """Arrow data that the bridge's Ray transport carries.

    On the sender, wrap what a method returns: ``ArrowPayload(obj)``, where ``obj`` is any Arrow
    PyCapsule producer (``__arrow_c_array__``, ``__arrow_c_stream__`` or their device forms):
    pyarrow tables, record batches and arrays, ``aib.to_device`` data, ``aib.from_cuda_arrays``
    columns, pylibcudf tables. ``copy`` is the publisher's copy policy for it (``"if_needed"``:
    host data outside shared memory is copied once into a sealed memfd, counted in
    :func:`stats`; ``"never"``: such data raises :class:`~arrow_ipc_bridge.CopyRequiredError`).

    On the receiver the same class arrives, over the imported object (``data``: an
    ``ImportedArray`` / ``ImportedStream``, or a Flight import) with ``route`` (``"socket"`` or
    ``"flight"``) and ``route_reason``. Either side it is itself an Arrow PyCapsule producer with
    the methods its data has (``pa.table(payload)``, ``pa.record_batch(payload)``,
    ``pylibcudf.Table.from_arrow(payload)``). ``release()`` gives the receiver's lease back now
    (otherwise it goes when the object is collected).
    """

    def __init__(self, data: Any, *, copy: str = "if_needed") -> None:
        if not any(hasattr(data, method) for method in _CAPSULE_METHODS - {"__arrow_c_schema__"}):
            raise aib.InvalidArgumentError(
                f"ArrowPayload needs an Arrow PyCapsule producer (__arrow_c_array__, __arrow_c_stream__ or "
                f"their device forms), not {type(data).__name__}",
                argument="data",
            )
        if not isinstance(copy, str):
            raise aib.InvalidArgumentError(
                f"copy must be one of {', '.join(_COPY_CHOICES)}, not {type(copy).__name__}", argument="copy"
            )
        if copy not in _COPY_CHOICES:
            raise aib.InvalidArgumentError(
                f"copy must be one of {', '.join(_COPY_CHOICES)}, not {copy!r}", argument="copy"
            )
        self.data = data
        self.copy = cast(_Copy, copy)
        #: ``None`` on the sender; ``"socket"`` or ``"flight"`` on a receiver
        self.route: str | None = None
        self.route_reason: str | None = None
        #: the publication's name and version (set once the transport published or received it)
        self.name: str | None = None
        self.version: int | None = None
        #: the node (Ray node id, or :data:`NODE_ID_ENV`'s value) of the process that published it
        self.source_node: str | None = None

    def __getattr__(self, name: str) -> Any:
        # Only the Arrow protocol is forwarded, and only what the data offers: consumers probe with
        # hasattr (pylibcudf tries the device array first), so a method the data lacks must be
        # missing here too. __dict__ is read directly: unpickling asks before it is filled.
        if name in _CAPSULE_METHODS and "data" in self.__dict__:
            return getattr(self.__dict__["data"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def release(self) -> None:
        """Give the data's hold back now, where it has one (an import's lease); idempotent."""
        release = getattr(self.data, "release", None)
        if callable(release):
            release()

    def __enter__(self) -> ArrowPayload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        where = f"route={self.route!r}" if self.route else "sender"
        return f"<ArrowPayload {self.name!r} {where} {self.data!r}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickling is Ray's own path, not this transport's: a payload returned by a method without
        # tensor_transport, passed as a plain argument, or fetched with ray.get(...,
        # _use_object_store=True). It then travels as pyarrow data, copied like any object there;
        # counted, so that a transport silently not taken shows in stats().
        data = _host_pyarrow(self.data)
        with _lock:
            _counters["pickled"] += 1
        return (_unpickle_payload, (data, self.copy))


def _unpickle_payload(data: Any, copy: str) -> ArrowPayload:
    return ArrowPayload(data, copy=copy)


def _host_pyarrow(data: Any) -> Any:
    """``data`` as a picklable pyarrow object: pyarrow objects as they are, host imports and other
    host producers through their stream or array; device data is refused (pickling it would be a
    device-to-host copy nobody asked for)."""
    if isinstance(data, pa.Table | pa.RecordBatch | pa.Array | pa.ChunkedArray):
        return data
    device = getattr(data, "device", "cpu")
    if (isinstance(device, str) and device != "cpu") or not (
        hasattr(data, "__arrow_c_stream__") or hasattr(data, "__arrow_c_array__")
    ):
        raise TypeError(
            "an ArrowPayload of device data cannot be pickled (Ray's object store path): return it from "
            f"a method with tensor_transport={TRANSPORT!r}, or copy it to the host (aib.to_host) first"
        )
    if hasattr(data, "__arrow_c_stream__"):
        return pa.RecordBatchReader.from_stream(data).read_all()
    return pa.record_batch(data)


_metadata_base: Any = _rdt.TensorTransportMetadata
_manager_base: Any = _rdt.TensorTransportManager
_communicator_base: Any = _rdt.CommunicatorMetadata


@dataclass
class BridgeTransportMetadata(_metadata_base):  # type: ignore[misc]  # ray's class, seen as Any
    """What Ray ships from the sender to a receiver: everything a receiver needs to get the objects.

    ``tensor_meta`` (Ray's field) has one ``((), kind)`` entry per payload (Ray checks the count),
    ``tensor_device`` is ``"cuda"`` when a payload holds device data, else ``"cpu"``.
    """

    socket_path: str = ""
    publisher_id: str = ""
    names: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    node_id: str = ""
    boot_id: str = ""
    hostname: str = ""
    pid: int = 0
    #: the sender's Flight front (:func:`serve_flight`), for receivers on other machines
    flight_location: str | None = None
    #: the bearer token of that front: it travels with Ray's metadata, inside the cluster
    flight_token: str | None = None


@dataclass
class _NoCommunicator(_communicator_base):  # type: ignore[misc]  # ray's class, seen as Any
    """One-sided: the receiver needs nothing from Ray to reach the sender but the metadata."""


@dataclass(frozen=True)
class TransferRecord:
    """One receive of one payload, as :func:`transfers` lists it."""

    object_id: str
    name: str
    route: str
    reason: str
    source_node: str
    node: str
    device: str
    seconds: float


@dataclass(frozen=True)
class TransportStats:
    """This process's counters of the transport since import (:func:`stats`).

    Sender: ``published`` payloads, ``freed`` (unpublished by Ray's free), ``live`` publications
    now, ``copied_bytes`` copied into shared memory by the copy policy. Receiver: ``received_socket``,
    ``received_flight``, ``receive_errors``. Either: ``pickled`` payloads that went Ray's own way
    (see :class:`ArrowPayload`).
    """

    published: int
    freed: int
    live: int
    copied_bytes: int
    received_socket: int
    received_flight: int
    receive_errors: int
    pickled: int


_lock = threading.RLock()
_counters: collections.Counter[str] = collections.Counter()
_records: collections.deque[TransferRecord] = collections.deque(maxlen=_MAX_RECORDS)


class _Sender:
    """The process's publisher (one per process: the transport manager is a process singleton), in a
    temporary directory of its own, and its optional Flight front."""

    def __init__(self) -> None:
        _sweep_stale_directories()
        self.directory = tempfile.mkdtemp(prefix=f"{_DIRECTORY_PREFIX}{os.getpid()}-")
        self.publisher = aib.Publisher(os.path.join(self.directory, "publisher.sock"))
        self.front: Any = None
        self.flight_location: str | None = None
        self.flight_token: str | None = None
        self.pid = os.getpid()

    def close(self) -> None:
        if self.front is not None:
            self.front.close()
        self.publisher.close()
        shutil.rmtree(self.directory, ignore_errors=True)


_DIRECTORY_PREFIX = "aib-ray-"


def _sweep_stale_directories() -> None:
    """Remove the socket directories of senders of this uid that died without closing (Ray kills
    actors at shutdown and on ray.kill, so their atexit never runs): the directory's name carries
    its process id, and one whose process is gone holds only a dead socket file."""
    base = tempfile.gettempdir()
    try:
        entries = os.listdir(base)
    except OSError:
        return
    for entry in entries:
        if not entry.startswith(_DIRECTORY_PREFIX):
            continue
        pid_text = entry[len(_DIRECTORY_PREFIX) :].split("-", 1)[0]
        path = os.path.join(base, entry)
        try:
            if not pid_text.isdigit() or os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue  # alive under another uid (EPERM), or gone meanwhile


_sender: _Sender | None = None
_sessions: dict[str, Any] = {}  # socket path -> Session, this process's
_flight_sessions: dict[str, Any] = {}  # Flight location -> FlightSession
_sessions_pid = os.getpid()


def _the_sender() -> _Sender:
    global _sender
    with _lock:
        if _sender is None or _sender.pid != os.getpid():
            _sender = _Sender()
            location = os.environ.get(FLIGHT_ENV)
            if location:
                _serve_flight_locked(_sender, location, None, None, {})
        return _sender


def local_publisher() -> aib.Publisher | None:
    """This process's transport publisher, if it made one (it does at its first send): its
    ``names()``, ``active_leases`` and ``version()`` show what is in flight."""
    with _lock:
        return _sender.publisher if _sender is not None and _sender.pid == os.getpid() else None


def serve_flight(
    location: str = "grpc://0.0.0.0:0",
    *,
    token: str | None = None,
    advertise: str | None = None,
    **serve_options: Any,
) -> str:
    """Serve this process's transport publisher over Arrow Flight, for receivers on other machines;
    returns the location receivers are given. Call it in the sending actor (its ``__init__``), or
    set :data:`FLIGHT_ENV`.

    ``token``: the bearer token receivers must send (default: a new random one); it travels to them
    in Ray's metadata. ``advertise``: the location receivers connect to (default: this node's IP
    address from Ray and the port listened on). ``serve_options`` go to
    :func:`arrow_ipc_bridge.flight.serve`. A second call returns the first front's location.
    """
    with _lock:
        sender = _the_sender()
        return _serve_flight_locked(sender, location, token, advertise, serve_options)


def _serve_flight_locked(
    sender: _Sender, location: str, token: str | None, advertise: str | None, options: dict[str, Any]
) -> str:
    if sender.flight_location is not None:
        return sender.flight_location
    from arrow_ipc_bridge.flight import serve

    token = token or secrets.token_urlsafe(32)
    front = serve(sender.publisher, location, tokens=[token], advertise=advertise, **options)
    if advertise is None:
        scheme, _, host_port = front.location.partition("://")
        host = host_port.rsplit(":", 1)[0].strip("[]")
        if host in ("0.0.0.0", "::", ""):
            host = ray.util.get_node_ip_address()
        advertise = f"{scheme}://{host}:{front.port}"
    sender.front = front
    sender.flight_location = advertise
    sender.flight_token = token
    return advertise


def close() -> None:
    """Close this process's transport publisher (and Flight front) and its receiving sessions.

    As a sender: publications not yet received then raise :class:`SourceGoneError` at their
    receivers, while what receivers hold stays valid; the next send makes a new publisher. As a
    receiver: the payloads this process received are released (``payload.data`` raises
    ``ClosedError``; pyarrow objects already made from them stay valid). Runs at exit by itself.
    """
    global _sender
    with _lock:
        sender, _sender = _sender, None
        sessions = [*_sessions.values(), *_flight_sessions.values()]
        _sessions.clear()
        _flight_sessions.clear()
    if sender is not None and sender.pid == os.getpid():
        sender.close()
    for session in sessions:
        # At exit or on request: a session's close releases what it handed out, which at exit no
        # one uses any more; a caller of close() asked for exactly that.
        session.close()


atexit.register(close)


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _place() -> tuple[str, str]:
    """This process's (node, machine) for routing: Ray's node id and the kernel's boot id, or
    :data:`NODE_ID_ENV`'s value for both."""
    pretend = os.environ.get(NODE_ID_ENV)
    if pretend:
        return pretend, pretend
    return str(ray.get_runtime_context().get_node_id()), _boot_id()


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


def _kind(data: Any) -> tuple[str, str]:
    """(kind, device) of a payload's data, for Ray's per-object metadata: what it is and where."""
    device = getattr(data, "device", None)
    if isinstance(device, str):
        where = "cpu" if device == "cpu" else "cuda"
    elif isinstance(data, pa.Table | pa.RecordBatch | pa.Array | pa.ChunkedArray):
        where = "cpu"
    else:
        # A producer that offers only the device methods (pylibcudf) holds device data.
        host = hasattr(data, "__arrow_c_array__") or hasattr(data, "__arrow_c_stream__")
        where = "cpu" if host else "cuda"
    return type(data).__name__, where


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
        sender = _sender
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


def transfers() -> list[TransferRecord]:
    """The last 1024 receives of this process, oldest first: which route each took and why."""
    with _lock:
        return list(_records)


def stats() -> TransportStats:
    """This process's counters (:class:`TransportStats`)."""
    with _lock:
        sender = _sender
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
