#!/usr/bin/env python3
"""Write the seed corpus of fuzz_channel.c into corpus/: well-formed frame scripts to mutate from.

Each file is an input in the harness's format (options byte, then records of u8 control, u16 length,
bytes; control's low 2 bits = descriptors on that write). Run it again after changing the format.
"""

from __future__ import annotations

import struct
from pathlib import Path

HEADER = struct.Struct("<4sHHIHH")
HELLO, GET, ITEM, RELEASE, PING = 1, 5, 6, 7, 9


def frame(kind: int, payload: bytes = b"", n_fds: int = 0) -> bytes:
    return HEADER.pack(b"AIBT", 1, kind, len(payload), n_fds, 0) + payload


def record(data: bytes, n_fds: int = 0) -> bytes:
    return struct.pack("<BH", n_fds, len(data)) + data


def script(*records: bytes, options: int = 0) -> bytes:
    return bytes([options]) + b"".join(records)


def _chunks(data: bytes, size: int = 60_000) -> list[bytes]:
    return [data[k : k + size] for k in range(0, len(data), size)]


SEEDS = {
    "hello": script(record(frame(HELLO, struct.pack("<H", 1)))),
    "get": script(record(frame(GET, b"trades"))),
    "release": script(record(frame(RELEASE, struct.pack("<Q", 7)))),
    "ping_pair": script(record(frame(PING, b"abc") + frame(PING, b""))),
    "item_with_fds": script(record(frame(ITEM, struct.pack("<Q", 1) + b"M" * 40, 2), 2)),
    "split_header": script(record(frame(GET, b"x")[:5]), record(frame(GET, b"x")[5:])),
    "fds_on_second_part": script(
        record(frame(ITEM, b"L" * 24, 1)[:20]), record(frame(ITEM, b"L" * 24, 1)[20:], 1)
    ),
    "seeded": script(record(frame(HELLO, struct.pack("<H", 1))), record(frame(GET, b"n")), options=0x40),
    # a payload over the channel's 64 KiB buffer takes the big-frame path
    "big_frame": script(*[record(chunk) for chunk in _chunks(frame(ITEM, bytes(70_000)))]),
    "small_limit": script(record(frame(GET, b"y" * 100)), options=0x20),
    "deadline": script(record(frame(PING, b"p")), options=0x10),
}


def main() -> None:
    out = Path(__file__).resolve().parent / "corpus"
    out.mkdir(exist_ok=True)
    for name, data in SEEDS.items():
        (out / f"seed-{name}").write_bytes(data)


if __name__ == "__main__":
    main()
