"""Content checks (docs/wire-format.md, "Content checks"): a hostile producer must not make a consumer
read out of bounds through the values of one buffer that index another.

Messages are crafted with ``wire_craft`` over a memfd whose bytes the test writes, so every hostile
value is exactly the one named in the test.
"""

from __future__ import annotations

import gc
import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import wire_craft as wc
from helpers.arrow_equality import assert_arrays_equal
from helpers.arrow_values import arrow_arrays
from hypothesis import given

import arrow_ipc_bridge as aib
from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.consumer.content_check import CHECK_LEVELS, check_content
from arrow_ipc_bridge.errors import BridgeError, InvalidArgumentError, ProtocolError
from arrow_ipc_bridge.producer.exporter import Exported
from arrow_ipc_bridge.wire.metadata import Decoded

TESTS = Path(__file__).parent


def _live() -> tuple[int, int, int]:
    gc.collect()
    return int(lib.aib_live_owners()), int(lib.aib_live_nodes()), int(lib.aib_live_mappings())


@pytest.fixture
def session() -> Iterator[aib.Session]:
    with aib.Session(mapping_cache_size=0) as s:
        yield s


def _import(
    session: aib.Session, schema: wc.Node, nodes: list[wc.ArrayNode], heap: wc.Heap
) -> pa.RecordBatch | pa.Array:
    fd, region = wc.memfd_region(bytes(heap.data), size=max(len(heap.data), 64))
    try:
        message = wc.message(schema, [nodes], [region])
        with session.import_message(message, [fd]) as imported:
            return pa.record_batch(imported) if schema.format == "+s" else pa.array(imported)
    finally:
        os.close(fd)


def _rejects(
    session: aib.Session, schema: wc.Node, nodes: list[wc.ArrayNode], heap: wc.Heap
) -> ProtocolError:
    before = _live()
    with pytest.raises(ProtocolError) as info:
        _import(session, schema, nodes, heap)
    assert _live() == before  # owners, struct nodes, mappings all released
    return info.value


def _string_column(heap: wc.Heap, offsets: list[int], data: bytes, fmt: str = "u") -> wc.ArrayNode:
    width = "i" if fmt in "uz" else "q"
    return wc.ArrayNode(len(offsets) - 1, 0, 0, [wc.NULL_BUFFER, heap.ints(offsets, width), heap.put(data)])


# ---------- the reported defect: string offsets pointing at another column's data ---------------------
def _hostile_export() -> tuple[bytes, list[int], Exported]:
    """A real message of {x: int64, s: string} exported from host memory, then rewritten (with
    wire_craft, from the decoded buffer references) so that s's offsets buffer is x's data, whose
    values reach 2^62."""
    # read as int32 offsets, x's bytes are 0, 0, 0, 0, 2^30, ...: non-decreasing, the last 1 GiB
    batch = pa.record_batch(
        {
            "x": pa.array([0, 0, 1 << 30, 1 << 62], pa.int64()),
            "s": pa.array([b"a", b"bb", b"c", b"d"], pa.binary()),
        }
    )
    exported = aib.export(batch)
    decoded = Decoded(exported.message, len(exported.fds))
    refs = decoded.buffer_refs()  # root validity, x validity, x data, s validity, s offsets, s data
    region = decoded.regions()[0]
    decoded.close()
    x_data, s_data = refs[2], refs[5]
    schema = wc.Node("+s", "", children=[wc.Node("l", "x"), wc.Node("z", "s")])
    nodes = [
        wc.ArrayNode(4, 0, 0, [wc.NULL_BUFFER]),
        wc.ArrayNode(4, 0, 0, [wc.NULL_BUFFER, x_data]),
        wc.ArrayNode(4, 0, 0, [wc.NULL_BUFFER, (x_data[0], x_data[1], 40), s_data]),
    ]
    # x's data is 32 bytes; the 5 offsets need 20: lengthen the reference within the region
    assert x_data[1] + 40 <= region.size
    crafted = wc.message(
        schema,
        [nodes],
        [wc.Region(size=region.size, file_offset=region.file_offset, flags=region.flags)],
    )
    return crafted, list(exported.fds), exported


