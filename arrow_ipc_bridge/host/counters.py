"""The host-memory counters of this process (producer placement, consumer mappings) and their snapshot.

Every module of :mod:`arrow_ipc_bridge.host` counts here with :func:`_count`; :func:`host_stats` builds the
``host`` section of :func:`arrow_ipc_bridge.stats`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

__all__ = ["HostStats", "host_stats"]


@dataclass(frozen=True)
class HostStats:
    """Snapshot of this process's host-memory counters since import (see :func:`host_stats`)."""

    # producer: placement of exported buffers
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
    # consumer: read-only mappings of received regions
    regions_mapped: int = 0  # mmap calls for received regions (a mapping cache hit makes none)
    bytes_mapped: int = 0  # bytes those mappings cover
    mapping_cache_hits: int = 0  # zero-copy regions served by a session's cache of mappings


_stats_lock = threading.Lock()
_stats: dict[str, int] = dict.fromkeys(HostStats.__dataclass_fields__, 0)


def _after_fork_in_child() -> None:
    # A parent thread may have held the lock at the fork; the child's copy would stay locked.
    global _stats_lock
    _stats_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _count(**deltas: int) -> None:
    with _stats_lock:
        for key, value in deltas.items():
            _stats[key] += value


def host_stats() -> HostStats:
    """A snapshot of the host-memory counters: bytes copied, zero-copy regions made, regions mapped, ..."""
    with _stats_lock:
        return HostStats(**_stats)
