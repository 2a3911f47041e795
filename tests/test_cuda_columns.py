"""from_cuda_array(s) without a GPU: the checks made before any driver call, and the C builder of
the columns' Arrow structs (exercised over host memory, which it never reads)."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import arrow_ipc_bridge as aib
from arrow_ipc_bridge._ffi import ffi, lib, new_error
from arrow_ipc_bridge.arrays import device
from arrow_ipc_bridge.wire.capsules import DEVICE_CPU, CapturedArray, CapturedData, capture
from arrow_ipc_bridge.wire.metadata import Described, DeviceInfo, process_region

# A column's format code: its type's place in device._NUMERIC_TYPES (py_columns.c's order).
_FORMAT_CODES = {typestr[1:]: code for code, (_, typestr, _) in enumerate(device._NUMERIC_TYPES)}


class _FakeCudaArray:
    """An object announcing ``__cuda_array_interface__`` facts (never dereferenced by the checks)."""

    def __init__(self, **overrides: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (0x1000, False),
            "version": 3,
            "strides": None,
            "stream": None,
            **overrides,
        }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"shape": (2, 2)}, "only 1-D arrays"),
        ({"typestr": ">f4"}, "little-endian numbers only"),
        ({"typestr": "<c8"}, "no zero-copy Arrow equivalent"),
        ({"strides": (8,)}, "not contiguous"),
        ({"mask": object()}, "masked GPU arrays"),
    ],
)
def test_arrays_arrow_cannot_show_are_refused_before_the_driver(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(aib.BridgeError, match=message):
        aib.from_cuda_arrays({"x": _FakeCudaArray(**overrides)})
    with pytest.raises(aib.BridgeError, match=message):
        aib.from_cuda_array(_FakeCudaArray(**overrides))


def test_a_batch_needs_columns_of_one_length_and_at_least_one() -> None:
    with pytest.raises(aib.BridgeError, match="different lengths"):
        aib.from_cuda_arrays({"a": _FakeCudaArray(), "b": _FakeCudaArray(shape=(5,))})
    with pytest.raises(aib.BridgeError, match="at least one column"):
        aib.from_cuda_arrays({})


def test_objects_without_an_array_interface_are_refused() -> None:
    with pytest.raises(aib.BridgeError, match="neither __cuda_array_interface__ nor __dlpack__"):
        aib.from_cuda_arrays({"a": [1.0, 2.0]})


def _columns(arrays: list[np.ndarray]) -> Any:
    columns = ffi.new("aib_cuda_column[]", len(arrays))
    for column, a in zip(columns, arrays, strict=True):
        column.data = a.ctypes.data
        column.length = len(a)
        column.code = _FORMAT_CODES[a.dtype.str[1:]]
    return columns


def _built(arrays: list[np.ndarray], names: tuple[str, ...] | None) -> CapturedData:
    """The C builder's structs over host arrays, as captured host data."""
    schema = lib.aib_schema_alloc()
    array = lib.aib_device_array_alloc()
    err = new_error()
    rc = lib.aib_columns_build(
        len(arrays),
        ffi.NULL if names is None else device._c_names(names),
        _columns(arrays),
        int(names is not None),
        schema,
        ffi.addressof(array, "array"),
        err,
    )
    assert rc == 0, ffi.string(err.message)
    array.device_type = DEVICE_CPU
    array.device_id = -1
    return CapturedData(schema, [array], is_stream=False)


def _message(captured: CapturedData) -> bytes:
    described = Described(captured)
    lib.aib_described_place_all(described.raw, 0, 0)
    return described.encode(DeviceInfo(device_type=DEVICE_CPU), [process_region()])


_DTYPES = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"]


def test_built_structs_are_what_pyarrow_exports() -> None:
    """Same schema, values and wire message as pyarrow's record batch (and plain array) of the
    same buffers: consumers cannot tell the fast path from the old one."""
    columns = {f"c_{dtype}": np.arange(7).astype(dtype) for dtype in _DTYPES}
    reference = pa.RecordBatch.from_arrays([pa.array(v) for v in columns.values()], names=list(columns))
    names = tuple(columns)
    built = pa.record_batch(CapturedArray(_built(list(columns.values()), names)))
    assert built.equals(reference)
    assert built.schema.equals(reference.schema)
    assert _message(_built(list(columns.values()), names)) == _message(capture(reference))
    one = np.arange(5, dtype=np.float64)
    assert pa.array(CapturedArray(_built([one], None))).equals(pa.array(one))
    assert _message(_built([one], None)) == _message(capture(pa.array(one)))


