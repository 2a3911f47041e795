"""The producer's side of CUDA regions: each allocation behind a message's buffers becomes a region.

By allocation kind:

- IPC-enabled memory pool -> ``REGION_CUDA_POOL``: the pool's fd travels with the message, the
  handle is ``nonce(16) | pool handle(8) | cuMemPoolExportPointer data(64)``;
- legacy ``cudaMalloc`` memory -> ``REGION_CUDA_LEGACY``: the 64-byte ``cuIpcGetMemHandle`` handle,
  cached per allocation (buffer id);
- VMM memory exportable as a POSIX fd -> ``REGION_CUDA_VMM``: the fd travels with the message, the
  handle is ``nonce(16) | buffer id(8)``;
- anything else (managed memory, a pool without IPC): ``CopyRequiredError``, or with ``copy`` allowing
  it, one device-to-device copy into the bridge's own IPC pool, counted.

The nonce is random per producer process, so consumer caches keyed on it never confuse two producers.
This module also serves the pool fds a consumer asks for (:func:`pool_fd_for`) and keeps the producer's
event pools.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arrow_ipc_bridge._ffi import ffi as _core_ffi
from arrow_ipc_bridge._ffi import lib as _core
from arrow_ipc_bridge.cuda import _state
from arrow_ipc_bridge.cuda._declarations import CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
from arrow_ipc_bridge.cuda.devices import _ctx, synchronize
from arrow_ipc_bridge.cuda.events import Event, EventPool
from arrow_ipc_bridge.cuda.legacy_ipc import LegacyHandleCache
from arrow_ipc_bridge.cuda.pointers import (
    PointerInfo,
    memcpy_dtod,
    pointer_info,
    read_device,
)
from arrow_ipc_bridge.cuda.pools import (
    IpcMemoryPool,
    own_pool,
    pool_is_ipc_capable,
)
from arrow_ipc_bridge.cuda.slab import kept_slab
from arrow_ipc_bridge.cuda.vmm import vmm_export_fd
from arrow_ipc_bridge.errors import (
    BridgeError,
    CopyRequiredError,
    CudaError,
    InvalidArgumentError,
    NotPublishedError,
)
from arrow_ipc_bridge.wire.metadata import (
    REGION_CUDA_LEGACY,
    REGION_CUDA_POOL,
    REGION_CUDA_VMM,
    REGION_FLAG_KEPT,
    SLOT_UNPLACED,
    Described,
    Region,
    fill_region,
)

__all__ = [
    "CudaPlacement",
    "CudaPlacer",
    "bridge_pool",
    "event_pool",
    "export_region_stats",
    "pool_fd_for",
    "recorded_export_event",
    "remember_local_event",
    "sync_handle_of",
]

_log = logging.getLogger("arrow_ipc_bridge")
_NONCE = os.urandom(16)
_bridge_pools: dict[int, IpcMemoryPool] = {}
_legacy_handles = LegacyHandleCache()
# The IPC pools this process named in a message (serial -> pool, weakly): the only ones whose fd
# it hands to a session that asks (POOL_FD), and only while the pool object is alive.
_named_pools: weakref.WeakValueDictionary[int, IpcMemoryPool] = weakref.WeakValueDictionary()
# The regions this process made, by allocation (CUDA buffer id), in the C core: placing a message
# whose allocations all have one is a single C walk (see CudaPlacer.place). Only regions that need no
# per-message work go in: legacy handles, and pool export data (whose fd a session asks for once).
_EXPORT_REGIONS_MAX = 1024
_export_regions = _core_ffi.gc(
    _core.aib_export_regions_new(_EXPORT_REGIONS_MAX), _core.aib_export_regions_free
)
if _export_regions == _core_ffi.NULL:
    raise MemoryError("allocating the export region table")


def remember_local_event(handle: bytes, event: int) -> None:
    """Record an event this process exported, so a same-process consumer uses it directly (CUDA
    refuses to open an IPC event handle in the process that made it)."""
    with _state.lock:
        _state.local_events[handle] = event
        _state.local_events.move_to_end(handle)
        while len(_state.local_events) > _state.LOCAL_MAX:
            _state.local_events.popitem(last=False)


def _remember_local(handle: bytes, base: int) -> None:
    with _state.lock:
        _state.local_exports[handle] = base
        _state.local_exports.move_to_end(handle)
        while len(_state.local_exports) > _state.LOCAL_MAX:
            _state.local_exports.popitem(last=False)
            # A region of the export table must stay findable by a consumer in this process (CUDA
            # refuses to open our own handles): forgetting one forgets the table, which is rebuilt.
            _core.aib_export_regions_clear(_export_regions)


def _remember_region(info: PointerInfo, region: Region) -> None:
    """Put a region made for an allocation into the export table, for the next messages over it."""
    raw = _core_ffi.new("aib_region *")
    fill_region(raw, region)
    # A pool's fd is never in the table: a message that carries it has the region made for it.
    raw.fd_index = -1
    _core.aib_export_regions_put(_export_regions, info.buffer_id, info.device, raw)


def export_region_stats() -> dict[str, int]:
    """The export region table: entries, and allocations whose region a placement found there
    (hits) or did not (misses: their region was made)."""
    out = _core_ffi.new("uint64_t[3]")
    _core.aib_export_regions_stats(_export_regions, out, out + 1, out + 2)
    return {"entries": int(out[0]), "hits": int(out[1]), "misses": int(out[2])}


# The pooled events recorded for captured data (recorded_export_event) and not exported yet, by
# CUevent: the first export sends such an event's handle instead of recording another after it.
_recorded_events: dict[int, Event] = {}
# The same events, while their data lives (exported or not), by CUevent -> the stream recorded on.
_recorded_streams: dict[int, int] = {}
# CUDA's legacy default stream: 0 in the driver API, and CU_STREAM_LEGACY (1) where a
# __cuda_array_interface__ names it (CuPy's default stream).
_LEGACY_STREAMS = frozenset({0, 1})


def recorded_export_event(device: int, stream: int) -> tuple[Event, Callable[[], None]]:
    """An event of the device's pool recorded on ``stream`` (the producer's), and what gives it back.

    Call the second when nobody can wait on this recording any more (the captured data died).
    """
    events = event_pool(device)
    event = events.acquire()
    try:
        event.record(stream)
    except BaseException:
        events.release(event)
        raise
    handle = event.handle
    with _state.lock:
        _recorded_events[handle] = event
        _recorded_streams[handle] = stream

    def release() -> None:
        with _state.lock:
            _recorded_events.pop(handle, None)
            _recorded_streams.pop(handle, None)
        events.release(event)

    return event, release


def recorded_on_legacy_stream(event_handle: int) -> bool:
    """Whether ``event_handle`` is a pooled event :func:`recorded_export_event` recorded on the
    legacy default stream (its data still alive): work recorded on that stream later runs after it,
    with no wait to add."""
    with _state.lock:
        return _recorded_streams.get(event_handle, -1) in _LEGACY_STREAMS


def sync_handle_of(event_handle: int) -> bytes | None:
    """The interprocess handle of a pooled event :func:`recorded_export_event` recorded (still
    leased), for the first export of its data only; None for any other event, and for a later
    export of the same data (which then records an event of its own after it, as for any producer,
    covering what the legacy default stream did since)."""
    with _state.lock:
        event = _recorded_events.pop(event_handle, None)
    if event is None:
        return None
    sync = event.ipc_handle()
    remember_local_event(sync, event_handle)
    return sync


def bridge_pool(device: int) -> IpcMemoryPool:
    """The bridge's own IPC-enabled memory pool on ``device`` (copies and ``to_device`` use it)."""
    with _state.lock:
        pool = _bridge_pools.get(device)
        if pool is None:
            pool = _bridge_pools[device] = IpcMemoryPool(device)
        return pool


