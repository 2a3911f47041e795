"""Live streams: queue semantics, every batch delivered (docs/streams.md).

- :mod:`~arrow_ipc_bridge.streams.frames`: the stream frames' payloads (kinds in ``protocol.py``).
- :mod:`~arrow_ipc_bridge.streams.hub`: the publisher's streams, subscribers, credit and policies.
- :mod:`~arrow_ipc_bridge.streams.writer`: the producer's :class:`StreamWriter` and the
  ``publish_stream`` pump.
- :mod:`~arrow_ipc_bridge.streams.slots`: reserved batch memory filled in place.
- :mod:`~arrow_ipc_bridge.streams.live`: the consumer's :class:`LiveStream`.
"""

from arrow_ipc_bridge.streams.live import LiveStream
from arrow_ipc_bridge.streams.slots import SlotLayout, StreamSlot
from arrow_ipc_bridge.streams.writer import StreamWriter

__all__ = ["LiveStream", "SlotLayout", "StreamSlot", "StreamWriter"]
