"""What the Ray transport carries, and what its sending and receiving sides share: the loading of
ray itself, the transport's names and errors, :class:`ArrowPayload`, the metadata Ray ships from a
sender to its receivers (:class:`BridgeTransportMetadata`), where a process runs (its node and
machine), and the process's counters and record of receives.

Users import all of it from :mod:`arrow_ipc_bridge.integrations.ray`; this module imports no other
module of the integration.
"""

from __future__ import annotations

import collections
import importlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import pyarrow as pa

import arrow_ipc_bridge as aib

# Ray is loaded here only (the integration's other modules take it from this one), and by name:
# loading it through importlib keeps the type checker's view of the package the same whether or
# not ray is installed (the classes below subclass ray's, which it then sees as Any).
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
