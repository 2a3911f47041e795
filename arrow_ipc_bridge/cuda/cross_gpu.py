"""Imported GPU data read from another GPU of this process: in place, or copied to the reader's GPU.

The imported object says where its bytes live (``device_id``: this process's ordinal of the
producer's GPU, as the C Device interface requires). A consumer whose work runs on another GPU,
the *reader*, has two ways to use it:

- **in place** (``imported.readable_on(reader)``, which calls :func:`reader_mappings`): its
  kernels read the producer's memory over NVLink or PCIe. That needs the reader's access to each
  region's memory (:func:`grant_in_place`): peer access between the two primary contexts
  (``peer.enable_peer_access``, once per pair), ``cuMemPoolSetAccess`` on the imported pool for
  IPC-pool regions (once per pool and reader: an importer sets its own access), ``cuMemSetAccess``
  on the mapping for VMM regions (a mapping is made per get). Legacy (``cudaMalloc``) regions need
  more: an IPC handle opened in the owner's context is not mapped for another GPU even with peer
  access on, so each is opened again in the reader's context (held open per handle and reader,
  ``opener.open_legacy_for_reader``) and the object handed out names those pointers. Pairs without
  a peer path raise ``CudaError`` (``reason="no_peer_access"``).
- **a copy** (:func:`copy_to_device`): one new allocation on the reader's GPU (from the bridge's
  IPC pool, so the copy can be published again), one ``cuMemcpyPeerAsync`` per contiguous run of
  buffers of each region on the caller's stream, queued after the producer's event; the copy
  carries an event of its own recorded after the copies, as its ``sync_event``. The host does not
  wait. The source import is held until the copies completed (checked at the next copy, and when
  the copy is released), never longer, so the producer's lease ends as it would without a copy.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.cuda import _state
from arrow_ipc_bridge.cuda._declarations import (
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_LOCATION_TYPE_DEVICE,
)
from arrow_ipc_bridge.cuda._driver import _api, _check, _stream_value
from arrow_ipc_bridge.cuda.devices import _device, device_context
from arrow_ipc_bridge.cuda.events import Event, EventPool, event_query, event_value, stream_wait_event
from arrow_ipc_bridge.cuda.opener import opener
from arrow_ipc_bridge.cuda.peer import (
    copy_peer_async,
    enable_peer_access,
    is_no_peer_access,
    peer_access_error,
    try_enable_peer_access,
)
from arrow_ipc_bridge.cuda.placer import bridge_pool
from arrow_ipc_bridge.errors import BridgeError, CudaError
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.wire.metadata import (
    REGION_CUDA_LEGACY,
    REGION_CUDA_POOL,
    REGION_CUDA_VMM,
    SLOT_FIRST_REGION,
    Decoded,
)

__all__ = [
    "CROSS_DEVICE_MODES",
    "ReaderPlacement",
    "copy_plan",
    "copy_to_device",
    "grant_in_place",
    "reader_mappings",
    "reader_view",
]

_log = logging.getLogger("arrow_ipc_bridge")
_DEVICE_CUDA = 2  # ARROW_DEVICE_CUDA (capsules.DEVICE_CUDA; the C Device interface's number)
# A copied region starts at this alignment plus the source's own offset from it, so every buffer
# keeps the alignment it had (cudaMalloc's 256 bytes covers what any consumer asks for).
_ALIGN = 256
CROSS_DEVICE_MODES = ("peer", "copy")

# ---------- reading in place ---------------------------------------------------------------------------
# (pool identity, reader) granted already: the producer's 24-byte identity, never reused (the
# driver hands a destroyed pool's CUmemoryPool value to a new one)
_pool_access: set[tuple[bytes, int]] = set()
_pool_access_lock = threading.Lock()
# Messages whose regions were all made readable from a reader (message bytes, reader): cleared when
# full (a bound, as the remembered messages have one).
_granted: dict[tuple[bytes, int], None] = {}
_GRANTED_MAX = 1024


def _check_reader(reader: Any) -> int:
    if isinstance(reader, bool) or not isinstance(reader, int):
        raise TypeError(f"device must be a GPU ordinal (int), not {type(reader).__name__}")
    _device(reader)  # CudaError naming CUDA_VISIBLE_DEVICES for an ordinal this process lacks
    return reader


def _check_cuda(imported: Any, what: str) -> None:
    if imported.device_type != _DEVICE_CUDA:
        raise BridgeError(
            f"{what} needs GPU data; this is on device type {imported.device_type} "
            "(host data: aib.to_device(imported, device) uploads it)",
            field="device_type",
        )


def grant_in_place(imported: Any, reader: int) -> None:
    """Let kernels on GPU ``reader`` read ``imported``'s memory where it is (see the module's text).

    Nothing to do when the data lives on ``reader`` already. Every region the message names is
    made accessible; the imported object itself is unchanged (its ``device_id`` stays where the
    bytes are).

    Raises
    ------
    CudaError (``reason="no_peer_access"``)
        The two GPUs have no peer path, or the driver refused access to a region: both GPUs named.
    BridgeError
        Host data, or a released object (``ClosedError``).
    """
    _grant(imported, reader)


def _grant(imported: Any, reader: int) -> bool:
    """:func:`grant_in_place`; True when the grant covers every later get of the same message on
    ``reader`` (no VMM mapping, which is made, and so granted, per get)."""
    _check_cuda(imported, "reading in place")
    decoded = imported._borrow()
    try:
        return _grant_decoded(decoded, imported._bases, imported.device_id, reader)
    finally:
        decoded.unborrow()


def _grant_decoded(decoded: Decoded, bases: Any, owner: int, reader: int) -> bool:
    """:func:`_grant` for ``decoded``'s message with its regions at ``bases`` on GPU ``owner``."""
    reader = _check_reader(reader)
    if owner == reader:
        return True
    enable_peer_access(reader, owner)
    # A message granted before needs nothing more (a steady-state re-get must not pay a walk of
    # its regions): its legacy regions are covered by the pair, its pools by their grants.
    key = (decoded.message, reader)
    if key in _granted:
        return True
    has_mapping = False
    for index, region in enumerate(decoded.regions()):
        if region.kind == REGION_CUDA_POOL:
            pool = opener().imported_pool(region.handle[:24])
            if pool is not None:  # None: this process's own pool (same-process export)
                _grant_pool(region.handle[:24], pool.handle, owner, reader)
        elif region.kind == REGION_CUDA_VMM:
            _grant_mapping(int(bases[index]), region.size, owner, reader)
            has_mapping = True
    if not has_mapping:  # VMM regions are mapped per get: granted per get
        with _pool_access_lock:
            if len(_granted) >= _GRANTED_MAX:
                _granted.clear()
            _granted[key] = None
    return not has_mapping


