"""Layout rules: every Arrow format parses, sizes match pyarrow's own buffers, bad formats fail."""

from __future__ import annotations

import pyarrow as pa
import pytest

from arrow_ipc_bridge.errors import UnsupportedFormatError
from arrow_ipc_bridge.wire.layout import min_buffer_sizes, parse_format

FORMATS = {
    "n": ("null", 0, 0),
    "b": ("bool", 2, 0),
    "c": ("fixed_width", 2, 0),
    "C": ("fixed_width", 2, 0),
    "s": ("fixed_width", 2, 0),
    "S": ("fixed_width", 2, 0),
    "i": ("fixed_width", 2, 0),
    "I": ("fixed_width", 2, 0),
    "l": ("fixed_width", 2, 0),
    "L": ("fixed_width", 2, 0),
    "e": ("fixed_width", 2, 0),
    "f": ("fixed_width", 2, 0),
    "g": ("fixed_width", 2, 0),
    "d:10,2": ("fixed_width", 2, 0),
    "d:9,2,32": ("fixed_width", 2, 0),
    "d:18,3,64": ("fixed_width", 2, 0),
    "d:40,5,256": ("fixed_width", 2, 0),
    "w:7": ("fixed_width", 2, 0),
    "z": ("binary", 3, 0),
    "u": ("binary", 3, 0),
    "Z": ("large_binary", 3, 0),
    "U": ("large_binary", 3, 0),
    "vz": ("binary_view", 3, 0),
    "vu": ("binary_view", 3, 0),
    "tdD": ("fixed_width", 2, 0),
    "tdm": ("fixed_width", 2, 0),
    "tts": ("fixed_width", 2, 0),
    "ttm": ("fixed_width", 2, 0),
    "ttu": ("fixed_width", 2, 0),
    "ttn": ("fixed_width", 2, 0),
    "tss:": ("fixed_width", 2, 0),
    "tsn:Europe/Paris": ("fixed_width", 2, 0),
    "tDs": ("fixed_width", 2, 0),
    "tDn": ("fixed_width", 2, 0),
    "tiM": ("fixed_width", 2, 0),
    "tiD": ("fixed_width", 2, 0),
    "tin": ("fixed_width", 2, 0),
    "+l": ("list", 2, 1),
    "+L": ("large_list", 2, 1),
    "+vl": ("list_view", 3, 1),
    "+vL": ("large_list_view", 3, 1),
    "+w:4": ("fixed_size_list", 1, 1),
    "+s": ("struct", 1, -1),
    "+m": ("map", 2, 1),
    "+ud:0,1": ("dense_union", 2, 2),
    "+us:5,2,9": ("sparse_union", 1, 3),
    "+r": ("run_end_encoded", 0, 2),
}


@pytest.mark.parametrize(("fmt", "expected"), FORMATS.items())
def test_every_format_parses(fmt: str, expected: tuple[str, int, int]) -> None:
    """Each Arrow C data interface format maps to its layout kind, buffer count and child arity."""
    layout = parse_format(fmt)
    assert (layout.kind, layout.n_buffers, layout.n_children) == expected


def test_widths_and_parameters() -> None:
    """Element widths, fixed sizes and union type ids come out of the format string."""
    assert parse_format("d:40,5,256").bit_width == 256
    assert parse_format("d:10,2").bit_width == 128
    assert parse_format("w:7").bit_width == 56
    assert parse_format("w:0").bit_width == 0  # pyarrow's binary(0) exists
    assert parse_format("tin").bit_width == 128
    assert parse_format("tiD").bit_width == 64
    assert parse_format("+w:4").fixed_size == 4
    assert parse_format("+us:5,2,9").type_ids == (5, 2, 9)
    assert parse_format("i").is_integer
    assert not parse_format("f").is_integer


@pytest.mark.parametrize(
    "fmt",
    [
        "",
        "q",
        "d:",
        "d:0,1",
        "d:10",
        "d:10,2,48",
        "w:-3",
        "+w:",
        "+ud:1,1",
        "+ud:200",
        "+ud:1,",
        "ts",
        "tsx:",
        "ti",
        "+x",
        "vx",
        "+vz",
        "w:3x",
        "d:10,2,128x",
    ],
)
def test_bad_formats_are_refused(fmt: str) -> None:
    """Malformed or unknown format strings raise UnsupportedFormatError naming the string."""
    with pytest.raises(UnsupportedFormatError, match="format"):
        parse_format(fmt)


def test_view_buffer_counts() -> None:
    """Views take any number of variadic buffers; their sizes buffer holds 8 bytes per variadic buffer."""
    assert min_buffer_sizes("vu", length=4, n_buffers=3) == [1, 64, 0]
    assert min_buffer_sizes("vu", length=4, offset=4, n_buffers=5) == [1, 128, 0, 0, 16]
    with pytest.raises(UnsupportedFormatError):
        min_buffer_sizes("vu", length=1, n_buffers=2)


@pytest.mark.parametrize(
    ("array", "fmt"),
    [
        (pa.array([1, None, 3], pa.int8()), "c"),
        (pa.array([1, None, 3, 4, 5, 6, 7, 8, 9], pa.int64()), "l"),
        (pa.array([1.0, None], pa.float16()), "e"),
        (pa.array([True, None, False] * 5), "b"),
        (pa.array([1, None], pa.decimal128(10, 2)), "d:10,2"),
        (pa.array([1, None], pa.decimal256(40, 2)), "d:40,2,256"),
        (pa.array([b"abc", None], pa.binary(3)), "w:3"),
        (pa.array([1, None], pa.date32()), "tdD"),
        (pa.array([1, None], pa.timestamp("ns", "UTC")), "tsn:UTC"),
        (pa.array([1, None], pa.duration("s")), "tDs"),
        (pa.array([(1, 2, 3), None], pa.month_day_nano_interval()), "tin"),
        (pa.array(["a", None, "ccc"]), "u"),
        (pa.array(["a", None, "ccc"], pa.large_string()), "U"),
        (pa.array([[1], None, [2, 3]]), "+l"),
        (pa.array([[1], None, [2, 3]], pa.large_list(pa.int64())), "+L"),
        (pa.array([[1, 2], None], pa.list_(pa.int64(), 2)), "+w:2"),
    ],
)
def test_sizes_match_pyarrow_buffers(array: pa.Array, fmt: str) -> None:
    """For unsliced arrays, the fixed-size rules equal the sizes pyarrow allocated (data-dependent
    sizes are 0 in the rules and come from the offsets)."""
    buffers = array.buffers()[: parse_format(fmt).n_buffers]
    sizes = min_buffer_sizes(fmt, length=len(array))
    for i, (size, buf) in enumerate(zip(sizes, buffers, strict=True)):
        if buf is None:
            continue
        if size == 0:  # data-dependent: the string data
            continue
        assert size == buf.size, f"buffer {i}: rule {size} != pyarrow {buf.size}"


def test_sliced_sizes_cover_the_offset() -> None:
    """With an offset, buffers must reach element offset + length (the C interface starts at the
    buffer base, not at the offset)."""
    assert min_buffer_sizes("i", length=2, offset=3) == [1, 20]
    assert min_buffer_sizes("u", length=2, offset=3) == [1, 24, 0]
    assert min_buffer_sizes("u", length=0, offset=3) == [1, 16, 0]  # offsets[3] is still read
    assert min_buffer_sizes("+ud:0", length=2, offset=1) == [3, 12]
