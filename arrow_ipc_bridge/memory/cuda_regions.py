"""CUDA regions: place a described tree's device buffers in shareable allocations, and open them.

Producer (:class:`CudaPlacer`): each distinct allocation behind the buffers becomes one region, by
allocation kind:

- IPC-enabled memory pool -> ``REGION_CUDA_POOL``: the pool's fd travels with the message, the
  handle is ``nonce(16) | pool handle(8) | cuMemPoolExportPointer data(64)``;
- legacy ``cudaMalloc`` memory -> ``REGION_CUDA_LEGACY``: the 64-byte ``cuIpcGetMemHandle`` handle,
  cached per allocation (buffer id);
- VMM memory exportable as a POSIX fd -> ``REGION_CUDA_VMM``: the fd travels with the message, the
  handle is ``nonce(16) | buffer id(8)``;
- anything else (managed memory, a pool without IPC): ``CopyRequiredError``, or with ``copy`` allowing
  it, one device-to-device copy into the bridge's own IPC pool, counted.

The nonce is random per producer process, so consumer caches keyed on it never confuse two producers.

Consumer (:class:`CudaOpener`, one per process): opens regions and caches what is safe to cache.
Legacy handles stay open (bounded LRU) because re-opening costs 90-400 µs; pool imports are cached per
producer pool (the first import costs ~100 µs, a pointer ~1.5 µs and more for large allocations), but
imported *pointers* are freed when the last owner using them dies, because CUDA requires the importer
to free a pool allocation before the exporter does (a session that keeps a pool message holds a lease
for as long as it holds the imports: session.py); VMM imports are unmapped with their last array.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from arrow_ipc_bridge import _reaper
from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.errors import CopyRequiredError, CudaError, RegionError
from arrow_ipc_bridge.memory import cuda
from arrow_ipc_bridge.memory.slab import kept_slab
from arrow_ipc_bridge.metadata import (
    REGION_CUDA_LEGACY,
    REGION_CUDA_POOL,
    REGION_CUDA_VMM,
    REGION_FLAG_KEPT,
    SLOT_FIRST_REGION,
    SLOT_UNPLACED,
    Described,
    Region,
)

__all__ = [
    "CudaPlacer",
    "CudaPlacement",
    "CudaOpener",
    "bridge_pool",
    "cuda_stats",
    "opener",
    "owner_slot",
    "pool_fd_for",
    "event_pool",
    "event_value",
]

_log = logging.getLogger("arrow_ipc_bridge")
# Asks the producer for the fd of the pool a 24-byte identity names; the caller closes the fd.
PoolFdSource = Callable[[bytes], int]
_NONCE = os.urandom(16)
_lock = threading.Lock()
_bridge_pools: dict[int, cuda.IpcMemoryPool] = {}
_legacy_handles = cuda.LegacyHandleCache()
_stats = {
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
}
# The IPC pools this process named in a message (serial -> pool, weakly): the only ones whose fd
# it hands to a session that asks (POOL_FD), and only while the pool object is alive.
_named_pools: weakref.WeakValueDictionary[int, cuda.IpcMemoryPool] = weakref.WeakValueDictionary()
# Handles this process exported, by handle bytes -> device address. CUDA refuses to open a legacy
# handle (or import a pool) in the process that made it, so a consumer in the producer's own process
# resolves its regions here instead. Bounded: entries of freed allocations age out.
_LOCAL_MAX = 4096
_local_exports: OrderedDict[bytes, int] = OrderedDict()
_local_events: OrderedDict[bytes, int] = OrderedDict()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # CUDA is unusable in a fork child; the counters must not deadlock


os.register_at_fork(after_in_child=_after_fork_in_child)


def remember_local_event(handle: bytes, event: int) -> None:
    """Record an event this process exported, so a same-process consumer uses it directly (CUDA
    refuses to open an IPC event handle in the process that made it)."""
    with _lock:
        _local_events[handle] = event
        _local_events.move_to_end(handle)
        while len(_local_events) > _LOCAL_MAX:
            _local_events.popitem(last=False)


def open_event(handle: bytes, device: int) -> int:
    """The CUevent for an IPC event handle: our own event, or the opened (and cached) import."""
    with _lock:
        local = _local_events.get(handle)
    return local if local is not None else cuda.open_ipc_event(handle, device)


def _remember_local(handle: bytes, base: int) -> None:
    with _lock:
        _local_exports[handle] = base
        _local_exports.move_to_end(handle)
        while len(_local_exports) > _LOCAL_MAX:
            _local_exports.popitem(last=False)


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
    with _lock:
        stats = dict(_stats)
    stats["c_imports"] = int(imports[0])
    stats["c_legacy_hits"] = int(handles[0])
    stats["sync_events_pending"] = int(pending[0])
    stats["sync_events_complete"] = int(complete[0])
    return stats


def bridge_pool(device: int) -> cuda.IpcMemoryPool:
    """The bridge's own IPC-enabled memory pool on ``device`` (copies and ``to_device`` use it)."""
    with _lock:
        pool = _bridge_pools.get(device)
        if pool is None:
            pool = _bridge_pools[device] = cuda.IpcMemoryPool(device)
        return pool