def test_hostile_offsets_are_rejected_by_default() -> None:
    crafted, fds, exported = _hostile_export()
    try:
        before = _live()
        with aib.Session(mapping_cache_size=0) as session, pytest.raises(ProtocolError) as info:
            session.import_message(crafted, fds)
        assert _live() == before
        error = info.value
        assert error.path == "batch0/root/child1"
        assert error.field == "buffers[1]"
        assert str(1 << 30) in str(error)
        with aib.Session(check="bounds") as session, pytest.raises(ProtocolError):
            session.import_message(crafted, fds)
    finally:
        exported.close()


def test_hostile_offsets_crash_a_reader_without_the_check() -> None:
    """What the default prevents: with check="none" the import is accepted, pyarrow's
    validate(full=True) passes, and reading the strings dies (a subprocess, so pytest survives)."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import pyarrow as pa, arrow_ipc_bridge as aib
        from test_content_checks import _hostile_export
        crafted, fds, exported = _hostile_export()
        session = aib.Session(check="none")
        imported = session.import_message(crafted, fds)
        batch = pa.record_batch(imported)
        batch.validate(full=True)
        print("validated", flush=True)
        print(len(batch.column(1).to_pylist()))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert "validated" in result.stdout
    assert result.returncode != 0  # SIGBUS/SIGSEGV past the 192-byte region


# ---------- every kind that indexes another buffer -----------------------------------------------------
def test_string_offsets_decreasing() -> None:
    heap = wc.Heap()
    node = _string_column(heap, [0, 3, 1, 4], b"abcd")
    with aib.Session() as session:
        error = _rejects(session, wc.Node("u"), [node], heap)
        assert "offset 1 at index 2" in str(error)
        assert error.field == "buffers[1]"
    # "bounds" reads the first and last only: accepted, and pyarrow's own full validation (now
    # safe: every offset is inside [first, last] of a buffer that holds last) catches the rest.
    with aib.Session(check="bounds") as session:
        array = _import(session, wc.Node("u"), [node], heap)
        with pytest.raises(pa.ArrowInvalid):
            array.validate(full=True)


@pytest.mark.parametrize("fmt", ["u", "z", "U", "Z"])
@pytest.mark.parametrize("level", ["full", "bounds"])
def test_binary_offsets_past_the_data(fmt: str, level: str) -> None:
    heap = wc.Heap()
    node = _string_column(heap, [0, 1, 2, 5], b"abcd", fmt)
    with aib.Session(check=level) as session:
        error = _rejects(session, wc.Node(fmt), [node], heap)
    assert "5" in str(error)
    assert "4" in str(error)


def test_binary_negative_first_offset_and_sliced_offsets() -> None:
    heap = wc.Heap()
    with aib.Session() as session:
        _rejects(session, wc.Node("u"), [_string_column(heap, [-1, 1, 2], b"ab")], heap)
        # a slice reads offsets from its offset on: the bad offset before it does not matter
        heap = wc.Heap()
        node = wc.ArrayNode(2, 0, 1, [wc.NULL_BUFFER, heap.ints([99, 0, 1, 2], "i"), heap.put(b"ab")])
        assert _import(session, wc.Node("u"), [node], heap).to_pylist() == ["a", "b"]


@pytest.mark.parametrize("fmt", ["u", "Z", "+l"])
def test_empty_slice_needs_its_offset_in_the_offsets_buffer(fmt: str) -> None:
    """An empty array at offset 49 is still read at offsets[49] (pyarrow's validation does): its
    offsets buffer must reach that far. Found by the mutation fuzz over the libFuzzer corpus."""
    width = 8 if fmt in "UZ" else 4
    children = [wc.Node("i", "item")] if fmt == "+l" else []
    child_nodes = [wc.ArrayNode(0, 0, 0, [wc.NULL_BUFFER, wc.NULL_BUFFER])] if fmt == "+l" else []
    data = [] if fmt == "+l" else [(2, 0, 0)]
    short = wc.ArrayNode(0, 0, 49, [wc.NULL_BUFFER, (2, 0, 8), *data])
    with pytest.raises(ProtocolError, match=f"need {50 * width}"):
        Decoded(wc.message(wc.Node(fmt, children=children), [[short, *child_nodes]]), 1)
    sliced = pa.array(["a", "bb"] * 50, pa.large_binary() if fmt == "Z" else None)
    if fmt == "+l":
        sliced = pa.array([[1]] * 100, pa.list_(pa.int32()))
    exported = aib.export(sliced.slice(49, 0))
    try:
        with aib.Session() as session, session.import_message(exported.message, exported.fds) as imported:
            got = pa.array(imported)
            got.validate(full=True)
            assert len(got) == 0
    finally:
        exported.close()


@pytest.mark.parametrize("fmt", ["u", "z", "U", "Z", "+l", "+L", "+m"])
def test_an_empty_array_with_null_offsets_gets_zero_offsets(fmt: str) -> None:
    """A producer may leave an empty array's offsets (or views) NULL: they need no bytes, so decode
    admits it. pyarrow refuses a NULL offsets buffer and polars panics on one (a PanicException,
    which ``except Exception`` does not catch): the rebuilt array points them at zeros instead, as
    it does for empty buffers. The validity bitmap stays NULL (no bitmap: no nulls)."""
    children: list[wc.Node] = []
    child_nodes: list[wc.ArrayNode] = []
    if fmt in ("+l", "+L"):
        children = [wc.Node("i", "item")]
        child_nodes = [wc.ArrayNode(0, 0, 0, [wc.NULL_BUFFER, wc.NULL_BUFFER])]
    elif fmt == "+m":
        key, value = wc.Node("i", "key", flags=0), wc.Node("i", "value")
        children = [wc.Node("+s", "entries", flags=0, children=[key, value])]
        child_nodes = [
            wc.ArrayNode(0, 0, 0, [wc.NULL_BUFFER]),
            wc.ArrayNode(0, 0, 0, [wc.NULL_BUFFER, wc.NULL_BUFFER]),
            wc.ArrayNode(0, 0, 0, [wc.NULL_BUFFER, wc.NULL_BUFFER]),
        ]
    n_buffers = 3 if fmt in ("u", "z", "U", "Z") else 2
    node = wc.ArrayNode(0, 0, 0, [wc.NULL_BUFFER] * n_buffers)
    fd, region = wc.memfd_region(b"", size=64)
    message = wc.message(wc.Node(fmt, children=children), [[node, *child_nodes]], [region])
    try:
        with aib.Session(check="full") as session, session.import_message(message, [fd]) as imported:
            got = pa.array(imported)
            got.validate(full=True)
            assert len(got) == 0
            assert got.buffers()[0] is None
            pl = pytest.importorskip("polars")
            assert len(pl.Series(imported)) == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("fmt", ["+l", "+L", "+m"])
def test_list_offsets_past_the_child(fmt: str) -> None:
    heap = wc.Heap()
    width = "q" if fmt == "+L" else "i"
    child_format = "+s" if fmt == "+m" else "i"
    child = wc.Node(child_format, "item")
    values = heap.ints([1, 2, 3], "i")
    if fmt == "+m":
        child = wc.Node(
            "+s", "entries", flags=0, children=[wc.Node("i", "key", flags=0), wc.Node("i", "value")]
        )
        child_nodes = [
            wc.ArrayNode(3, 0, 0, [wc.NULL_BUFFER]),
            wc.ArrayNode(3, 0, 0, [wc.NULL_BUFFER, values]),
            wc.ArrayNode(3, 0, 0, [wc.NULL_BUFFER, values]),
        ]
    else:
        child_nodes = [wc.ArrayNode(3, 0, 0, [wc.NULL_BUFFER, values])]
    node = wc.ArrayNode(2, 0, 0, [wc.NULL_BUFFER, heap.ints([0, 2, 4], width)])
    with aib.Session() as session:
        error = _rejects(session, wc.Node(fmt, children=[child]), [node, *child_nodes], heap)
    assert "the child" in str(error)


def _view(length: int, index: int = 0, offset: int = 0, inline: bytes = b"") -> bytes:
    if length <= 12:
        return struct.pack("<i", length) + inline.ljust(12, b"\0")
    return struct.pack("<i4sii", length, b"prfx", index, offset)


@pytest.mark.parametrize(
    ("views", "sizes", "needle"),
    [
        ([_view(20, 1, 0)], [32], "names data buffer 1 of 1"),
        ([_view(20, 0, 20)], [32], "reads bytes [20, +20)"),
        ([_view(-1)], [32], "negative length"),
        ([_view(20, 0, 0)], [64], "declares 64 bytes but holds 32"),
    ],
)
def test_string_views(views: list[bytes], sizes: list[int], needle: str) -> None:
    heap = wc.Heap()
    node = wc.ArrayNode(
        len(views),
        0,
        0,
        [wc.NULL_BUFFER, heap.put(b"".join(views)), heap.put(b"x" * 32), heap.ints(sizes, "q")],
    )
    with aib.Session() as session:
        error = _rejects(session, wc.Node("vu"), [node], heap)
    assert needle in str(error)


def test_valid_string_views_are_accepted() -> None:
    heap = wc.Heap()
    views = [_view(3, inline=b"abc"), _view(20, 0, 4)]
    node = wc.ArrayNode(
        2, 0, 0, [wc.NULL_BUFFER, heap.put(b"".join(views)), heap.put(b"x" * 32), heap.ints([32], "q")]
    )
    with aib.Session() as session:
        assert _import(session, wc.Node("vu"), [node], heap).to_pylist() == ["abc", "x" * 20]


@pytest.mark.parametrize("fmt", ["+vl", "+vL"])
def test_list_views(fmt: str) -> None:
    width = "i" if fmt == "+vl" else "q"
    heap = wc.Heap()
    child = wc.ArrayNode(3, 0, 0, [wc.NULL_BUFFER, heap.ints([1, 2, 3], "i")])
    node = wc.ArrayNode(2, 0, 0, [wc.NULL_BUFFER, heap.ints([0, 2], width), heap.ints([2, 2], width)])
    schema = wc.Node(fmt, children=[wc.Node("i", "item")])
    with aib.Session() as session:
        error = _rejects(session, schema, [node, child], heap)
        assert "list view 1 covers [2, +2)" in str(error)
    # no O(1) form: pyarrow's full validation is safe, and catches it
    with aib.Session(check="bounds") as session, pytest.raises(pa.ArrowInvalid):
        _import(session, schema, [node, child], heap).validate(full=True)


def _dictionary_message(heap: wc.Heap, indices: list[int], validity: bytes | None, fmt: str = "c") -> tuple:
    schema = wc.Node(fmt, "d", dictionary=wc.Node("u", ""))
    nulls = (
        0
        if validity is None
        else sum(1 for i in range(len(indices)) if not (validity[i // 8] >> (i % 8)) & 1)
    )
    bitmap = wc.NULL_BUFFER if validity is None else heap.put(validity)
    pack = {"c": "b", "C": "B", "i": "i", "I": "I", "l": "q", "L": "Q", "s": "h", "S": "H"}[fmt]
    node = wc.ArrayNode(len(indices), nulls, 0, [bitmap, heap.ints(indices, pack)])
    dictionary = _string_column(heap, [0, 1, 2], b"ab")
    return schema, [node, dictionary]


@pytest.mark.parametrize(
    ("fmt", "bad"), [("c", 2), ("c", -1), ("C", 255), ("l", 1 << 40), ("L", 2**64 - 1), ("S", 7)]
)
def test_dictionary_indices(fmt: str, bad: int) -> None:
    heap = wc.Heap()
    schema, nodes = _dictionary_message(heap, [0, 1, bad], None, fmt)
    with aib.Session() as session:
        error = _rejects(session, schema, nodes, heap)
    assert "dictionary index" in str(error)
    assert "index 2" in str(error)


def test_dictionary_null_slots_may_hold_sentinels() -> None:
    """pandas categoricals keep -1 under a null: a null slot's index is never looked up."""
    heap = wc.Heap()
    schema, nodes = _dictionary_message(heap, [0, -1, 1], bytes([0b101]))
    with aib.Session() as session:
        assert _import(session, schema, nodes, heap).to_pylist() == ["a", None, "b"]


def test_unions() -> None:
    heap = wc.Heap()
    children = [wc.Node("i", "a"), wc.Node("u", "b")]
    ints = wc.ArrayNode(3, 0, 0, [wc.NULL_BUFFER, heap.ints([1, 2, 3], "i")])
    strings = _string_column(heap, [0, 1, 2, 3], b"xyz")
    with aib.Session() as session:
        sparse = wc.ArrayNode(3, 0, 0, [heap.ints([0, 1, 9], "b")])
        error = _rejects(session, wc.Node("+us:0,1", children=children), [sparse, ints, strings], heap)
        assert "type id 9 at index 2" in str(error)
        assert error.field == "buffers[0]"
        dense = wc.ArrayNode(3, 0, 0, [heap.ints([0, 1, 1], "b"), heap.ints([0, 0, 3], "i")])
        error = _rejects(session, wc.Node("+ud:0,1", children=children), [dense, ints, strings], heap)
        assert "offset 3 at index 2 is outside child 1" in str(error)
        assert error.field == "buffers[1]"
        good = wc.ArrayNode(3, 0, 0, [heap.ints([0, 1, 1], "b"), heap.ints([2, 0, 2], "i")])
        assert _import(
            session, wc.Node("+ud:0,1", children=children), [good, ints, strings], heap
        ).to_pylist() == [
            3,
            "x",
            "z",
        ]


@pytest.mark.parametrize(
    ("ends", "level", "needle"),
    [
        ([2, 3], "full", "does not cover the parent's 4"),
        ([2, 3], "bounds", "does not cover the parent's 4"),
        ([3, 2, 4], "full", "not above the previous 3"),
        ([0, 4], "full", "run end 0 at index 0"),
    ],
)
def test_run_ends(ends: list[int], level: str, needle: str) -> None:
    heap = wc.Heap()
    schema = wc.Node("+r", children=[wc.Node("i", "run_ends", flags=0), wc.Node("l", "values")])
    nodes = [
        wc.ArrayNode(4, 0, 0, []),
        wc.ArrayNode(len(ends), 0, 0, [wc.NULL_BUFFER, heap.ints(ends, "i")]),
        wc.ArrayNode(len(ends), 0, 0, [wc.NULL_BUFFER, heap.ints(list(range(len(ends))), "q")]),
    ]
    with aib.Session(check=level) as session:
        error = _rejects(session, schema, nodes, heap)
    assert needle in str(error)
    assert error.path == "batch0/root/child0"


def test_real_data_of_every_checked_kind_passes_the_full_check() -> None:
    """What pyarrow itself produces, sliced and with nulls, imports under the default check."""
    strings = pa.array(["a", None, "ccc", "dd"] * 50)
    columns = {
        "s": strings.slice(3, 30),
        "ls": pa.array(["x" * 20, None, "y"] * 10, pa.large_string()),
        "v": pa.array(["short", None, "a much longer string view"] * 10, pa.string_view()),
        "l": pa.array([[1, 2], None, [], [3]] * 10, pa.list_(pa.int32())).slice(1, 30),
        "d": pa.array(["a", None, "b"] * 10).dictionary_encode(),
        "r": pa.RunEndEncodedArray.from_arrays(pa.array([10, 20, 30], pa.int32()), pa.array([1, 2, 3])),
        "u": pa.UnionArray.from_dense(
            pa.array([0, 1, 0] * 10, pa.int8()),
            pa.array([i % 10 for i in range(30)], pa.int32()),
            [pa.array(range(20)), pa.array([str(i) for i in range(20)])],
        ),
    }
    batch = pa.record_batch(columns)
    exported = aib.export(batch)
    try:
        with aib.Session() as session, session.import_message(exported.message, exported.fds) as imported:
            assert pa.record_batch(imported).equals(batch)
    finally:
        exported.close()


@given(arrow_arrays())
def test_any_array_passes_every_level(array: pa.Array) -> None:
    """No false positives: every Arrow type the strategies make (nulls, slices, nesting,
    dictionaries, unions, views, run ends) is accepted at every level and arrives equal."""
    exported = aib.export(array)
    try:
        for level in CHECK_LEVELS:
            with (
                aib.Session(check=level) as session,
                session.import_message(exported.message, exported.fds) as got,
            ):
                assert_arrays_equal(pa.array(got), array)
    finally:
        exported.close()


# ---------- the option ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["Full", "", None, 2, "structure"])
def test_check_argument_is_validated(bad: object) -> None:
    if bad is None:
        aib.Session(check=None).close()  # the per-device default
        return
    error = ValueError if isinstance(bad, str) else TypeError  # a level is a str
    with pytest.raises(error, match="'full', 'bounds', 'none'"):
        aib.Session(check=bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="'full', 'bounds', 'none'"):
        aib.connect("/nonexistent/socket", check=bad)  # type: ignore[arg-type]
    assert CHECK_LEVELS == ("full", "bounds", "none")


# ---------- device reads go through a read function: the same logic over a stand-in --------------------
def _decoded_over_heap(
    heap: wc.Heap, schema: wc.Node, nodes: list[wc.ArrayNode]
) -> tuple[Decoded, object, bytes]:
    backing = bytes(heap.data) + b"\0" * 64
    message = wc.message(schema, [nodes], [wc.Region(size=len(backing))])
    return Decoded(message, 1), backing, message


@pytest.mark.parametrize("level", ["full", "bounds"])
def test_read_function_stand_in_gives_the_host_answers(level: str) -> None:
    heap = wc.Heap()
    node = _string_column(heap, [0, 1, 2, 5], b"abcd")
    decoded, backing, _ = _decoded_over_heap(heap, wc.Node("u"), [node])
    pinned = ffi.from_buffer(backing)
    base = int(ffi.cast("uintptr_t", pinned))
    bases = ffi.new("uint64_t[]", [base])
    reads: list[tuple[int, int]] = []

    def read(address: int, n: int) -> bytes:
        reads.append((address - base, n))
        return bytes(ffi.buffer(ffi.cast("char *", address), n))

    try:
        with pytest.raises(ProtocolError) as direct:
            check_content(decoded, bases, level)
        with pytest.raises(ProtocolError) as through_read:
            check_content(decoded, bases, level, read)
        assert str(direct.value) == str(through_read.value)
        # bounds reads two offsets of 4 bytes; full the 4 offsets at once
        assert [n for _, n in reads] == ([4, 4] if level == "bounds" else [16])

        def broken(address: int, n: int) -> bytes:
            raise OSError("the device went away")

        with pytest.raises(OSError, match="went away"):
            check_content(decoded, bases, level, broken)
        check_content(decoded, bases, "none", broken)  # reads nothing
    finally:
        decoded.close()


# ---------- defect 6: descriptor arguments --------------------------------------------------------------
@pytest.mark.parametrize(
    ("fds", "error"),
    [
        ([2**31], InvalidArgumentError),
        ([-1], InvalidArgumentError),
        (["3"], TypeError),
        ([1.0], TypeError),
        ([True], TypeError),
    ],
)
def test_bad_descriptor_arguments(fds: list[object], error: type[Exception]) -> None:
    exported = aib.export(pa.record_batch({"x": [1, 2]}))
    try:
        with aib.Session() as session, pytest.raises(error) as info:
            session.import_message(exported.message, fds)  # type: ignore[arg-type]
        assert isinstance(info.value, BridgeError) or error is TypeError
    finally:
        exported.close()


# ---------- the fuzzer's regression corpus --------------------------------------------------------------
def test_fuzz_corpus_replays_through_the_python_import() -> None:
    """Every input the libFuzzer harness kept (fuzz/decoder/corpus) imported through the session:
    accepted or a ProtocolError, and when accepted the oracle walk finds every index in bounds."""
    result = subprocess.run(
        [
            sys.executable,
            str(TESTS / "helpers" / "fuzz_decoder.py"),
            "--corpus",
            str(TESTS.parent / "fuzz" / "decoder" / "corpus"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "replayed" in result.stdout


@pytest.mark.gpu
def test_cuda_bounds_check_reads_the_device(cuda_device: int) -> None:
    """A device copy of hostile offsets is rejected at "bounds" through device-to-host reads."""
    from helpers.cuda_helpers import write_device

    from arrow_ipc_bridge.consumer.content_check import cuda_reader
    from arrow_ipc_bridge.cuda.pointers import mem_alloc, mem_free

    heap = wc.Heap()
    node = _string_column(heap, [0, 1, 2, 5], b"abcd")
    data = bytes(heap.data)
    pointer = mem_alloc(len(data), cuda_device)
    try:
        write_device(pointer, data, device=cuda_device)
        message = wc.message(wc.Node("u"), [[node]], [wc.Region(size=len(data))])
        decoded = Decoded(message, 1)
        try:
            bases = ffi.new("uint64_t[]", [pointer])
            with pytest.raises(ProtocolError):
                check_content(decoded, bases, "bounds", cuda_reader(cuda_device))
        finally:
            decoded.close()
    finally:
        mem_free(pointer)


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["full", "bounds"])
def test_cuda_imports_are_checked_on_request(cuda_device: int, level: str) -> None:
    """Real device data of every checked kind passes an explicit check through device reads."""
    strings = pa.array(["a", None, "ccc", "a much longer string than twelve"] * 8)
    batch = pa.record_batch(
        {
            "s": strings,
            "v": strings.cast(pa.string_view()),
            "l": pa.array([[1, 2], None, [], [3]] * 8, pa.list_(pa.int32())),
            "d": pa.array(["x", None, "y", "x"] * 8).dictionary_encode(),
        }
    )
    exported = aib.export(aib.to_device(batch))
    try:
        with (
            aib.Session(check=level) as session,
            session.import_message(exported.message, exported.fds) as imported,
        ):
            back = aib.to_host(imported)
            assert isinstance(back, pa.RecordBatch)
            assert back.equals(batch)
    finally:
        exported.close()