def test_built_structs_free_every_node() -> None:
    before = lib.aib_live_nodes()
    captured = _built([np.zeros(3, np.float32)] * 16, tuple(f"c{i}" for i in range(16)))
    assert lib.aib_live_nodes() - before == 2 * 17
    captured.close()
    assert lib.aib_live_nodes() == before


def test_the_builder_refuses_bad_arguments() -> None:
    schema = lib.aib_schema_alloc()
    array = lib.aib_device_array_alloc()
    two = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
    bad_code = _columns(two)
    bad_code[1].code = 11
    bad_length = _columns(two)
    bad_length[1].length = 5
    try:
        for n, columns, as_batch in (
            (0, _columns(two), 1),
            (2, _columns(two), 0),
            (2, bad_code, 1),
            (2, bad_length, 1),
        ):
            err = new_error()
            rc = lib.aib_columns_build(
                n, device._c_names(("a", "b")), columns, as_batch, schema, ffi.addressof(array, "array"), err
            )
            assert rc == lib.AIB_E_FORMAT
            assert schema.release == ffi.NULL
            assert array.array.release == ffi.NULL
    finally:
        lib.aib_schema_free(schema)
        lib.aib_device_array_free(array)


def _read(values: Any, cupy_type: type | None = None) -> tuple[int, Any, int, Any]:
    """read_cuda_columns: how many leading columns it read, the facts as an aib_cuda_column[], why
    it stopped (device._READ_OK when it did not) and the offending value."""
    from arrow_ipc_bridge._ffi import read_cuda_columns

    done, facts, reason, detail = read_cuda_columns(values, len(values), cupy_type)
    assert isinstance(facts, bytes)
    assert len(facts) == len(values) * ffi.sizeof("aib_cuda_column")
    return done, device._facts_array(facts), reason, detail


def test_the_column_reader_reads_every_interface_fact() -> None:
    """Pointer, length, format code (in device._NUMERIC_TYPES' order) and announced stream of
    every numeric type, '|' and '<' typestrs, explicit contiguous strides and no stream."""
    good = [
        _FakeCudaArray(typestr=f"<{t}" if t[1] != "1" else f"|{t}", data=(0x1000 * (k + 1), False), stream=k)
        for k, t in enumerate(_DTYPES)
    ]
    good.append(_FakeCudaArray(strides=(4,), stream=None))
    done, columns, reason, detail = _read(good)
    assert (done, reason, detail) == (len(good), device._READ_OK, None)
    expected = [(0x1000 * (k + 1), 4, _FORMAT_CODES[t], k) for k, t in enumerate(_DTYPES)]
    expected.append((0x1000, 4, _FORMAT_CODES["f4"], 0))
    got = [(c.data, c.length, c.code, c.stream) for c in columns]
    assert got == expected
    assert all(c.reserved == 0 for c in columns)


@pytest.mark.parametrize(
    ("bad", "reason", "detail"),
    [
        ([1.0], device._NO_INTERFACE, None),
        (_FakeCudaArray(shape=(2, 2)), device._SHAPE, (2, 2)),
        (_FakeCudaArray(typestr=">f4"), device._TYPE, ">f4"),
        (_FakeCudaArray(typestr="<c8"), device._TYPE, "<c8"),
        (_FakeCudaArray(strides=(8,)), device._STRIDES, None),
        (_FakeCudaArray(mask=object()), device._MASK, None),
        (_FakeCudaArray(shape=(5,)), device._LENGTH, 5),
        (_FakeCudaArray(data=(-1, False)), device._MALFORMED, None),
        (_FakeCudaArray(shape=[4]), device._MALFORMED, None),
        (_FakeCudaArray(typestr=4), device._MALFORMED, 4),
    ],
)
def test_the_column_reader_stops_at_a_column_it_cannot_take_and_says_why(
    bad: Any, reason: int, detail: Any
) -> None:
    """The first column it cannot take stops it: the reason and the offending value come back,
    the facts are zeros from that column on, and from_cuda_arrays raises the documented error."""
    done, columns, got_reason, got_detail = _read([_FakeCudaArray(), bad, _FakeCudaArray()])
    assert (done, got_reason, got_detail) == (1, reason, detail)
    size = ffi.sizeof("aib_cuda_column")
    assert bytes(ffi.buffer(columns))[size:] == bytes(2 * size)
    messages = {
        device._NO_INTERFACE: "neither __cuda_array_interface__ nor __dlpack__",
        device._SHAPE: r"only 1-D arrays become Arrow columns \(got shape \(2, 2\)\)",
        device._TYPE: f"array type '{detail}' has no zero-copy Arrow equivalent",
        device._STRIDES: "not contiguous",
        device._MASK: "masked GPU arrays",
        device._LENGTH: r"different lengths \(4 and 5\)",
        device._MALFORMED: "does not follow the protocol",
    }
    with pytest.raises(aib.BridgeError, match=messages[reason]):
        aib.from_cuda_arrays({"a": _FakeCudaArray(), "b": bad})


