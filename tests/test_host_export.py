"""Tests of the producer side of host-memory regions (arrow_ipc_bridge.host: placement, proc_maps, reopen,
sealed_copy, shared_alloc)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import hashlib
import json
import mmap
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pyarrow as pa
import pytest

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.errors import ClosedError, CopyRequiredError, InvalidArgumentError
from arrow_ipc_bridge.host import (
    F_SEAL_FUTURE_WRITE,
    FULL_SEALS,
    HostExport,
    HostRegion,
    Placement,
    allocate_shared,
    export_host_buffers,
    find_shared_mapping,
    host_stats,
    proc_maps,
    reopen,
    sealed_copy,
    shared_alloc,
)

PAGE = mmap.PAGESIZE
MAP_FIXED = 0x10  # <sys/mman.h>; Python's mmap module does not export it
MAP_FAILED = ctypes.c_void_p(-1).value

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


# --- helpers ------------------------------------------------------------------------------------------------
def buffer_pairs(obj: pa.Array | pa.Table) -> list[tuple[int, int]]:
    """(address, size) of every non-missing buffer of an array or of all chunks of a table."""
    arrays = [obj] if isinstance(obj, pa.Array) else [ch for col in obj.columns for ch in col.chunks]
    return [(b.address, b.size) for a in arrays for b in a.buffers() if b is not None]


def region_bytes(region: HostRegion, offset: int, nbytes: int) -> bytes:
    """Map the region's fd read-only at its file offset, as a consumer would, and read one buffer."""
    with mmap.mmap(
        region.fd, region.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=region.file_offset
    ) as m:
        return m[offset : offset + nbytes]


def placed_bytes(export: HostExport, index: int, nbytes: int) -> bytes:
    placement = export.placements[index]
    assert placement is not None
    return region_bytes(export.regions[placement.region], placement.offset, nbytes)


def memory_at(address: int, nbytes: int) -> bytes:
    return ctypes.string_at(address, nbytes)


