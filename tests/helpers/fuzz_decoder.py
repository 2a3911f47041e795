"""Mutation fuzzer for the message decoder and the content checks, run in a subprocess so a crash
fails the calling test.

    python tests/helpers/fuzz_decoder.py ITERATIONS SEED
    python tests/helpers/fuzz_decoder.py --corpus DIRECTORY

Seeds are the golden messages and the libFuzzer corpus (``fuzz/decoder/corpus``: a 2-byte message
length, the message, then its regions' bytes); each iteration truncates, flips bits, splices,
overwrites with random bytes or inserts huge varints, and fills the regions with zeros, small
numbers or random bytes. The only exception allowed out of the decoder and the content check is
ProtocolError. The oracle: every message that passes the full content check is imported into
pyarrow and read in full (validation, then every value), over regions that end at a guard page, so a
read past a region's end kills this process.

``--corpus`` replays each corpus input through ``Session.import_message`` instead (memfds holding
the region bytes): the path a consumer takes, with the same oracle.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import random
import sys
import traceback
from pathlib import Path
from typing import Any

import pyarrow as pa

from arrow_ipc_bridge import Session
from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.consumer.content_check import check_content
from arrow_ipc_bridge.errors import BridgeError, ProtocolError
from arrow_ipc_bridge.wire.metadata import Decoded

GOLDEN = Path(__file__).parent.parent / "golden"
CORPUS = Path(__file__).parent.parent.parent / "fuzz" / "decoder" / "corpus"
_BACKING_BYTES = 1 << 16
_PAGE = mmap.PAGESIZE
MAX_FDS = int(lib.AIB_MAX_FDS)


class GuardedBacking:
    """``_BACKING_BYTES`` of memory followed by an inaccessible page: a region placed to end at the
    guard makes any read past its end a segmentation fault."""

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, _BACKING_BYTES + _PAGE)
        self._view = (ctypes.c_char * (_BACKING_BYTES + _PAGE)).from_buffer(self._map)
        self.start = ctypes.addressof(self._view)
        self.guard = self.start + _BACKING_BYTES
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mprotect(ctypes.c_void_p(self.guard), ctypes.c_size_t(_PAGE), 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect of the guard page failed")

    def place(self, sizes: list[int], contents: bytes) -> list[int]:
        """Region bases, each region ending at the guard page and holding the next bytes of
        ``contents`` (zero-padded). Regions overlap here; the larger ones are written first, so
        each small region holds its own bytes."""
        ctypes.memset(self.start, 0, _BACKING_BYTES)
        pieces = []
        for size in sizes:
            pieces.append(contents[:size].ljust(size, b"\0"))
            contents = contents[size:]
        for size, piece in sorted(zip(sizes, pieces, strict=True), key=lambda item: -item[0]):
            ctypes.memmove(self.guard - size, piece, size)
        return [self.guard - size for size in sizes]


def split_input(data: bytes) -> tuple[bytes, bytes]:
    """A libFuzzer corpus input -> (message, region bytes)."""
    n = int.from_bytes(data[:2], "little")
    return data[2 : 2 + n], data[2 + n :]


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


def region_bytes(rng: random.Random, seed_bytes: bytes) -> bytes:
    """Contents for the regions: the seed's own (mutated), zeros, small numbers or noise."""
    choice = rng.randrange(4)
    if choice == 0:
        return mutate(rng, seed_bytes) if seed_bytes else b""
    if choice == 1:
        return b""
    if choice == 2:
        return bytes(rng.randrange(4) for _ in range(len(seed_bytes) or 256))
    return rng.randbytes(len(seed_bytes) or 256)


def read_everything(obj: Any, is_stream: bool) -> None:
    """The oracle's reader: pyarrow imports the data and reads every value. Python exceptions are
    fine (invalid UTF-8, types pyarrow does not take); only a crash fails."""
    try:
        if is_stream:
            table = pa.RecordBatchReader.from_stream(obj).read_all()
            arrays = [table.column(i) for i in range(table.num_columns)]
        else:
            arrays = [pa.array(obj)]
    except Exception:
        return
    for array in arrays:
        with contextlib.suppress(Exception):
            array.validate(full=True)
        with contextlib.suppress(Exception):
            array.to_pylist()