def reader_mappings(imported: Any, reader: int) -> tuple[Decoded, Any, frozenset[int]] | None:
    """What makes ``imported`` readable in place from GPU ``reader`` (``ImportedArray.readable_on``
    builds the object): :func:`grant_in_place` first; then, where the message has legacy
    (``cudaMalloc``) regions of another process on another GPU, those opened again in the reader's
    context: ``(a decode of the message with an owner of its own, the regions' bases with those
    pointers, the indexes of the regions opened there)``. The owner holds the reader's mappings
    and ``imported``'s owner (its lease and its event slot). None when ``imported``'s own pointers
    serve (data on ``reader``, or no such region). Raises as :func:`grant_in_place`.

    A re-get (the same decoded message again, with the same bases, on the same reader) reuses what
    the first one worked out, kept in the decode's ``reader_maps`` (shared by every import of a
    remembered message; dropped, and its hold on the reader's mappings with it, when the message
    is forgotten): no grant, no walk of the regions, no table lookup per handle, no driver call."""
    if imported.device_type == _DEVICE_CUDA and type(reader) is int and imported.device_id != reader:
        decoded = imported._borrow()
        try:
            entry = decoded.reader_maps.get(reader)
            # The bases are compared because VMM regions are mapped per get (never kept here) and a
            # message that is not remembered may be imported again over other pointers.
            if entry is not None and entry[1] == ffi.buffer(imported._bases, 8 * imported._n_bases)[:]:
                group, _, bases, remap = entry
                if group is None:
                    return None
                return _sharing(decoded, group), bases, remap
        finally:
            decoded.unborrow()
    lasting = _grant(imported, reader)
    if imported.device_id == reader:
        return None
    decoded = imported._borrow()
    try:
        source = ffi.buffer(imported._bases, 8 * imported._n_bases)[:]
        group, base_array, remapped = _remapped(decoded, imported._bases, imported._n_bases, reader)
        if group is None:
            if lasting:
                decoded.reader_maps.setdefault(reader, (None, source, None, frozenset()))
            return None
        shared = _sharing(decoded, group)
        if lasting:
            decoded.reader_maps.setdefault(reader, (group, source, base_array, remapped))
    finally:
        decoded.unborrow()
    return shared, base_array, remapped


