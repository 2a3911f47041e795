"""Payloads of the live-stream frames (kinds in :mod:`arrow_ipc_bridge.transport.protocol`, table in
docs/protocol.md). Every decoder treats its input as hostile and raises
:class:`~arrow_ipc_bridge.errors.ProtocolError`; a bad frame closes the subscription's connection.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TypeGuard

from arrow_ipc_bridge.errors import ProtocolError
from arrow_ipc_bridge.transport import protocol

__all__ = [
    "BATCH_HEADER_SIZE",
    "FLAG_RING",
    "FLAG_SLOT_AGAIN",
    "MAX_IN_FLIGHT",
    "MAX_SLOTS",
    "NO_SLOT",
    "POLICIES",
    "StreamEnd",
    "Subscribed",
    "decode_release_many",
    "decode_stream_end",
    "decode_subscribe",
    "decode_subscribed",
    "encode_batch_header",
    "encode_release_many",
    "encode_stream_end",
    "encode_subscribe",
    "encode_subscribed",
]

MAX_IN_FLIGHT = 4096
"""The largest credit window a SUBSCRIBE may ask for (and a stream may allow)."""
MAX_SLOTS = 65536
"""The most reserved slots a stream may have."""
POLICIES = ("block", "drop_oldest", "error")
"""What a stream does when a consumer has ``max_in_flight`` batches unreleased (docs/streams.md)."""

_SUBSCRIBE = struct.Struct("<I")
_BATCH = struct.Struct("<QQII")  # sequence, lease id, slot, flags
NO_SLOT = 0xFFFFFFFF
FLAG_SLOT_AGAIN = 1
"""BATCH flag: this slot's last message and descriptors to this subscriber, again (not re-sent)."""
FLAG_RING = 2
"""BATCH flag: ``slot`` is a segment of the producer's ring (a written batch copied in), not a
reserved slot; its one descriptor must be a memfd sealed against shrinking, growing and writes."""
BATCH_HEADER_SIZE = _BATCH.size
_U64_MAX = (1 << 64) - 1


def encode_subscribe(name: str, max_in_flight: int) -> bytes:
    return _SUBSCRIBE.pack(max_in_flight) + protocol.encode_name(name)


def decode_subscribe(payload: bytes) -> tuple[str, int]:
    """(name, max_in_flight) of a SUBSCRIBE."""
    if len(payload) < _SUBSCRIBE.size + 1:
        raise ProtocolError(f"SUBSCRIBE payload of {len(payload)} bytes (a u32 credit, then a name)")
    (window,) = _SUBSCRIBE.unpack_from(payload)
    if not 1 <= window <= MAX_IN_FLIGHT:
        raise ProtocolError(f"SUBSCRIBE asks for max_in_flight {window} (1 to {MAX_IN_FLIGHT})")
    return protocol.decode_name(payload[_SUBSCRIBE.size :]), int(window)


@dataclass(frozen=True)
class Subscribed:
    """The publisher's answer to SUBSCRIBE: the window it granted, the stream's policy and the
    sequence number of the first batch this subscription can receive (late join: from now on)."""

    max_in_flight: int
    policy: str
    next_sequence: int


def encode_subscribed(answer: Subscribed) -> bytes:
    body = {"max_in_flight": answer.max_in_flight, "policy": answer.policy}
    return protocol.encode_json({**body, "next_sequence": answer.next_sequence})


def decode_subscribed(payload: bytes, asked: int) -> Subscribed:
    body = protocol.decode_json(payload, "SUBSCRIBED")
    if not isinstance(body, dict):
        raise ProtocolError("SUBSCRIBED payload is not an object")
    window, policy, sequence = body.get("max_in_flight"), body.get("policy"), body.get("next_sequence")
    if not _is_int(window) or not 1 <= window <= asked:
        raise ProtocolError(f"SUBSCRIBED grants max_in_flight {window!r} (asked for at most {asked})")
    if policy not in POLICIES:
        raise ProtocolError(f"SUBSCRIBED names an unknown policy {policy!r}")
    if not _is_int(sequence) or not 0 <= sequence <= _U64_MAX:
        raise ProtocolError(f"SUBSCRIBED next_sequence {sequence!r} is not a u64")
    return Subscribed(int(window), str(policy), int(sequence))


def encode_release_many(lease_ids: list[int]) -> bytes:
    return struct.pack(f"<{len(lease_ids)}Q", *lease_ids)


def decode_release_many(payload: bytes) -> tuple[int, ...]:
    """The lease ids of a RELEASE_MANY (1 to :data:`MAX_IN_FLIGHT` of them)."""
    count, rest = divmod(len(payload), 8)
    if rest or not 1 <= count <= MAX_IN_FLIGHT:
        raise ProtocolError(
            f"RELEASE_MANY payload of {len(payload)} bytes (1 to {MAX_IN_FLIGHT} u64 lease ids)"
        )
    return struct.unpack(f"<{count}Q", payload)


def encode_batch_header(sequence: int, lease_id: int, slot: int = NO_SLOT, flags: int = 0) -> bytes:
    """A BATCH's header; the message follows unless ``flags`` has :data:`FLAG_SLOT_AGAIN`. The
    consumer reads it in its C receive (``cffi_build/stream_consume.c``), as hostile input."""
    return _BATCH.pack(sequence, lease_id, slot, flags)


# A STREAM_END's type for an end with an error. They are tokens of the wire, spelled as the
# exception classes that once had these names (every publisher sends them so): the consumer turns
# them into StreamError(reason=...) or PeerClosedError. Any other type names the producer's own
# exception (StreamWriter.fail).
END_FAILED = "StreamFailedError"
END_SLOW_CONSUMER = "SlowConsumerError"
END_INTERRUPTED = "StreamInterruptedError"


@dataclass(frozen=True)
class StreamEnd:
    """How a stream ended for one consumer: ``error_type`` None for a clean end; ``dropped``: the
    batches the publisher dropped for this consumer (policy ``"drop_oldest"``)."""

    error_type: str | None
    message: str
    dropped: int


def encode_stream_end(end: StreamEnd) -> bytes:
    return protocol.encode_json({"type": end.error_type, "message": end.message, "dropped": end.dropped})


def decode_stream_end(payload: bytes) -> StreamEnd:
    body = protocol.decode_json(payload, "STREAM_END")
    if not isinstance(body, dict):
        raise ProtocolError("STREAM_END payload is not an object")
    error_type, message, dropped = body.get("type"), body.get("message"), body.get("dropped")
    if error_type is not None and (not isinstance(error_type, str) or not 0 < len(error_type) <= 200):
        raise ProtocolError(f"STREAM_END type {error_type!r} is not null or a short string")
    if not isinstance(message, str):
        raise ProtocolError("STREAM_END message is not a string")
    if not _is_int(dropped) or not 0 <= dropped <= _U64_MAX:
        raise ProtocolError(f"STREAM_END dropped {dropped!r} is not a count")
    return StreamEnd(error_type, message, int(dropped))


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