def _import_structs(decoded: Decoded, bases: Any, batch: int) -> Any:
    schema = ffi.new("struct ArrowSchema *")
    array = ffi.new("struct ArrowArray *")
    decoded.rebuild_schema(schema)
    decoded.rebuild_array(batch, bases, array)
    try:
        return pa.Array._import_from_c(int(ffi.cast("uintptr_t", array)), int(ffi.cast("uintptr_t", schema)))
    except Exception:
        if array.release != ffi.NULL:
            array.release(array)
        if schema.release != ffi.NULL:
            schema.release(schema)
        return None


def exercise(message: bytes, contents: bytes, backing: GuardedBacking) -> str:
    """How far the message got: "refused", "large", "checked out" or "read"."""
    try:
        decoded = Decoded(message, n_fds=MAX_FDS)
    except ProtocolError:
        return "refused"
    try:
        regions = decoded.regions()
        if not all(r.size <= _BACKING_BYTES for r in regions):
            return "large"
        bases = ffi.new("uint64_t[]", backing.place([r.size for r in regions], contents) or [0])
        try:
            check_content(decoded, bases, "bounds")
            bounds_ok = True
        except ProtocolError:
            bounds_ok = False
        try:
            check_content(decoded, bases, "full")
        except ProtocolError:
            return "checked out"
        if not bounds_ok:
            raise AssertionError("the bounds check refused what the full check accepted")
        for batch in range(decoded.batch_count):
            array = _import_structs(decoded, bases, batch)
            if array is not None:
                read_everything(array, is_stream=False)
        return "read"
    finally:
        decoded.close()


def main(iterations: int, seed: int) -> int:
    rng = random.Random(seed)
    seeds = [(p.read_bytes(), b"") for p in sorted(GOLDEN.glob("*.bin"))]
    seeds += [split_input(p.read_bytes()) for p in sorted(CORPUS.glob("*"))]
    backing = GuardedBacking()
    outcomes: dict[str, int] = {}
    for i in range(iterations):
        seed_message, seed_bytes = rng.choice(seeds)
        message = mutate(rng, seed_message) if rng.random() < 0.9 else seed_message
        contents = region_bytes(rng, seed_bytes)
        try:
            outcome = exercise(message, contents, backing)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        except Exception:
            print(f"iteration {i}: unexpected exception for message {message.hex()}", file=sys.stderr)
            traceback.print_exc()
            return 1
        if rng.random() < 0.01:
            exercise(rng.randbytes(rng.randint(0, 200)), b"", backing)
    print(f"fuzzed {iterations} messages, seed {seed}: {outcomes}")
    return 0


def replay(directory: Path) -> int:
    """Every corpus input through Session.import_message (bounded: region bytes up to 1 MiB)."""
    accepted = refused = 0
    with Session(mapping_cache_size=0) as session:
        for path in sorted(directory.glob("*")):
            message, contents = split_input(path.read_bytes())
            fds: list[int] = []
            try:
                try:
                    regions = Decoded(message, MAX_FDS).regions()
                except ProtocolError:
                    regions = []
                if sum(r.size for r in regions) > 1 << 20:
                    continue
                by_index: dict[int, bytes] = {}
                for region in regions:
                    by_index.setdefault(region.fd_index, b"\0" * region.file_offset + contents[: region.size])
                    contents = contents[region.size :]
                for index in range(max(by_index, default=-1) + 1):
                    fd = os.memfd_create("corpus", os.MFD_ALLOW_SEALING)
                    fds.append(fd)
                    data = by_index.get(index, b"")
                    size = max((r.file_offset + r.size for r in regions if r.fd_index == index), default=0)
                    if size:
                        os.write(fd, data.ljust(size, b"\0"))
                    # sealed like the producer's copies, so regions flagged sealed are importable
                    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
                try:
                    imported = session.import_message(message, fds)
                except BridgeError:
                    refused += 1
                    continue
                with imported:
                    read_everything(imported, is_stream=type(imported).__name__ == "ImportedStream")
                accepted += 1
            except Exception:
                print(f"{path.name}: unexpected exception", file=sys.stderr)
                traceback.print_exc()
                return 1
            finally:
                for fd in fds:
                    os.close(fd)
    print(f"replayed {accepted + refused} corpus inputs: {accepted} accepted and read, {refused} refused")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--corpus":
        sys.exit(replay(Path(sys.argv[2])))
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