def reader_view(
    decoded: Decoded, bases: Any, owner: int, reader: int
) -> tuple[Any, Any, frozenset[int]] | None:
    """How GPU ``reader`` reads ``decoded``'s message, whose regions lie at ``bases`` (a
    ``uint64_t[]``) on GPU ``owner``, in place on every get of it: access granted (as
    :func:`grant_in_place`), and ``(an owner holding the legacy regions opened again in the reader's
    context, or None where there are none; the bases the reader reads the regions at, a
    ``uint64_t[]``; the indexes of the regions opened again)``. A remembered message is kept that
    way for a session whose reader is another GPU (``consumer/remembered.py``), so its re-gets need
    no placement. None when nothing needs doing (``owner`` is ``reader``) or the grant holds for
    one get only (a VMM region). Raises as :func:`grant_in_place`."""
    if owner == reader or not _grant_decoded(decoded, bases, owner, reader):
        return None
    group, base_array, remapped = _remapped(decoded, bases, len(bases), reader)
    return group, bases if base_array is None else base_array, remapped


def _remapped(decoded: Decoded, bases: Any, n_bases: int, reader: int) -> tuple[Any, Any, frozenset[int]]:
    """The message's legacy regions of another process opened again in GPU ``reader``'s context:
    ``(one owner holding them, the bases with their pointers there, their indexes)``, or
    ``(None, None, frozenset())`` when it has none (this process's own exports are its own
    allocations: peer access covers them)."""
    regions = decoded.regions()
    with _state.lock:
        remap = [
            index
            for index, region in enumerate(regions)
            if region.kind == REGION_CUDA_LEGACY and region.handle not in _state.local_exports
        ]
    if not remap:
        return None, None, frozenset()
    new_bases = [int(bases[index]) for index in range(n_bases)]
    pointers, group = opener().open_legacy_for_reader([regions[index].handle for index in remap], reader)
    group = ffi.gc(group, lib.aib_owner_unref)  # the caller's hold, or nobody's
    for index, pointer in zip(remap, pointers, strict=True):
        new_bases[index] = pointer
    return group, ffi.new("uint64_t[]", new_bases), frozenset(remap)


def _sharing(decoded: Decoded, group: Any) -> Decoded:
    """A decode of ``decoded``'s message whose owner holds the reader's mappings (``group``) and
    ``decoded``'s owner; its structs name the reader's pointers (``own_view``)."""
    shared = Decoded.sharing(decoded, own_view=True)
    try:
        shared.depend_on(group)
        shared.depend_on(decoded.owner)
    except BaseException:
        shared.close()
        raise
    return shared


def _access_descriptor(reader: int) -> Any:
    _, driver_ffi = _api()
    desc = driver_ffi.new("CUmemAccessDesc *")
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = reader
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def _grant_pool(identity: bytes, pool: int, owner: int, reader: int) -> None:
    """``cuMemPoolSetAccess`` for ``reader`` on an imported pool, once per pool and reader."""
    if (identity, reader) in _pool_access:
        return
    lib_cuda, driver_ffi = _api()
    with _pool_access_lock:
        if (identity, reader) in _pool_access:
            return
        with device_context(owner):
            rc = int(
                lib_cuda.cuMemPoolSetAccess(
                    driver_ffi.cast("CUmemoryPool", pool), _access_descriptor(reader), 1
                )
            )
        _raise_access(rc, "cuMemPoolSetAccess", owner, reader, "an IPC memory pool's allocations")
        _pool_access.add((identity, reader))


def _grant_mapping(base: int, size: int, owner: int, reader: int) -> None:
    """``cuMemSetAccess`` for ``reader`` on a VMM mapping (made per get, so asked per get)."""
    lib_cuda, _ = _api()
    with device_context(owner):
        rc = int(lib_cuda.cuMemSetAccess(base, size, _access_descriptor(reader), 1))
    _raise_access(rc, "cuMemSetAccess", owner, reader, "a VMM allocation")


def _raise_access(rc: int, call: str, owner: int, reader: int, what: str) -> None:
    if rc == 0:
        return
    try:
        _check(call, rc)
    except CudaError as exc:
        raise peer_access_error(
            reader,
            owner,
            f"granting access to {what} failed: {exc.message}. Copy the data instead: "
            f"imported.to_device({reader})",
            call=call,
            code=rc,
            name=exc.details.get("name"),
        ) from None