@dataclass
class CudaPlacement:
    """What a producer must keep until the consumers are done: fds to send, copies it made."""

    regions: list[Region]
    fds: list[int]
    copied_bytes: int = 0
    buffers: int = 0
    copies: list[tuple[cuda.IpcMemoryPool, int]] = field(default_factory=list)
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


class CudaPlacer:
    """Places the unplaced buffers of a description in CUDA regions (producer side)."""

    def __init__(self, device: int, *, copy: str = "if_needed", pool_fds: bool = True) -> None:
        self.device = device
        self.copy = copy
        self.pool_fds = pool_fds  # attach each pool's fd, or leave it to be asked for (fd_index -1)

    def resolve_pending_lengths(self, described: Described) -> None:
        """Read from the device the lengths the describe walk could not read (string data sizes)."""
        for slot, address, width in described.pending_reads():
            raw = cuda.read_device(address, width, device=self.device)
            described.set_length(slot, int.from_bytes(raw, "little", signed=True))

    def place(self, described: Described) -> CudaPlacement:
        slots = described.slots()
        wanted = sorted(
            (i for i in range(0, len(slots), 4) if slots[i + 2] == SLOT_UNPLACED), key=lambda i: slots[i]
        )
        placement = CudaPlacement(regions=[], fds=[], buffers=len(wanted))
        addresses = [slots[i] for i in wanted]
        lengths = [slots[i + 1] for i in wanted]
        try:
            infos = _allocations_of(addresses, lengths)
            allocations: dict[int, cuda.PointerInfo] = {}  # buffer id -> its info (one per allocation)
            for info, address in zip(infos, addresses, strict=True):
                if info is None or info.memory_type == "host":
                    raise RegionError(f"buffer at {address:#x} is not CUDA device memory")
                allocations.setdefault(info.buffer_id, info)
            # buffer id -> can be shared as it is
            shareable = {
                bid: not info.is_managed and self._shareable(info) for bid, info in allocations.items()
            }
            exports = self._export_pool_allocations(
                [info for buffer_id, info in allocations.items() if shareable[buffer_id]]
            )
            by_allocation: dict[int, int] = {}  # buffer id -> region index
            for i, address, length, info in zip(wanted, addresses, lengths, infos, strict=True):
                assert info is not None
                if not shareable[info.buffer_id]:
                    if self.copy == "never":
                        raise CopyRequiredError(
                            f"a {length}-byte buffer at {address:#x} lives in {info.memory_type} memory that "
                            "cannot be shared through CUDA IPC; pass copy='if_needed' to copy it (counted)"
                        )
                    region, offset = self._copy_region(placement, address, length)
                    slots[i + 2] = SLOT_FIRST_REGION + region
                    slots[i + 3] = offset
                    continue
                region_index = by_allocation.get(info.buffer_id)
                if region_index is None:
                    region_index = len(placement.regions)
                    placement.regions.append(self._region_for(info, placement, exports))
                    by_allocation[info.buffer_id] = region_index
                slots[i + 2] = SLOT_FIRST_REGION + region_index
                slots[i + 3] = address - info.base
        except BaseException:
            placement.close()
            raise
        return placement

    @staticmethod
    def _shareable(info: cuda.PointerInfo) -> bool:
        if info.mempool:
            return cuda.pool_is_ipc_capable(info.mempool)
        return info.legacy_ipc_capable or bool(
            info.allowed_handle_types & cuda.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )

    def _export_pool_allocations(self, infos: list[cuda.PointerInfo]) -> dict[int, bytes]:
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

    def _region_for(
        self, info: cuda.PointerInfo, placement: CudaPlacement, exports: dict[int, bytes]
    ) -> Region:
        if info.mempool:
            pool = _own_pool(info.mempool)
            fd_index = self._pool_fd_index(pool, placement)
            handle = _pool_identity(pool) + exports[info.buffer_id]
            _remember_local(handle, info.base)
            # A slab is never freed while this process lives: consumers may keep it imported.
            flags = REGION_FLAG_KEPT if kept_slab(info.base) is not None else 0
            return Region(
                REGION_CUDA_POOL,
                size=info.size,
                identity=info.buffer_id,
                fd_index=fd_index,
                handle=handle,
                flags=flags,
            )
        if info.legacy_ipc_capable:
            handle = _legacy_handles.get(info.base, info.buffer_id)
            _remember_local(handle, info.base)
            return Region(REGION_CUDA_LEGACY, size=info.size, identity=info.buffer_id, handle=handle)
        fd_index = len(placement.fds)
        placement.fds.append(cuda.vmm_export_fd(info.base, device=self.device))
        handle = _NONCE + info.buffer_id.to_bytes(8, "little")
        _remember_local(handle, info.base)
        return Region(
            REGION_CUDA_VMM, size=info.size, identity=info.buffer_id, fd_index=fd_index, handle=handle
        )

    def _copy_region(self, placement: CudaPlacement, address: int, length: int) -> tuple[int, int]:
        pool = bridge_pool(self.device)
        target = pool.allocate(length)
        placement.copies.append((pool, target))
        cuda.memcpy_dtod(target, address, length, device=self.device)
        placement.copied_bytes += length
        with _lock:
            _stats["copied_bytes"] += length
            _stats["copies"] += 1
        _log.info(
            "arrow_ipc_bridge: copied %d device bytes at %#x into the bridge pool (copy policy)",
            length,
            address,
        )
        info = cuda.pointer_info(target)
        assert info is not None
        fd_index = self._pool_fd_index(pool, placement)
        handle = _pool_identity(pool) + pool.export_pointer(info.base)
        _remember_local(handle, info.base)
        placement.regions.append(
            Region(
                REGION_CUDA_POOL, size=info.size, identity=info.buffer_id, fd_index=fd_index, handle=handle
            )
        )
        return len(placement.regions) - 1, target - info.base

    def _pool_fd_index(self, pool: cuda.IpcMemoryPool, placement: CudaPlacement) -> int:
        """The fd index a region of ``pool`` names: its fd, attached once per message, or -1 when
        fds are left out (the consumer asks for the pool's fd once, see :func:`pool_fd_for`)."""
        with _lock:
            _named_pools[pool.serial] = pool
        if not self.pool_fds:
            return -1
        fd_index = placement.pool_fd_indexes.get(pool.serial)
        if fd_index is None:
            fd_index = placement.pool_fd_indexes[pool.serial] = len(placement.fds)
            placement.fds.append(pool.export_pool_fd())
        return fd_index


