"""Producer side of host-memory regions: place Arrow buffers in files another process can map read-only.

An Arrow buffer is an address in this process. To hand it to a consumer on the same host without copying,
the buffer must lie in a *region*: a file descriptor plus a page-aligned byte range that the consumer maps
``PROT_READ``/``MAP_SHARED``. Only the fds (sent with SCM_RIGHTS by the transport) and a small metadata
message cross; :func:`export_host_buffers` decides, per buffer, where its bytes live:

* **zero-copy** -- the buffer already lies in a file mapping whose pages *are* the file's pages:

  - memory from :func:`allocate_shared` (a bridge-owned memfd, found in a registry without reading /proc);
  - any ``MAP_SHARED`` file mapping (a memfd, a /dev/shm file, ``pa.memory_map(path, "r+")``);
  - a read-only ``MAP_PRIVATE`` file mapping whose pages covering the buffer were never copied-on-write. This
    is what ``pa.memory_map(path)`` makes (Arrow maps read-only files ``MAP_PRIVATE``), so it is the common
    case of an IPC file under /dev/shm. Untouched or read-faulted private pages are the page-cache pages of
    the file; a copied-on-write page is not, and is detected through /proc/self/pagemap.

  Buffers in the same mapping share one region (one fd, one range covering all of them). The fd opens the
  whole file, not only that range: a consumer can read every byte of the file (an allocate_shared
  allocation, an IPC file), and can write it where the file lets it -- never for allocate_shared memory
  (sealed with F_SEAL_FUTURE_WRITE), otherwise as the file's permissions allow (docs/security.md).

* **copy** -- everything else (heap memory from Arrow's allocator) is written into ONE new memfd per export,
  each buffer at a 64-byte aligned offset, then the memfd is sealed against shrink, grow and write so the
  consumer can verify the producer can never truncate it under its mapping (which would SIGBUS the reader).

The policy (``copy="never" | "if_needed" | "always"``) is explicit and every copied byte is counted in
:func:`host_stats`: a copy instead of zero-copy happens only by explicit, counted policy.

Finding the mapping behind an address uses the ``PROCMAP_QUERY`` ioctl on /proc/self/maps (Linux 6.11+): one
~2-4 us kernel lookup that is always current. On older kernels the text of /proc/self/maps is parsed once and
cached; a lookup re-parses on a miss, and a cached hit on a file mapping is re-validated with one readlink of
/proc/self/map_files/START-END (mappings change: a stale hit must never export the wrong file).
"""

from __future__ import annotations

import array
import bisect
import contextlib
import errno
import fcntl
import mmap
import operator
import os
import stat
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, NamedTuple, NoReturn

import cffi

from ..errors import CopyRequiredError, RegionError, ReleasedError

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "HostRegion",
    "Placement",
    "HostExport",
    "export_host_buffers",
    "SharedHostBuffer",
    "allocate_shared",
    "SharedMapping",
    "find_shared_mapping",
    "HostExportStats",
    "host_stats",
    "COPY_POLICIES",
    "BUFFER_ALIGNMENT",
    "FULL_SEALS",
    "F_SEAL_FUTURE_WRITE",
]

COPY_POLICIES: Final = ("never", "if_needed", "always")
#: Alignment of each buffer inside a copy region (Arrow's recommended buffer alignment).
BUFFER_ALIGNMENT: Final = 64
#: Seals of a copy region: the consumer may rely on the bytes and the size never changing.
FULL_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_CONTENT_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
# F_SEAL_FUTURE_WRITE (Linux 5.1; <linux/fcntl.h> 0x0010, missing from the fcntl module before Python 3.12):
# write(), fallocate hole punching and *new* writable shared mappings fail with EPERM for every fd of the
# file, while mappings that already exist stay writable.
F_SEAL_FUTURE_WRITE: Final = int(getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010))
# allocate_shared() memory: the size is fixed (a consumer's mapping can never SIGBUS from a truncation) and
# the owner's one writable mapping, made before the seal, is the only way to write it. Any holder of an fd
# can reopen a memfd read-write through /proc/PID/fd (its inode is mode 0777, whatever the uid), so without
# the write seal every consumer could change the data under the producer and the other consumers.
# F_SEAL_SEAL is left off so a later "freeze" can add F_SEAL_WRITE once the owner's mapping is gone.
_SHARED_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE

_PAGE: Final = mmap.PAGESIZE
_ADDRESS_LIMIT: Final = 1 << 64
# O_NONBLOCK: if a path in the maps was replaced by a FIFO, opening it must not hang (files ignore it).
_RDONLY: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_DELETED: Final = " (deleted)"

# --- raw memory access --------------------------------------------------------------------------------------
# cffi in ABI mode (no compiler needed) rather than Python's mmap module: allocate_shared() needs the raw
# address of a MAP_SHARED mapping, and getting it from an mmap.mmap object means holding a buffer export
# (ctypes.c_char.from_buffer / ffi.from_buffer) that makes mmap.close() fail until it is dropped. Calling
# mmap/munmap directly gives a plain address with an explicit unmap, and ffi.gc() ties the unmap to the
# lifetime of one cdata object that pyarrow buffers and memoryviews can hold (see SharedHostBuffer).
_ffi = cffi.FFI()
_ffi.cdef(
    """
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset);
    int munmap(void *addr, size_t length);
    int ioctl(int fd, unsigned long request, ...);
    struct iovec { void *iov_base; size_t iov_len; };
    ssize_t pwritev(int fd, const struct iovec *iov, int iovcnt, long offset);
    struct procmap_query {
        uint64_t size, query_flags, query_addr;
        uint64_t vma_start, vma_end, vma_flags, vma_page_size, vma_offset, inode;
        uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
        uint64_t vma_name_addr, build_id_addr;
    };
    """
)
_libc: Any = _ffi.dlopen(None)
_MAP_FAILED: Final = _ffi.cast("void *", -1)

