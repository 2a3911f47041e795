"""The sending side of the Ray transport: the process's one publisher, in a socket directory of
its own (with the sweep of directories that killed senders left behind), its optional Flight front
for receivers on other machines, and what the sender tells Ray about each payload it publishes.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from typing import Any

import pyarrow as pa

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.integrations.ray_payload import FLIGHT_ENV, _lock, ray


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


def _take_sender() -> _Sender | None:
    """This process's sender (or ``None``), forgotten here: the next send makes a new one. For
    :func:`~arrow_ipc_bridge.integrations.ray.close`, which closes it."""
    global _sender
    with _lock:
        sender, _sender = _sender, None
    return sender


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