def test_the_column_reader_lets_an_interface_error_through() -> None:
    """An array whose interface raises something other than AttributeError: that exception, not a
    refusal in the array's name."""

    class Broken:
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            raise RuntimeError("the stream was destroyed")

    with pytest.raises(RuntimeError, match="the stream was destroyed"):
        _read([_FakeCudaArray(), Broken()])
    with pytest.raises(aib.BridgeError, match="does not follow the protocol"):
        aib.from_cuda_arrays({"a": _FakeCudaArray(data=None)})
    from arrow_ipc_bridge._ffi import read_cuda_columns

    for values in ((_FakeCudaArray(),), []):
        with pytest.raises(ValueError, match="list of n >= 1 values"):
            read_cuda_columns(values, len(values), None)  # type: ignore[arg-type]


class _Pointer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class ndarray:  # named as CuPy's array type, which the reader recognises
    """What the C reader reads of a CuPy array after the first (its own attributes), beside the
    interface a CuPy array builds from them; ``interface`` may disagree, to show which was read."""

    __module__ = "cupy"

    def __init__(
        self, length: int, dtype: str, ptr: int, *, contiguous: bool = True, interface: Any = None
    ) -> None:
        self.ndim, self.size, self.dtype, self.data = 1, length, np.dtype(dtype), _Pointer(ptr)
        # CuPy's public strides (bytes, always a tuple): every other item when not contiguous
        self.strides = ((1 if contiguous else 2) * self.dtype.itemsize,)
        self.__cuda_array_interface__ = interface or {
            "shape": (length,),
            "typestr": np.dtype(dtype).str,
            "data": (ptr if length else 0, False),
            "version": 3,
            "strides": None if contiguous else (2 * np.dtype(dtype).itemsize,),
            "stream": 7,
        }


def test_the_c_reader_reads_cupy_arrays_after_the_first_from_their_attributes() -> None:
    """Given CuPy's type, the columns after the first of exactly that type are read from their
    attributes (the stream is the first column's: CuPy's interface reports the current stream),
    with the facts their interfaces would give; one it cannot take that way (not contiguous) is
    read through its interface, and so stops there."""

    values = [ndarray(8, t, 0x1000 * (k + 1)) for k, t in enumerate(_DTYPES)]
    done, columns, _, _ = _read(values, ndarray)
    assert done == len(values)
    read = [(c.data, c.length, c.code, c.stream) for c in columns]
    done, columns, _, _ = _read(values)  # interfaces only
    assert done == len(values)
    assert read == [(c.data, c.length, c.code, c.stream) for c in columns]
    # Attributes, not interfaces, after the first: an interface that lies is not read.
    liar = ndarray(8, "float32", 0x9000, interface={"shape": (8,), "typestr": "<f8", "data": (0x1, False)})
    done, columns, _, _ = _read([values[0], liar], ndarray)
    assert done == 2
    assert (columns[1].data, columns[1].code, columns[1].stream) == (0x9000, _DTYPES.index("f4"), 7)
    # One dtype after another (the reader keeps the last dtype it saw): each column its own code.
    mixed = [ndarray(8, t, 0x1000) for t in ("float32", "float32", "int8", "float32", "float64", "float64")]
    done, columns, _, _ = _read(mixed, ndarray)
    assert done == len(mixed)
    assert [c.code for c in columns] == [_DTYPES.index(t) for t in ("f4", "f4", "i1", "f4", "f8", "f8")]
    strided = ndarray(8, "float32", 0x9000, contiguous=False)
    done, _, reason, _ = _read([values[0], strided], ndarray)
    assert (done, reason) == (1, device._STRIDES)
    # One item, whatever its stride (CuPy gives a sliced single item the parent's): contiguous.
    single = ndarray(1, "float32", 0x9000, contiguous=False)
    single.__cuda_array_interface__ = {"shape": (1,), "typestr": "<f8", "data": (0x1, False)}  # not read
    done, columns, _, _ = _read([ndarray(1, "float32", 0x1000), single], ndarray)
    assert (done, columns[1].data, columns[1].length) == (2, 0x9000, 1)
    empty = [ndarray(0, "float32", 0x1000), ndarray(0, "float32", 0x2000)]
    done, columns, _, _ = _read(empty, ndarray)
    assert done == 2
    assert columns[1].data == 0  # as the interface says of an empty array


