"""The consumer's host regions: map a received file descriptor read-only, once, safely; cache the mappings.

The mapping is owned by a C owner record (``aib_owner_new_mapping``): it is unmapped when the last
array built on it is released, from whatever thread releases it. Before mapping we check the file is
large enough for the announced range, because touching a mapping past the end of its file raises
SIGBUS in the consumer. A sealed memfd (the producer's copies) cannot shrink afterwards; for an
unsealed zero-copy file the producer must not truncate it while it is published (docs/lifetime.md).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.errors import ProtocolError, RegionError
from arrow_ipc_bridge.host.counters import _count
from arrow_ipc_bridge.wire.metadata import REGION_FLAG_SEALED, Region

__all__ = ["MappedRegion", "map_host_region", "HostMappingCache"]

_PAGE = mmap.PAGESIZE
# What "sealed" promises the consumer: the producer can neither shrink (SIGBUS for us), grow nor
# write the file any more.
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


@dataclass(frozen=True)
class MappedRegion:
    """A region mapped into this process: its base address and the owner that unmaps it."""

    base: int
    owner: Any  # cdata aib_owner*, one reference held by whoever holds this record
    key: tuple[int, int, int, int]


def _file_key(fd: int, region: Region) -> tuple[int, int, int, int]:
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise ProtocolError(f"received file descriptor {fd} is unusable: {exc}") from exc
    return (st.st_dev, st.st_ino, region.file_offset, region.size)


def map_host_region(fd: int, region: Region) -> MappedRegion:
    """Map ``region`` of ``fd`` read-only. The caller owns one reference on the result's owner.

    Raises :class:`RegionError` when the fd is not a regular file large enough for the region, when
    a region that claims to be sealed is not, or when mmap fails.
    """
    if region.file_offset % _PAGE:
        raise ProtocolError(
            f"region file offset {region.file_offset} is not page aligned", field="file_offset"
        )
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise ProtocolError(f"received file descriptor {fd} is unusable: {exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError(
            "a host region must be a regular file (memfd or /dev/shm), not another kind of fd"
        )
    if region.file_offset + region.size > st.st_size:
        raise ProtocolError(
            f"region [{region.file_offset}, +{region.size}) reaches past the end of its "
            f"{st.st_size}-byte file; "
            "mapping it would fault (SIGBUS) on access"
        )
    if region.flags & REGION_FLAG_SEALED:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
            raise ProtocolError(
                "the region claims a sealed memfd but the file is not sealed against shrink/grow/write"
            )
    address = ffi.new("void **")
    error = ffi.new("int *")
    owner = lib.aib_owner_new_mapping(0, fd, region.file_offset, region.size, address, error)
    if owner == ffi.NULL:
        raise RegionError(f"mmap of a {region.size}-byte region failed: {os.strerror(error[0])}")
    _count(regions_mapped=1, bytes_mapped=region.size)
    key = (st.st_dev, st.st_ino, region.file_offset, region.size)
    return MappedRegion(int(ffi.cast("uintptr_t", address[0])), owner, key)


class HostMappingCache:
    """Mappings of zero-copy files reused across imports, keyed by (device, inode, offset, size).

    The key comes from ``fstat`` of the fd that arrived, never from the message, so a stale or forged
    identity cannot alias another file. Copied regions (a fresh memfd per export) are never reused,
    so they are not cached. The cache holds one owner reference per entry; ``close()`` drops them
    (mappings still used by live arrays stay until those are released).
    """

    def __init__(self, max_entries: int = 256) -> None:
        self._entries: OrderedDict[tuple[int, int, int, int], MappedRegion] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def map(self, fd: int, region: Region, *, cacheable: bool) -> MappedRegion:
        """A mapping for the caller, who owns one owner reference on it."""
        cacheable = cacheable and self._max > 0
        if cacheable:
            key = _file_key(fd, region)
            with self._lock:
                hit = self._entries.get(key)
                if hit is not None:
                    self._entries.move_to_end(key)
                    lib.aib_owner_ref(hit.owner)
                    self.hits += 1
                    _count(mapping_cache_hits=1)
                    return hit
        mapped = map_host_region(fd, region)  # outside the lock: mmap of a large file is not instant
        if cacheable:
            with self._lock:
                raced = self._entries.get(mapped.key)
                if raced is not None:
                    # Another thread mapped the same file meanwhile: use its entry, drop ours.
                    lib.aib_owner_ref(raced.owner)
                    self.hits += 1
                else:
                    self.misses += 1
                    if len(self._entries) >= self._max:
                        _, evicted = self._entries.popitem(last=False)  # the least recently used
                        lib.aib_owner_unref(evicted.owner)
                    lib.aib_owner_ref(mapped.owner)
                    self._entries[mapped.key] = mapped
            if raced is not None:
                lib.aib_owner_unref(mapped.owner)  # unmaps our duplicate
                return raced
        return mapped

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        """Drop every cached mapping; each is unmapped once no import uses it any more."""
        with self._lock:
            entries, self._entries = self._entries, OrderedDict()
        for entry in entries.values():
            lib.aib_owner_unref(entry.owner)