def _pool_identity(pool: cuda.IpcMemoryPool) -> bytes:
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
        raise RegionError("the pool identity does not name a pool of this process", field="handle")
    serial = int.from_bytes(identity[16:], "little")
    with _lock:
        pool = _named_pools.get(serial)
    if pool is None or pool.closed:
        raise RegionError("no live IPC pool of this process has that identity", field="handle")
    fd = pool.export_pool_fd()
    with _lock:
        _stats["pool_fds_served"] += 1
    return fd


def _allocations_of(addresses: list[int], lengths: list[int]) -> list[cuda.PointerInfo | None]:
    """The allocation behind each buffer (sorted by address). Consecutive buffers often share an
    allocation (CuPy's pool carves arrays out of big blocks), so one attribute query serves many;
    the queries run in one C loop, or one by one where the driver refuses the batch's attribute set."""
    described = cuda.describe_buffers(addresses, lengths)
    if described is not None:
        infos, allocation_of = described
        return [infos[k] for k in allocation_of]
    out: list[cuda.PointerInfo | None] = []
    current: cuda.PointerInfo | None = None
    for address, length in zip(addresses, lengths, strict=True):
        if current is None or not (
            current.base <= address and address + length <= current.base + current.size
        ):
            current = cuda.pointer_info(address)
        out.append(current)
    return out