def test_held_facts_spare_the_device_query_only_while_their_arrays_are_held() -> None:
    """Columns whose facts a live publication holds (device.hold_checked_columns) take its device
    without a driver query (here there is no driver at all); the holder keeps those arrays alive,
    and its release takes the facts out before it lets go of them, so the same addresses are
    checked again afterwards (and refused here: the arrays were never device memory)."""
    from arrow_ipc_bridge.runtime import reaper

    base = 0x7000_0000_0000
    arrays = [_FakeCudaArray(data=(base + k * 0x100000, False)) for k in range(3)]
    alive = weakref.ref(arrays[0])
    facts, objects = device._read_columns(list(arrays))
    checked = device._CudaColumns(("c0", "c1", "c2"), facts, objects, 0)  # as if checked on device 0
    release = device.hold_checked_columns(facts, 0, checked._live())
    held = device.held_column_facts()
    again = aib.from_cuda_arrays({f"c{k}": a for k, a in enumerate(arrays)})
    assert again.column_signature == (0, ("c0", "c1", "c2"), facts)
    moved = [_FakeCudaArray(data=(base + k * 0x100000 + 0x40, False)) for k in range(3)]
    with pytest.raises(aib.BridgeError):  # other facts (one offset): asked, and refused
        aib.from_cuda_arrays({f"c{k}": a for k, a in enumerate(moved)})
    del arrays, objects, checked, again
    reaper.settle()
    assert alive() is not None  # the holder keeps the arrays
    release()
    release()  # once only
    reaper.settle()
    assert alive() is None
    assert device.held_column_facts() == held - 1
    same_addresses = [_FakeCudaArray(data=(base + k * 0x100000, False)) for k in range(3)]
    with pytest.raises(aib.BridgeError):
        aib.from_cuda_arrays({f"c{k}": a for k, a in enumerate(same_addresses)})


def test_column_names_that_are_not_str_are_refused_with_the_name() -> None:
    with pytest.raises(TypeError, match="column names"):
        aib.from_cuda_arrays({"a": _FakeCudaArray(), 2: _FakeCudaArray()})


def _place(
    table: Any, described: Described, made: dict[int, Any] | None = None, pool_regions_allowed: int = 1
) -> tuple[int, list[tuple[int, int, int]], Any]:
    """aib_cuda_place on device 0: (buffers placed, missing allocations, the regions written)."""
    n = max(described.buffer_count, 1)
    made = made or {}
    regions = ffi.new("aib_region[]", n)
    missing = ffi.new("uint64_t[]", 3 * n)
    counts = [ffi.new("size_t *") for _ in range(3)]
    made_raw = ffi.new("aib_region[]", max(len(made), 1))
    for k, region in enumerate(made.values()):
        made_raw[k] = region[0]
    rc = lib.aib_cuda_place(
        table,
        described.raw,
        0,
        pool_regions_allowed,
        ffi.new("uint64_t[]", list(made) or [0]),
        made_raw,
        len(made),
        regions,
        missing,
        n,
        *counts,
    )
    assert rc == 0
    n_regions, n_buffers, n_missing = (int(c[0]) for c in counts)
    words = [int(missing[k]) for k in range(3 * n_missing)]
    assert (n_buffers > 0) != (n_missing > 0) or described.buffer_count == 0
    return n_buffers, [tuple(words[k : k + 3]) for k in range(0, len(words), 3)], (regions, n_regions)


