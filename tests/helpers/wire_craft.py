"""An independent, spec-following writer of bridge messages (docs/wire-format.md), for tests.

It exists to craft messages the real encoder would never produce: hostile counts, bad references,
deep nesting. Keeping it separate from the C encoder also checks that the spec page is enough to
write a peer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

MAGIC = b"AIBM"


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def blob(data: bytes) -> bytes:
    return varint(len(data)) + data


@dataclass
class Node:
    format: str
    name: str | None = ""
    metadata: list[tuple[bytes, bytes]] = field(default_factory=list)
    flags: int = 2
    children: list[Node] = field(default_factory=list)
    dictionary: Node | None = None

    def encode(self) -> bytes:
        out = blob(self.format.encode())
        out += varint(0) if self.name is None else varint(len(self.name.encode()) + 1) + self.name.encode()
        out += varint(len(self.metadata)) + b"".join(blob(k) + blob(v) for k, v in self.metadata)
        out += varint(self.flags) + varint(len(self.children)) + bytes([self.dictionary is not None])
        out += b"".join(child.encode() for child in self.children)
        if self.dictionary is not None:
            out += self.dictionary.encode()
        return out

    def preorder(self) -> list[Node]:
        nodes = [self]
        for child in self.children:
            nodes += child.preorder()
        if self.dictionary is not None:
            nodes += self.dictionary.preorder()
        return nodes


@dataclass
class ArrayNode:
    length: int
    null_count: int = 0
    offset: int = 0
    buffers: list[tuple[int, int, int]] = field(default_factory=list)  # (region code, offset, length)

    def encode(self) -> bytes:
        out = (
            varint(self.length)
            + varint(self.null_count + 1)
            + varint(self.offset)
            + varint(len(self.buffers))
        )
        for code, offset, length in self.buffers:
            out += varint(code)
            if code >= 2:
                out += varint(offset) + varint(length)
        return out


@dataclass
class Region:
    kind: int = 2
    size: int = 1 << 20
    file_offset: int = 0
    identity: int = 0
    fd_index: int = 0
    handle: bytes = b""
    flags: int = 0

    def encode(self) -> bytes:
        return (
            varint(self.kind)
            + varint(self.flags)
            + varint(self.size)
            + varint(self.file_offset)
            + varint(self.identity)
            + varint(self.fd_index + 1)
            + blob(self.handle)
        )


def message(
    schema: Node,
    batches: list[list[ArrayNode]],
    regions: list[Region] | None = None,
    *,
    kind: int = 1,
    device_type: int = 1,
    extensions: list[tuple[int, bytes]] | None = None,
    major: int = 1,
    minor: int = 0,
    flags: int = 0,
) -> bytes:
    regions = [Region()] if regions is None else regions
    body = varint(device_type) + blob(b"") + blob(b"")
    body += varint(len(regions)) + b"".join(r.encode() for r in regions)
    body += schema.encode()
    body += varint(len(batches)) + b"".join(node.encode() for batch in batches for node in batch)
    exts = extensions or []
    body += varint(len(exts)) + b"".join(varint(tag) + blob(payload) for tag, payload in exts)
    return MAGIC + bytes([major, minor, kind, 0]) + struct.pack("<II", len(body), flags) + body


def int64_column(length: int = 4, region_offset: int = 0) -> tuple[Node, ArrayNode]:
    """A non-null int64 column of ``length`` values in region 0."""
    return Node("l", "x"), ArrayNode(length, 0, 0, [(0, 0, 0), (2, region_offset, 8 * length)])


def memfd_region(data: bytes, size: int | None = None) -> tuple[int, Region]:
    """A sealed-free memfd holding ``data`` (padded to ``size``) and the host region naming it as fd 0.

    The caller closes the fd. Buffers are placed by the test: the region is the test's own memory,
    so crafted buffer contents (hostile offsets, views, indices) are exactly what the test wrote.
    """
    import os

    size = len(data) if size is None else size
    fd = os.memfd_create("wire-craft")
    os.write(fd, data.ljust(size, b"\0"))
    return fd, Region(size=max(size, 1))


class Heap:
    """Bytes laid out as a region: ``put`` appends a buffer (64-byte aligned) and returns its
    ``(region code, offset, length)`` reference for an :class:`ArrayNode`."""

    def __init__(self) -> None:
        self.data = bytearray()

    def put(self, raw: bytes, region: int = 0) -> tuple[int, int, int]:
        offset = (len(self.data) + 63) // 64 * 64
        self.data += b"\0" * (offset - len(self.data)) + raw
        return (2 + region, offset, len(raw))

    def ints(self, values: list[int], fmt: str) -> tuple[int, int, int]:
        return self.put(struct.pack(f"<{len(values)}{fmt}", *values))


NULL_BUFFER = (0, 0, 0)


def encode_item(lease_id: int, message: bytes) -> bytes:
    """An ITEM frame's payload (docs/protocol.md): the 8-byte little-endian lease id, then the
    message. Only the publisher's C code writes ITEMs; tests that play a publisher write their own."""
    return struct.pack("<Q", lease_id) + message
