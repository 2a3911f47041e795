"""The producer's placement of host buffers: each goes to a zero-copy region or a sealed copy, per policy.

An Arrow buffer is an address in this process. To hand it to a consumer on the same host without copying,
the buffer must lie in a *region*: a file descriptor plus a page-aligned byte range that the consumer maps
``PROT_READ``/``MAP_SHARED``. Only the fds (sent with SCM_RIGHTS by the transport) and a small metadata
message cross; :func:`export_host_buffers` decides, per buffer, where its bytes live:

* **zero-copy** -- the buffer already lies in a file mapping whose pages *are* the file's pages:

  - memory from :func:`~arrow_ipc_bridge.host.allocate_shared` (a bridge-owned memfd, found in a registry
    without reading /proc);
  - any ``MAP_SHARED`` file mapping (a memfd, a /dev/shm file, ``pa.memory_map(path, "r+")``);
  - a read-only ``MAP_PRIVATE`` file mapping whose pages covering the buffer were never copied-on-write. This
    is what ``pa.memory_map(path)`` makes (Arrow maps read-only files ``MAP_PRIVATE``), so it is the common
    case of an IPC file under /dev/shm. Untouched or read-faulted private pages are the page-cache pages of
    the file; a copied-on-write page is not, and is detected through /proc/self/pagemap.

  Buffers in the same mapping share one region (one fd, one range covering all of them). The fd opens the
  whole file, not only that range: a consumer can read every byte of the file (an allocate_shared
  allocation, an IPC file), and can write it where the file lets it -- never for allocate_shared memory
  (sealed with F_SEAL_FUTURE_WRITE), otherwise as the file's permissions allow (docs/security.md).

* **copy** -- everything else (heap memory from Arrow's allocator) is written into ONE new sealed memfd per
  export (:mod:`~arrow_ipc_bridge.host.sealed_copy`).

The policy (``copy="never" | "if_needed" | "always"``) is explicit and every copied byte is counted in
:func:`~arrow_ipc_bridge.host.host_stats`: a copy instead of zero-copy happens only by explicit, counted
policy. Which mapping holds an address is :mod:`~arrow_ipc_bridge.host.proc_maps`.
"""

from __future__ import annotations

import fcntl
import operator
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final, NoReturn

from arrow_ipc_bridge.errors import ClosedError, CopyRequiredError, InvalidArgumentError
from arrow_ipc_bridge.host._system import _PAGE, _close_fds
from arrow_ipc_bridge.host.counters import _count
from arrow_ipc_bridge.host.proc_maps import (
    _CHECK_PAGES,
    _SHARE,
    SharedMapping,
    _lookup,
    _mapping_verdict,
    _not_shareable,
    _pages_unmodified,
)
from arrow_ipc_bridge.host.reopen import _explain_not_shareable, _open_mapping_file
from arrow_ipc_bridge.host.sealed_copy import FULL_SEALS, _copy_to_memfd

__all__ = [
    "HostRegion",
    "Placement",
    "HostExport",
    "export_host_buffers",
    "find_shared_mapping",
    "COPY_POLICIES",
]

COPY_POLICIES: Final = ("never", "if_needed", "always")
# A zero-copy region is announced sealed when its file carries these (the consumer checks the same bits).
_CONTENT_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_ADDRESS_LIMIT: Final = 1 << 64


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
            raise ClosedError("the HostExport is closed: its fds are no longer valid", what="HostExport")
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
            raise InvalidArgumentError(
                f"buffer {i} must be an (address, nbytes) pair of integers, got {item!r}", index=i
            ) from exc
        if nbytes < 0:
            raise InvalidArgumentError(f"buffer {i} has a negative size ({nbytes})", index=i, nbytes=nbytes)
        if address < 0 or address + nbytes > _ADDRESS_LIMIT:
            raise InvalidArgumentError(
                f"buffer {i} at address {address:#x} with {nbytes} bytes is outside the 64-bit address space",
                index=i,
                address=address,
                nbytes=nbytes,
            )
        if address == 0 and nbytes > 0:
            raise InvalidArgumentError(
                f"buffer {i} has a NULL address but {nbytes} bytes", index=i, nbytes=nbytes
            )
    raise AssertionError("unreachable: the fast check failed but no pair is invalid")  # pragma: no cover


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
        raise InvalidArgumentError(
            f"copy must be one of {', '.join(COPY_POLICIES)}, got {copy!r}", argument="copy"
        )
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
        "into a sealed memfd (counted in arrow_ipc_bridge.stats().host), or allocate the data with "
        "arrow_ipc_bridge.allocate_shared()",
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