# ---------- copies ---------------------------------------------------------------------------------------
def copy_plan(
    buffer_refs: list[tuple[int, int, int]], region_starts: list[int]
) -> tuple[int, dict[int, Any]]:
    """Where each region's bytes go in one new allocation, and which runs of them to copy.

    ``buffer_refs``: the message's ``(slot code, offset, length)`` (``Decoded.buffer_refs``);
    ``region_starts``: each region's base address in this process (for alignment). Returns
    ``(total bytes, {region: (lo, placed_at, [(start, end), ...])})``: the region's bytes from
    offset ``lo`` on are placed at ``placed_at`` in the allocation (``placed_at - lo + offset`` is a
    buffer's new address relative to the allocation), and each ``(start, end)`` run of offsets
    (buffers merged where they touch or overlap) is one copy. Gaps between runs are left
    uninitialised: no buffer points into them. Pure arithmetic, so it is tested without a GPU.
    """
    runs: dict[int, list[tuple[int, int]]] = {}
    for code, offset, length in buffer_refs:
        if code >= SLOT_FIRST_REGION and length:
            runs.setdefault(code - SLOT_FIRST_REGION, []).append((offset, offset + length))
    plan: dict[int, Any] = {}
    cursor = 0
    for region in sorted(runs):
        ranges = sorted(runs[region])
        merged = [list(ranges[0])]
        for lo, hi in ranges[1:]:
            if lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        lo, hi = merged[0][0], merged[-1][1]
        misalignment = (region_starts[region] + lo) % _ALIGN
        placed_at = (cursor + _ALIGN - 1) // _ALIGN * _ALIGN + misalignment
        plan[region] = (lo, placed_at, [(start, end) for start, end in merged])
        cursor = placed_at + (hi - lo)
    return max(cursor, _ALIGN), plan


_event_pools: dict[int, EventPool] = {}
_copies_lock = threading.Lock()
# Copies queued whose sources are still held: (the copy's event, a holder owner of the source's
# message). Swept at each copy and at each copy's release: a completed event drops its holder.
_pending: list[tuple[Event, Any]] = []


def _copy_events(device: int) -> EventPool:
    with _copies_lock:
        pool = _event_pools.get(device)
        if pool is None:
            pool = _event_pools[device] = EventPool(device)
        return pool


def _sweep(wait_for: Event | None = None) -> None:
    """Let go of the sources of completed copies (``wait_for``'s after its copies finished)."""
    if wait_for is not None:
        wait_for.synchronize()
    with _copies_lock:
        done = [entry for entry in _pending if entry[0] is wait_for or _finished(entry[0])]
        for entry in done:
            _pending.remove(entry)
    for _, holder in done:
        lib.aib_owner_unref(holder)


def _finished(event: Event) -> bool:
    try:
        return event_query(event)
    except CudaError:  # a failed copy: its source is no use to anyone any more
        return True


