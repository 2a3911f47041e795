"""The publisher/session conversation on top of the channel's frames (format: docs/protocol.md, "Frames").

Frame kinds and their payloads. Hot frames (GET, ITEM, RELEASE) are small binary payloads; rare
control frames (WELCOME, NAMES, ERROR) carry size-limited JSON. Every parser here treats its input
as hostile and raises :class:`~arrow_ipc_bridge.errors.ProtocolError`.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from arrow_ipc_bridge.errors import (
    RETIRED,
    BridgeError,
    BridgeTimeoutError,
    ClosedError,
    CopyRequiredError,
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
from arrow_ipc_bridge.runtime import arguments

__all__ = [
    "PROTOCOL_VERSION",
    "HELLO",
    "WELCOME",
    "LIST",
    "NAMES",
    "GET",
    "ITEM",
    "RELEASE",
    "ERROR",
    "PING",
    "PONG",
    "POOL_FD",
    "POOL",
    "SUBSCRIBE",
    "SUBSCRIBED",
    "BATCH",
    "STREAM_END",
    "RELEASE_MANY",
    "WAIT",
    "VERSIONED_ITEM",
    "BOARD_FD",
    "BOARD",
    "BOARD_ITEM",
    "NO_SLOT",
    "WAIT_FOREVER",
    "MAX_PING",
    "POOL_IDENTITY_SIZE",
    "FEATURES",
    "BOARD_FEATURES",
    "encode_hello",
    "decode_hello",
    "encode_json",
    "decode_json",
    "decode_item",
    "encode_lease",
    "decode_lease",
    "decode_pool_identity",
    "encode_wait",
    "decode_wait",
    "decode_versioned_item",
    "decode_board_item",
    "answer_message",
    "encode_error",
    "raise_error",
]

PROTOCOL_VERSION = 1

HELLO = 1  # session -> publisher: u16 protocol version
WELCOME = 2  # publisher -> session: JSON {"protocol", "wire", "publisher_id", "pid", "features"}
LIST = 3  # session -> publisher: empty
NAMES = 4  # publisher -> session: JSON list of names
GET = 5  # session -> publisher: the name, UTF-8
ITEM = 6  # publisher -> session: u64 lease id + message bytes; region fds attached
RELEASE = 7  # session -> publisher: u64 lease id (no reply)
ERROR = 8  # publisher -> session: JSON {"type", "message"}
PING = 9  # session -> publisher: 0 to MAX_PING bytes, echoed (publishers advertising "ping")
PONG = 10  # publisher -> session: the PING's payload
POOL_FD = 11  # session -> publisher: a 24-byte IPC-pool identity (publishers advertising "pool_fd")
POOL = 12  # publisher -> session: the same identity, the pool's fd attached
# Live streams (publishers advertising "stream"; payloads in arrow_ipc_bridge/transport/stream_frames.py).
# A subscription has a connection of its own: after SUBSCRIBED the publisher pushes BATCH frames
# and the session sends RELEASE (of a batch's lease: credit back) and nothing else.
SUBSCRIBE = 13  # session -> publisher: u32 max_in_flight, then the stream's name, UTF-8
SUBSCRIBED = 14  # publisher -> session: JSON {"max_in_flight", "policy", "next_sequence"}
BATCH = 15  # publisher -> session: u64 sequence, u64 lease id, then the message; region fds attached
STREAM_END = 16  # publisher -> session: JSON {"type", "message", "dropped"} (type null: a clean end)
RELEASE_MANY = 17  # session -> publisher, on a subscription: 1 to 4096 u64 lease ids (no reply)
# 18-19 are kept for streams.
# Feature "watch" (docs/protocol.md, "Waiting and versions"); kinds 20-23 belong to it.
WAIT = 20  # session -> publisher: u64 after, u32 timeout ms, the name; answered once a version > after is out
VERSIONED_ITEM = 21  # publisher -> session: u64 lease id, u64 version + message bytes; region fds attached
# Feature "board" (docs/protocol.md, "The version board"); kinds 24-26.
BOARD_FD = 24  # session -> publisher: empty; asks for the version board
BOARD = (
    25  # publisher -> session: u32 slots; the board's fd attached. GETs are answered with BOARD_ITEM after
)
# publisher -> session, a GET's answer once the session has the board: u64 lease id, u64 version, u64 serial,
# u32 slot, u32 0, then the message; region fds attached
BOARD_ITEM = 26
NO_SLOT = 0xFFFFFFFF
"""A BOARD_ITEM's slot when the name has none on the board (it was full)."""