def _export_pool_pointers(pool: cuda.IpcMemoryPool, bases: list[int], device: int) -> list[bytes]:
    try:
        return pool.export_pointers(bases)
    except CudaError:
        # A stream-ordered allocation whose allocating work has not run yet cannot be exported;
        # once the device has caught up it can.
        _log.debug("arrow_ipc_bridge: pool pointers not exportable yet; synchronizing device %d", device)
        cuda.synchronize(device)
        return pool.export_pointers(bases)


def _own_pool(handle: int) -> cuda.IpcMemoryPool:
    pool = cuda.own_pool(handle)
    if pool is None:
        raise RegionError(
            "the buffer comes from an IPC-capable memory pool this process did not create through "
            "arrow_ipc_bridge.memory.cuda.IpcMemoryPool; its pool fd cannot be exported here"
        )
    return pool


# ---------- consumer ---------------------------------------------------------------------------------
@dataclass
class _Opened:
    base: int
    owner: Any  # aib_owner*, one reference held by the cache entry (when cached)


class _OpenLru:
    """Opened regions kept open beyond their last array, least recently used first, mirrored into
    the C core's region table (``region_table.c``), whose get path imports new messages over them.
    Each entry holds one owner reference. No lock of its own: the opener's guards it."""

    def __init__(self, key_kind: int, limit: int) -> None:
        self._entries: OrderedDict[bytes, _Opened] = OrderedDict()
        self._key_kind = key_kind
        self._limit = limit

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def find(self, key: bytes) -> _Opened | None:
        """The entry for ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def add(self, key: bytes, entry: _Opened, evicted: list[_Opened]) -> None:
        """Keep ``entry`` (and its owner reference); one the bound pushes out goes to ``evicted``,
        for the caller to unref after the lock."""
        self._entries[key] = entry
        lib.aib_regions_put(self._key_kind, key, len(key), entry.base, entry.owner)
        if len(self._entries) > self._limit:
            old_key, old = self._entries.popitem(last=False)
            lib.aib_regions_remove(self._key_kind, old_key, len(old_key))
            evicted.append(old)

    def clear(self) -> list[_Opened]:
        """Take every entry out (the caller unrefs their owners after the lock)."""
        for key in self._entries:
            lib.aib_regions_remove(self._key_kind, key, len(key))
        entries = list(self._entries.values())
        self._entries.clear()
        return entries


class CudaOpener:
    """Opens CUDA regions in this process (one instance per process: handles are per process)."""

    def __init__(self, max_legacy: int = 256, max_pools: int = 16, max_kept: int = 256) -> None:
        self._lock = threading.Lock()
        self._legacy = _OpenLru(lib.AIB_REGION_KEY_LEGACY, max_legacy)  # legacy handles kept open
        # handle -> [pointer, owners using it]: each is opened once per process, closed by its last owner
        self._legacy_live: dict[bytes, list[int]] = {}
        # Imported pools by identity, least recently used first. Beyond max_pools, pools with no
        # pointer imported are destroyed (producers that come and go, or churn pools).
        self._pools: OrderedDict[bytes, cuda.ImportedPool] = OrderedDict()
        self._pool_pointers: dict[bytes, list[int]] = {}  # handle -> [pointer, leases using it]
        # Imports of kept slabs (REGION_FLAG_KEPT: the producer never frees them), open beyond their
        # leases like legacy handles; an entry's owner, when it ends, releases the import.
        self._kept = _OpenLru(lib.AIB_REGION_KEY_POOL, max_kept)
        self._max_pools = max_pools

    def open(
        self,
        region: Region,
        fds: list[int] | tuple[int, ...],
        device: int,
        fetch_pool_fd: PoolFdSource | None = None,
    ) -> _Opened:
        """Open ``region``; the caller receives one owner reference (drop it with aib_owner_unref).
        ``fetch_pool_fd`` gets a pool's fd that the message left out (see :meth:`_pool`)."""
        with _lock:
            local = _local_exports.get(region.handle)
            if local is not None:
                _stats["same_process"] += 1
        if local is not None:
            # Our own export: the memory is already mapped here, and the producer's lease keeps it.
            return _Opened(local, lib.aib_owner_new(0))
        if region.kind == REGION_CUDA_LEGACY:
            return self._open_legacy(region, device)
        if region.kind == REGION_CUDA_POOL:
            return self._open_pool_pointer(region, fds, device, fetch_pool_fd)
        if region.kind == REGION_CUDA_VMM:
            return self._open_vmm(region, fds, device)
        raise RegionError(f"region kind {region.kind} is not a CUDA region")

    def _open_legacy(self, region: Region, device: int) -> _Opened:
        if len(region.handle) != 64:
            raise RegionError("a legacy CUDA IPC handle is 64 bytes", field="handle")
        evicted: list[_Opened] = []
        try:
            with self._lock:
                return self._legacy_locked(region.handle, device, evicted)
        finally:
            for entry in evicted:
                lib.aib_owner_unref(entry.owner)  # its handle closes once no array uses it

    def open_legacy_regions(self, regions: list[Region], device: int) -> tuple[list[int], Any]:
        """Open a message's legacy regions together: ``(bases in order, one owner holding them
        all)``, the caller's. One lock and one owner for the message instead of one per region:
        a new message over known allocations (CuPy's pool carves new arrays out of the same
        blocks) costs little more than the lookups. Same rules as :meth:`open`."""
        handles = [region.handle for region in regions]
        if any(len(handle) != 64 for handle in handles):
            raise RegionError("a legacy CUDA IPC handle is 64 bytes", field="handle")
        with _lock:
            local = [_local_exports.get(handle) for handle in handles]
            _stats["same_process"] += sum(base is not None for base in local)
        group = lib.aib_owner_new(0)
        if group == ffi.NULL:
            raise MemoryError("allocating an owner")
        bases: list[int] = []
        evicted: list[_Opened] = []
        try:
            with self._lock:
                for handle, local_base in zip(handles, local, strict=True):
                    if local_base is not None:  # our own export: mapped here, kept by the producer
                        bases.append(local_base)
                        continue
                    opened = self._legacy_locked(handle, device, evicted)
                    failed = lib.aib_owner_add_dependency(group, opened.owner)
                    lib.aib_owner_unref(opened.owner)
                    if failed:
                        raise MemoryError("adding an owner dependency")
                    bases.append(opened.base)
        except BaseException:
            lib.aib_owner_unref(group)
            raise
        finally:
            for entry in evicted:
                lib.aib_owner_unref(entry.owner)
        return bases, group

    def _legacy_locked(self, handle: bytes, device: int, evicted: list[_Opened]) -> _Opened:
        """Under the lock: the open handle (one owner reference for the caller), from the LRU or
        opened now; an entry the LRU pushes out goes to ``evicted`` for the caller to unref after
        the lock.

        Opens and closes happen under the lock, and a handle is opened once per process however
        many owners use it: an evicted entry whose arrays are still alive keeps its mapping, and a
        new get of the same handle reuses it instead of opening it again (a later close would
        otherwise pull the mapping from under the new one)."""
        hit = self._legacy.find(handle)
        if hit is not None:
            lib.aib_owner_ref(hit.owner)
            _stats["legacy_hits"] += 1
            return hit
        if handle not in self._legacy_live:
            _stats["legacy_opens"] += 1
        ptr = _acquire(self._legacy_live, handle, lambda: cuda.ipc_open_mem_handle(handle, device))
        owner = lib.aib_owner_new(
            _reaper.register(
                lambda: self._release(
                    self._legacy_live, handle, lambda ptr: cuda.ipc_close_mem_handle(ptr, device=device)
                )
            )
        )
        opened = _Opened(ptr, owner)
        lib.aib_owner_ref(owner)  # the caller's reference; the cache keeps the first
        self._legacy.add(handle, opened, evicted)
        return opened

    def _release(self, table: dict[bytes, list[int]], key: bytes, close: Any) -> None:
        """One owner of ``key`` ended; the last one closes it. Under the lock: a get arriving
        meanwhile would otherwise open the same handle again (the driver hands back the same
        address) and then lose it to this close."""
        with self._lock:
            entry = table.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del table[key]
            _close_quietly(lambda: close(entry[0]))

    def _open_pool_pointer(
        self,
        region: Region,
        fds: list[int] | tuple[int, ...],
        device: int,
        fetch_pool_fd: PoolFdSource | None,
    ) -> _Opened:
        # One import per allocation however many leases use it at once (see open_pool_regions).
        bases, owner = self.open_pool_regions([region], fds, device, fetch_pool_fd)
        return _Opened(bases[0], owner)

    def open_pool_regions(
        self,
        regions: list[Region],
        fds: list[int] | tuple[int, ...],
        device: int,
        fetch_pool_fd: PoolFdSource | None = None,
    ) -> tuple[list[int], Any]:
        """Open a message's pool regions together: ``(bases in order, one owner for all)``.

        New pointers of one pool are imported in one batch (one context switch, no per-region
        Python objects), and the whole message's imports end with one owner: this is what keeps a
        new buffer near the driver's own ~1.5 µs. Same counting as :meth:`open`: a pointer is
        imported once per process and freed after its last lease. ``fetch_pool_fd``: see
        :meth:`_pool`.
        """
        keys: list[bytes] = []
        for region in regions:
            if len(region.handle) != 88:
                raise RegionError("a pool region needs an 88-byte handle", field="handle")
            keys.append(region.handle)
        with _lock:
            local = any(key in _local_exports for key in keys)
        if local:  # our own export (same process): one region at a time, from the producer's records
            return self._open_one_by_one(regions, fds, device, fetch_pool_fd)
        # Kept slabs are held by their LRU entries; the others are counted per message (lease).
        kept = {region.handle for region in regions if region.flags & REGION_FLAG_KEPT}
        counted = [key for key in keys if key not in kept]
        evicted: list[_Opened] = []
        held: list[Any] = []  # one reference on each kept slab's owner, for the group below
        try:
            for _ in range(3):
                pools: dict[bytes, cuda.ImportedPool] = {}
                for region in regions:
                    pool_key = region.handle[:24]
                    if pool_key not in pools:
                        pools[pool_key] = self._pool(
                            pool_key, _attached_fd(region, fds), device, fetch_pool_fd
                        )
                with self._lock:
                    # An idle pool can be evicted between _pool() and here (many other pools
                    # imported meanwhile by other threads): then look it up again.
                    if all(self._pools.get(key) is pool for key, pool in pools.items()):
                        bases = self._import_pool_pointers(
                            keys, counted=counted, kept=kept, pools=pools, held=held, evicted=evicted
                        )
                        break
            else:
                raise RegionError("the message's IPC pools were evicted three times while being imported")
            token = _reaper.register(lambda: self._release_pool_pointers(counted, pools)) if counted else 0
            group = lib.aib_owner_new(token)
            if group == ffi.NULL:
                if token:
                    _reaper.unregister(token)
                    self._release_pool_pointers(counted, pools)
                raise MemoryError("allocating an owner")
            for owner in held:
                if lib.aib_owner_add_dependency(group, owner):
                    lib.aib_owner_unref(group)
                    raise MemoryError("adding an owner dependency")
        finally:
            for owner in held:
                lib.aib_owner_unref(owner)
            for entry in evicted:
                lib.aib_owner_unref(entry.owner)  # its import is freed once no array uses it
        return bases, group

    def _import_pool_pointers(
        self,
        keys: list[bytes],
        *,
        counted: list[bytes],
        kept: set[bytes],
        pools: dict[bytes, cuda.ImportedPool],
        held: list[Any],
        evicted: list[_Opened],
    ) -> list[int]:
        """Under the lock: import the pointers not imported yet (one batch per pool), count one
        more lease on every pointer of ``counted``, and append to ``held`` a reference on the LRU
        entry's owner of every kept one (made now for new ones; one the LRU pushes out goes to
        ``evicted``; the caller unrefs both after the lock). Returns the addresses of ``keys`` in
        order."""
        fresh: dict[bytes, list[bytes]] = {}
        for key in dict.fromkeys(keys):
            if self._kept.find(key) is not None:
                _stats["pool_kept_hits"] += 1
            elif key not in self._pool_pointers:
                fresh.setdefault(key[:24], []).append(key)
        done: list[bytes] = []
        try:
            for pool_key, new_keys in fresh.items():
                pointers = pools[pool_key].import_pointers([key[24:] for key in new_keys])
                _stats["pool_pointer_imports"] += len(pointers)
                for key, ptr in zip(new_keys, pointers, strict=True):
                    self._pool_pointers[key] = [ptr, 0]
                    done.append(key)
        except BaseException:
            for key in done:  # another pool's batch failed: nobody uses these yet
                ptr = self._pool_pointers.pop(key)[0]
                _close_quietly(lambda ptr=ptr, key=key: pools[key[:24]].free_imported(ptr))
            raise
        for key in counted:
            self._pool_pointers[key][1] += 1
        for key in kept:
            entry = self._kept.find(key)
            if entry is None:
                entry = self._keep_pool_pointer(key, pools[key[:24]], evicted)
            lib.aib_owner_ref(entry.owner)
            held.append(entry.owner)
        return [self._pool_pointers[key][0] for key in keys]

    def _keep_pool_pointer(self, key: bytes, pool: cuda.ImportedPool, evicted: list[_Opened]) -> _Opened:
        """Under the lock: the LRU entry for a kept slab's import (imported already): one more
        count on the pointer, held by an owner the entry keeps; the C core's get path finds it
        too (region_table.c). The owner's end (evicted, and no array using it) takes the count
        back, and the last count frees the import."""
        self._pool_pointers[key][1] += 1
        owner = lib.aib_owner_new(
            _reaper.register(lambda: self._release_pool_pointers([key], {key[:24]: pool}))
        )
        if owner == ffi.NULL:
            self._pool_pointers[key][1] -= 1
            raise MemoryError("allocating an owner")
        entry = _Opened(self._pool_pointers[key][0], owner)
        self._kept.add(key, entry, evicted)
        return entry

    def _open_one_by_one(
        self,
        regions: list[Region],
        fds: list[int] | tuple[int, ...],
        device: int,
        fetch_pool_fd: PoolFdSource | None,
    ) -> tuple[list[int], Any]:
        group = lib.aib_owner_new(0)
        bases = []
        try:
            for region in regions:
                opened = self.open(region, fds, device, fetch_pool_fd)
                lib.aib_owner_add_dependency(group, opened.owner)
                lib.aib_owner_unref(opened.owner)
                bases.append(opened.base)
        except BaseException:
            lib.aib_owner_unref(group)
            raise
        return bases, group

    def _pool(
        self, pool_key: bytes, fd: int | None, device: int, fetch_pool_fd: PoolFdSource | None
    ) -> cuda.ImportedPool:
        """The imported pool for ``pool_key`` (imported once per process, ~100 µs).

        Its fd is the one the message attached, or (``fd`` None: a publisher's message) the one
        ``fetch_pool_fd`` asks the producer for, once per pool per process. Without either the
        pool must have been imported already."""
        with self._lock:
            pool = self._pools.get(pool_key)
            if pool is not None:
                self._pools.move_to_end(pool_key)
                return pool
        if fd is not None:
            imported = cuda.import_pool(fd, device)
        elif fetch_pool_fd is None:
            raise RegionError(
                "an IPC-pool region came without its pool's fd and this process has not imported "
                "that pool: import a publisher's message through its Session, or export with "
                "pool_fds=True",
                field="fd_index",
            )
        else:
            fetched = fetch_pool_fd(pool_key)
            with _lock:
                _stats["pool_fd_requests"] += 1
            try:
                imported = cuda.import_pool(fetched, device)
            finally:
                os.close(fetched)  # the driver keeps its own reference
        evicted: list[cuda.ImportedPool] = []
        with self._lock:
            pool = self._pools.setdefault(pool_key, imported)
            if pool is imported:
                _stats["pool_imports"] += 1
                evicted = self._evict_idle_pools(keep=pool_key)
        if pool is not imported:  # another thread imported it meanwhile
            imported.close()
        for old in evicted:
            _close_quietly(old.close)
        return pool

    def _evict_idle_pools(self, keep: bytes) -> list[cuda.ImportedPool]:
        """Under the lock: take the least recently used pools with no pointer imported out of the
        cache while it holds more than max_pools; the caller closes them."""
        evicted = []
        excess = len(self._pools) - self._max_pools
        for key, pool in list(self._pools.items()):
            if excess <= 0:
                break
            if key != keep and pool.imported_count == 0:
                del self._pools[key]
                evicted.append(pool)
                excess -= 1
        return evicted

    def _release_pool_pointers(self, keys: list[bytes], pools: dict[bytes, cuda.ImportedPool]) -> None:
        """A message's pool imports ended: each pointer whose last lease this was is freed, one
        batch per pool. Under the lock, like :meth:`_release`: an import of the same allocation
        meanwhile would get the address back and then lose it to this free."""
        with self._lock:
            last: dict[bytes, list[int]] = {}
            for key in keys:
                entry = self._pool_pointers.get(key)
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._pool_pointers[key]
                    last.setdefault(key[:24], []).append(entry[0])
            for pool_key, pointers in last.items():
                free = pools[pool_key].free_imported_many
                _close_quietly(lambda free=free, pointers=pointers: free(pointers))

    def _open_vmm(self, region: Region, fds: list[int] | tuple[int, ...], device: int) -> _Opened:
        if region.fd_index < 0:
            raise RegionError("a VMM region needs its fd", field="fd_index")
        mapping = cuda.vmm_import(fds[region.fd_index], region.size, device)
        token = _reaper.register(mapping.close)
        return _Opened(mapping.ptr, lib.aib_owner_new(token))

    def close(self) -> None:
        """Drop the caches' references (handles close, kept slab imports are freed, as their last
        arrays go)."""
        with self._lock:
            entries = self._legacy.clear() + self._kept.clear()
        for entry in entries:
            lib.aib_owner_unref(entry.owner)


