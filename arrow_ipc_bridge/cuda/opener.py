"""The consumer's side of CUDA regions: opens them and caches what is safe to cache.

One :class:`CudaOpener` per process (:func:`opener`), because handles are per process. The legacy
handles and kept slabs it holds open live in the C core's region table (``region_table.c``), the one
record of them (with their owners and least-recently-used order), which the C get path reads too; the
opener asks it and writes to it, and keeps no copy. Legacy handles stay open (bounded LRU) because
re-opening maps the allocation again; pool imports are cached per producer pool (the pool is imported
once, then each pointer, which the driver maps: more work for large allocations), but imported
*pointers* are freed when the last owner using them dies, because CUDA requires the importer to free a
pool allocation before the exporter does (a session that keeps a pool message holds a lease for as long
as it holds the imports: consumer/session.py); VMM imports are unmapped with their last array.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.cuda import _state
from arrow_ipc_bridge.cuda.events import open_ipc_event
from arrow_ipc_bridge.cuda.legacy_ipc import ipc_close_mem_handle, ipc_open_mem_handle
from arrow_ipc_bridge.cuda.pools import (
    ImportedPool,
    import_pool,
)
from arrow_ipc_bridge.cuda.vmm import vmm_import
from arrow_ipc_bridge.errors import CudaError, ProtocolError
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.wire.metadata import (
    REGION_CUDA_LEGACY,
    REGION_CUDA_POOL,
    REGION_CUDA_VMM,
    REGION_FLAG_KEPT,
    Region,
)

__all__ = [
    "CudaOpener",
    "PoolFdSource",
    "open_event",
    "opener",
    "owner_slot",
]

_log = logging.getLogger("arrow_ipc_bridge")
# Asks the producer for the fd of the pool a 24-byte identity names; the caller closes the fd.
PoolFdSource = Callable[[bytes], int]


def open_event(handle: bytes, device: int) -> int:
    """The CUevent for an IPC event handle: our own event, or the opened (and cached) import."""
    with _state.lock:
        local = _state.local_events.get(handle)
    return local if local is not None else open_ipc_event(handle, device)


@dataclass
class _Opened:
    base: int
    owner: Any  # aib_owner*, one reference: the caller's


class _HeldOpen:
    """One kind of region held open beyond its last array (legacy handles, or kept slabs' imports):
    the C core's region table (``region_table.c``) holds the entries, their owners (one reference
    each) and their least-recently-used order, and its get path imports new messages over them;
    this names the kind and the bound. Called under the opener's lock, so a find and the put after
    it see the same table."""

    def __init__(self, key_kind: int, key_size: int, limit: int) -> None:
        self._key_kind = key_kind
        self._key_size = key_size  # keys of this kind are this long (list() reads them back)
        self._limit = limit
        self._value = ffi.new("uint64_t *")
        self._owner = ffi.new("aib_owner **")

    def __iter__(self) -> Iterator[bytes]:
        """The keys held, least recently used first (for inspection)."""
        size = self._key_size
        n = lib.aib_regions_list(self._key_kind, ffi.NULL, size, 0)
        keys = ffi.new("uint8_t[]", max(n, 1) * size)
        n = min(n, lib.aib_regions_list(self._key_kind, keys, size, n))
        raw = ffi.buffer(keys, n * size)[:]
        return iter([raw[i * size : (i + 1) * size] for i in range(n)])

    def has(self, key: bytes) -> bool:
        """Whether ``key`` is held (it is now the most recently used)."""
        return bool(lib.aib_regions_find(self._key_kind, key, len(key), self._value, ffi.NULL))

    def find(self, key: bytes) -> _Opened | None:
        """The entry for ``key`` (now the most recently used) with an owner reference for the
        caller, or None."""
        if not lib.aib_regions_find(self._key_kind, key, len(key), self._value, self._owner):
            return None
        return _Opened(int(self._value[0]), self._owner[0])

    def add(self, key: bytes, entry: _Opened) -> None:
        """Hold ``entry`` (the table takes its own owner reference; the caller keeps its own).
        The bound lets go of the least recently used: its owner reference goes, and what it
        keeps open closes once no array uses it (the owner's end only queues the reaper's call)."""
        lib.aib_regions_put(self._key_kind, key, len(key), entry.base, entry.owner, self._limit)

    def clear(self) -> None:
        """Let go of every entry of this kind (their opens close as their last arrays go)."""
        key = ffi.new("uint8_t[]", lib.AIB_REGION_KEY_MAX)
        length = ffi.new("size_t *")
        while lib.aib_regions_take_oldest(self._key_kind, key, length, self._value):
            pass


class CudaOpener:
    """Opens CUDA regions in this process (one instance per process: handles are per process)."""

    def __init__(self, max_legacy: int = 256, max_pools: int = 16, max_kept: int = 256) -> None:
        self._lock = threading.Lock()
        self._legacy = _HeldOpen(lib.AIB_REGION_KEY_LEGACY, 64, max_legacy)  # legacy handles kept open
        # handle -> [pointer, owners using it]: each is opened once per process, closed by its last owner
        self._legacy_live: dict[bytes, list[int]] = {}
        # Imported pools by identity, least recently used first. Beyond max_pools, pools with no
        # pointer imported are destroyed (producers that come and go, or churn pools).
        self._pools: OrderedDict[bytes, ImportedPool] = OrderedDict()
        self._pool_pointers: dict[bytes, list[int]] = {}  # handle -> [pointer, leases using it]
        # Imports of kept slabs (REGION_FLAG_KEPT: the producer never frees them), open beyond their
        # leases like legacy handles; an entry's owner, when it ends, releases the import.
        self._kept = _HeldOpen(lib.AIB_REGION_KEY_POOL, 88, max_kept)
        # Legacy handles opened again in another GPU's context for reading there (see
        # open_legacy_for_reader), held open like the others; keyed by handle + reader ordinal.
        self._reader_legacy = _HeldOpen(lib.AIB_REGION_KEY_READER_LEGACY, 68, max_legacy)
        self._reader_legacy_live: dict[bytes, list[int]] = {}
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
        with _state.lock:
            local = _state.local_exports.get(region.handle)
            if local is not None:
                _state.counters["same_process"] += 1
        if local is not None:
            # Our own export: the memory is already mapped here, and the producer's lease keeps it.
            return _Opened(local, lib.aib_owner_new(0))
        if region.kind == REGION_CUDA_LEGACY:
            return self._open_legacy(region, device)
        if region.kind == REGION_CUDA_POOL:
            return self._open_pool_pointer(region, fds, device, fetch_pool_fd)
        if region.kind == REGION_CUDA_VMM:
            return self._open_vmm(region, fds, device)
        raise ProtocolError(f"region kind {region.kind} is not a CUDA region")

    def _open_legacy(self, region: Region, device: int) -> _Opened:
        if len(region.handle) != 64:
            raise ProtocolError("a legacy CUDA IPC handle is 64 bytes", field="handle")
        with self._lock:
            return self._legacy_locked(region.handle, device)

    def open_legacy_regions(self, regions: list[Region], device: int) -> tuple[list[int], Any]:
        """Open a message's legacy regions together: ``(bases in order, one owner holding them
        all)``, the caller's. One lock and one owner for the message instead of one per region:
        a new message over known allocations (CuPy's pool carves new arrays out of the same
        blocks) costs little more than the lookups. Same rules as :meth:`open`."""
        handles = [region.handle for region in regions]
        if any(len(handle) != 64 for handle in handles):
            raise ProtocolError("a legacy CUDA IPC handle is 64 bytes", field="handle")
        with _state.lock:
            local = [_state.local_exports.get(handle) for handle in handles]
            _state.counters["same_process"] += sum(base is not None for base in local)
        return self._open_grouped(
            list(zip(handles, local, strict=True)), lambda handle: self._legacy_locked(handle, device)
        )

    def _open_grouped(
        self, handles: list[tuple[bytes, int | None]], open_locked: Callable[[bytes], _Opened]
    ) -> tuple[list[int], Any]:
        """``(bases in order, one owner holding every open)``, the caller's: each handle's known
        base (our own export: mapped here, kept by the producer) or ``open_locked(handle)``,
        called under the lock."""
        group = lib.aib_owner_new(0)
        if group == ffi.NULL:
            raise MemoryError("allocating an owner")
        bases: list[int] = []
        try:
            with self._lock:
                for handle, known_base in handles:
                    if known_base is not None:
                        bases.append(known_base)
                        continue
                    opened = open_locked(handle)
                    failed = lib.aib_owner_add_dependency(group, opened.owner)
                    lib.aib_owner_unref(opened.owner)
                    if failed:
                        raise MemoryError("adding an owner dependency")
                    bases.append(opened.base)
        except BaseException:
            lib.aib_owner_unref(group)
            raise
        return bases, group

    def open_legacy_for_reader(self, handles: list[bytes], reader: int) -> tuple[list[int], Any]:
        """Open legacy handles of another GPU's memory in GPU ``reader``'s primary context:
        ``(their pointers there, in order; one owner holding them all)``, the caller's.

        A legacy allocation opened in its own GPU's context is not readable from another GPU, even
        with peer access enabled between the two (the driver maps it in the opening context only;
        measured on NVLink-connected H200s). Opened in the reader's context (with
        ``CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS``) it gets a mapping, at another address, that kernels on
        the reader can dereference. Each (handle, reader) is opened once per process and held open
        like the owner's own opens (a table of its own kind, so no import on the owner's GPU is
        ever given one of these pointers)."""
        if any(len(handle) != 64 for handle in handles):
            raise ProtocolError("a legacy CUDA IPC handle is 64 bytes", field="handle")
        suffix = reader.to_bytes(4, "little")
        return self._open_grouped(
            [(handle, None) for handle in handles],
            lambda handle: self._reader_legacy_locked(handle + suffix, handle, reader),
        )

    def _reader_legacy_locked(self, key: bytes, handle: bytes, reader: int) -> _Opened:
        """:meth:`_legacy_locked` for a handle opened in GPU ``reader``'s context (``key``: the
        handle and the reader)."""
        hit = self._reader_legacy.find(key)
        if hit is not None:
            return hit
        return self._open_and_hold(self._reader_legacy, self._reader_legacy_live, key, handle, reader)

    def _legacy_locked(self, handle: bytes, device: int) -> _Opened:
        """Under the lock: the open handle (one owner reference for the caller), from the region
        table or opened now (and held there, the bound letting go of the least recently used).

        Opens and closes happen under the lock, and a handle is opened once per process however
        many owners use it: an evicted entry whose arrays are still alive keeps its mapping, and a
        new get of the same handle reuses it instead of opening it again (a later close would
        otherwise pull the mapping from under the new one)."""
        hit = self._legacy.find(handle)
        if hit is not None:
            _state.counters["legacy_hits"] += 1
            return hit
        if handle not in self._legacy_live:
            _state.counters["legacy_opens"] += 1
        return self._open_and_hold(self._legacy, self._legacy_live, handle, handle, device)

    def _open_and_hold(
        self, held: _HeldOpen, live: dict[bytes, list[int]], key: bytes, handle: bytes, device: int
    ) -> _Opened:
        """Under the lock, for a ``key`` that ``held`` lacks: ``handle`` opened in ``device``'s
        context (or found open in ``live``, counting one more owner), held in ``held``; one owner
        reference for the caller, the table takes its own. The last owner's end closes it."""
        ptr = _acquire(live, key, lambda: ipc_open_mem_handle(handle, device))
        owner = lib.aib_owner_new(
            reaper.register(
                lambda: self._release(live, key, lambda ptr: ipc_close_mem_handle(ptr, device=device))
            )
        )
        opened = _Opened(ptr, owner)
        held.add(key, opened)
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
        new buffer's cost near the driver's own import call. Same counting as :meth:`open`: a pointer is
        imported once per process and freed after its last lease. ``fetch_pool_fd``: see
        :meth:`_pool`.
        """
        keys: list[bytes] = []
        for region in regions:
            if len(region.handle) != 88:
                raise ProtocolError("a pool region needs an 88-byte handle", field="handle")
            keys.append(region.handle)
        with _state.lock:
            local = any(key in _state.local_exports for key in keys)
        if local:  # our own export (same process): one region at a time, from the producer's records
            return self._open_one_by_one(regions, fds, device, fetch_pool_fd)
        # Kept slabs are held by their LRU entries; the others are counted per message (lease).
        kept = {region.handle for region in regions if region.flags & REGION_FLAG_KEPT}
        counted = [key for key in keys if key not in kept]
        held: list[Any] = []  # one reference on each kept slab's owner, for the group below
        try:
            for _ in range(3):
                pools: dict[bytes, ImportedPool] = {}
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
                            keys, counted=counted, kept=kept, pools=pools, held=held
                        )
                        break
            else:
                raise CudaError("the message's IPC pools were evicted three times while being imported")
            token = reaper.register(lambda: self._release_pool_pointers(counted, pools)) if counted else 0
            group = lib.aib_owner_new(token)
            if group == ffi.NULL:
                if token:
                    reaper.unregister(token)
                    self._release_pool_pointers(counted, pools)
                raise MemoryError("allocating an owner")
            for owner in held:
                if lib.aib_owner_add_dependency(group, owner):
                    lib.aib_owner_unref(group)
                    raise MemoryError("adding an owner dependency")
        finally:
            for owner in held:
                lib.aib_owner_unref(owner)
        return bases, group

    def _import_pool_pointers(
        self,
        keys: list[bytes],
        *,
        counted: list[bytes],
        kept: set[bytes],
        pools: dict[bytes, ImportedPool],
        held: list[Any],
    ) -> list[int]:
        """Under the lock: import the pointers not imported yet (one batch per pool), count one
        more lease on every pointer of ``counted``, and append to ``held`` a reference on the owner
        of every kept one's region-table entry (made now for new ones; the caller unrefs them after
        the lock). Returns the addresses of ``keys`` in order."""
        fresh: dict[bytes, list[bytes]] = {}
        for key in dict.fromkeys(keys):
            if self._kept.has(key):
                _state.counters["pool_kept_hits"] += 1
            elif key not in self._pool_pointers:
                fresh.setdefault(key[:24], []).append(key)
        done: list[bytes] = []
        try:
            for pool_key, new_keys in fresh.items():
                pointers = pools[pool_key].import_pointers([key[24:] for key in new_keys])
                _state.counters["pool_pointer_imports"] += len(pointers)
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
                entry = self._keep_pool_pointer(key, pools[key[:24]])
            held.append(entry.owner)
        return [self._pool_pointers[key][0] for key in keys]

    def _keep_pool_pointer(self, key: bytes, pool: ImportedPool) -> _Opened:
        """Under the lock: hold a kept slab's import (imported already) in the region table
        (region_table.c, where the C core's get path finds it too): one more count on the pointer,
        held by an owner the entry keeps; returned with a reference for the caller. The owner's end
        (let go of by the table, and no array using it) takes the count back, and the last count
        frees the import."""
        self._pool_pointers[key][1] += 1
        owner = lib.aib_owner_new(
            reaper.register(lambda: self._release_pool_pointers([key], {key[:24]: pool}))
        )
        if owner == ffi.NULL:
            self._pool_pointers[key][1] -= 1
            raise MemoryError("allocating an owner")
        entry = _Opened(self._pool_pointers[key][0], owner)
        self._kept.add(key, entry)
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
    ) -> ImportedPool:
        """The imported pool for ``pool_key`` (imported once per process: a driver call per pool).

        Its fd is the one the message attached, or (``fd`` None: a publisher's message) the one
        ``fetch_pool_fd`` asks the producer for, once per pool per process. Without either the
        pool must have been imported already."""
        with self._lock:
            pool = self._pools.get(pool_key)
            if pool is not None:
                self._pools.move_to_end(pool_key)
                return pool
        if fd is not None:
            imported = import_pool(fd, device)
        elif fetch_pool_fd is None:
            raise ProtocolError(
                "an IPC-pool region came without its pool's fd and this process has not imported "
                "that pool: import a publisher's message through its Session, or export with "
                "pool_fds=True",
                field="fd_index",
            )
        else:
            fetched = fetch_pool_fd(pool_key)
            with _state.lock:
                _state.counters["pool_fd_requests"] += 1
            try:
                imported = import_pool(fetched, device)
            finally:
                os.close(fetched)  # the driver keeps its own reference
        evicted: list[ImportedPool] = []
        with self._lock:
            pool = self._pools.setdefault(pool_key, imported)
            if pool is imported:
                _state.counters["pool_imports"] += 1
                evicted = self._evict_idle_pools(keep=pool_key)
        if pool is not imported:  # another thread imported it meanwhile
            imported.close()
        for old in evicted:
            _close_quietly(old.close)
        return pool

    def imported_pool(self, pool_key: bytes) -> ImportedPool | None:
        """The pool imported here under a 24-byte identity, or None (not imported, or this process's
        own: a same-process export resolves its pointers from the producer's records)."""
        with self._lock:
            return self._pools.get(pool_key)

    def _evict_idle_pools(self, keep: bytes) -> list[ImportedPool]:
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

    def _release_pool_pointers(self, keys: list[bytes], pools: dict[bytes, ImportedPool]) -> None:
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
            raise ProtocolError("a VMM region needs its fd", field="fd_index")
        mapping = vmm_import(fds[region.fd_index], region.size, device)
        token = reaper.register(mapping.close)
        return _Opened(mapping.ptr, lib.aib_owner_new(token))

    def close(self) -> None:
        """Drop the caches' references (handles close, kept slab imports are freed, as their last
        arrays go)."""
        with self._lock:
            self._legacy.clear()
            self._kept.clear()
            self._reader_legacy.clear()


def _attached_fd(region: Region, fds: list[int] | tuple[int, ...]) -> int | None:
    """The fd a region's message attached for it, or None (fd_index -1). The decoder checked the
    index against the message's fd count; a short list here is the caller's error."""
    if region.fd_index < 0:
        return None
    if region.fd_index >= len(fds):
        raise ProtocolError(f"fd index {region.fd_index} but {len(fds)} fds came", field="fd_index")
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
    with _state.lock:
        if _opener is None:
            _opener = CudaOpener()
        return _opener


def owner_slot(owner: Any) -> Any:
    """Address inside ``owner`` where a CUevent value can live as long as the owner."""
    return lib.aib_owner_slot(owner)