MAX_PING = 64
# An IPC pool's identity, the first bytes of a CUDA_POOL region's handle: the producer's 16-byte
# nonce and the pool's 8-byte serial (docs/wire-format.md).
POOL_IDENTITY_SIZE = 24
# What this side's publisher offers beyond protocol 1's first frames, advertised in WELCOME's
# "features": a session checks before it uses one, so older publishers keep working with it.
FEATURES = ("board", "board_wake", "ping", "pool_fd", "stream", "watch")
# Features offered only with the version board (a kernel without F_SEAL_FUTURE_WRITE gets none).
BOARD_FEATURES = frozenset({"board", "board_wake"})

MAX_JSON = 1 << 20
MAX_NAME = 4096
_U64 = struct.Struct("<Q")
_U16 = struct.Struct("<H")
_WAIT = struct.Struct("<QI")  # after, timeout ms
_VERSIONED = struct.Struct("<QQ")  # lease id, version
_BOARD_ITEM = struct.Struct("<QQQII")  # lease id, version, serial, slot, 0
WAIT_FOREVER = 0xFFFFFFFF
"""A WAIT's timeout field for a wait without a limit (any other value is milliseconds)."""

# Errors a publisher may report: an ERROR frame names the family ("type") and carries the family's
# attributes beside the message; anything else arrives as BridgeError. A name of a class retired
# into a family (what older publishers send) arrives as its family with the attributes that say
# the same (errors.RETIRED).
_ERROR_TYPES: dict[str, type[BridgeError]] = {
    cls.__name__: cls
    for cls in (
        BridgeError,
        BridgeTimeoutError,
        ClosedError,
        CopyRequiredError,
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
}
# The attributes an ERROR frame carries, each with the types a value may have (checked on receipt:
# the frame comes from another process).
_ERROR_ATTRIBUTES: dict[str, tuple[type, ...]] = {
    "limit": (str,),
    "value": (int,),
    "waiting_for": (str,),
    "timeout": (int, float),
    "reason": (str,),
    "what": (str,),
    "field": (str,),
    "path": (str,),
    "stream": (str,),
    "received": (int,),
    "producer_error": (str,),
}
_MAX_ATTRIBUTE_CHARS = 200


def encode_hello() -> bytes:
    return _U16.pack(PROTOCOL_VERSION)


def decode_hello(payload: bytes) -> int:
    if len(payload) != _U16.size:
        raise ProtocolError(f"HELLO payload of {len(payload)} bytes, expected 2")
    return int(_U16.unpack(payload)[0])


def encode_json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def decode_json(payload: bytes, what: str) -> Any:
    if len(payload) > MAX_JSON:
        raise ProtocolError(f"{what} payload over {MAX_JSON} bytes")
    try:
        return json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"{what} payload is not valid JSON: {exc}") from exc


def encode_name(name: str, what: str = "name") -> bytes:
    """``name``'s bytes for a frame; :class:`~arrow_ipc_bridge.errors.InvalidArgumentError` for a
    non-str, :class:`~arrow_ipc_bridge.errors.InvalidArgumentError` outside 1 to MAX_NAME UTF-8 bytes
    (``what``: the argument's name in the message)."""
    if type(name) is str:  # the hot path (publish, get) without a call more
        try:
            raw = name.encode()
        except UnicodeEncodeError:
            raw = b""  # refused below, saying why
        if 0 < len(raw) <= MAX_NAME:
            return raw
    return arguments.name(name, what, MAX_NAME)


def decode_name(payload: bytes) -> str:
    if not payload or len(payload) > MAX_NAME:
        raise ProtocolError(f"name of {len(payload)} bytes (1 to {MAX_NAME} allowed)")
    try:
        return payload.decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError("name is not UTF-8") from exc


def decode_item(payload: bytes) -> tuple[int, bytes]:
    if len(payload) < _U64.size:
        raise ProtocolError("ITEM payload shorter than its lease id")
    return int(_U64.unpack_from(payload)[0]), payload[_U64.size :]


def encode_lease(lease_id: int) -> bytes:
    return _U64.pack(lease_id)


def decode_lease(payload: bytes) -> int:
    if len(payload) != _U64.size:
        raise ProtocolError(f"RELEASE payload of {len(payload)} bytes, expected 8")
    return int(_U64.unpack(payload)[0])


