"""arrow_ipc_bridge: zero-copy hand-off of Apache Arrow data between processes on one host.

Producer::

    with aib.Publisher("/tmp/demo.sock") as pub:
        pub.publish("trades", table)

Consumer::

    with aib.connect("/tmp/demo.sock") as session, session.get("trades") as imported:
        pa.table(imported)

Bring your own channel: ``aib.export(obj)`` gives ``.message`` and ``.fds``;
``aib.Session().import_message(message, fds)`` imports them.

Every process-wide counter (bytes copied, regions mapped, imports by path, CUDA handle opens, ...):
``aib.stats()``.
"""

from arrow_ipc_bridge._version import __version__
from arrow_ipc_bridge.addresses import connect
from arrow_ipc_bridge.arrays.columns import ColumnView, column_arrays, column_view
from arrow_ipc_bridge.arrays.device import from_cuda_array, from_cuda_arrays, to_device
from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream, to_host
from arrow_ipc_bridge.consumer.live_stream import LiveStream
from arrow_ipc_bridge.consumer.session import Session
from arrow_ipc_bridge.consumer.socket_connect import subscribe
from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    BuildMismatchError,
    ClosedError,
    CopyRequiredError,
    CudaError,
    InvalidArgumentError,
    LimitError,
    NotPublishedError,
    PeerClosedError,
    ProtocolError,
    RegionError,
    StreamError,
    TransportError,
    UnsupportedFormatError,
)
from arrow_ipc_bridge.host import SharedHostBuffer, allocate_shared
from arrow_ipc_bridge.process_stats import (
    BridgeStats,
    CudaStats,
    HostStats,
    SessionStats,
    StreamStats,
    WaitStats,
    stats,
)
from arrow_ipc_bridge.producer.exporter import Exported, ExportStats, export
from arrow_ipc_bridge.producer.publisher import Publisher
from arrow_ipc_bridge.producer.stream_slots import SlotLayout, StreamSlot
from arrow_ipc_bridge.producer.stream_writer import StreamWriter

__all__ = [
    "__version__",
    # producer
    "Publisher",
    "export",
    "Exported",
    "ExportStats",
    "allocate_shared",
    "SharedHostBuffer",
    "StreamWriter",
    "StreamSlot",
    "SlotLayout",
    # consumer
    "connect",
    "Session",
    "ImportedArray",
    "ImportedStream",
    "subscribe",
    "LiveStream",
    # devices
    "to_device",
    "to_host",
    "from_cuda_array",
    "from_cuda_arrays",
    "column_view",
    "column_arrays",
    "ColumnView",
    # counters
    "stats",
    "BridgeStats",
    "HostStats",
    "CudaStats",
    "SessionStats",
    "StreamStats",
    "WaitStats",
    # errors: one root and its families (arrow_ipc_bridge.errors)
    "BridgeError",
    "InvalidArgumentError",
    "ClosedError",
    "TransportError",
    "PeerClosedError",
    "NotPublishedError",
    "BridgeTimeoutError",
    "LimitError",
    "ProtocolError",
    "UnsupportedFormatError",
    "RegionError",
    "CopyRequiredError",
    "CudaError",
    "StreamError",
    "BuildMismatchError",
]


def __getattr__(name: str) -> object:
    # A retired exception class says which family took it over (errors.RETIRED).
    from arrow_ipc_bridge.errors import retired_hint

    hint = retired_hint(name)
    raise AttributeError(hint or f"module {__name__!r} has no attribute {name!r}")