def _attached_fd(region: Region, fds: list[int] | tuple[int, ...]) -> int | None:
    """The fd a region's message attached for it, or None (fd_index -1). The decoder checked the
    index against the message's fd count; a short list here is the caller's error."""
    if region.fd_index < 0:
        return None
    if region.fd_index >= len(fds):
        raise RegionError(f"fd index {region.fd_index} but {len(fds)} fds came", field="fd_index")
    return fds[region.fd_index]


def _acquire(table: dict[bytes, list[int]], key: bytes, open_: Any) -> int:
    """The pointer for ``key``, opened on first use; counts one more owner (caller holds the lock)."""
    entry = table.get(key)
    if entry is None:
        entry = table[key] = [open_(), 0]
    entry[1] += 1
    return entry[0]


def _close_quietly(close: Any) -> None:
    try:
        close()
    except Exception as exc:  # cleanup never raises; the process may be shutting down
        _log.warning("arrow_ipc_bridge: closing a CUDA import failed: %s", exc)


_opener: CudaOpener | None = None


def opener() -> CudaOpener:
    """The process-wide opener (CUDA handles are per process, so their caches are too)."""
    global _opener
    with _lock:
        if _opener is None:
            _opener = CudaOpener()
        return _opener


_event_pools: dict[int, cuda.EventPool] = {}


def event_pool(device: int) -> cuda.EventPool:
    """The producer's pool of interprocess events on ``device`` (creating one costs ~225 µs)."""
    with _lock:
        pool = _event_pools.get(device)
        if pool is None:
            pool = _event_pools[device] = cuda.EventPool(device)
        return pool


def event_value(sync_event: Any) -> int:
    """The CUevent a C Device interface ``sync_event`` points to (the spec's pointer-to-CUevent)."""
    return int(ffi.cast("uintptr_t *", sync_event)[0])


def owner_slot(owner: Any) -> Any:
    """Address inside ``owner`` where a CUevent value can live as long as the owner."""
    return lib.aib_owner_slot(owner)