def copy_to_device(imported: Any, device: int, stream: object = None) -> tuple[Any, list[int], Any]:
    """Copy GPU data to GPU ``device`` (see the module's text): ``(a new decode of the message that
    owns the copy, the regions' bases in it, its sync_event slot)``, from which ``consumer/imported.py``
    makes the object (``ImportedArray.to_device``). ``stream``: a stream of ``device`` (CuPy /
    PyTorch stream object or ``CUstream`` int); None or 0 is its legacy default stream.

    The copy's memory comes from the bridge's IPC pool on ``device`` and goes back to it when the
    copy and every struct built from it are released (ordered after the copies on the legacy
    default stream; the C Device interface leaves it to the consumer to have finished its own work
    on the data by then).
    """
    _check_cuda(imported, "to_device")
    device = _check_reader(device)
    stream_value = _stream_value(stream)
    source_device = imported.device_id
    # The context each region's pointer is mapped in: the owner's, or the reader's for the legacy
    # regions readable_on opened there (the copy reads them through that mapping).
    mapped_device, mapped_regions = imported._mapped_on or (source_device, frozenset())
    if source_device != device:
        # Direct copies over the peer path when there is one; the driver stages them otherwise.
        # Pool and VMM sources have access of their own, given here too where the pair allows.
        if try_enable_peer_access(device, source_device):
            try:
                grant_in_place(imported, device)
            except CudaError as exc:  # no peer path for this pair: the copy goes without it
                if not is_no_peer_access(exc):
                    raise
        try_enable_peer_access(source_device, device)
    _sweep()
    decoded = imported._borrow()
    try:
        bases = imported._bases
        n_regions = len(decoded.regions())
        total, plan = copy_plan(decoded.buffer_refs(), [int(bases[i]) for i in range(n_regions)])
        sync = imported._sync_event()
        pool = bridge_pool(device)
        events = _copy_events(device)
        base = pool.allocate(total, stream_value)
        with _state.lock:  # aib.stats().cuda: copies of imports to a GPU, counted as they are made
            _state.counters["device_copies"] += 1
            _state.counters["device_copied_bytes"] += total
        event = events.acquire()
        try:
            if sync != ffi.NULL:
                stream_wait_event(stream_value, event_value(sync), device=device)
            new_bases = [0] * max(n_regions, 1)
            for region, (lo, placed_at, runs) in plan.items():
                source = int(bases[region])
                for start, end in runs:
                    copy_peer_async(
                        base + placed_at + (start - lo),
                        device,
                        (source + start) % (1 << 64),
                        mapped_device if region in mapped_regions else source_device,
                        end - start,
                        stream=stream_value,
                    )
                # modulo 2**64: the C rebuild adds offsets back with unsigned wrap-around (offsets of
                # same-process regions are device addresses)
                new_bases[region] = (base + placed_at - lo) % (1 << 64)
            event.record(stream_value)
            holder = lib.aib_owner_new(0)
            if holder == ffi.NULL:
                raise MemoryError("holding the source of a copy")
            if lib.aib_owner_add_dependency(holder, decoded.owner):
                lib.aib_owner_unref(holder)
                raise MemoryError("holding the source of a copy")
            with _copies_lock:
                _pending.append((event, holder))
            owner = lib.aib_owner_new(reaper.register(lambda: _free_copy(pool, base, event, events, device)))
            if owner == ffi.NULL:
                raise MemoryError("allocating an owner")
        except BaseException:
            _free_copy(pool, base, event, events, device)
            raise
        try:
            slot = lib.aib_owner_slot(owner)
            slot[0] = event.handle  # the C Device interface's sync_event points at a CUevent
            copy = decoded.copy()
            copy.depend_on(owner)
        finally:
            lib.aib_owner_unref(owner)  # the copy's message holds it now (or nobody, on error)
    finally:
        decoded.unborrow()
    return copy, new_bases, slot


def _free_copy(pool: Any, base: int, event: Event, events: EventPool, device: int) -> None:
    """A copy ended: its source goes (after the copies), its memory returns to the pool after them,
    its event to the event pool. Never raises (runs on the reaper thread)."""
    try:
        _sweep(wait_for=event)
        stream_wait_event(0, event, device=device)
        pool.free(base, 0)
        events.release(event)
    except Exception as exc:  # cleanup never raises; the process may be shutting down
        _log.warning("arrow_ipc_bridge: freeing a GPU copy failed: %s", exc)


# ---------- what a session does with data from another GPU ---------------------------------------------
class ReaderPlacement:
    """A session's rule for CUDA data on a GPU other than its reader's (``Session(reader_device=...)``).

    ``"peer"``: the object is handed out as it is, after :func:`grant_in_place`; ``"copy"``: a copy
    on the reader's GPU (:func:`copy_to_device` on ``stream``) is handed out and the import released.
    Data on the reader's GPU, and host data, pass through untouched.
    """

    __slots__ = ("device", "mode", "stream")

    def __init__(self, device: Any, mode: Any, stream: object = None) -> None:
        if mode not in CROSS_DEVICE_MODES:
            raise ValueError(f"cross_device must be one of {CROSS_DEVICE_MODES}, not {mode!r}")
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"reader_device must be a GPU ordinal (int >= 0), not {device!r}")
        if stream is not None and mode != "copy":
            raise ValueError("copy_stream is only used with cross_device='copy'")
        _stream_value(stream)  # RegionError now for something that is not a stream
        self.device = device
        self.mode = mode
        self.stream = stream

    def place(self, imported: Any) -> Any:
        """What the session hands out for ``imported``."""
        if imported.device_type != _DEVICE_CUDA or imported.device_id == self.device:
            return imported
        mapped_on = imported._mapped_on
        if mapped_on is not None and mapped_on[0] == self.device and self.mode == "peer":
            return imported  # a re-get of a message remembered as the reader reads it
        if self.mode == "peer":
            try:
                readable = imported.readable_on(self.device)
            except BaseException:
                imported.release()
                raise
            if readable is not imported:  # the readable object holds the lease now
                imported.release()
            return readable
        try:
            return imported.to_device(self.device, stream=self.stream)
        finally:
            imported.release()