def fd_count() -> int:
    """Open fds of this process, settled: garbage collected, and the module's two long-lived /proc fds
    (maps for PROCMAP_QUERY, pagemap) already open, so only fds an export leaks make a difference."""
    proc_maps._maps_file.fd()
    proc_maps._pagemap_file.fd()
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def map_files_openable() -> bool:
    """Whether this process may open /proc/self/map_files links (CAP_SYS_ADMIN / CAP_CHECKPOINT_RESTORE)."""
    fd = os.memfd_create("probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, PAGE)
        with mmap.mmap(fd, PAGE) as m:
            probe = ctypes.c_char.from_buffer(m)
            start = ctypes.addressof(probe)
            del probe
            try:
                os.close(os.open(f"/proc/self/map_files/{start:x}-{start + PAGE:x}", os.O_RDONLY))
            except PermissionError:
                return False
            return True
    finally:
        os.close(fd)


def raw_mmap(fd: int, length: int, *, address: int = 0, flags: int = mmap.MAP_SHARED) -> int:
    """mmap(2) through libc: unlike Python's mmap module it keeps no dup() of the fd alive."""
    pointer = libc.mmap(address or None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    assert pointer not in (None, MAP_FAILED), os.strerror(ctypes.get_errno())
    return int(pointer)


@contextlib.contextmanager
def mapped_memfd(name: str, data: bytes, *, keep_fd: bool = True) -> Iterator[tuple[int, int]]:
    """A memfd holding ``data`` mapped MAP_SHARED outside the bridge registry: yields (address, fd or -1)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    address = raw_mmap(fd, len(data))
    if not keep_fd:
        os.close(fd)
    try:
        yield address, fd if keep_fd else -1
    finally:
        libc.munmap(address, len(data))
        if keep_fd:
            os.close(fd)


@pytest.fixture
def sample_table() -> pa.Table:
    return pa.table(
        {
            "i": pa.array([i if i % 7 else None for i in range(20_000)], pa.int64()),
            "s": pa.array([f"value-{i}" for i in range(20_000)]),
            "f": pa.array([i / 3 for i in range(20_000)], pa.float64()),
        }
    )


@pytest.fixture
def shm_ipc_file(sample_table: pa.Table) -> Iterator[str]:
    """An Arrow IPC file under /dev/shm holding ``sample_table``."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="aib-test-", suffix=".arrow", delete=False) as f:
        path = f.name
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, sample_table.schema) as writer:
        writer.write_table(sample_table)
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def read_mapped(path: str, mode: str = "r") -> pa.Table:
    """The IPC file's table, memory-mapped. The source is closed (its fd too): the buffers keep the mapping.

    Closing explicitly matters: pyarrow's MemoryMappedFile holds an fd on the file until it is closed or
    garbage collected, and an open fd changes how a deleted file can be reopened and what fd counts see.
    """
    with pa.memory_map(path, mode) as source:
        return pa.ipc.open_file(source).read_all()


# --- copy path ----------------------------------------------------------------------------------------------
def test_copy_path_roundtrip(sample_table: pa.Table) -> None:
    """Heap buffers are copied into ONE memfd at 64-byte aligned offsets; the fd maps back the same bytes."""
    table = pa.table(
        {
            n: pa.concat_arrays(c.chunks)
            for n, c in zip(sample_table.column_names, sample_table.columns, strict=True)
        }
    )
    bufs = [b for col in table.columns for ch in col.chunks for b in ch.buffers() if b is not None]
    before = host_stats()
    with export_host_buffers([(b.address, b.size) for b in bufs]) as export:
        assert len(export.regions) == 1
        region = export.regions[0]
        assert not region.zero_copy
        assert region.file_offset == 0
        assert export.copied_bytes == sum(b.size for b in bufs)
        for i, b in enumerate(bufs):
            placement = export.placements[i]
            assert placement is not None
            assert placement.region == 0
            assert placement.offset % 64 == 0
            assert placed_bytes(export, i, b.size) == b.to_pybytes()
        assert region.size >= max(p.offset for p in export.placements if p) + bufs[-1].size
    after = host_stats()
    assert after.copied_bytes - before.copied_bytes == export.copied_bytes
    assert after.copy_regions - before.copy_regions == 1
    assert after.exports - before.exports == 1


def test_copy_region_is_sealed_and_immutable() -> None:
    """The copy memfd is sealed against shrink/grow/write and sealing: truncate, write, writable mmap fail,
    even through a read-write reopen of the file (a memfd's inode is mode 0777: any peer can reopen it)."""
    arr = pa.array(range(10_000), pa.int64())
    with export_host_buffers(buffer_pairs(arr)) as export:
        region = export.regions[0]
        assert region.sealed
        assert region.seals == FULL_SEALS
        assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) == FULL_SEALS
        writable = os.open(f"/proc/self/fd/{region.fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(writable, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(writable, region.size * 2)
            with pytest.raises(PermissionError):
                os.pwrite(writable, b"x", 0)
            with pytest.raises(PermissionError):
                mmap.mmap(writable, region.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):  # F_SEAL_SEAL: the seals can no longer change
                fcntl.fcntl(writable, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        finally:
            os.close(writable)


def test_a_copied_region_arrives_read_only() -> None:
    """The copy's descriptor that leaves (and so the one a consumer receives) is a read-only open of the
    memfd (docs/security.md), not the read-write one it was written through."""
    batch = pa.record_batch({"x": pa.array(range(1000), pa.int64())})
    exported = aib.export(batch, copy="always")
    try:
        assert exported.fds
        sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with sender, receiver:
            socket.send_fds(sender, [b"x"], list(exported.fds))
            _, received, _, _ = socket.recv_fds(receiver, 1, len(exported.fds))
        try:
            for fd in received:
                assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
                with pytest.raises(OSError, match="Bad file descriptor"):  # no write access, seals aside
                    os.pwrite(fd, b"x", 0)
        finally:
            for fd in received:
                os.close(fd)
    finally:
        exported.close()


def _heap_table(rows: int = 1 << 20) -> pa.Table:
    return pa.table({"x": pa.array(range(rows), pa.int64()), "s": pa.array(["ab"] * rows)})


@pytest.mark.parametrize("copy", ["if_needed", "always"])
def test_a_copied_export_lets_go_of_its_source(copy: str) -> None:
    """Once every buffer is in the sealed copy the export keeps nothing of its source: the heap table
    is freed when its user drops it, not when the export closes (a published 1 GiB table kept 1 GiB
    of heap beside its copy until it was unpublished)."""
    gc.collect()
    base = pa.total_allocated_bytes()
    table = _heap_table()
    expected = table.to_pylist()[:3]
    assert pa.total_allocated_bytes() - base > 8 << 20
    exported = aib.export(table, copy=copy)  # type: ignore[arg-type]
    try:
        assert exported.stats.zero_copy_regions == 0
        del table
        gc.collect()
        assert pa.total_allocated_bytes() == base  # the copy is a memfd, not Arrow's heap
        with aib.Session() as session, session.import_message(exported.message, exported.fds) as imported:
            assert pa.table(imported).slice(0, 3).to_pylist() == expected
    finally:
        exported.close()


def test_a_published_copy_lets_go_of_its_source(tmp_path: pathlib.Path) -> None:
    gc.collect()
    base = pa.total_allocated_bytes()
    table = _heap_table()
    expected = table.slice(0, 3).to_pylist()
    with aib.Publisher(str(tmp_path / "p.sock"), copy="always") as publisher:
        publisher.publish("t", table)
        del table
        gc.collect()
        assert pa.total_allocated_bytes() == base
        with aib.connect(publisher.path, timeout=10.0) as session, session.get("t") as imported:
            assert pa.table(imported).slice(0, 3).to_pylist() == expected


def test_an_export_with_a_zero_copy_region_keeps_its_source() -> None:
    """A zero-copy region names the source's own memory, so the source is kept until the export
    closes, heap columns copied beside it included: one capture holds every buffer of the object."""
    n = 1 << 16
    with allocate_shared(n * 8, name="aib-test") as shared:
        shared_column = pa.Array.from_buffers(pa.int64(), n, [None, shared.as_pyarrow()])
        gc.collect()
        base = pa.total_allocated_bytes()
        batch = pa.record_batch({"shared": shared_column, "heap": pa.array(range(n), pa.int64())})
        held = pa.total_allocated_bytes() - base
        assert held >= n * 8
        exported = aib.export(batch, copy="if_needed")
        try:
            assert exported.stats.zero_copy_regions == 1
            del batch, shared_column
            gc.collect()
            assert pa.total_allocated_bytes() - base >= held  # the heap column too
        finally:
            exported.close()
        gc.collect()
        assert pa.total_allocated_bytes() == base


def test_copy_padding_reads_as_zeros() -> None:
    """Bytes between copied buffers (alignment padding) are zeros, never leftover producer memory."""
    a = pa.py_buffer(b"\xff" * 3)
    b = pa.py_buffer(b"\xee" * 5)
    with export_host_buffers([(a.address, a.size), (b.address, b.size)], copy="always") as export:
        region = export.regions[0]
        assert [p.offset for p in export.placements if p] == [0, 64]
        assert region.size == 128
        assert region_bytes(region, 0, 128) == b"\xff" * 3 + bytes(61) + b"\xee" * 5 + bytes(59)


def test_copy_never_raises_for_heap_memory() -> None:
    """copy="never" on heap buffers raises CopyRequiredError naming the buffer and the two ways out."""
    arr = pa.array(range(1000), pa.int32())
    address, nbytes = buffer_pairs(arr)[0]
    assert find_shared_mapping(address, nbytes) is None
    fds_before = fd_count()
    with pytest.raises(CopyRequiredError) as info:
        export_host_buffers([(address, nbytes)], copy="never")
    message = str(info.value)
    assert f"{address:#x}" in message
    assert f"{nbytes} bytes" in message
    assert "copy='if_needed'" in message
    assert "allocate_shared" in message
    assert info.value.address == address
    assert isinstance(info.value, CopyRequiredError)
    assert fd_count() == fds_before


def test_copy_always_copies_even_shareable_memory() -> None:
    """copy="always" copies buffers that could be shared, detaching the consumer from producer memory."""
    with allocate_shared(4096) as shared:
        shared.view()[:4] = b"abcd"
        before = host_stats()
        with export_host_buffers([(shared.address, 4096)], copy="always") as export:
            assert [r.zero_copy for r in export.regions] == [False]
            assert export.copied_bytes == 4096
            assert export.regions[0].sealed
            shared.view()[:4] = b"WXYZ"  # the copy is a snapshot
            assert placed_bytes(export, 0, 4) == b"abcd"
        assert host_stats().copied_bytes - before.copied_bytes == 4096


def test_unreadable_address_is_region_error_not_crash() -> None:
    """Copying from an address that is not mapped raises InvalidArgumentError (EFAULT) instead of crashing."""
    fds_before = fd_count()
    with pytest.raises(InvalidArgumentError, match="not readable memory"):
        export_host_buffers([(PAGE, 100)])  # the first pages are never mapped (vm.mmap_min_addr)
    assert fd_count() == fds_before


# --- zero-copy path -----------------------------------------------------------------------------------------
def test_zero_copy_ipc_file_in_dev_shm(shm_ipc_file: str, sample_table: pa.Table) -> None:
    """Buffers of an IPC file memory-mapped from /dev/shm export zero-copy: one region, nothing copied."""
    table = read_mapped(shm_ipc_file)
    assert table.equals(sample_table)
    pairs = buffer_pairs(table)
    mapping = find_shared_mapping(*pairs[0])
    assert mapping is not None
    assert mapping.path == shm_ipc_file
    # pa.memory_map(path) maps the file read-only MAP_PRIVATE, not MAP_SHARED.
    assert not mapping.shared
    assert not mapping.writable
    before = host_stats()
    with export_host_buffers(pairs, copy="never") as export:
        assert export.copied_bytes == 0
        assert len(export.regions) == 1
        region = export.regions[0]
        assert region.zero_copy
        assert region.file_offset % PAGE == 0
        assert os.fstat(region.fd).st_ino == os.stat(shm_ipc_file).st_ino
        assert fcntl.fcntl(region.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        for i, (address, nbytes) in enumerate(pairs):
            assert placed_bytes(export, i, nbytes) == memory_at(address, nbytes)
    after = host_stats()
    assert after.copied_bytes == before.copied_bytes
    assert after.zero_copy_regions - before.zero_copy_regions == 1
    assert after.zero_copy_buffers - before.zero_copy_buffers == len(pairs)


def test_zero_copy_shared_memory_map(shm_ipc_file: str) -> None:
    """A MAP_SHARED mapping (pa.memory_map(path, "r+")) exports zero-copy too; the region is page aligned."""
    table = read_mapped(shm_ipc_file, "r+")
    pairs = buffer_pairs(table.slice(5000))  # a slice still shares the mapping's buffers
    mapping = find_shared_mapping(*pairs[-1])
    assert mapping is not None
    assert mapping.shared
    with export_host_buffers(pairs, copy="never") as export:
        assert len(export.regions) == 1
        assert export.regions[0].zero_copy
        for i, (address, nbytes) in enumerate(pairs):
            assert placed_bytes(export, i, nbytes) == memory_at(address, nbytes)


@pytest.mark.parametrize("keep_source_open", [True, False])
def test_zero_copy_deleted_file_needs_map_files_or_open_fd(shm_ipc_file: str, keep_source_open: bool) -> None:
    """An unlinked file is reopened via an fd this process holds on it (any user) or /proc/self/map_files
    (CAP_SYS_ADMIN/CAP_CHECKPOINT_RESTORE only); with neither its buffers are copied."""
    source = pa.memory_map(shm_ipc_file)
    table = pa.ipc.open_file(source).read_all()
    if not keep_source_open:
        source.close()  # closes pyarrow's fd; the buffers keep the mapping alive
    os.unlink(shm_ipc_file)
    pairs = buffer_pairs(table)
    with export_host_buffers(pairs) as export:
        zero_copy = keep_source_open or map_files_openable()
        assert [r.zero_copy for r in export.regions] == [zero_copy]
        assert export.copied_bytes == (0 if zero_copy else sum(n for _, n in pairs))
        for i, (address, nbytes) in enumerate(pairs):
            assert placed_bytes(export, i, nbytes) == memory_at(address, nbytes)
    source.close()


def test_allocate_shared_array_exports_zero_copy_without_reading_proc() -> None:
    """An array built in allocate_shared memory exports zero-copy from the registry, with no /proc lookup."""
    n = 10_000
    with allocate_shared(n * 8 + 64, name="aib-test") as shared:
        view = shared.view().cast("q")
        for i in range(n):
            view[i] = i * i
        view.release()
        data = shared.as_pyarrow()
        arr = pa.Array.from_buffers(pa.int64(), n, [None, data])
        assert arr[1234].as_py() == 1234 * 1234
        pairs = [(data.address, n * 8), (data.address + 8 * 100, 800)]  # two buffers in one mapping
        mapping = find_shared_mapping(*pairs[0])
        assert mapping is not None
        assert mapping.source == "registry"
        before = host_stats()
        with export_host_buffers(pairs, copy="never") as export:
            assert len(export.regions) == 1
            region = export.regions[0]
            assert region.zero_copy
            assert export.copied_bytes == 0
            assert (
                region.seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            )
            assert not region.sealed  # the owner may still write: not write-sealed...
            assert region.seals & F_SEAL_FUTURE_WRITE  # ...but only through its own mapping
            assert fcntl.fcntl(region.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            assert region.fd != shared.fd
            assert export.placements[1] == Placement(0, 800)
            assert placed_bytes(export, 0, n * 8) == arr.buffers()[1].to_pybytes()[: n * 8]
        after = host_stats()
        assert after.maps_queries == before.maps_queries
        assert after.maps_parses == before.maps_parses
        assert after.fd_scans == before.fd_scans


def test_buffers_in_separate_mappings_get_separate_regions() -> None:
    """One region per mapping, in order of first buffer; heap buffers go to one trailing copy region."""
    heap = pa.py_buffer(b"heap-bytes" * 10)
    with allocate_shared(3 * PAGE) as a, allocate_shared(PAGE) as b:
        a.view()[2 * PAGE + 5 : 2 * PAGE + 10] = b"AAAAA"
        b.view()[:5] = b"BBBBB"
        pairs = [(b.address, 5), (heap.address, heap.size), (a.address + 2 * PAGE + 5, 5), (a.address + 7, 1)]
        with export_host_buffers(pairs) as export:
            assert [r.zero_copy for r in export.regions] == [True, True, False]
            assert export.placements[0] == Placement(0, 0)
            # Region 1 starts at the page holding its lowest buffer (a + 7 -> a's first page).
            assert export.regions[1].file_offset == 0
            assert export.placements[2] == Placement(1, 2 * PAGE + 5)
            assert export.placements[3] == Placement(1, 7)
            assert export.placements[1] == Placement(2, 0)
            assert export.copied_bytes == heap.size
            assert placed_bytes(export, 2, 5) == b"AAAAA"
            assert placed_bytes(export, 0, 5) == b"BBBBB"
            assert placed_bytes(export, 1, heap.size) == heap.to_pybytes()
        with export_host_buffers([(a.address + 2 * PAGE + 5, 5)]) as export:
            # Only the last page is needed: the region starts at a page-aligned file offset inside the file.
            assert export.regions[0].file_offset == 2 * PAGE
            assert export.placements[0] == Placement(0, 5)
            assert placed_bytes(export, 0, 5) == b"AAAAA"


def test_range_past_end_of_file_is_copied() -> None:
    """Bytes of the last mapped page beyond EOF are not the file's: a region reaching there is copied."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="aib-test-short-") as f:
        f.write(b"x" * 100)
        f.flush()
        address = raw_mmap(f.fileno(), PAGE)  # one page over a 100-byte file
        try:
            with export_host_buffers([(address, 100)], copy="never") as export:
                assert export.regions[0].zero_copy
                assert export.regions[0].size == 100
                assert placed_bytes(export, 0, 100) == b"x" * 100
            with export_host_buffers([(address, 100), (address + 50, 100)]) as export:
                # One region per mapping: it would reach past EOF, so the mapping's buffers are copied.
                assert [r.zero_copy for r in export.regions] == [False]
                assert placed_bytes(export, 0, 100) == b"x" * 100
                assert placed_bytes(export, 1, 100) == b"x" * 50 + bytes(50)
            with pytest.raises(CopyRequiredError):
                export_host_buffers([(address + 50, 100)], copy="never")
        finally:
            libc.munmap(address, PAGE)


@contextlib.contextmanager
def shm_file(data: bytes) -> Iterator[int]:
    """A file under /dev/shm holding ``data``; yields an fd open on it (read-write)."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="aib-test-offset-") as f:
        f.write(data)
        f.flush()
        yield f.fileno()


@pytest.mark.parametrize("lookup", ["procmap_query", "text"])
def test_mapping_at_a_file_offset_reaches_the_consumer_intact(
    lookup: str, request: pytest.FixtureRequest
) -> None:
    """A table in a mapping that starts at a non-zero file offset (numpy.memmap(path, offset=...), mmap with
    offset) is exported from that offset of the file: the consumer reads the producer's bytes."""
    import arrow_ipc_bridge as aib

    if lookup == "text":
        request.getfixturevalue("text_maps")
    values = pa.array(range(PAGE), pa.int64())  # 8 pages of data, distinct from the pages before it
    data = values.buffers()[1].to_pybytes()
    with (
        shm_file(os.urandom(3 * PAGE) + data) as fd,
        mmap.mmap(fd, len(data), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=3 * PAGE) as m,
    ):
        mapped = pa.py_buffer(m)
        arr = pa.Array.from_buffers(pa.int64(), PAGE - 10, [None, mapped], offset=10)
        with export_host_buffers([(mapped.address + 80, len(data) - 80)], copy="never") as export:
            assert export.regions[0].file_offset == 3 * PAGE
            assert placed_bytes(export, 0, len(data) - 80) == data[80:]
        with aib.export(arr, copy="never") as exported, aib.Session() as session:
            assert exported.stats.copied_bytes == 0
            with session.import_message(exported.message, exported.fds) as imported:
                assert pa.array(imported).equals(values.slice(10))
        del arr, mapped


@pytest.mark.parametrize("second", ["other file", "same file, later offset"])
def test_buffer_straddling_adjacent_mappings_is_not_one_region(second: str) -> None:
    """Two file mappings placed back to back (MAP_FIXED) are two regions: a buffer running from the first
    into the second is copied (or refused with copy="never"), never exported as a range of the first file,
    whose bytes past the first mapping are not what the producer sees at those addresses."""
    first_file = b"A" * PAGE + b"a" * PAGE + b"C" * PAGE
    with shm_file(first_file) as fd_a, shm_file(b"B" * PAGE) as fd_b:
        base = raw_mmap(-1, 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # reserve two pages
        try:
            # Python's mmap cannot place a mapping; libc's with MAP_FIXED replaces the reservation.
            assert libc.mmap(base, PAGE, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd_a, 0) == base
            fd, offset = (fd_b, 0) if second == "other file" else (fd_a, 2 * PAGE)
            assert (
                libc.mmap(base + PAGE, PAGE, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, offset)
                == base + PAGE
            )
            expected = memory_at(base + PAGE - 50, 100)
            assert expected[:50] == b"A" * 50
            assert expected[50:] in (b"B" * 50, b"C" * 50)
            # Alone, and after a buffer of the first mapping (its lookup must not be reused for the next).
            for pairs in ([(base + PAGE - 50, 100)], [(base + 8, 16), (base + PAGE - 50, 100)]):
                with export_host_buffers(pairs) as export:
                    assert export.copied_bytes == 100
                    assert placed_bytes(export, len(pairs) - 1, 100) == expected
                    for i, (address, nbytes) in enumerate(pairs):
                        assert placed_bytes(export, i, nbytes) == memory_at(address, nbytes)
                with pytest.raises(CopyRequiredError, match="mapping"):
                    export_host_buffers(pairs, copy="never")
        finally:
            libc.munmap(base, 2 * PAGE)


def test_private_copy_on_write_pages_are_not_shared(shm_ipc_file: str) -> None:
    """In a read-only MAP_PRIVATE file mapping, a copied-on-write page differs from the file: it is copied."""
    size = os.stat(shm_ipc_file).st_size
    with open(shm_ipc_file, "r+b") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # MAP_PRIVATE, writable
    try:
        probe = ctypes.c_char.from_buffer(m)
        base = ctypes.addressof(probe)
        del probe
        pairs = [(base + 16, 100), (base + PAGE + 16, 100)]
        assert find_shared_mapping(*pairs[0]) is None  # writable private: never shared
        m[PAGE + 16 : PAGE + 20] = b"COW!"  # page 1 is now an anonymous copy
        assert libc.mprotect(base, size, mmap.PROT_READ) == 0
        assert find_shared_mapping(*pairs[0]) is not None
        assert find_shared_mapping(*pairs[1]) is None
        with export_host_buffers(pairs) as export:
            assert [r.zero_copy for r in export.regions] == [True, False]
            assert export.copied_bytes == 100
            for i, (address, nbytes) in enumerate(pairs):
                assert placed_bytes(export, i, nbytes) == memory_at(address, nbytes)
            assert placed_bytes(export, 1, 4) == b"COW!"
        with pytest.raises(CopyRequiredError, match="copy-on-write"):
            export_host_buffers(pairs, copy="never")
    finally:
        m.close()


def test_memfd_mapping_via_fd_table_when_map_files_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the capability to open map_files, a mapped memfd is reopened through this process's open fd."""
    monkeypatch.setattr(reopen, "_map_files_open_ok", False)
    data = os.urandom(3 * PAGE)
    with mapped_memfd("aib-test-memfd", data) as (address, fd):
        before = host_stats()
        with export_host_buffers([(address + PAGE, PAGE)], copy="never") as export:
            region = export.regions[0]
            assert region.zero_copy
            assert region.file_offset == PAGE
            assert os.fstat(region.fd).st_ino == os.fstat(fd).st_ino
            assert fcntl.fcntl(region.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            assert placed_bytes(export, 0, PAGE) == data[PAGE : 2 * PAGE]
        assert host_stats().fd_scans - before.fd_scans == 1


def test_memfd_mapping_without_fd_is_copied_when_map_files_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A memfd mapped after its fd was closed cannot be reopened without map_files: copied, or refused."""
    monkeypatch.setattr(reopen, "_map_files_open_ok", False)
    data = os.urandom(PAGE)
    with mapped_memfd("aib-test-orphan", data, keep_fd=False) as (address, _):
        with export_host_buffers([(address, PAGE)]) as export:
            assert not export.regions[0].zero_copy
            assert placed_bytes(export, 0, PAGE) == data
        with pytest.raises(CopyRequiredError, match="map_files"):
            export_host_buffers([(address, PAGE)], copy="never")


def test_memfd_mapping_without_fd_uses_map_files_when_permitted() -> None:
    """With CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE) a memfd with no open fd is reopened via map_files."""
    if not map_files_openable():
        pytest.skip(
            "this process may not open /proc/self/map_files (no CAP_SYS_ADMIN/CAP_CHECKPOINT_RESTORE)"
        )
    data = os.urandom(PAGE)
    with (
        mapped_memfd("aib-test-orphan", data, keep_fd=False) as (address, _),
        export_host_buffers([(address, PAGE)], copy="never") as export,
    ):
        assert export.regions[0].zero_copy
        assert placed_bytes(export, 0, PAGE) == data


# --- text /proc/self/maps fallback (kernels before 6.11) ----------------------------------------------------
@pytest.fixture
def text_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the parsed-text lookup, as on a kernel without PROCMAP_QUERY, with an empty cache."""
    monkeypatch.setattr(proc_maps, "_procmap_query_ok", False)
    monkeypatch.setattr(proc_maps, "_maps_text", proc_maps._MapsText())


@pytest.mark.usefixtures("text_maps")
def test_text_maps_parsed_once_then_cached(shm_ipc_file: str) -> None:
    """Without PROCMAP_QUERY, /proc/self/maps is parsed on a miss and later lookups hit the cache."""
    table = read_mapped(shm_ipc_file)
    pairs = buffer_pairs(table)
    before = host_stats()
    with export_host_buffers(pairs, copy="never") as export:
        assert export.regions[0].zero_copy
        for i, (address, nbytes) in enumerate(pairs):
            assert placed_bytes(export, i, nbytes) == memory_at(address, nbytes)
    middle = host_stats()
    assert middle.maps_parses - before.maps_parses == 1
    assert middle.maps_queries == before.maps_queries
    with export_host_buffers(pairs, copy="never") as export:
        assert export.regions[0].zero_copy
    mapping = find_shared_mapping(*pairs[0])
    assert mapping is not None
    assert mapping.source == "proc_maps_cache"
    assert host_stats().maps_parses == middle.maps_parses
    heap = pa.py_buffer(b"x" * 100)
    with export_host_buffers([(heap.address, heap.size)]) as export:  # heap: copied, no extra parse needed
        assert not export.regions[0].zero_copy


@pytest.mark.usefixtures("text_maps")
def test_text_maps_stale_cache_never_exports_the_replaced_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached mapping replaced at its address by a same-named memfd is detected: the new bytes go out."""
    monkeypatch.setattr(reopen, "_map_files_open_ok", False)  # the hard case: only the fd table can reopen
    old_data, new_data = b"O" * (2 * PAGE), b"N" * (2 * PAGE)
    with mapped_memfd("aib-same-name", old_data) as (address, old_fd):
        with export_host_buffers([(address, 100)], copy="never") as export:
            assert placed_bytes(export, 0, 100) == b"O" * 100
        new_fd = os.memfd_create("aib-same-name", os.MFD_CLOEXEC)
        try:
            os.write(new_fd, new_data)
            assert raw_mmap(new_fd, 2 * PAGE, address=address, flags=mmap.MAP_SHARED | MAP_FIXED) == address
            assert memory_at(address, 4) == b"NNNN"
            with export_host_buffers([(address, 100)], copy="never") as export:
                assert export.regions[0].zero_copy
                assert os.fstat(export.regions[0].fd).st_ino == os.fstat(new_fd).st_ino
                assert os.fstat(export.regions[0].fd).st_ino != os.fstat(old_fd).st_ino
                assert placed_bytes(export, 0, 100) == b"N" * 100
        finally:
            os.close(new_fd)


# --- cross-process ------------------------------------------------------------------------------------------
CHILD = r"""
import fcntl, hashlib, json, mmap, os, sys
spec = json.loads(sys.argv[1])
views = []
for r in spec["regions"]:
    # The consumer's view: the fd mapped read-only, shared, from the page-aligned file offset.
    m = mmap.mmap(r["fd"], r["size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=r["file_offset"])
    views.append(m)
    if r["sealed"]:
        assert fcntl.fcntl(r["fd"], fcntl.F_GET_SEALS) == r["seals"], "seals"
    try:
        mmap.mmap(r["fd"], r["size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                  offset=r["file_offset"])
    except OSError:
        pass
    else:
        raise AssertionError("a region could be mapped writable")
for region, offset, nbytes, digest in spec["buffers"]:
    got = hashlib.sha256(views[region][offset:offset + nbytes]).hexdigest()
    assert got == digest, (region, offset, nbytes)
print("ok", len(spec["buffers"]))
"""


def test_child_process_maps_regions_read_only(shm_ipc_file: str) -> None:
    """A fresh interpreter given only the fds maps every region read-only and sees the exported bytes."""
    mapped = read_mapped(shm_ipc_file)
    heap = pa.array([f"heap-{i}" for i in range(5000)])
    with allocate_shared(PAGE * 2) as shared:
        shared.view()[100:200] = bytes(range(100))
        pairs = [*buffer_pairs(mapped), *buffer_pairs(heap), (shared.address + 100, 100), (0, 0)]
        with export_host_buffers(pairs) as export:
            assert sorted(r.zero_copy for r in export.regions) == [False, True, True]
            spec = {
                "regions": [
                    {
                        "fd": r.fd,
                        "file_offset": r.file_offset,
                        "size": r.size,
                        "sealed": r.sealed,
                        "seals": r.seals,
                    }
                    for r in export.regions
                ],
                "buffers": [
                    [p.region, p.offset, n, hashlib.sha256(memory_at(a, n)).hexdigest()]
                    for (a, n), p in zip(pairs, export.placements, strict=True)
                    if p is not None
                ],
            }
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(spec)],
                pass_fds=export.fds(),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ok {len(pairs) - 1}"


# --- policy, validation, lifetimes --------------------------------------------------------------------------
def test_empty_and_null_buffers_get_no_placement() -> None:
    """Zero-length and NULL (0, 0) buffers get placement None and need no region at all."""
    heap = pa.py_buffer(b"payload")
    with export_host_buffers([(0, 0), (heap.address, 0), (heap.address, heap.size)]) as export:
        assert export.placements[:2] == [None, None]
        assert export.placements[2] == Placement(0, 0)
    for policy in ("never", "if_needed", "always"):
        with export_host_buffers([(0, 0), (12345, 0)], copy=policy) as export:
            assert export.regions == []
            assert export.placements == [None, None]
            assert export.fds() == []
    with export_host_buffers([]) as export:
        assert export.placements == []
        assert export.copied_bytes == 0


@pytest.mark.parametrize(
    ("pairs", "match"),
    [
        ([(4096, -1)], "negative size"),
        ([(-4096, 10)], "address space"),
        ([((1 << 64) - 8, 16)], "address space"),
        ([(0, 5)], "NULL address"),
        ([(4096,)], "pair of integers"),
        ([("0x1000", 4)], "pair of integers"),
        ([(4096.0, 4)], "pair of integers"),
    ],
)
def test_invalid_buffers_raise_region_error(pairs: list[tuple[int, int]], match: str) -> None:
    """Negative sizes, ranges past 2**64, NULL with bytes, non-integer pairs:
    InvalidArgumentError, no fd left."""
    fds_before = fd_count()
    with pytest.raises(InvalidArgumentError, match=match):
        export_host_buffers(pairs)
    assert fd_count() == fds_before


def test_invalid_policy_and_allocation_raise_region_error() -> None:
    """An unknown copy policy given to the placement itself raises InvalidArgumentError; a non-positive
    allocation or a bad memfd name are argument errors of allocate_shared (InvalidArgumentError, a
    ValueError naming the argument), refused before any memfd is made."""
    with pytest.raises(InvalidArgumentError, match="copy must be one of"):
        export_host_buffers([], copy="sometimes")
    with pytest.raises(InvalidArgumentError, match=r"^nbytes must be an int >= 1"):
        allocate_shared(0)
    with pytest.raises(InvalidArgumentError, match=r"^name must be 1 to 249 bytes"):
        allocate_shared(10, name="bad\0name")
    with pytest.raises(InvalidArgumentError, match=r"^name must be 1 to 249 bytes"):
        allocate_shared(10, name="n" * 300)


def test_failure_midway_closes_opened_fds(shm_ipc_file: str) -> None:
    """When the copy fails after zero-copy regions were opened, every fd opened so far is closed."""
    table = read_mapped(shm_ipc_file)  # keep it alive: its buffers must stay mapped
    pairs = [*buffer_pairs(table), (PAGE, 64)]
    fds_before = fd_count()
    with pytest.raises(InvalidArgumentError):
        export_host_buffers(pairs)
    assert fd_count() == fds_before


def test_no_fd_leak_over_many_exports(shm_ipc_file: str) -> None:
    """Hundreds of exports of every kind, errors included, leave the process fd count unchanged."""
    table = read_mapped(shm_ipc_file)
    heap = pa.array(range(1000))
    mapped_pairs, heap_pairs = buffer_pairs(table), buffer_pairs(heap)
    fds_before = fd_count()
    for _ in range(50):
        with allocate_shared(PAGE) as shared:
            for policy in ("if_needed", "always"):
                export_host_buffers([*mapped_pairs, *heap_pairs, (shared.address, PAGE)], copy=policy).close()
            with pytest.raises(CopyRequiredError):
                export_host_buffers([*mapped_pairs, *heap_pairs], copy="never")
            with pytest.raises(InvalidArgumentError):
                export_host_buffers([*mapped_pairs, (0, 1)])
        gone = export_host_buffers(heap_pairs)
        del gone  # garbage collection closes the fds too
    assert fd_count() == fds_before


def test_close_is_idempotent_and_fds_invalid_after() -> None:
    """close() twice is harmless; fds() after close raises ClosedError; the fds are really closed."""
    heap = pa.py_buffer(b"abc" * 100)
    export = export_host_buffers([(heap.address, heap.size)])
    (fd,) = export.fds()
    assert not export.closed
    export.close()
    export.close()
    assert export.closed
    with pytest.raises(ClosedError) as raised:
        export.fds()
    assert raised.value.reason == "closed"
    with pytest.raises(OSError, match="Bad file descriptor") as info:
        os.fstat(fd)
    assert info.value.errno == errno.EBADF
    with export_host_buffers([(heap.address, heap.size)]) as export:
        pass
    export.close()
    assert export.closed
    assert "closed" in repr(export)


def test_shared_buffer_outlives_close_while_pyarrow_uses_it() -> None:
    """close() drops only the owner's reference: memory stays mapped until the last pyarrow buffer is gone."""
    shared = allocate_shared(PAGE * 4)
    shared.view()[:5] = b"alive"
    data = shared.as_pyarrow()
    address = shared.address
    shared.close()
    shared.close()
    assert shared.closed
    with pytest.raises(ClosedError) as raised:
        _ = shared.address
    assert raised.value.reason == "closed"
    with pytest.raises(ClosedError) as raised:
        shared.as_pyarrow()
    assert raised.value.reason == "closed"
    assert data.to_pybytes()[:5] == b"alive"  # still mapped
    mapping = find_shared_mapping(address, 5)
    assert mapping is not None
    assert mapping.source == "registry"
    with export_host_buffers([(address, 5)], copy="never") as export:
        assert placed_bytes(export, 0, 5) == b"alive"
    del data
    gc.collect()
    assert shared_alloc._registry_lookup(address, 1) is None  # unregistered, unmapped and its fd closed
    assert find_shared_mapping(address, 5) is None


def test_shared_buffer_fd_closed_when_last_reference_goes() -> None:
    """Dropping every reference unmaps the memory and closes the memfd (no leak)."""
    fds_before = fd_count()
    buffers = [allocate_shared(PAGE) for _ in range(20)]
    assert fd_count() == fds_before + 20
    assert host_stats().shared_allocations >= 20
    for b in buffers:
        b.close()
    del buffers
    gc.collect()
    assert fd_count() == fds_before


class _ShortWritingCore:
    """Wraps the module's C core so that pwritev writes only its first vector, as a short write would."""

    def __init__(self, real: object) -> None:
        self._real = real
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)

    def aib_sys_pwritev(self, fd: int, pairs: object, count: int, offset: int, error: object) -> int:
        self.calls += 1
        return int(self._real.aib_sys_pwritev(fd, pairs, 1, offset, error))  # type: ignore[attr-defined]


def test_short_pwritev_is_resumed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short pwritev (the kernel caps one call at 0x7ffff000 bytes) is finished buffer by buffer."""
    fake = _ShortWritingCore(sealed_copy.lib)
    monkeypatch.setattr(sealed_copy, "lib", fake)
    bufs = [pa.py_buffer(bytes([i]) * (100 + i)) for i in range(5)]
    with export_host_buffers([(b.address, b.size) for b in bufs], copy="always") as export:
        for i, b in enumerate(bufs):
            assert placed_bytes(export, i, b.size) == b.to_pybytes()
    assert fake.calls == 1


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_forked_child_queries_its_own_mappings() -> None:
    """After fork the child reopens /proc/self/maps: it finds a mapping only it has, not the parent's view."""
    heap = pa.py_buffer(b"warm")
    assert find_shared_mapping(heap.address, heap.size) is None  # opens the parent's query fd
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            with mapped_memfd("aib-child", b"c" * PAGE) as (address, fd):
                mapping = find_shared_mapping(address, PAGE)
                code = 0 if mapping is not None and mapping.inode == os.fstat(fd).st_ino else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
