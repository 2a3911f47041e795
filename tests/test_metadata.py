"""The metadata tree: round trips, golden messages, hostile messages, fuzzing."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import wire_craft as wc
from helpers.arrow_equality import assert_arrays_equal
from helpers.arrow_values import arrow_arrays, record_batches, tables
from helpers.golden_cases import GOLDEN_CASES, GOLDEN_DIR, placed_message
from hypothesis import given

from arrow_ipc_bridge._ffi import WIRE_VERSION, ffi, lib
from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream, imported_from
from arrow_ipc_bridge.errors import BridgeError, ProtocolError
from arrow_ipc_bridge.wire.capsules import capture
from arrow_ipc_bridge.wire.metadata import Decoded, Described, DeviceInfo, process_region

TESTS = Path(__file__).parent


def place_in_process(described: Described) -> None:
    """Place every buffer in region 0 at its own address: the same-process region (process_region)."""
    lib.aib_described_place_all(described._d, 0, 0)


def roundtrip(obj: object) -> ImportedArray | ImportedStream:
    """describe -> encode -> decode -> rebuild in this process (the same-process fast path)."""
    captured = capture(obj)
    described = Described(captured)
    place_in_process(described)
    message = described.encode(DeviceInfo(captured.device_type), [process_region()])
    decoded = Decoded(message, allow_process_regions=True)
    decoded.depend_on(captured.owner)
    captured.close()
    return imported_from(decoded, [0], device_type=1, device_id=-1)


@given(arrow_arrays())
def test_any_array_round_trips(arr: pa.Array) -> None:
    """Every type, nested, with nulls and offsets: equal after the full message round trip."""
    assert_arrays_equal(pa.array(roundtrip(arr)), arr)


@given(record_batches())
def test_any_batch_round_trips(batch: pa.RecordBatch) -> None:
    """Record batches (schema metadata, field flags) come back equal."""
    assert_arrays_equal(pa.record_batch(roundtrip(batch)), batch)


@given(tables())
def test_any_table_round_trips(table: pa.Table) -> None:
    """Tables of several batches come back equal through one stream message."""
    imported = roundtrip(table)
    assert isinstance(imported, ImportedStream)
    assert_arrays_equal(pa.table(imported), table)


def test_rebuilt_structs_keep_data_alive_and_release_everything() -> None:
    """The producer's buffers live while any rebuilt struct lives; then every owner goes away."""
    gc.collect()
    owners, nodes, allocated = lib.aib_live_owners(), lib.aib_live_nodes(), pa.total_allocated_bytes()
    arr = pa.array(["x", "y", None] * 5000)
    imported = roundtrip(arr)
    del arr
    first = pa.array(imported)
    second = pa.array(imported)  # a second consumer of the same import
    imported.release()
    assert first.to_pylist() == second.to_pylist()
    del first, second, imported
    gc.collect()
    assert (lib.aib_live_owners(), lib.aib_live_nodes()) == (owners, nodes)
    assert pa.total_allocated_bytes() == allocated


def test_message_is_compact() -> None:
    """A 16-column primitive table's message stays far under 2 KiB."""
    assert len((GOLDEN_DIR / "wide_16_float32.bin").read_bytes()) < 2048


# ---------- golden messages ------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_messages_are_stable(name: str) -> None:
    """Encoding the golden data gives the checked-in bytes: a format change is deliberate
    (regenerate with tests/helpers/golden_cases.py, bump the wire version, update docs/wire-format.md)."""
    golden = (GOLDEN_DIR / f"{name}.bin").read_bytes()
    assert golden[4:6] == bytes(WIRE_VERSION), "golden files were written by another wire version"
    assert placed_message(GOLDEN_CASES[name]()) == golden


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_messages_decode(name: str) -> None:
    """Every golden message decodes and validates."""
    decoded = Decoded((GOLDEN_DIR / f"{name}.bin").read_bytes(), n_fds=1)
    assert decoded.batch_count >= 1
    assert decoded.regions()[0].fd_index == 0


