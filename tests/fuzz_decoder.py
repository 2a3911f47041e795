"""Mutation fuzzer for the message decoder, run in a subprocess so a crash fails the calling test.

    python tests/fuzz_decoder.py ITERATIONS SEED

Seeds are the golden messages plus crafted ones; each iteration truncates, flips bits, splices,
overwrites with random bytes or inserts huge varints. The only exception allowed out of the decoder
is WireFormatError. Messages that still decode are rebuilt over a zeroed buffer (never read) and
released, so the rebuild path sees the same inputs.
"""

from __future__ import annotations

import random
import sys
import traceback
from pathlib import Path

from arrow_ipc_bridge._ffi import ffi
from arrow_ipc_bridge.errors import WireFormatError
from arrow_ipc_bridge.metadata import Decoded

GOLDEN = Path(__file__).parent / "golden"
_BACKING = bytearray(1 << 16)
_BASE = int(ffi.cast("uintptr_t", ffi.from_buffer(_BACKING)))


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(6)
        if choice == 0 and buf:
            del buf[rng.randrange(len(buf)) :]
        elif choice == 1 and buf:
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif choice == 2 and buf:
            i = rng.randrange(len(buf))
            buf[i] = rng.randrange(256)
        elif choice == 3:
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = bytes([0xFF] * rng.randint(1, 10) + [0x01])
        elif choice == 4:
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = rng.randbytes(rng.randint(1, 16))
        elif buf:
            i, j = sorted(rng.randrange(len(buf)) for _ in range(2))
            buf[i:j] = buf[i:j][::-1]
    if len(buf) >= 16 and rng.random() < 0.7:
        # keep the header's body length consistent so mutations reach the body
        buf[8:12] = (len(buf) - 16).to_bytes(4, "little")
    return bytes(buf)


def exercise(message: bytes) -> None:
    try:
        decoded = Decoded(message, n_fds=1)
    except WireFormatError:
        return
    regions = decoded.regions()
    if all(r.size <= len(_BACKING) for r in regions):
        bases = ffi.new("uint64_t[]", [_BASE] * max(len(regions), 1))
        for batch in range(decoded.batch_count):
            out = ffi.new("struct ArrowArray *")
            decoded.rebuild_array(batch, bases, out)
            out.release(out)
        schema = ffi.new("struct ArrowSchema *")
        decoded.rebuild_schema(schema)
        schema.release(schema)
    decoded.close()


def main(iterations: int, seed: int) -> int:
    rng = random.Random(seed)
    seeds = [p.read_bytes() for p in sorted(GOLDEN.glob("*.bin"))]
    for i in range(iterations):
        message = mutate(rng, rng.choice(seeds))
        try:
            exercise(message)
        except Exception:
            print(f"iteration {i}: unexpected exception for message {message.hex()}", file=sys.stderr)
            traceback.print_exc()
            return 1
        if rng.random() < 0.01:
            exercise(rng.randbytes(rng.randint(0, 200)))
    print(f"fuzzed {iterations} messages, seed {seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