def test_the_export_region_table_places_nothing_it_was_not_told() -> None:
    """Without a driver (or with an empty table) every allocation is missing: the caller makes its
    region; nothing is placed meanwhile."""
    table = ffi.gc(lib.aib_export_regions_new(4), lib.aib_export_regions_free)
    array = np.arange(4, dtype=np.float32)
    described = Described(capture(pa.array(array)))
    before = described.slots().tolist()
    placed, missing, _ = _place(table, described)
    assert placed == 0
    assert missing == [(array.ctypes.data, 0, 0)]  # the buffer's address; the driver said nothing
    assert described.slots().tolist() == before
    n = described.buffer_count
    too_few = lib.aib_cuda_place(
        table, described.raw, 0, 1, ffi.new("uint64_t[]", 1), ffi.new("aib_region[]", 1), 0,
        ffi.new("aib_region[]", n), ffi.new("uint64_t[]", 3 * n), n - 1,
        ffi.new("size_t *"), ffi.new("size_t *"), ffi.new("size_t *"),
    )  # fmt: skip
    assert too_few == -1
    region = ffi.new("aib_region *")
    region.handle_len = 64
    assert lib.aib_export_regions_put(table, 0, 0, region) == lib.AIB_E_FORMAT  # buffer id 0 is no id
    for buffer_id in range(1, 100):  # a full table starts over rather than growing
        assert lib.aib_export_regions_put(table, buffer_id, 0, region) == 0
    stats = ffi.new("uint64_t[3]")
    lib.aib_export_regions_stats(table, stats, stats + 1, stats + 2)
    assert 0 < stats[0] <= 64


def test_the_export_region_table_numbers_regions_by_address() -> None:
    """The placement walk numbers a message's regions in the order of their allocations'
    addresses, also when the columns come in another order (an allocator that hands out a lower
    address later: CuPy's pool reusing a freed block). Otherwise the same arrays would give two
    different messages, depending on whether their regions came from the table or were made. No
    driver needed: a stand-in answers for host arrays posing as device allocations."""
    from arrow_ipc_bridge.cuda import _driver

    arrays = [np.arange(64, dtype=np.float32) + k for k in range(3)]
    by_address = sorted(arrays, key=lambda a: a.ctypes.data)
    # Slot order: highest address first, then lowest, then the middle one.
    columns = {"high": by_address[2], "low": by_address[0], "middle": by_address[1]}
    allocations = {int(a.ctypes.data): (int(a.nbytes), 100 + rank) for rank, a in enumerate(by_address)}

    @ffi.callback("int(unsigned int, int *, void **, uint64_t)")
    def get_attributes(n: int, attributes: Any, data: Any, address: int) -> int:
        for base, (size, buffer_id) in allocations.items():
            if base <= address < base + size:
                answers = {2: 2, 8: 0, 9: 0, 11: base, 12: size, 7: buffer_id}  # device memory on device 0
                for k in range(n):
                    ffi.cast("uint64_t *", data[k])[0] = answers[attributes[k]]
                return 0
        return 1  # CUDA_ERROR_INVALID_VALUE

    table = ffi.gc(lib.aib_export_regions_new(8), lib.aib_export_regions_free)
    for size, buffer_id in allocations.values():
        region = ffi.new("aib_region *", {"kind": 3, "size": size, "identity": buffer_id, "fd_index": -1})
        region.handle_len = 64
        assert lib.aib_export_regions_put(table, buffer_id, 0, region) == 0
    described = Described(capture(pa.record_batch({name: pa.array(a) for name, a in columns.items()})))
    real = _driver._DRIVER.lib
    lib.aib_cuda_set_driver(
        ffi.new("aib_cuda_driver *", {"pointer_get_attributes": int(ffi.cast("uintptr_t", get_attributes))})
    )
    try:
        n_buffers, missing, (regions, n_regions) = _place(table, described)
    finally:  # the driver's own functions (or none) back
        restore = _driver.core_driver_table(real, _driver._DRIVER.ffi) if real is not None else None
        lib.aib_cuda_set_driver(restore if restore is not None else ffi.new("aib_cuda_driver *"))
    assert missing == []
    assert (n_regions, n_buffers) == (3, 3)
    assert [regions[k].identity for k in range(3)] == [100, 101, 102]  # by address
    slots = described.slots()
    placed = {slots[i]: (slots[i + 2], slots[i + 3]) for i in range(0, len(slots), 4) if slots[i + 1]}
    for base, (_, buffer_id) in allocations.items():
        assert placed[base] == (lib.AIB_REGION_FIRST + buffer_id - 100, 0)