# ---------- crafted hostile messages ---------------------------------------------------------------
def _decode(message: bytes, n_fds: int = 1) -> Decoded:
    return Decoded(message, n_fds)


def test_crafted_message_matches_the_spec() -> None:
    """A message written from the spec by the independent Python writer decodes and rebuilds."""
    field, node = wc.int64_column()
    schema = wc.Node("+s", "", children=[field], flags=0)
    msg = wc.message(schema, [[wc.ArrayNode(4, 0, 0, [(0, 0, 0)]), node]])
    decoded = _decode(msg)
    backing = bytearray(b"".join(i.to_bytes(8, "little") for i in range(4)))
    base = int(ffi.cast("uintptr_t", ffi.from_buffer(backing)))
    imported = imported_from(decoded, [base], device_type=1, device_id=-1)
    assert pa.record_batch(imported).column(0).to_pylist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda m: m[:10], "header"),
        (lambda m: b"XXXX" + m[4:], "magic"),
        (lambda m: m[:4] + b"\x02" + m[5:], "version"),
        (lambda m: m[:6] + b"\x07" + m[7:], "kind"),
        (lambda m: m[:12] + b"\x01\x00\x00\x00" + m[16:], "flags"),
        (lambda m: m + b"\x00", "body_length"),
    ],
)
def test_header_corruption(mutate: object, field: str) -> None:
    """Bad magic, unknown major version, unknown kind or flags, wrong lengths: ProtocolError naming
    the field."""
    f, n = wc.int64_column()
    msg = wc.message(f, [[n]])
    with pytest.raises(ProtocolError) as info:
        _decode(mutate(msg))  # type: ignore[operator]
    assert info.value.field == field


def test_newer_minor_version_with_optional_extension_is_accepted() -> None:
    """Same major, newer minor, unknown optional (even tag) extension: still decodes."""
    f, n = wc.int64_column()
    decoded = _decode(wc.message(f, [[n]], minor=7, extensions=[(4, b"future")]))
    assert decoded.minor_version == 7


def test_unknown_required_extension_is_refused() -> None:
    """An odd extension tag means "required": a decoder that does not know it refuses the message."""
    f, n = wc.int64_column()
    with pytest.raises(ProtocolError, match="required extension"):
        _decode(wc.message(f, [[n]], extensions=[(5, b"")]))


def test_buffer_past_region_end_names_the_path() -> None:
    """A buffer reaching past its region fails with the node path and field."""
    field, node = wc.int64_column(length=4, region_offset=(1 << 20) - 8)
    schema = wc.Node("+s", children=[field], flags=0)
    with pytest.raises(ProtocolError, match="outside region") as info:
        _decode(wc.message(schema, [[wc.ArrayNode(4, 0, 0, [(0, 0, 0)]), node]]))
    assert info.value.path == "batch0/root/child0"
    assert info.value.field == "buffers"


def test_offset_overflow_is_caught() -> None:
    """offset + length overflowing 64 bits is refused, not wrapped."""
    field = wc.Node("l")
    node = wc.ArrayNode(1, 0, 0, [(0, 0, 0), (2, 2**64 - 4, 8)])
    with pytest.raises(ProtocolError, match="outside region"):
        _decode(wc.message(field, [[node]], [wc.Region(size=2**64 - 1)]))


def test_buffer_too_small_for_length() -> None:
    """A data buffer smaller than length x width is refused."""
    field = wc.Node("l")
    with pytest.raises(ProtocolError, match="need 32"):
        _decode(wc.message(field, [[wc.ArrayNode(4, 0, 0, [(0, 0, 0), (2, 0, 31)])]]))