def decode_pool_identity(payload: bytes) -> bytes:
    if len(payload) != POOL_IDENTITY_SIZE:
        raise ProtocolError(f"pool identity of {len(payload)} bytes, expected {POOL_IDENTITY_SIZE}")
    return bytes(payload)


def encode_wait(after: int, timeout_ms: int, raw_name: bytes) -> bytes:
    """A WAIT's payload; ``timeout_ms`` is :data:`WAIT_FOREVER` for no limit."""
    return _WAIT.pack(after, timeout_ms) + raw_name


def decode_wait(payload: bytes) -> tuple[int, int, str]:
    """``(after, timeout ms, name)`` of a WAIT; :class:`ProtocolError` when malformed."""
    if len(payload) < _WAIT.size:
        raise ProtocolError(f"WAIT payload of {len(payload)} bytes, shorter than its {_WAIT.size}-byte start")
    after, timeout_ms = _WAIT.unpack_from(payload)
    return int(after), int(timeout_ms), decode_name(payload[_WAIT.size :])


def decode_versioned_item(payload: bytes) -> tuple[int, int, bytes]:
    """``(lease id, version, message)`` of a VERSIONED_ITEM; :class:`ProtocolError` when malformed."""
    if len(payload) < _VERSIONED.size:
        raise ProtocolError("VERSIONED_ITEM payload shorter than its lease id and version")
    lease_id, version = _VERSIONED.unpack_from(payload)
    if version == 0:
        raise ProtocolError("VERSIONED_ITEM with version 0 (versions start at 1)")
    return int(lease_id), int(version), payload[_VERSIONED.size :]


def decode_board_item(payload: bytes, n_slots: int) -> tuple[int, int, bytes]:
    """``(lease id, version, message)`` of a BOARD_ITEM from a publisher whose board has ``n_slots``
    slots (the serial and slot are the C core's: ``remembered.c``); :class:`ProtocolError` when
    malformed."""
    if len(payload) < _BOARD_ITEM.size:
        raise ProtocolError("BOARD_ITEM payload shorter than its lease id, version, serial and slot")
    lease_id, version, serial, slot, zero = _BOARD_ITEM.unpack_from(payload)
    if version == 0 or serial == 0 or serial > version:
        raise ProtocolError(f"BOARD_ITEM with version {version} and serial {serial} (1 <= serial <= version)")
    if (slot >= n_slots and slot != NO_SLOT) or zero:
        raise ProtocolError(f"BOARD_ITEM names board slot {slot} (the board has {n_slots})")
    return int(lease_id), int(version), payload[_BOARD_ITEM.size :]


def answer_message(kind: int, payload: bytes) -> bytes:
    """The message of a GET's answer whose prefix the C core checked already (ITEM or BOARD_ITEM)."""
    return payload[_BOARD_ITEM.size if kind == BOARD_ITEM else _U64.size :]


def encode_error(exc: BaseException) -> bytes:
    """An ERROR payload for ``exc``: its family's name, its message and the attributes of
    :data:`_ERROR_ATTRIBUTES` it has (a family outside the table goes as BridgeError)."""
    families = _ERROR_TYPES.values()
    name = next((c.__name__ for c in type(exc).__mro__ if c in families), "BridgeError")
    message = exc.message if isinstance(exc, BridgeError) else str(exc)
    body: dict[str, object] = {"type": name, "message": message}
    details = exc.details if isinstance(exc, BridgeError) else {}
    for key, types in _ERROR_ATTRIBUTES.items():
        value = details.get(key)
        if isinstance(value, types) and not isinstance(value, bool):
            body[key] = value
    return encode_json(body)


def raise_error(payload: bytes) -> None:
    """Raise the error a publisher reported: its family, with the attributes that came (each
    checked; one of the wrong type or size is left out) or those of a retired name."""
    body = decode_json(payload, "ERROR")
    if not isinstance(body, dict) or not isinstance(body.get("message"), str):
        raise ProtocolError("ERROR payload is not {type, message}")
    name = str(body.get("type"))
    details: dict[str, Any] = {}
    retired = RETIRED.get(name)
    if retired is not None:
        cls, implied = retired
        details.update(implied)
    else:
        cls = _ERROR_TYPES.get(name, BridgeError)
    for key, types in _ERROR_ATTRIBUTES.items():
        value = body.get(key)
        if isinstance(value, types) and not isinstance(value, bool):
            if isinstance(value, str) and len(value) > _MAX_ATTRIBUTE_CHARS:
                continue
            details[key] = value
    raise cls(f"publisher: {body['message']}", **details)