@dataclass
class CudaPlacement:
    """A message's regions, as the C core's ``aib_region[]`` (``region_count`` of them, numbered in
    the order of their allocations' addresses), and what the producer must keep until the consumers
    are done: fds to send, copies it made."""

    region_array: Any
    region_count: int = 0
    buffers: int = 0
    fds: list[int] = field(default_factory=list)
    copied_bytes: int = 0
    copies: list[tuple[IpcMemoryPool, int]] = field(default_factory=list)
    pool_fd_indexes: dict[int, int] = field(default_factory=dict)  # pool serial -> its fd's index

    def close(self) -> None:
        """Close the fds and free the policy copies (idempotent)."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        for pool, ptr in self.copies:
            pool.free(ptr)
        self.copies = []


@dataclass
class _Made:
    """The regions made for one message's allocations that had none, by buffer id, in the C core's
    form for :func:`_core.aib_cuda_place` (which looks them up before the export table)."""

    ids: list[int] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)

    def add(self, buffer_id: int, region: Region) -> None:
        self.ids.append(buffer_id)
        self.regions.append(region)

    def as_arrays(self) -> tuple[Any, Any]:
        if not self.ids:  # the usual walk: every region in the table, nothing made
            return _core_ffi.NULL, _core_ffi.NULL
        ids = _core_ffi.new("uint64_t[]", self.ids)
        raw = _core_ffi.new("aib_region[]", len(self.regions))
        for k, region in enumerate(self.regions):
            fill_region(raw[k], region)
        return ids, raw


class CudaPlacer:
    """Places the unplaced buffers of a description in CUDA regions (producer side)."""

    def __init__(self, device: int, *, copy: str = "if_needed", pool_fds: bool = True) -> None:
        self.device = device
        self.copy = copy
        self.pool_fds = pool_fds  # attach each pool's fd, or leave it to be asked for (fd_index -1)

    def resolve_pending_lengths(self, described: Described) -> None:
        """Read from the device the lengths the describe walk could not read (string data sizes)."""
        for slot, address, width in described.pending_reads():
            raw = read_device(address, width, device=self.device)
            described.set_length(slot, int.from_bytes(raw, "little", signed=True))

    def place(self, described: Described) -> CudaPlacement:
        """Place every unplaced buffer. One C walk finds each buffer's allocation and that
        allocation's region in the export table; the allocations without one come back, get their
        region made here (an export, or copies under the copy policy) and the walk runs again with
        those, placing all. An allocation placed before costs the walk alone."""
        n_slots = described.buffer_count
        placement = CudaPlacement(region_array=_core_ffi.new("aib_region[]", max(n_slots, 1)))
        # copy="always": no region from the table, every allocation's buffers are copied.
        table = _core_ffi.NULL if self.copy == "always" else _export_regions
        made = _Made()
        try:
            missing = self._walk(described, placement, table, made)
            if missing:
                self._make_regions(described, missing, placement, made)
                missing = self._walk(described, placement, table, made)
                if missing:  # the regions made for them were not found: a fault of ours
                    raise BridgeError(
                        f"placing CUDA buffers: {len(missing)} allocation(s) still without a region "
                        "after their regions were made"
                    )
        except BaseException:
            placement.close()
            raise
        return placement

    def _walk(
        self, described: Described, placement: CudaPlacement, table: Any, made: _Made
    ) -> list[tuple[int, int, int]]:
        """One ``aib_cuda_place``: ``[]`` when every buffer was placed (``placement`` filled), else
        the allocations without a region: (first buffer's address, base, size; 0 0 unknown)."""
        n_slots = max(described.buffer_count, 1)
        made_ids, made_raw = made.as_arrays()
        missing = _core_ffi.new("uint64_t[]", 3 * n_slots)
        n_regions = _core_ffi.new("size_t *")
        n_buffers = _core_ffi.new("size_t *")
        n_missing = _core_ffi.new("size_t *")
        with _ctx(None):
            rc = _core.aib_cuda_place(
                table,
                described.raw,
                self.device,
                int(not self.pool_fds),
                made_ids,
                made_raw,
                len(made.ids),
                placement.region_array,
                missing,
                n_slots,
                n_regions,
                n_buffers,
                n_missing,
            )
        if rc != 0:
            raise MemoryError("placing CUDA buffers: out of memory")
        if n_missing[0]:
            words = _core_ffi.unpack(missing, 3 * int(n_missing[0]))
            return [(words[k], words[k + 1], words[k + 2]) for k in range(0, len(words), 3)]
        placement.region_count = int(n_regions[0])
        placement.buffers = int(n_buffers[0])
        return []

    def _make_regions(
        self,
        described: Described,
        missing: list[tuple[int, int, int]],
        placement: CudaPlacement,
        made: _Made,
    ) -> None:
        """The region of each allocation the walk found none for: an export of shareable device
        memory (kept in the export table where no per-message fd is needed), or, under the copy
        policy, one copy of each of its buffers into the bridge's pool (the buffer's slot then
        names the copy, which the next walk places). Raises for what is not CUDA device memory of
        this device, and for what cannot be shared under copy="never"."""
        slots = described.slots()
        unplaced = [i for i in range(0, len(slots), 4) if slots[i + 2] == SLOT_UNPLACED]
        allocations: list[tuple[PointerInfo, list[int]]] = []  # info, its unplaced slots
        for address, walk_base, walk_size in missing:
            info = pointer_info(address)
            if info is None or info.memory_type == "host":
                raise InvalidArgumentError(f"buffer at {address:#x} is not CUDA device memory")
            if info.device != self.device:
                raise InvalidArgumentError(
                    f"buffer at {address:#x} lives on CUDA device {info.device}, the data's device is "
                    f"{self.device}"
                )
            # The walk's allocation, or (when it could not say) the one the driver names now.
            base, size = (walk_base, walk_size) if walk_size else (info.base, info.size)
            inside = [i for i in unplaced if base <= slots[i] and slots[i] + slots[i + 1] <= base + size]
            if not any(slots[i] == address for i in inside):
                length = next(slots[i + 1] for i in unplaced if slots[i] == address)
                raise InvalidArgumentError(
                    f"a {length}-byte buffer at {address:#x} runs past the end of its CUDA allocation "
                    f"({info.size} bytes at {info.base:#x})"
                )
            allocations.append((info, inside))
        shared: list[PointerInfo] = []
        copied: list[tuple[PointerInfo, list[int]]] = []
        for info, inside in allocations:
            if self.copy == "always" or info.is_managed or not self._shareable(info):
                copied.append((info, inside))
            else:
                shared.append(info)
        exports = self._export_pool_allocations(shared)
        for info in shared:
            made.add(info.buffer_id, self._region_for(info, placement, exports))
        for info, inside in copied:
            if self.copy == "never":
                raise CopyRequiredError(
                    f"a buffer at {slots[inside[0]]:#x} lives in {info.memory_type} memory that "
                    "cannot be shared through CUDA IPC; pass copy='if_needed' to copy it (counted)"
                )
            for i in inside:
                target, region = self._copy_region(placement, slots[i], slots[i + 1])
                slots[i] = target  # the buffer's bytes are the copy's now: the next walk places it
                made.add(region.identity, region)

    @staticmethod
    def _shareable(info: PointerInfo) -> bool:
        if info.mempool:
            return pool_is_ipc_capable(info.mempool)
        return info.legacy_ipc_capable or bool(
            info.allowed_handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )

    def _export_pool_allocations(self, infos: list[PointerInfo]) -> dict[int, bytes]:
        """The export data of every pool allocation among ``infos`` (buffer id -> 64 bytes): one
        batch per pool. A kept slab's is made once and reused, so consumers see one handle for it
        and find their import of it again."""
        by_pool: dict[int, dict[int, int]] = {}  # pool handle -> {buffer id: base}
        exports: dict[int, bytes] = {}
        slabs: dict[int, Any] = {}
        for info in infos:
            if not info.mempool:
                continue
            slab = kept_slab(info.base)
            if slab is not None and slab.export_data is not None:
                exports[info.buffer_id] = slab.export_data
                continue
            if slab is not None:
                slabs[info.buffer_id] = slab
            by_pool.setdefault(info.mempool, {})[info.buffer_id] = info.base
        for handle, allocations in by_pool.items():
            datas = _export_pool_pointers(_own_pool(handle), list(allocations.values()), self.device)
            exports.update(zip(allocations, datas, strict=True))
        for buffer_id, slab in slabs.items():
            slab.export_data = exports[buffer_id]  # the same bytes whichever thread wins
        return exports

    def _region_for(self, info: PointerInfo, placement: CudaPlacement, exports: dict[int, bytes]) -> Region:
        if info.mempool:
            pool = _own_pool(info.mempool)
            fd_index = self._pool_fd_index(pool, placement)
            handle = _pool_identity(pool) + exports[info.buffer_id]
            _remember_local(handle, info.base)
            # A slab is never freed while this process lives: consumers may keep it imported.
            flags = REGION_FLAG_KEPT if kept_slab(info.base) is not None else 0
            region = Region(
                REGION_CUDA_POOL,
                size=info.size,
                identity=info.buffer_id,
                fd_index=fd_index,
                handle=handle,
                flags=flags,
            )
            _remember_region(info, region)
            return region
        if info.legacy_ipc_capable:
            handle = _legacy_handles.get(info.base, info.buffer_id)
            _remember_local(handle, info.base)
            region = Region(REGION_CUDA_LEGACY, size=info.size, identity=info.buffer_id, handle=handle)
            _remember_region(info, region)
            return region
        fd_index = len(placement.fds)
        placement.fds.append(vmm_export_fd(info.base, device=self.device))
        handle = _NONCE + info.buffer_id.to_bytes(8, "little")
        _remember_local(handle, info.base)
        return Region(
            REGION_CUDA_VMM, size=info.size, identity=info.buffer_id, fd_index=fd_index, handle=handle
        )

    def _copy_region(self, placement: CudaPlacement, address: int, length: int) -> tuple[int, Region]:
        """One buffer copied into the bridge's IPC pool (counted): the copy's address and the
        region of its allocation."""
        pool = bridge_pool(self.device)
        target = pool.allocate(length)
        placement.copies.append((pool, target))
        memcpy_dtod(target, address, length, device=self.device)
        placement.copied_bytes += length
        with _state.lock:
            _state.counters["copied_bytes"] += length
            _state.counters["copies"] += 1
        _log.info(
            "arrow_ipc_bridge: copied %d device bytes at %#x into the bridge pool (copy policy)",
            length,
            address,
        )
        info = pointer_info(target)
        assert info is not None
        fd_index = self._pool_fd_index(pool, placement)
        handle = _pool_identity(pool) + pool.export_pointer(info.base)
        _remember_local(handle, info.base)
        region = Region(
            REGION_CUDA_POOL, size=info.size, identity=info.buffer_id, fd_index=fd_index, handle=handle
        )
        return target, region

    def _pool_fd_index(self, pool: IpcMemoryPool, placement: CudaPlacement) -> int:
        """The fd index a region of ``pool`` names: its fd, attached once per message, or -1 when
        fds are left out (the consumer asks for the pool's fd once, see :func:`pool_fd_for`)."""
        with _state.lock:
            _named_pools[pool.serial] = pool
        if not self.pool_fds:
            return -1
        fd_index = placement.pool_fd_indexes.get(pool.serial)
        if fd_index is None:
            fd_index = placement.pool_fd_indexes[pool.serial] = len(placement.fds)
            placement.fds.append(pool.export_pool_fd())
        return fd_index


def _pool_identity(pool: IpcMemoryPool) -> bytes:
    """What names ``pool`` to consumers: our nonce (random per process) and the pool's serial
    (never reused in this process), so a consumer's cached import can never be another pool's."""
    return _NONCE + pool.serial.to_bytes(8, "little")


def pool_fd_for(identity: bytes) -> int:
    """A new fd of the IPC pool that ``identity`` (a pool region's first 24 handle bytes) names,
    for a session that asked (POOL_FD); the caller sends and closes it.

    Raises :class:`RegionError` unless the identity names a pool this process named in a message
    and that is still alive: the fd maps the pool's memory, so it goes to no one for anything else.
    """
    if len(identity) != 24 or identity[:16] != _NONCE:
        raise NotPublishedError("the pool identity does not name a pool of this process")
    serial = int.from_bytes(identity[16:], "little")
    with _state.lock:
        pool = _named_pools.get(serial)
    if pool is None or pool.closed:
        raise NotPublishedError("no live IPC pool of this process has that identity")
    fd = pool.export_pool_fd()
    with _state.lock:
        _state.counters["pool_fds_served"] += 1
    return fd


def _export_pool_pointers(pool: IpcMemoryPool, bases: list[int], device: int) -> list[bytes]:
    try:
        return pool.export_pointers(bases)
    except CudaError:
        # A stream-ordered allocation whose allocating work has not run yet cannot be exported;
        # once the device has caught up it can.
        _log.debug("arrow_ipc_bridge: pool pointers not exportable yet; synchronizing device %d", device)
        synchronize(device)
        return pool.export_pointers(bases)


def _own_pool(handle: int) -> IpcMemoryPool:
    pool = own_pool(handle)
    if pool is None:
        raise InvalidArgumentError(
            "the buffer comes from an IPC-capable memory pool this process did not create through "
            "arrow_ipc_bridge.cuda.IpcMemoryPool; its pool fd cannot be exported here"
        )
    return pool


_event_pools: dict[int, EventPool] = {}


def event_pool(device: int) -> EventPool:
    """The producer's pool of interprocess events on ``device`` (an event is a driver call to create)."""
    with _state.lock:
        pool = _event_pools.get(device)
        if pool is None:
            pool = _event_pools[device] = EventPool(device)
        return pool