def test_missing_region_and_fd_index() -> None:
    """References to regions or fds that do not exist are refused."""
    field = wc.Node("l")
    with pytest.raises(ProtocolError, match="does not exist"):
        _decode(wc.message(field, [[wc.ArrayNode(1, 0, 0, [(0, 0, 0), (9, 0, 8)])]]))
    # One past the last: region code 3 is region 1, and the message has region 0 only.
    with pytest.raises(ProtocolError, match=r"region 1 does not exist \(1 regions\)"):
        _decode(wc.message(field, [[wc.ArrayNode(1, 0, 0, [(0, 0, 0), (3, 0, 8)])]]))
    with pytest.raises(ProtocolError, match="fds arrived"):
        _decode(wc.message(field, [[wc.ArrayNode(1, 0, 0, [(0, 0, 0), (2, 0, 8)])]]), n_fds=0)


def test_null_bitmap_required_when_nulls() -> None:
    """A NULL validity buffer with a positive null count is refused."""
    field = wc.Node("l")
    with pytest.raises(ProtocolError, match="absent"):
        _decode(wc.message(field, [[wc.ArrayNode(2, 1, 0, [(0, 0, 0), (2, 0, 16)])]]))


def test_deep_nesting_is_bounded() -> None:
    """Nesting deeper than the limit fails cleanly (no stack exhaustion)."""
    node = wc.Node("n")
    for _ in range(200):
        node = wc.Node("+l", children=[node])
    with pytest.raises(ProtocolError, match="deeper"):
        _decode(wc.message(node, [[]]))


@pytest.mark.parametrize("count_field", ["n_regions", "n_children", "n_batches"])
def test_huge_counts_do_not_allocate(count_field: str) -> None:
    """Counts far beyond the message size are refused, naming the count, before any allocation."""
    huge = wc.varint(2**62)
    device = wc.varint(1) + wc.blob(b"") + wc.blob(b"")
    regions = wc.varint(1) + wc.Region().encode()
    f, _ = wc.int64_column()
    if count_field == "n_regions":
        body = device + huge
    elif count_field == "n_children":
        # format "+s", empty name, no metadata, flags 0, then the child count
        body = device + regions + wc.blob(b"+s") + wc.varint(1) + wc.varint(0) + wc.varint(0) + huge + b"\x00"
    else:
        body = device + regions + f.encode() + huge
    message = b"AIBM" + bytes([1, 0, 1, 0]) + len(body).to_bytes(4, "little") + bytes(4) + body
    with pytest.raises(ProtocolError) as info:
        _decode(message)
    assert info.value.field == count_field


def test_wrong_child_arity_and_bad_dictionary_index() -> None:
    """A list without a child, or a dictionary with a float index type, is refused."""
    with pytest.raises(ProtocolError, match="children"):
        _decode(wc.message(wc.Node("+l"), [[wc.ArrayNode(0, 0, 0, [(0, 0, 0), (0, 0, 0)])]]))
    with pytest.raises(ProtocolError, match="integer index"):
        _decode(wc.message(wc.Node("f", dictionary=wc.Node("u")), [[]]))


def test_struct_child_shorter_than_parent() -> None:
    """A struct child shorter than parent offset + length is refused."""
    f, _ = wc.int64_column(length=2)
    schema = wc.Node("+s", children=[f], flags=0)
    batch = [wc.ArrayNode(3, 0, 0, [(0, 0, 0)]), wc.ArrayNode(2, 0, 0, [(0, 0, 0), (2, 0, 16)])]
    with pytest.raises(ProtocolError, match="shorter"):
        _decode(wc.message(schema, [batch]))


