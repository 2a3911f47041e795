"""Process-wide state the producer's placer and the consumer's opener share, under one lock.

The counters :func:`cuda_stats` reports (both sides count), and the same-process tables: CUDA refuses to
open a legacy handle, import a pool or open an IPC event in the process that made it, so the placer records
what this process exported (handle bytes -> device address, handle bytes -> event) and an opener in the same
process resolves those regions and events here instead. The tables are bounded: entries of freed
allocations age out.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from arrow_ipc_bridge._ffi import ffi, lib

__all__ = ["cuda_stats"]

lock = threading.Lock()
counters = {
    "copied_bytes": 0,
    "copies": 0,
    "legacy_opens": 0,
    "legacy_hits": 0,
    "pool_imports": 0,
    "pool_pointer_imports": 0,
    "pool_kept_hits": 0,
    "pool_fd_requests": 0,
    "pool_fds_served": 0,
    "same_process": 0,
    "device_copies": 0,
    "device_copied_bytes": 0,
}
LOCAL_MAX = 4096
local_exports: OrderedDict[bytes, int] = OrderedDict()
local_events: OrderedDict[bytes, int] = OrderedDict()


def _after_fork_in_child() -> None:
    global lock
    lock = threading.Lock()  # CUDA is unusable in a fork child; the counters must not deadlock


os.register_at_fork(after_in_child=_after_fork_in_child)


def cuda_stats() -> dict[str, int]:
    """Process-wide counters: device bytes copied by policy, handle opens and cache hits, the new
    messages the C get path imported over handles open here (``c_imports``, ``c_legacy_hits``), and
    the structs of imported data built with the producer's event still pending (handed out) or
    already complete (``sync_event`` NULL): ``sync_events_pending``, ``sync_events_complete``."""
    imports = ffi.new("uint64_t *")
    handles = ffi.new("uint64_t *")
    lib.aib_regions_stats(imports, handles)
    pending = ffi.new("uint64_t *")
    complete = ffi.new("uint64_t *")
    lib.aib_sync_event_stats(pending, complete)
    with lock:
        stats = dict(counters)
    stats["c_imports"] = int(imports[0])
    stats["c_legacy_hits"] = int(handles[0])
    stats["sync_events_pending"] = int(pending[0])
    stats["sync_events_complete"] = int(complete[0])
    return stats