def test_the_placement_walk_hands_back_what_it_cannot_place_and_then_places_all() -> None:
    """aib_cuda_place, the one placement of CUDA buffers, with a stand-in driver over host arrays
    posing as allocations: one attribute query per allocation; an allocation in the table is placed
    from it, one the caller made a region for from that (before the table), and every other comes
    back as missing — not in the table, managed, on another device, a pool region where the message
    must carry the pool's fd, no table at all (copy="always") — with nothing placed until none is."""
    from arrow_ipc_bridge.cuda import _driver

    arrays = {name: np.arange(64, dtype=np.float32) + k for k, name in enumerate("abcde")}
    # name -> (buffer id, managed, device); "a" and "e" are in the table, "e" as a pool region
    kinds = {"a": (101, 0, 0), "b": (102, 0, 0), "c": (103, 1, 0), "d": (104, 0, 1), "e": (105, 0, 0)}
    allocations = {int(arrays[n].ctypes.data): (int(arrays[n].nbytes), *kinds[n]) for n in arrays}
    asked: list[int] = []

    @ffi.callback("int(unsigned int, int *, void **, uint64_t)")
    def get_attributes(n: int, attributes: Any, data: Any, address: int) -> int:
        asked.append(address)
        for base, (size, buffer_id, managed, device_ordinal) in allocations.items():
            if base <= address < base + size:
                answers = {2: 2, 8: managed, 9: device_ordinal, 11: base, 12: size, 7: buffer_id}
                for k in range(n):
                    ffi.cast("uint64_t *", data[k])[0] = answers[attributes[k]]
                return 0
        return 1

    def region(kind: int, buffer_id: int) -> Any:
        raw = ffi.new("aib_region *", {"kind": kind, "size": 256, "identity": buffer_id, "fd_index": -1})
        raw.handle_len = 64
        return raw

    table = ffi.gc(lib.aib_export_regions_new(8), lib.aib_export_regions_free)
    legacy, pool = lib.AIB_REGION_KIND_CUDA_LEGACY, lib.AIB_REGION_KIND_CUDA_POOL
    assert lib.aib_export_regions_put(table, 101, 0, region(legacy, 101)) == 0
    assert lib.aib_export_regions_put(table, 105, 0, region(pool, 105)) == 0
    batch = pa.record_batch({n: pa.array(a) for n, a in arrays.items()})
    described = Described(capture(batch))
    before = described.slots().tolist()
    base_of = {n: int(a.ctypes.data) for n, a in arrays.items()}
    real = _driver._DRIVER.lib
    lib.aib_cuda_set_driver(
        ffi.new("aib_cuda_driver *", {"pointer_get_attributes": int(ffi.cast("uintptr_t", get_attributes))})
    )
    try:
        placed, missing, _ = _place(table, described, pool_regions_allowed=0)
        assert placed == 0
        assert described.slots().tolist() == before  # nothing placed while anything is missing
        assert sorted(asked) == sorted(base_of.values())  # one query per allocation
        assert {m[0] for m in missing} == {base_of[n] for n in "bcde"}  # "a" from the table
        assert all((m[1], m[2]) == (m[0], 256) for m in missing)  # each allocation's base and size
        placed, missing, _ = _place(table, described, pool_regions_allowed=1)
        assert {m[0] for m in missing} == {base_of[n] for n in "bcd"}  # the pool region may come now
        placed, missing, _ = _place(ffi.NULL, described)
        assert {m[0] for m in missing} == set(base_of.values())  # no table: everything is missing
        # Regions made for b, c, d, e: managed and other-device memory is never placed from one.
        made = {k: region(legacy, k) for k in (102, 103, 104, 105)}
        placed, missing, _ = _place(table, described, made=made, pool_regions_allowed=0)
        assert {m[0] for m in missing} == {base_of[n] for n in "cd"}
        only = Described(capture(pa.record_batch({n: pa.array(arrays[n]) for n in "eab"})))
        placed, missing, (regions, n_regions) = _place(table, only, made=made, pool_regions_allowed=0)
    finally:
        restore = _driver.core_driver_table(real, _driver._DRIVER.ffi) if real is not None else None
        lib.aib_cuda_set_driver(restore if restore is not None else ffi.new("aib_cuda_driver *"))
    assert (placed, missing, n_regions) == (3, [], 3)
    by_address = sorted("abe", key=lambda n: base_of[n])
    assert [regions[k].identity for k in range(3)] == [kinds[n][0] for n in by_address]
    assert regions[by_address.index("e")].kind == legacy  # the one made for e, not the table's pool one
    slots = only.slots()
    placed_slots = {slots[i]: slots[i + 2] for i in range(0, len(slots), 4) if slots[i + 1]}
    assert placed_slots == {base_of[n]: lib.AIB_REGION_FIRST + by_address.index(n) for n in "abe"}