def test_only_the_validity_bitmap_may_be_absent_without_nulls() -> None:
    """With null_count 0 a validity bitmap may be NULL; a data buffer may not (a consumer's
    column_view would read whatever address NULL + offset is)."""
    field = wc.Node("l", "x")
    assert _decode(wc.message(field, [[wc.ArrayNode(2, 0, 0, [(0, 0, 0), (2, 0, 16)])]])).batch_count == 1
    with pytest.raises(ProtocolError, match="buffer 1 is absent"):
        _decode(wc.message(field, [[wc.ArrayNode(2, 0, 0, [(0, 0, 0), (0, 0, 0)])]]))
    with pytest.raises(ProtocolError, match="buffer 1 is absent"):
        _decode(wc.message(wc.Node("u"), [[wc.ArrayNode(2, 0, 0, [(0, 0, 0), (0, 0, 0), (1, 0, 0)])]]))


@pytest.mark.parametrize("null_count", [3, 1000])
def test_null_count_above_length_is_refused(null_count: int) -> None:
    field = wc.Node("l", "x")
    bitmap_and_data = [(2, 0, 1), (2, 64, 16)]
    assert _decode(wc.message(field, [[wc.ArrayNode(2, 2, 0, bitmap_and_data)]])).batch_count == 1
    with pytest.raises(ProtocolError, match="null count above the length"):
        _decode(wc.message(field, [[wc.ArrayNode(2, null_count, 0, bitmap_and_data)]]))


def test_fixed_size_list_child_shorter_than_parent() -> None:
    """A +w:N parent of offset + length L addresses N * L child values."""
    schema = wc.Node("+w:2", children=[wc.Node("i", "item")])
    parent = wc.ArrayNode(3, 0, 0, [(0, 0, 0)])
    assert (
        _decode(wc.message(schema, [[parent, wc.ArrayNode(6, 0, 0, [(0, 0, 0), (2, 0, 24)])]])).batch_count
        == 1
    )
    with pytest.raises(ProtocolError, match="child length 5 is shorter than the 6"):
        _decode(wc.message(schema, [[parent, wc.ArrayNode(5, 0, 0, [(0, 0, 0), (2, 0, 20)])]]))
    sliced = wc.ArrayNode(2, 0, 1, [(0, 0, 0)])  # offset 1 + length 2: 6 values again
    with pytest.raises(ProtocolError, match="shorter than the 6"):
        _decode(wc.message(schema, [[sliced, wc.ArrayNode(5, 0, 0, [(0, 0, 0), (2, 0, 20)])]]))


def test_sparse_union_child_shorter_than_parent() -> None:
    schema = wc.Node("+us:0,1", children=[wc.Node("i", "a"), wc.Node("i", "b")])
    parent = wc.ArrayNode(3, 0, 0, [(2, 0, 3)])
    full = wc.ArrayNode(3, 0, 0, [(0, 0, 0), (2, 64, 12)])
    short = wc.ArrayNode(2, 0, 0, [(0, 0, 0), (2, 64, 8)])
    assert _decode(wc.message(schema, [[parent, full, full]])).batch_count == 1
    with pytest.raises(ProtocolError, match="child length 2 is shorter than the 3"):
        _decode(wc.message(schema, [[parent, full, short]]))


def test_dense_union_type_ids_are_not_an_optional_bitmap() -> None:
    """A union has no validity bitmap: its buffer 0 (type ids) is required even without nulls."""
    schema = wc.Node("+ud:0", children=[wc.Node("i", "a")])
    child = wc.ArrayNode(1, 0, 0, [(0, 0, 0), (2, 64, 4)])
    assert (
        _decode(wc.message(schema, [[wc.ArrayNode(1, 0, 0, [(2, 0, 1), (2, 8, 4)]), child]])).batch_count == 1
    )
    with pytest.raises(ProtocolError, match="buffer 0 is absent"):
        _decode(wc.message(schema, [[wc.ArrayNode(1, 0, 0, [(0, 0, 0), (2, 8, 4)]), child]]))
    with pytest.raises(ProtocolError, match="buffer 0 is absent"):
        _decode(
            wc.message(
                wc.Node("+us:0", children=[wc.Node("i", "a")]), [[wc.ArrayNode(1, 0, 0, [(0, 0, 0)]), child]]
            )
        )


