"""Which mapping of this process holds an address, and whether its pages are the pages of its file.

``PROCMAP_QUERY`` (an ioctl on /proc/self/maps, Linux 6.11+) answers in one kernel lookup, without reading or
parsing the text of the maps, and is always current. On older kernels the text of /proc/self/maps is parsed
once and cached; a lookup re-parses on a miss, and a cached hit on a file mapping is re-validated with one
readlink of /proc/self/map_files/START-END (mappings change: a stale hit must never export the wrong file).
Memory from ``allocate_shared`` is found in its registry first, without reading /proc.

A read-only ``MAP_PRIVATE`` file mapping is shareable only where its pages were never copied-on-write, which
/proc/self/pagemap tells.
"""

from __future__ import annotations

import bisect
import errno
import os
import threading
from typing import Final, NamedTuple

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.errors import RegionError
from arrow_ipc_bridge.host._system import _PAGE, _close_fds
from arrow_ipc_bridge.host.counters import _count
from arrow_ipc_bridge.host.shared_alloc import _registry_lookup
from arrow_ipc_bridge.runtime.file_limit import is_out_of_descriptors

__all__ = ["SharedMapping"]

# <linux/fs.h>: struct procmap_query's vma_flags bits (the ioctl itself: aib_sys_procmap_query).
_VMA_READABLE, _VMA_WRITABLE, _VMA_SHARED = 0x1, 0x2, 0x8
_NAME_MAX: Final = 4096


class SharedMapping(NamedTuple):
    """A file mapping of this process that can back zero-copy regions (diagnostics; see find_shared_mapping).

    ``source`` says how it was found: ``"registry"`` (allocate_shared, no /proc read), ``"procmap_query"``
    (ioctl on /proc/self/maps, Linux 6.11+), ``"proc_maps"`` (text of /proc/self/maps parsed for this lookup)
    or ``"proc_maps_cache"`` (an earlier parse, re-validated with a readlink of /proc/self/map_files).

    A NamedTuple rather than a frozen dataclass: one is built per lookup on the export path, and a frozen
    dataclass is constructed through object.__setattr__ per field (13 here), a NamedTuple in one C call.
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


_query_buffers = threading.local()


def _query_vma(address: int) -> SharedMapping | None:
    """PROCMAP_QUERY: the mapping containing ``address``, or None if unmapped; OSError if unsupported."""
    try:
        query, name, error = _query_buffers.buffers
    except AttributeError:  # first query of this thread: allocate its buffers once (the name takes 4 KiB)
        query, name, error = ffi.new("aib_procmap_query *"), ffi.new("char[]", _NAME_MAX), ffi.new("int *")
        query.vma_name_addr = int(ffi.cast("uintptr_t", name))
        _query_buffers.buffers = (query, name, error)
    query.query_flags = 0
    query.query_addr = address
    query.vma_name_size = _NAME_MAX  # in/out: the kernel writes back the name's length
    _count(maps_queries=1)
    if lib.aib_sys_procmap_query(_maps_file.fd(), query, error) != 0:
        code = error[0]
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
        os.fsdecode(ffi.string(name)) if inode and query.vma_name_size else "",
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
            if is_out_of_descriptors(exc):  # opening /proc/self/maps: the exporter says what to do
                raise
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
    except OSError as exc:
        if is_out_of_descriptors(exc):  # not a hardened /proc: no descriptor left to open it
            raise
        return False  # no pagemap (hardened /proc): cannot prove it, so do not share it
    return True
