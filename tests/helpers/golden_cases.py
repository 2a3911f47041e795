"""Deterministic messages checked into tests/golden/: a change to the wire format shows up as a diff.

``python tests/helpers/golden_cases.py`` rewrites the files. Do that only together with a wire-version bump
and a docs/wire-format.md change (test_metadata checks the version in the files).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from arrow_ipc_bridge.wire.capsules import capture
from arrow_ipc_bridge.wire.metadata import (
    REGION_HOST_FD,
    SLOT_FIRST_REGION,
    SLOT_UNPLACED,
    Described,
    DeviceInfo,
    Region,
)

GOLDEN_DIR = Path(__file__).parent.parent / "golden"


def placed_message(obj: object) -> bytes:
    """Encode ``obj`` with every buffer laid out back to back (64-byte aligned) in one host region:
    the bytes depend only on the data, not on addresses."""
    described = Described(capture(obj))
    slots = described.slots()
    cursor = 0
    for i in range(0, len(slots), 4):
        if slots[i + 2] == SLOT_UNPLACED:
            slots[i + 2] = SLOT_FIRST_REGION
            slots[i + 3] = cursor
            cursor += (slots[i + 1] + 63) // 64 * 64
    region = Region(kind=REGION_HOST_FD, size=max(cursor, 64), fd_index=0)
    return described.encode(DeviceInfo(device_type=1), [region], n_fds=1)


def _primitive() -> pa.RecordBatch:
    return pa.record_batch({"i": pa.array([1, None, 3], pa.int32()), "f": pa.array([0.5, 1.5, None])})


def _nested() -> pa.Array:
    struct = pa.StructArray.from_arrays(
        [pa.array(["a", None, "ccc"]), pa.array([[1, 2], None, []], pa.list_(pa.int16()))],
        fields=[pa.field("s", pa.string()), pa.field("l", pa.list_(pa.int16()), nullable=False)],
    )
    return struct.slice(1)


def _dictionary() -> pa.Array:
    return pa.array(["x", "y", None, "x"]).dictionary_encode()


def _table() -> pa.Table:
    schema = pa.schema([pa.field("v", pa.int64(), metadata={"unit": "m"})], metadata={"origin": "golden"})
    batch = pa.record_batch([pa.array([1, 2, 3])], schema=schema)
    return pa.Table.from_batches([batch, batch.slice(1)])


def _wide() -> pa.RecordBatch:
    return pa.record_batch({f"c{i}": pa.array([float(i)] * 8, pa.float32()) for i in range(16)})


GOLDEN_CASES: dict[str, Callable[[], object]] = {
    "primitive_batch": _primitive,
    "nested_struct_sliced": _nested,
    "dictionary": _dictionary,
    "table_two_batches": _table,
    "wide_16_float32": _wide,
}


def main() -> int:
    GOLDEN_DIR.mkdir(exist_ok=True)
    for name, make in GOLDEN_CASES.items():
        (GOLDEN_DIR / f"{name}.bin").write_bytes(placed_message(make()))
        print("wrote", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