def test_non_bytes_message() -> None:
    """Anything but bytes-like is refused as a ProtocolError."""
    with pytest.raises(ProtocolError):
        Decoded("text")  # type: ignore[arg-type]


def test_error_pickles() -> None:
    """Errors survive pickling with their details (a consumer may forward them)."""
    with pytest.raises(ProtocolError) as info:
        _decode(b"garbage-garbage-garbage")
    again = pickle.loads(pickle.dumps(info.value))
    assert isinstance(again, ProtocolError)
    assert again.field == info.value.field == "magic"
    assert str(again) == str(info.value)


# ---------- fuzzing in a subprocess (a crash fails the test instead of killing pytest) -------------
def test_decoder_fuzz_in_subprocess() -> None:
    """Thousands of mutated messages (golden and libFuzzer-corpus seeds, mutated region contents):
    only ProtocolError, never a crash or another exception; every message that passes the full
    content check is read in full by pyarrow over regions ending at a guard page."""
    iterations = os.environ.get("AIB_FUZZ_ITERATIONS", "30000")
    result = subprocess.run(
        [sys.executable, str(TESTS / "helpers" / "fuzz_decoder.py"), iterations, "12345"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "fuzzed" in result.stdout


def test_same_process_region_is_refused_unless_allowed() -> None:
    """A same-process region (raw addresses) is refused by default: only the in-process fast path,
    decoding its own message, may allow it."""
    f, n = wc.int64_column()
    msg = wc.message(f, [[n]], [wc.Region(kind=1, size=2**64 - 1, fd_index=-1)])
    with pytest.raises(ProtocolError, match="same-process"):
        Decoded(msg, 0)
    assert Decoded(msg, 0, allow_process_regions=True).batch_count == 1


def test_overlong_varint_and_reserved_byte_are_refused() -> None:
    """One value has one encoding (no over-long varints); the reserved header byte must be 0."""
    f, n = wc.int64_column()
    msg = wc.message(f, [[n]])
    body = b"\x81\x00" + msg[17:]  # device type 1 written in two bytes
    overlong = msg[:8] + len(body).to_bytes(4, "little") + msg[12:16] + body
    with pytest.raises(ProtocolError) as info:
        _decode(overlong)
    assert info.value.field == "device_type"
    with pytest.raises(ProtocolError) as info:
        _decode(msg[:7] + b"\x01" + msg[8:])
    assert info.value.field == "reserved"


def test_encoder_refuses_what_a_decoder_must_refuse() -> None:
    """Names and metadata over the wire limits fail at describe time, not at the peer."""
    too_long = pa.record_batch([pa.array([1])], names=["x" * 70_000])
    with pytest.raises(BridgeError, match="name"):
        Described(capture(too_long))
    meta = pa.schema([pa.field("x", pa.int64(), metadata={"k": "v" * (2 << 20)})])
    with pytest.raises(BridgeError, match="metadata"):
        Described(capture(pa.record_batch([pa.array([1])], schema=meta)))


@ffi.callback("void(struct ArrowArray *)")
def _release_handmade(array: object) -> None:
    array.release = ffi.NULL  # type: ignore[attr-defined]


def test_null_array_with_a_legacy_validity_buffer() -> None:
    """Older producers (pyarrow <= 25) export a null array with one NULL buffer; it is described as
    the specification has it (no buffers) and comes back as a valid null array."""
    from arrow_ipc_bridge.wire.capsules import new_capsule

    schema_capsule = pa.null().__arrow_c_schema__()
    array_capsule, array = new_capsule("array")
    buffers = ffi.new("const void *[1]", [ffi.NULL])
    array.length = 3
    array.null_count = 3
    array.n_buffers = 1
    array.buffers = buffers
    array.release = _release_handmade
    imported = roundtrip((schema_capsule, array_capsule))
    assert pa.array(imported).to_pylist() == [None, None, None]