# <linux/fs.h>: PROCMAP_QUERY = _IOWR('f', 17, struct procmap_query); vma_flags bits.
_PROCMAP_QUERY_SIZE: Final = int(_ffi.sizeof("struct procmap_query"))
_PROCMAP_QUERY: Final = (3 << 30) | (_PROCMAP_QUERY_SIZE << 16) | (ord("f") << 8) | 17
_VMA_READABLE, _VMA_WRITABLE, _VMA_SHARED = 0x1, 0x2, 0x8
_NAME_MAX: Final = 4096


# --- public records -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostRegion:
    """One file range the consumer maps read-only; several buffers may be placed in it."""

    fd: int  # owned by the HostExport; closed by HostExport.close()
    file_offset: int  # page aligned
    size: int  # bytes the consumer must map from file_offset
    zero_copy: bool
    sealed: bool  # memfd sealed against shrink/grow/write
    seals: int = 0  # the file's F_GET_SEALS bits (0 where the file does not support seals)


@dataclass(frozen=True)
class Placement:
    """Where one input buffer lies: ``regions[region]`` at byte ``offset`` from the region's start."""

    region: int  # index into HostExport.regions
    offset: int  # byte offset of the buffer inside the region


class SharedMapping(NamedTuple):
    """A file mapping of this process that can back zero-copy regions (diagnostics; see find_shared_mapping).

    ``source`` says how it was found: ``"registry"`` (allocate_shared, no /proc read), ``"procmap_query"``
    (ioctl on /proc/self/maps, Linux 6.11+), ``"proc_maps"`` (text of /proc/self/maps parsed for this lookup)
    or ``"proc_maps_cache"`` (an earlier parse, re-validated with a readlink of /proc/self/map_files).

    A NamedTuple rather than a frozen dataclass: one is built per lookup on the export path, and a 13-field
    frozen dataclass costs several times more to construct (object.__setattr__ per field).
    """

    start: int  # first address of the mapping
    end: int  # one past its last address
    file_offset: int  # file offset mapped at ``start``
    dev_major: int
    dev_minor: int
    inode: int
    path: str  # as the kernel shows it: "/dev/shm/x.arrow", "/memfd:aib (deleted)", ...
    readable: bool
    writable: bool
    shared: bool  # MAP_SHARED; MAP_PRIVATE is shared only read-only and with the buffer's pages unmodified
    page_size: int  # mapping page size (larger than the base page for hugetlbfs)
    source: str
    registry_fd: int = -1  # allocate_shared's memfd (borrowed), -1 otherwise


@dataclass(frozen=True)
class HostExportStats:
    """Snapshot of the module's counters since import (see :func:`host_stats`)."""

    exports: int = 0  # export_host_buffers calls that succeeded
    copied_bytes: int = 0  # bytes copied into copy regions (excluding alignment padding)
    copied_buffers: int = 0
    copy_regions: int = 0  # memfds created for copies
    zero_copy_regions: int = 0
    zero_copy_buffers: int = 0
    zero_copy_bytes: int = 0
    maps_queries: int = 0  # PROCMAP_QUERY ioctls
    maps_parses: int = 0  # reads of the text of /proc/self/maps (kernels without PROCMAP_QUERY)
    fd_scans: int = 0  # scans of /proc/self/fd to reopen a deleted file or memfd
    shared_allocations: int = 0  # allocate_shared calls


_stats_lock = threading.Lock()
_stats: dict[str, int] = dict.fromkeys(HostExportStats.__dataclass_fields__, 0)


def _count(**deltas: int) -> None:
    with _stats_lock:
        for key, value in deltas.items():
            _stats[key] += value


def host_stats() -> HostExportStats:
    """A snapshot of how many bytes were copied and how many zero-copy regions were made, since import."""
    with _stats_lock:
        return HostExportStats(**_stats)


# --- the export ---------------------------------------------------------------------------------------------
def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        # Nothing useful to do about EBADF/EIO on close; keep closing the others.
        with contextlib.suppress(OSError):
            os.close(fd)


class HostExport:
    """The regions and placements of one export. Owns the region fds: close it (or use ``with``) once sent.

    The fds are closed by :meth:`close`, by ``with``, or when the object is garbage collected.
    """

    regions: list[HostRegion]
    placements: list[Placement | None]
    copied_bytes: int

    def __init__(
        self, regions: list[HostRegion], placements: list[Placement | None], copied_bytes: int
    ) -> None:
        self.regions = regions
        self.placements = placements
        self.copied_bytes = copied_bytes
        self._closer = weakref.finalize(self, _close_fds, tuple(r.fd for r in regions))
        self._closer.atexit = False  # the process exit closes them anyway

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def fds(self) -> list[int]:
        """The region fds in region order (borrowed: they stay owned by this export)."""
        if self.closed:
            raise ReleasedError("the HostExport is closed: its fds are no longer valid")
        return [r.fd for r in self.regions]

    def close(self) -> None:
        """Close every region fd; idempotent. A consumer that already received them keeps its own copies."""
        self._closer()

    def __enter__(self) -> HostExport:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        zero = sum(r.zero_copy for r in self.regions)
        state = "closed" if self.closed else "open"
        return (
            f"<HostExport {state}: {len(self.placements)} buffers, {len(self.regions)} regions "
            f"({zero} zero-copy), {self.copied_bytes} bytes copied>"
        )


