"""Writes seed inputs for the decoder fuzzer (harness.c's input format) from real exports: a 2-byte
message length, the message, then each region's bytes as the producer wrote them.

    .venv/bin/python fuzz/decoder/make_seeds.py DIRECTORY
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow as pa

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.wire.metadata import Decoded


def samples() -> dict[str, pa.RecordBatch]:
    strings = pa.array(["a", None, "ccc", "dd", "a much longer string than twelve"])
    return {
        "strings": pa.record_batch({"s": strings, "x": pa.array([1, 2, 3, 4, 5], pa.int64())}),
        "sliced": pa.record_batch({"s": strings}).slice(1, 3),
        "large": pa.record_batch(
            {"s": strings.cast(pa.large_string()), "b": strings.cast(pa.large_binary())}
        ),
        "views": pa.record_batch({"v": strings.cast(pa.string_view()), "b": strings.cast(pa.binary_view())}),
        "lists": pa.record_batch(
            {
                "l": pa.array([[1, 2], None, [], [3], [4, 5, 6]], pa.list_(pa.int32())),
                "L": pa.array([[1], [2, 3], None, [], [4]], pa.large_list(pa.int16())),
                "w": pa.array([[1, 2], [3, 4], None, [5, 6], [7, 8]], pa.list_(pa.int8(), 2)),
                "m": pa.array(
                    [[(1, "a")], [], None, [(2, "b"), (3, "c")], []], pa.map_(pa.int32(), pa.string())
                ),
            }
        ),
        "list_views": pa.record_batch(
            {
                "lv": pa.array([[1, 2], None, [], [3], [4]], pa.list_view(pa.int32())),
                "LV": pa.array([[1], [2, 3], None, [], [4]], pa.large_list_view(pa.int64())),
            }
        ),
        "dictionary": pa.record_batch(
            {
                "d": pa.array(["x", None, "y", "x", "z"]).dictionary_encode(),
                "e": pa.array([1, 2, 1, 1, 3], pa.int8()).dictionary_encode(),
            }
        ),
        "unions": pa.record_batch(
            {
                "ud": pa.UnionArray.from_dense(
                    pa.array([0, 1, 0, 1, 1], pa.int8()),
                    pa.array([0, 0, 1, 1, 2], pa.int32()),
                    [pa.array([10, 20]), pa.array(["a", "b", "c"])],
                ),
                "us": pa.UnionArray.from_sparse(
                    pa.array([1, 0, 1, 0, 0], pa.int8()),
                    [pa.array([1, 2, 3, 4, 5]), pa.array(["a", "b", "c", "d", "e"])],
                ),
            }
        ),
        "run_ends": pa.record_batch(
            {
                "r": pa.RunEndEncodedArray.from_arrays(
                    pa.array([2, 3, 5], pa.int32()), pa.array(["a", "b", None])
                )
            }
        ),
        "nested": pa.record_batch(
            {
                "n": pa.array(
                    [
                        {"a": [1, 2], "b": "x"},
                        None,
                        {"a": [], "b": None},
                        {"a": None, "b": "yy"},
                        {"a": [3], "b": "z"},
                    ]
                )
            }
        ),
    }


def seed(batch: pa.RecordBatch) -> bytes:
    exported = aib.export(batch)
    try:
        decoded = Decoded(exported.message, len(exported.fds))
        regions = decoded.regions()
        decoded.close()
        out = len(exported.message).to_bytes(2, "little") + exported.message
        for region in regions:
            out += os.pread(exported.fds[region.fd_index], region.size, region.file_offset)
        return out
    finally:
        exported.close()


def main(directory: str) -> int:
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    for name, batch in samples().items():
        (target / f"seed-{name}").write_bytes(seed(batch))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