def _validate(buffers: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pairs as plain ints; RegionError naming the first bad one.

    The common all-valid case is checked with C-level builtins over whole lists (min/max/in), not a Python
    loop of comparisons per buffer: validation stays a small part of exporting many small buffers.
    """
    try:
        items = [(operator.index(a), operator.index(n)) for a, n in buffers]
    except (TypeError, ValueError):
        items = []  # some pair is malformed: the loop below finds and names it
    else:
        addresses = [a for a, _ in items]
        sizes = [n for _, n in items]
        if not items or (
            min(sizes) >= 0
            and min(addresses) >= 0
            and max(map(operator.add, addresses, sizes)) <= _ADDRESS_LIMIT
            and (0 not in addresses or not any(n for a, n in items if a == 0))
        ):
            return items
    for i, item in enumerate(buffers):
        try:
            raw_address, raw_nbytes = item
            address, nbytes = operator.index(raw_address), operator.index(raw_nbytes)
        except (TypeError, ValueError) as exc:
            raise RegionError(
                f"buffer {i} must be an (address, nbytes) pair of integers, got {item!r}", index=i
            ) from exc
        if nbytes < 0:
            raise RegionError(f"buffer {i} has a negative size ({nbytes})", index=i, nbytes=nbytes)
        if address < 0 or address + nbytes > _ADDRESS_LIMIT:
            raise RegionError(
                f"buffer {i} at address {address:#x} with {nbytes} bytes is outside the 64-bit address space",
                index=i,
                address=address,
                nbytes=nbytes,
            )
        if address == 0 and nbytes > 0:
            raise RegionError(f"buffer {i} has a NULL address but {nbytes} bytes", index=i, nbytes=nbytes)
    raise AssertionError("unreachable: the fast check failed but no pair is invalid")  # pragma: no cover


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _get_seals(fd: int) -> int:
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: the filesystem has no seals (ext4, xfs, ...)
        return 0


@dataclass
class _Group:
    """Buffers that fall in one mapping and will share one zero-copy region."""

    mapping: SharedMapping
    indices: list[int]
    low: int
    high: int


def export_host_buffers(buffers: Sequence[tuple[int, int]], *, copy: str = "if_needed") -> HostExport:
    """Place each ``(address, nbytes)`` buffer in a region a consumer process can map read-only.

    ``copy="if_needed"`` (default) shares what lies in a shareable file mapping and copies the rest into one
    sealed memfd; ``"never"`` raises :class:`CopyRequiredError` instead of copying; ``"always"`` copies every
    buffer (detaching the consumer from this process's memory). Empty buffers get placement ``None``.
    On any failure every fd opened so far is closed.
    """
    if copy not in COPY_POLICIES:
        raise RegionError(f"copy must be one of {', '.join(COPY_POLICIES)}, got {copy!r}", field="copy")
    items = _validate(buffers)
    placements: list[Placement | None] = [None] * len(items)
    regions: list[HostRegion] = []
    live = [i for i, (_address, nbytes) in enumerate(items) if nbytes > 0]
    to_copy: list[int] = live if copy == "always" else []
    zero_bytes = zero_buffers = copied = 0
    try:
        if copy != "always":
            groups, to_copy = _group_by_mapping(items, live, never=copy == "never")
            if to_copy and copy == "never":
                _raise_copy_required(items, to_copy)  # before opening any file
            for group in groups:
                opened = _open_zero_copy_region(group)
                if opened is None:
                    if copy == "never":
                        _raise_copy_required(items, group.indices)
                    to_copy.extend(group.indices)
                    continue
                region, aligned_low = opened
                regions.append(region)
                for i in group.indices:
                    placements[i] = Placement(len(regions) - 1, items[i][0] - aligned_low)
                    zero_bytes += items[i][1]
                zero_buffers += len(group.indices)
        if to_copy:
            to_copy.sort()
            copy_items = [items[i] for i in to_copy]
            fd, total, offsets = _copy_to_memfd(copy_items)
            regions.append(HostRegion(fd, 0, total, zero_copy=False, sealed=True, seals=FULL_SEALS))
            index = len(regions) - 1
            for i, offset in zip(to_copy, offsets, strict=True):
                placements[i] = Placement(index, offset)
            copied = sum(n for _, n in copy_items)
    except BaseException:
        _close_fds([r.fd for r in regions])
        raise
    _count(
        exports=1,
        copied_bytes=copied,
        copied_buffers=len(to_copy),
        copy_regions=1 if to_copy else 0,
        zero_copy_regions=len(regions) - (1 if to_copy else 0),
        zero_copy_buffers=zero_buffers,
        zero_copy_bytes=zero_bytes,
    )
    return HostExport(regions, placements, copied)


def _raise_copy_required(items: list[tuple[int, int]], indices: list[int]) -> NoReturn:
    first = min(indices)
    address, nbytes = items[first]
    raise CopyRequiredError(
        f"buffer {first} at {address:#x} ({nbytes} bytes) cannot be shared zero-copy "
        f"({_explain_not_shareable(address, nbytes)}); export it with copy='if_needed' to copy it "
        "into a sealed memfd (counted in host_stats()), or allocate the data with "
        "arrow_ipc_bridge.memory.host.allocate_shared()",
        index=first,
        address=address,
        nbytes=nbytes,
    )


def _group_by_mapping(
    items: list[tuple[int, int]], live: list[int], *, never: bool
) -> tuple[list[_Group], list[int]]:
    """Split the live buffers into per-mapping groups (zero-copy candidates) and the rest (to copy).

    With ``never`` the first buffer that must be copied ends the scan: the export fails on it anyway.
    """
    groups: dict[tuple[int, ...], _Group] = {}
    rest: list[int] = []
    mapping: SharedMapping | None = None
    group: _Group | None = None  # the current mapping's group, once it has a buffer
    start = stop = 0
    verdict = ""
    # Address order lets consecutive buffers of one mapping reuse one lookup and one verdict; the loop body
    # is kept to a few operations per buffer because exports of many small buffers are common.
    for i in sorted(live, key=lambda k: items[k][0]):
        address, nbytes = items[i]
        end = address + nbytes
        if mapping is None or address < start or end > stop:
            mapping = _lookup(address, nbytes, insist=never)
            if mapping is None:
                verdict = "the address is not mapped"
            else:
                start, stop = mapping.start, mapping.end
                verdict = _mapping_verdict(mapping) if end <= stop else "it spans mappings"
                group = groups.get(_identity(mapping))
        if verdict != _SHARE and (verdict != _CHECK_PAGES or not _pages_unmodified(address, nbytes)):
            rest.append(i)
            if never:
                break
            continue
        if group is None:
            assert mapping is not None
            group = groups[_identity(mapping)] = _Group(mapping, [i], address, end)
        else:
            group.indices.append(i)
            group.high = max(group.high, end)
    # Sorted by address, so each group's first buffer is its lowest. Regions follow the caller's order of
    # first buffers, so the layout does not depend on where the allocator put things.
    ordered = sorted(groups.values(), key=lambda g: min(g.indices))
    for group in ordered:
        group.indices.sort()
    return ordered, rest


def _open_zero_copy_region(group: _Group) -> tuple[HostRegion, int] | None:
    """Open a read-only fd on the group's file; return the region covering its buffers and its address."""
    mapping: SharedMapping | None = group.mapping
    fd = _open_mapping_file(group.mapping)
    if fd is None and group.mapping.source == "proc_maps_cache":
        # The cached line may describe a mapping replaced since: re-parse, and only if the buffers are still
        # shareable in what is mapped now, open that (fresh data may use every fallback).
        mapping = _lookup(group.low, group.high - group.low, insist=True, refresh=True)
        if mapping is not None and _not_shareable(mapping, group.low, group.high - group.low) is None:
            fd = _open_mapping_file(mapping)
    if fd is None or mapping is None:
        return None
    alignment = max(_PAGE, mapping.page_size)
    aligned_low = mapping.start + (group.low - mapping.start) // alignment * alignment
    file_offset = mapping.file_offset + (aligned_low - mapping.start)
    size = group.high - aligned_low
    try:
        st = os.fstat(fd)
        # The consumer refuses a range past EOF (a mapping touched beyond the file's last page raises SIGBUS);
        # bytes past EOF in the last page read as zeros but are not the file's, so copy such a buffer instead.
        if file_offset + size > st.st_size:
            os.close(fd)
            return None
        seals = _get_seals(fd)
    except BaseException:
        os.close(fd)
        raise
    sealed = seals & _CONTENT_SEALS == _CONTENT_SEALS
    return HostRegion(fd, file_offset, size, zero_copy=True, sealed=sealed, seals=seals), aligned_low


# --- the copy path ------------------------------------------------------------------------------------------
def _copy_to_memfd(items: list[tuple[int, int]]) -> tuple[int, int, list[int]]:
    """Copy the buffers into one new sealed memfd at 64-byte aligned offsets; return (fd, size, offsets).

    The bytes go in with pwritev(2) (one syscall for up to 512 buffers, padding written from a static zero
    block) rather than mmap + memmove. Measured on this kind of host it is about 2x faster for large buffers
    (a fresh memfd page written through a mapping is first zero-filled by the fault, then copied over; a
    whole-page write skips both the zeroing and the fault) and several times faster for many small ones
    (one syscall, no Python object per buffer). There is also no writable mapping to unmap before
    F_SEAL_WRITE, and an unreadable source address fails with EFAULT instead of crashing the process.
    """
    offsets: list[int] = []
    iov = array.array("Q")  # struct iovec[] on LP64: (base, length) pairs
    total = 0
    for address, nbytes in items:
        offsets.append(total)
        pad = -nbytes % BUFFER_ALIGNMENT
        iov.extend((address, nbytes, _ZEROS_ADDRESS, pad) if pad else (address, nbytes))
        total += nbytes + pad
    fd = os.memfd_create("aib-copy", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, total)
        _write_iov(fd, iov)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, FULL_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, total, offsets


_ZEROS = _ffi.new("char[]", BUFFER_ALIGNMENT)  # source of the padding between buffers
_ZEROS_ADDRESS: Final = int(_ffi.cast("uintptr_t", _ZEROS))
_IOV_MAX: Final = 1024  # Linux UIO_MAXIOV


def _write_iov(fd: int, iov: array.array[int]) -> None:
    """Write the (base, length) pairs back to back from file offset 0, in batches of _IOV_MAX entries."""
    offset = 0
    for first in range(0, len(iov), 2 * _IOV_MAX):
        batch = iov[first : first + 2 * _IOV_MAX]
        expected = sum(batch[1::2])
        written = _libc.pwritev(
            fd, _ffi.cast("struct iovec *", _ffi.from_buffer(batch)), len(batch) // 2, offset
        )
        if written != expected:
            # Error (-1), or a short write: at most 0x7ffff000 bytes go per call, and a signal can cut one.
            # Finish buffer by buffer from where it stopped; a bad address then fails naming itself.
            done = max(written, 0)
            for k in range(0, len(batch), 2):
                base, length = batch[k], batch[k + 1]
                if done < length:
                    _pwrite_all(fd, base + done, length - done, offset + done)
                offset += length
                done = max(done - length, 0)
            continue
        offset += expected


def _pwrite_all(fd: int, address: int, nbytes: int, offset: int) -> None:
    view = memoryview(_ffi.buffer(_ffi.cast("char *", address), nbytes))
    done = 0
    try:
        while done < nbytes:
            done += os.pwrite(fd, view[done:], offset + done)
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            raise RegionError(
                f"buffer at {address:#x} ({nbytes} bytes) is not readable memory of this process "
                f"(EFAULT at byte {done})",
                address=address,
                nbytes=nbytes,
            ) from exc
        raise RegionError(f"could not copy {nbytes} bytes into a memfd: {exc}", nbytes=nbytes) from exc
    finally:
        view.release()


# --- allocate_shared and its registry -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Registered:
    start: int
    end: int
    fd: int
    dev: int
    inode: int


# RLock: the ffi.gc destructor that unregisters a buffer may run from garbage collection in a thread that is
# inside a registry lookup; a plain Lock would deadlock there.
_registry_lock = threading.RLock()
_registry_starts: list[int] = []
_registry: dict[int, _Registered] = {}


def _after_fork_in_child() -> None:
    # A parent thread may have held these at the fork; the child's copies would stay locked. (The
    # registered buffers stay: the child inherited their mappings.)
    global _stats_lock, _registry_lock
    _stats_lock = threading.Lock()
    _registry_lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _registry_lookup(address: int, nbytes: int) -> _Registered | None:
    with _registry_lock:
        k = bisect.bisect_right(_registry_starts, address) - 1
        if k < 0:
            return None
        entry = _registry.get(_registry_starts[k])
    if entry is None or address + nbytes > entry.end:
        return None
    return entry


def _release_shared(start: int, length: int, fd: int, _cdata: Any) -> None:
    """ffi.gc destructor of a SharedHostBuffer's memory: unregister, unmap, close. Must never raise."""
    with _registry_lock:
        if _registry.pop(start, None) is not None:
            del _registry_starts[bisect.bisect_left(_registry_starts, start)]
    _libc.munmap(_ffi.cast("void *", start), length)
    with contextlib.suppress(OSError):
        os.close(fd)


class SharedHostBuffer:
    """A bridge-owned memfd mapping (``MAP_SHARED``, writable by its owner) whose contents export zero-copy.

    Fill it through :meth:`view` or wrap it with :meth:`as_pyarrow` and build arrays on it. The memory stays
    mapped while any view or pyarrow buffer made from it is alive: :meth:`close` only drops this owner's
    reference, so closing can never leave an array pointing at unmapped memory.

    The memfd is sealed against shrink and grow, so a consumer's mapping can never SIGBUS, and with
    ``F_SEAL_FUTURE_WRITE``: the mapping made at allocation (behind :meth:`view` and :meth:`as_pyarrow`) is
    the only way to write it. ``write()`` on :attr:`fd`, new writable mappings and hole punching fail with
    ``EPERM`` for every process, this one included, so no consumer can change the data (a consumer can
    reopen the memfd read-write through /proc, memfd inodes being mode 0777, but cannot write through it).
    The owner's writes stay visible to consumers: the memory is shared, not frozen.
    """

    def __init__(self, keeper: Any, address: int, size: int, fd: int) -> None:
        self._keeper: Any = keeper  # the ffi.gc cdata whose collection unmaps the memory
        self._address = address
        self._size = size
        self._fd = fd

    def _live(self) -> Any:
        if self._keeper is None:
            raise ReleasedError("the SharedHostBuffer is closed")
        return self._keeper

    @property
    def address(self) -> int:
        self._live()
        return self._address

    @property
    def size(self) -> int:
        return self._size

    @property
    def fd(self) -> int:
        """The memfd (borrowed: do not close it; exports reopen it read-only)."""
        self._live()
        return self._fd

    @property
    def closed(self) -> bool:
        return self._keeper is None

    def view(self) -> memoryview:
        """A writable memoryview of the memory; it keeps the mapping alive."""
        return memoryview(_ffi.buffer(self._live(), self._size))

    def as_pyarrow(self) -> pa.Buffer:
        """The memory as a ``pyarrow.Buffer`` (zero-copy); it keeps the mapping alive."""
        import pyarrow as pa  # lazy: exporting works without importing pyarrow

        return pa.foreign_buffer(self._address, self._size, base=self._live())

    def close(self) -> None:
        """Drop the owner's reference; idempotent. Unmapped once no view or pyarrow buffer uses it."""
        self._keeper = None

    def __enter__(self) -> SharedHostBuffer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"at {self._address:#x}, fd {self._fd}"
        return f"<SharedHostBuffer {self._size} bytes {state}>"


def allocate_shared(nbytes: int, *, name: str = "aib") -> SharedHostBuffer:
    """Allocate ``nbytes`` of zero-filled shared memory that :func:`export_host_buffers` shares zero-copy.

    ``name`` labels the memfd (it shows as ``/memfd:NAME`` in /proc/PID/maps of both processes).

    Write the memory through the result's :meth:`~SharedHostBuffer.view` or
    :meth:`~SharedHostBuffer.as_pyarrow`; nothing else can write it, consumers included (see
    :class:`SharedHostBuffer`).

    A zero-copy export hands consumers an fd on the *whole* allocation, not only the buffers published: a
    consumer can read every byte of it, including bytes never published (stale data, other arrays built
    in the same allocation). Give data that must not reach a consumer an allocation of its own, or export
    with ``copy="always"``, which sends a sealed copy of the published bytes alone.

    Raises :class:`RegionError` for a size that is not positive, a bad name, or a kernel without
    ``F_SEAL_FUTURE_WRITE`` (before Linux 5.1): memory that consumers could write is never handed out.
    """
    nbytes = operator.index(nbytes)
    if nbytes <= 0:
        raise RegionError(f"allocate_shared needs a positive size, got {nbytes}", nbytes=nbytes)
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, ValueError) as exc:  # EINVAL: name over 249 bytes; ValueError: embedded NUL
        raise RegionError(f"memfd_create({name!r}) failed: {exc}", field="name") from exc
    length = _align_up(nbytes, _PAGE)
    pointer = _MAP_FAILED
    try:
        os.ftruncate(fd, nbytes)
        st = os.fstat(fd)
        pointer = _libc.mmap(_ffi.NULL, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if pointer == _MAP_FAILED:
            code = _ffi.errno
            raise RegionError(f"mmap of {nbytes} shared bytes failed: {os.strerror(code)}", nbytes=nbytes)
        _seal_shared(fd)  # after the mmap: from now on no new writable mapping can be made
    except BaseException:
        if pointer != _MAP_FAILED:
            _libc.munmap(pointer, length)
        os.close(fd)
        raise
    address = int(_ffi.cast("uintptr_t", pointer))
    entry = _Registered(address, address + nbytes, fd, st.st_dev, st.st_ino)
    with _registry_lock:
        _registry[address] = entry
        bisect.insort(_registry_starts, address)
    keeper = _ffi.gc(_ffi.cast("char *", pointer), lambda cdata: _release_shared(address, length, fd, cdata))
    _count(shared_allocations=1)
    return SharedHostBuffer(keeper, address, nbytes, fd)


def _seal_shared(fd: int) -> None:
    """Add _SHARED_SEALS; RegionError (no fallback) on a kernel without F_SEAL_FUTURE_WRITE (before 5.1)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SHARED_SEALS)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise RegionError(f"sealing the shared memfd failed: {exc}") from exc
        raise RegionError(
            f"this kernel ({os.uname().release}) does not support F_SEAL_FUTURE_WRITE (Linux 5.1+): "
            "allocate_shared memory could not be protected against writes by its consumers, so it is "
            "refused; build the data in ordinary memory and export it with copy='if_needed' or 'always' "
            "(a sealed, counted copy)"
        ) from exc


# --- finding the mapping behind an address ------------------------------------------------------------------
class _ProcFile:
    """A /proc/self file kept open for repeated queries, reopened in a forked child (whose 'self' differs)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._fd = -1
        self._pid = -1
        self._lock = threading.Lock()

    def fd(self) -> int:
        pid = os.getpid()
        if self._pid != pid:
            with self._lock:
                if self._pid != pid:
                    if self._fd >= 0:
                        _close_fds([self._fd])  # inherited from the parent: it describes the parent
                    self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
                    self._pid = pid
        return self._fd


_maps_file = _ProcFile("/proc/self/maps")
_pagemap_file = _ProcFile("/proc/self/pagemap")
_procmap_query_ok = True  # cleared on the first ENOTTY/EINVAL (kernel older than 6.11)
_map_files_open_ok = True  # cleared on the first EPERM (opening map_files needs CAP_SYS_ADMIN)


_query_buffers = threading.local()


def _query_vma(address: int) -> SharedMapping | None:
    """PROCMAP_QUERY: the mapping containing ``address``, or None if unmapped; OSError if unsupported."""
    try:
        query, name = _query_buffers.pair
    except AttributeError:  # first query of this thread: allocate its buffers once (the name takes 4 KiB)
        query, name = _ffi.new("struct procmap_query *"), _ffi.new("char[]", _NAME_MAX)
        query.size = _PROCMAP_QUERY_SIZE
        query.vma_name_addr = int(_ffi.cast("uintptr_t", name))
        _query_buffers.pair = (query, name)
    query.query_flags = 0
    query.query_addr = address
    query.vma_name_size = _NAME_MAX  # in/out: the kernel writes back the name's length
    _count(maps_queries=1)
    if _libc.ioctl(_maps_file.fd(), _PROCMAP_QUERY, query) != 0:
        code = _ffi.errno
        if code == errno.ENOENT:
            return None
        raise OSError(code, os.strerror(code))
    flags = query.vma_flags
    inode = query.inode
    return SharedMapping(
        query.vma_start,
        query.vma_end,
        query.vma_offset,
        query.dev_major,
        query.dev_minor,
        inode,
        # Only a file's name matters (reopening it); "[heap]" and the like are not worth decoding.
        os.fsdecode(_ffi.string(name)) if inode and query.vma_name_size else "",
        bool(flags & _VMA_READABLE),
        bool(flags & _VMA_WRITABLE),
        bool(flags & _VMA_SHARED),
        query.vma_page_size or _PAGE,
        "procmap_query",
    )


class _MapsText:
    """Cached parse of the text of /proc/self/maps, for kernels without PROCMAP_QUERY.

    Only start/end are decoded for every line (a few hundred lines, once per miss); a line is fully decoded
    when a lookup hits it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._lines: list[bytes] = []

    def parse(self) -> None:
        with open("/proc/self/maps", "rb") as f:
            data = f.read()
        starts: list[int] = []
        ends: list[int] = []
        lines = data.splitlines()
        for line in lines:
            lo, _, rest = line.partition(b"-")
            starts.append(int(lo, 16))
            ends.append(int(rest[: rest.index(b" ")], 16))
        with self._lock:
            self._starts, self._ends, self._lines = starts, ends, lines
        _count(maps_parses=1)

    def cached(self, address: int, source: str) -> SharedMapping | None:
        with self._lock:
            k = bisect.bisect_right(self._starts, address) - 1
            if k < 0 or address >= self._ends[k]:
                return None
            line = self._lines[k]
        return _decode_maps_line(line, source)


def _decode_maps_line(line: bytes, source: str) -> SharedMapping:
    # "7f01c645d000-7f01c645f000 rw-s 00000000 00:01 3                          /memfd:t (deleted)"
    fields = line.split(None, 5)
    lo, _, hi = fields[0].partition(b"-")
    perms = fields[1]
    major, _, minor = fields[3].partition(b":")
    # The kernel escapes a newline in a path as \012 (seq_file_path); other bytes are verbatim.
    path = os.fsdecode(fields[5].lstrip(b" ").replace(b"\\012", b"\n")) if len(fields) > 5 else ""
    return SharedMapping(
        start=int(lo, 16),
        end=int(hi, 16),
        file_offset=int(fields[2], 16),
        dev_major=int(major, 16),
        dev_minor=int(minor, 16),
        inode=int(fields[4]),
        path=path,
        readable=perms[0:1] == b"r",
        writable=perms[1:2] == b"w",
        shared=perms[3:4] == b"s",
        page_size=_PAGE,  # the text does not say (smaps does); hugetlbfs mappings are aligned to more anyway
        source=source,
    )


_maps_text = _MapsText()


def _still_mapped(mapping: SharedMapping) -> bool:
    """Whether a cached file mapping still exists at exactly [start, end) with that path (one readlink)."""
    try:
        return os.readlink(f"/proc/self/map_files/{mapping.start:x}-{mapping.end:x}") == mapping.path
    except OSError:
        return False


def _identity(mapping: SharedMapping) -> tuple[int, ...]:
    """What makes two lookups the same mapping of the same file (the source aside)."""
    return (
        mapping.source == "registry",
        mapping.start,
        mapping.end,
        mapping.file_offset,
        mapping.dev_major,
        mapping.dev_minor,
        mapping.inode,
    )


def _lookup(address: int, nbytes: int, *, insist: bool, refresh: bool = False) -> SharedMapping | None:
    """The mapping containing ``address`` (any kind), or None when the address is not mapped.

    ``insist``: a negative answer will be an error, so a cached one is re-checked against a fresh parse.
    ``refresh``: re-parse the text of /proc/self/maps even on a valid-looking cache hit.
    """
    global _procmap_query_ok
    registered = _registry_lookup(address, nbytes)
    if registered is not None:
        return SharedMapping(
            start=registered.start,
            end=registered.end,
            file_offset=0,
            dev_major=os.major(registered.dev),
            dev_minor=os.minor(registered.dev),
            inode=registered.inode,
            path="",
            readable=True,
            writable=True,
            shared=True,
            page_size=_PAGE,
            source="registry",
            registry_fd=registered.fd,
        )
    if _procmap_query_ok:
        try:
            return _query_vma(address)
        except OSError as exc:
            if exc.errno not in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                raise RegionError(f"PROCMAP_QUERY on /proc/self/maps failed: {exc}") from exc
            _procmap_query_ok = False
    mapping = None if refresh else _maps_text.cached(address, "proc_maps_cache")
    if mapping is None:
        stale = True
    elif _is_file_candidate(mapping):
        # One readlink catches a mapping that was unmapped or replaced by another file since the parse.
        stale = not _still_mapped(mapping)
    else:
        stale = insist
    if stale:
        _maps_text.parse()
        mapping = _maps_text.cached(address, "proc_maps")
    return mapping


def _is_file_candidate(mapping: SharedMapping) -> bool:
    return _mapping_verdict(mapping) in (_SHARE, _CHECK_PAGES)


_SHARE: Final = "share"
_CHECK_PAGES: Final = "check pages"


def _mapping_verdict(mapping: SharedMapping) -> str:
    """_SHARE, _CHECK_PAGES (read-only private: only unmodified pages are the file's), or why not."""
    if mapping.source == "registry":
        return _SHARE
    if not mapping.readable:
        return "its mapping is not readable"
    if mapping.inode == 0:
        return "it is anonymous memory (heap), not a file mapping"
    if mapping.shared:
        return _SHARE
    if mapping.writable:
        return "it is in a writable private (copy-on-write) mapping"
    return _CHECK_PAGES


def _not_shareable(mapping: SharedMapping | None, address: int, nbytes: int) -> str | None:
    """Why [address, address+nbytes) in ``mapping`` cannot be shared zero-copy, or None when it can."""
    if mapping is None:
        return "the address is not mapped"
    if address + nbytes > mapping.end:
        return f"it runs past the end of its mapping at {mapping.end:#x} into another one"
    verdict = _mapping_verdict(mapping)
    if verdict == _SHARE:
        return None
    if verdict == _CHECK_PAGES:
        if _pages_unmodified(address, nbytes):
            return None
        return "pages of its read-only private mapping were modified (copy-on-write): not the file's"
    return verdict


# pagemap entry flags, top byte of each little-endian u64: 0x80 present, 0x40 swapped, 0x20 file page.
# A page is a file page (good) when not present, or present with the file bit; a swapped or present
# non-file page of a private file mapping is an anonymous copy-on-write copy.
_PAGE_FLAGS_GOOD: Final = bytes(b for b in range(256) if not (b & 0x40 or (b & 0x80 and not b & 0x20)))
_PAGEMAP_CHUNK: Final = 1 << 17  # pages per read: 1 MiB of pagemap for 512 MiB of memory


def _pages_unmodified(address: int, nbytes: int) -> bool:
    """Whether the pages of a private file mapping covering the range are all still the file's pages."""
    first = address // _PAGE
    last = (address + nbytes - 1) // _PAGE
    try:
        fd = _pagemap_file.fd()
        for page in range(first, last + 1, _PAGEMAP_CHUNK):
            count = min(_PAGEMAP_CHUNK, last + 1 - page)
            data = os.pread(fd, count * 8, page * 8)
            # Keep the flag byte of each entry, delete the good values: anything left is a modified page.
            if len(data) != count * 8 or data[7::8].translate(None, _PAGE_FLAGS_GOOD):
                return False
    except OSError:
        return False  # no pagemap (hardened /proc): cannot prove it, so do not share it
    return True


def _explain_not_shareable(address: int, nbytes: int) -> str:
    mapping = _lookup(address, nbytes, insist=True)
    reason = _not_shareable(mapping, address, nbytes)
    if reason is not None:
        return reason
    assert mapping is not None
    if mapping.source != "registry" and mapping.path.endswith(_DELETED) and not _map_files_open_ok:
        return (
            f"its file {mapping.path!r} is deleted or a memfd, /proc/self/map_files refused to open it "
            "(needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE) and no open fd of this process refers to it"
        )
    name = mapping.path or "(memfd)"
    return f"its file {name!r} could not be reopened read-only, or is shorter than the mapping"


def find_shared_mapping(address: int, nbytes: int) -> SharedMapping | None:
    """The mapping that would back a zero-copy export of [address, address+nbytes), or None if there is none.

    For diagnostics and tests; it does not open the file (which can still fail for a deleted file).
    """
    ((address, nbytes),) = _validate([(address, nbytes)])
    if nbytes == 0:
        return None
    mapping = _lookup(address, nbytes, insist=True)
    if mapping is None or _not_shareable(mapping, address, nbytes) is not None:
        return None
    return mapping


# --- reopening the file behind a mapping read-only ----------------------------------------------------------
def _open_verified(path: str, mapping: SharedMapping) -> int | None:
    """Open ``path`` read-only; keep the fd only if it is the mapping's regular file (device and inode).

    Raises PermissionError (the caller decides what a refusal means); other failures give None.
    """
    try:
        fd = os.open(path, _RDONLY)
    except PermissionError:
        raise
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if stat.S_ISREG(st.st_mode) and _same_file(st, mapping):
        return fd
    os.close(fd)
    return None


def _same_file(st: os.stat_result, mapping: SharedMapping) -> bool:
    # The maps show the device of the inode's superblock. On overlayfs and btrfs subvolumes stat() reports
    # another device, so such files do not verify and are copied instead: never share a file not proven same.
    return st.st_ino == mapping.inode and (os.major(st.st_dev), os.minor(st.st_dev)) == (
        mapping.dev_major,
        mapping.dev_minor,
    )


def _open_mapping_file(mapping: SharedMapping) -> int | None:
    """A new read-only fd on the file behind ``mapping`` (a fresh open file description), or None.

    Tried in order: the registry memfd reopened through /proc/self/fd (never hands the owner's O_RDWR
    description to a consumer); the path, if it still names the same inode; /proc/self/map_files/START-END
    (opening it needs CAP_SYS_ADMIN, or CAP_CHECKPOINT_RESTORE since Linux 5.9: refused to ordinary users);
    an fd of this process open on the same inode, reopened through /proc/self/fd (needs no privilege).

    The first three check the file that is mapped *now* (the path resolves to the mapping's inode, the
    map_files link is the mapping itself). The fd-table scan only proves an fd on the inode the lookup
    reported, so it is used only with fresh lookup data, never with a cached line of /proc/self/maps.
    """
    global _map_files_open_ok
    if mapping.source == "registry":
        # Under the lock: the buffer's destructor cannot close its fd (and the kernel reuse the number) from
        # another thread meanwhile; the inode check covers garbage collection in this thread.
        with _registry_lock:
            try:
                return _open_verified(f"/proc/self/fd/{mapping.registry_fd}", mapping)
            except PermissionError:
                return None
    if mapping.path.startswith("/") and not mapping.path.endswith(_DELETED):
        try:
            fd = _open_verified(mapping.path, mapping)
        except PermissionError:
            fd = None  # not readable by us under that name; the fallbacks may still reach it
        if fd is not None:
            return fd
    if _map_files_open_ok:
        try:
            fd = _open_verified(f"/proc/self/map_files/{mapping.start:x}-{mapping.end:x}", mapping)
        except PermissionError:
            _map_files_open_ok = False  # no capability: the same for every later call, skip the syscall
            fd = None
        if fd is not None:
            return fd
    if mapping.source == "proc_maps_cache":
        return None
    return _open_from_fd_table(mapping)


def _open_from_fd_table(mapping: SharedMapping) -> int | None:
    """Reopen, read-only, an fd of this process that is open on the mapping's file (memfds, deleted files)."""
    _count(fd_scans=1)
    try:
        with os.scandir("/proc/self/fd") as entries:
            for entry in entries:
                try:
                    st = os.stat(entry.path)
                except OSError:
                    continue  # closed meanwhile, or the scandir fd itself
                if _same_file(st, mapping):
                    try:
                        fd = _open_verified(entry.path, mapping)
                    except PermissionError:
                        continue
                    if fd is not None:
                        return fd
    except OSError:
        return None
    return None
