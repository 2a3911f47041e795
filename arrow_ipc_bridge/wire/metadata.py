"""The metadata tree: describe captured data, encode it, decode and validate a message, rebuild structs.

The walks and the codec are in the C core (``cffi_build/wire_*.c``) because they run on every hand-off,
where a walk in Python would build objects per node; this module is their typed Python face.
``docs/wire-format.md`` is the specification of the bytes.

Producer::

    described = Described(captured)                 # layouts checked, buffer sizes known
    for slot, address, width in described.pending_reads(): ...   # device data only
    described.place(slot, region, offset)           # region backends place each buffer
    message = described.encode(MESSAGE_ARRAY, device, regions, n_fds)

Consumer::

    decoded = Decoded(message, n_fds)               # ProtocolError unless fully valid
    decoded.rebuild_schema(out_schema)
    decoded.rebuild_array(0, region_bases, out_array)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from arrow_ipc_bridge._ffi import WIRE_VERSION, DecodedState, ffi, lib, new_error, raise_for
from arrow_ipc_bridge.errors import BridgeError, ClosedError, ProtocolError
from arrow_ipc_bridge.runtime.deferred_close import DeferredClose
from arrow_ipc_bridge.wire.capsules import HOST_READABLE_DEVICES, CapturedData

__all__ = [
    "Described",
    "fill_region",
    "Decoded",
    "Region",
    "DeviceInfo",
    "MESSAGE_ARRAY",
    "MESSAGE_STREAM",
    "REGION_PROCESS",
    "REGION_HOST_FD",
    "REGION_CUDA_LEGACY",
    "REGION_CUDA_POOL",
    "REGION_CUDA_VMM",
    "SLOT_NULL",
    "SLOT_EMPTY",
    "SLOT_UNPLACED",
    "WIRE_VERSION",
    "MAX_MESSAGE_BYTES",
    "REGION_FLAG_KEPT",
    "REGION_FLAG_SEALED",
    "REGION_FLAG_ZERO_COPY",
]

MESSAGE_ARRAY = int(lib.AIB_MESSAGE_ARRAY)
MESSAGE_STREAM = int(lib.AIB_MESSAGE_STREAM)
REGION_PROCESS = int(lib.AIB_REGION_KIND_PROCESS)
REGION_HOST_FD = int(lib.AIB_REGION_KIND_HOST_FD)
REGION_CUDA_LEGACY = int(lib.AIB_REGION_KIND_CUDA_LEGACY)
REGION_CUDA_POOL = int(lib.AIB_REGION_KIND_CUDA_POOL)
REGION_CUDA_VMM = int(lib.AIB_REGION_KIND_CUDA_VMM)
# Slot region codes: 0 = NULL pointer, 1 = zero-length non-NULL buffer, 2 + i = region i.
SLOT_NULL = int(lib.AIB_REGION_NULL)
SLOT_EMPTY = int(lib.AIB_REGION_EMPTY)
SLOT_FIRST_REGION = int(lib.AIB_REGION_FIRST)
SLOT_UNPLACED = 2**64 - 1
MAX_MESSAGE_BYTES = int(lib.AIB_MAX_MESSAGE_BYTES)
# Host region flags on the wire. Informational: the consumer verifies what it relies on (the seals)
# on the file descriptor itself.
REGION_FLAG_SEALED = 1  # a memfd sealed against shrink/grow/write
REGION_FLAG_ZERO_COPY = 2  # the producer's own memory, not a copy
# A CUDA pool allocation the producer never frees while its process lives (a SlabAllocator slab):
# consumers may keep the import beyond their leases.
REGION_FLAG_KEPT = 4
_PROCESS_SPAN = 2**64 - 1
_SLOT_WORDS = 4  # aib_buffer_slot: address, length, region, offset (uint64 each)
_uncleared = ffi.new_allocator(should_clear_after_alloc=False)  # encode writes every byte it returns


class Region(NamedTuple):
    """One shared allocation as the message describes it (the inert, picklable form).

    ``handle`` is kind-specific (a CUDA IPC handle, pool export data); ``fd_index`` points into the
    file descriptors that travel beside the message (-1: none). A named tuple, not a frozen
    dataclass: a consumer makes one per region per new message, and a frozen dataclass sets each
    field through ``object.__setattr__``, where a named tuple is built in one C call.
    """

    kind: int
    size: int
    file_offset: int = 0
    identity: int = 0
    fd_index: int = -1
    handle: bytes = b""
    flags: int = 0


@dataclass(frozen=True)
class DeviceInfo:
    """The device all buffers of a message live on, and the producer's sync handle if any."""

    device_type: int
    identity: bytes = b""  # the GPU UUID for CUDA, empty for the CPU
    sync: bytes = b""  # the interprocess CUDA event handle, empty when none


def _fill_device(device: DeviceInfo) -> Any:
    info = ffi.new("aib_device_info *")
    info.device_type = device.device_type
    if len(device.identity) > 64 or len(device.sync) > 128:
        raise BridgeError("device identity over 64 bytes or sync handle over 128 bytes")
    info.identity_len = len(device.identity)
    ffi.memmove(info.identity, device.identity, len(device.identity))
    info.sync_len = len(device.sync)
    ffi.memmove(info.sync, device.sync, len(device.sync))
    return info


def fill_region(target: Any, region: Region) -> None:
    """Write ``region`` into the C core's ``aib_region`` ``target``."""
    if len(region.handle) > 128:
        raise BridgeError("a region handle is over 128 bytes")
    target.kind = region.kind
    target.flags = region.flags
    target.size = region.size
    target.file_offset = region.file_offset
    target.identity = region.identity
    target.fd_index = region.fd_index
    target.handle_len = len(region.handle)
    ffi.memmove(target.handle, region.handle, len(region.handle))


class Described:
    """The producer's metadata tree for one captured object (schema plus every batch).

    Parameters
    ----------
    captured
        The data to describe. Its buffers must stay alive while the message is in use, which
        ``CapturedData`` guarantees until it is closed.
    host_readable
        Whether the buffers may be read in this process to find variable data sizes; by default
        decided from the device type (CPU memory yes, CUDA device memory no: see ``pending_reads``).
    """

    def __init__(self, captured: CapturedData, *, host_readable: bool | None = None) -> None:
        if captured.closed:
            raise ClosedError("cannot describe closed captured data", what="captured data")
        if host_readable is None:
            host_readable = captured.device_type in HOST_READABLE_DEVICES
        d = lib.aib_describe_new()
        if d == ffi.NULL:
            raise MemoryError("allocating a description")
        self._d = ffi.gc(d, lib.aib_described_free)
        err = new_error()
        rc = lib.aib_describe_schema(self._d, captured.schema, err)
        if rc:
            raise_for(rc, err, "describing the schema")
        for batch in captured.arrays:
            rc = lib.aib_describe_batch(self._d, ffi.addressof(batch, "array"), int(host_readable), err)
            if rc:
                raise_for(rc, err, "describing a batch")
        self.batch_count = len(captured.arrays)
        self.is_stream = captured.is_stream

    @property
    def node_count(self) -> int:
        """Schema nodes in the tree (the root included)."""
        return int(lib.aib_described_node_count(self._d))

    def slots(self) -> memoryview:
        """Writable view of the buffer slots as uint64 words: address, length, region, offset.

        Slot ``i`` is ``view[4*i : 4*i + 4]``. Region backends read address/length and write the
        region code (``SLOT_FIRST_REGION + index``) and the offset inside the region.
        """
        n = int(lib.aib_described_buffer_count(self._d))
        if n == 0:
            return memoryview(bytearray()).cast("Q")
        raw = ffi.buffer(lib.aib_described_buffers(self._d), n * _SLOT_WORDS * 8)
        return memoryview(raw).cast("B").cast("Q")

    def pending_reads(self) -> list[tuple[int, int, int]]:
        """``(slot, address, width)`` of lengths that must be read from device memory.

        Read ``width`` bytes (a little-endian signed integer) at ``address`` and pass the value to
        :meth:`set_length`.
        """
        n = int(lib.aib_described_pending_count(self._d))
        pending = lib.aib_described_pending(self._d)
        return [(int(pending[i].slot), int(pending[i].address), int(pending[i].width)) for i in range(n)]

    def set_length(self, slot: int, length: int) -> None:
        """Give the value read for a :meth:`pending_reads` entry: the length behind ``slot``, which
        describing could not know without reading device memory."""
        err = new_error()
        rc = lib.aib_described_set_length(self._d, slot, length, err)
        if rc:
            raise_for(rc, err, "setting a buffer length")

    @property
    def buffer_count(self) -> int:
        """Buffer slots in the tree."""
        return int(lib.aib_described_buffer_count(self._d))

    @property
    def raw(self) -> Any:
        """The C core's ``aib_described *`` (for region backends that place buffers in C)."""
        return self._d

    def encode(self, device: DeviceInfo, regions: Sequence[Region], n_fds: int = 0) -> bytes:
        """The wire message (see docs/wire-format.md)."""
        region_array = ffi.new("aib_region[]", max(len(regions), 1))
        for i, region in enumerate(regions):
            fill_region(region_array[i], region)
        return self.encode_region_array(device, region_array, len(regions), n_fds)

    def encode_region_array(
        self, device: DeviceInfo, region_array: Any, n_regions: int, n_fds: int = 0
    ) -> bytes:
        """:meth:`encode` with the regions already in an ``aib_region[]`` of the C core."""
        kind = MESSAGE_STREAM if self.is_stream else MESSAGE_ARRAY
        info = _fill_device(device)
        err = new_error()
        out_len = ffi.new("size_t *")
        capacity = 4096
        while True:
            out = _uncleared("uint8_t[]", capacity)
            rc = lib.aib_encode(
                self._d, kind, info, region_array, n_regions, n_fds, out, capacity, out_len, err
            )
            if rc == lib.AIB_E_LIMIT and out_len[0] > capacity and out_len[0] <= MAX_MESSAGE_BYTES:
                capacity = int(out_len[0])
                continue
            if rc:
                raise_for(rc, err, "encoding the message")
            return bytes(ffi.buffer(out, out_len[0]))


class Decoded(DecodedState, DeferredClose):
    """A message decoded and validated in full; raises :class:`ProtocolError` otherwise.

    The decoded tree belongs to a C owner record (``owner``): every struct rebuilt from it holds a
    reference on that owner, so the tree, and whatever the owner depends on (region mappings), lives
    until this object is closed *and* the last rebuilt struct is released. The owner's ``token``
    (from ``_reaper.register``) reports that moment: it is the end of the lease.

    Parameters
    ----------
    message
        The bytes as received.
    n_fds
        How many file descriptors arrived with it (region fd indexes are checked against it).
    token
        Reaper token for the owner; 0 for none.
    allow_process_regions
        Accept same-process regions (raw addresses of this process). Only for messages this process
        encoded itself: the in-process fast path. Never for anything that came from a peer.

    Its state is in the slots of the C base type (``DecodedState``, ``cffi_build/py_state.c``), which
    the C core's local getter fills by offset when it shares a remembered template.
    """

    owner: Any  # the import owner, a cffi ``aib_owner *`` (ffi.gc)
    _d: Any  # the ``aib_decoded *``
    _message: bytes
    _n_fds: int
    _allow_process_regions: bool
    _reader_maps: dict[int, Any] | None  # see reader_maps; None until first needed

    def __init__(
        self,
        message: bytes | bytearray | memoryview,
        n_fds: int = 0,
        *,
        token: int = 0,
        allow_process_regions: bool = False,
    ) -> None:
        if not isinstance(message, bytes | bytearray | memoryview):
            raise ProtocolError(f"a message must be bytes, not {type(message).__name__}", field="message")
        out = ffi.new("aib_decoded **")
        err = new_error()
        options = lib.AIB_DECODE_ALLOW_PROCESS_REGIONS if allow_process_regions else 0
        rc = lib.aib_decode(ffi.from_buffer(message), len(message), n_fds, options, out, err)
        if rc:
            raise_for(rc, err, "decoding a message", wire=True)
        owner = lib.aib_owner_new(token)
        if owner == ffi.NULL:
            lib.aib_decoded_free(out[0])
            raise MemoryError("allocating an import owner")
        lib.aib_owner_attach_decoded(owner, out[0])
        self._d = out[0]
        self._message = bytes(message)
        self._n_fds = n_fds
        self._allow_process_regions = allow_process_regions
        # ffi.gc drops our reference when this object goes away; close() does it early through
        # ffi.release. (weakref.finalize would cost more than the whole decode.)
        self.owner = ffi.gc(owner, lib.aib_owner_unref)

    @classmethod
    def sharing(cls, decoded: Decoded, token: int = 0, *, own_view: bool = False) -> Decoded:
        """Another handle on the same validated message, with an owner of its own (``token``) that
        keeps ``decoded``'s owner alive: an identical message seen again is not decoded twice, and
        each lease still ends on its own. ``own_view``: the new owner does not take ``decoded``'s
        view (where the regions are in this process): its object sets one of its own, for regions
        mapped elsewhere (``ImportedArray.readable_on``)."""
        return cls.adopt(_sharing_owner(decoded, token, own_view), decoded)

    def sharing_owner(self, token: int = 0) -> Any:
        """A fresh owner (``token``) that shares this message and its view and keeps this object's
        owner alive: what :meth:`sharing` wraps, for a caller that builds the handle in C
        (``RememberedMessage.adopt``). The caller's, held as ``ffi.gc`` holds it."""
        return ffi.gc(_sharing_owner(self, token, False), lib.aib_owner_unref)

    @classmethod
    def adopt(cls, owner: Any, template: Decoded) -> Decoded:
        """A handle over ``owner``, a fresh owner the C core already made to share ``template``'s
        message (``aib_session_get``; a remembered message's template); this object takes over the
        caller's reference. The same slots the C core's local getter fills (``py_local_get.c``)."""
        self = cls.__new__(cls)
        self._d = template._d
        self._message = template._message
        self._n_fds = template._n_fds
        self._allow_process_regions = template._allow_process_regions
        self._reader_maps = template.reader_maps
        self.owner = ffi.gc(owner, lib.aib_owner_unref)
        return self

    @property
    def reader_maps(self) -> dict[int, Any]:
        """What reading this message in place from another GPU worked out, per reader ordinal
        (``cuda/cross_gpu.reader_mappings`` fills it): one dict shared by every decode sharing this
        one, so a re-get of a remembered message reuses it. :meth:`drop_reader_maps` empties it."""
        maps = self._reader_maps
        if maps is None:  # made on first need: most messages are never read from another GPU
            maps = self._reader_maps = {}
        return maps

    def drop_reader_maps(self) -> None:
        """Forget :attr:`reader_maps` (the message is forgotten): each entry's hold on the reader's
        mappings (its first item, an owner, or None) ends now; objects handed out keep their own."""
        maps = self._reader_maps
        if maps:
            entries = list(maps.values())
            maps.clear()
            for entry in entries:
                if entry[0] is not None:
                    ffi.release(entry[0])

    @classmethod
    def adopt_owned(cls, owner: Any, message: bytes) -> Decoded:
        """A handle over ``owner``, a fresh owner the C core made with a validated decode of
        ``message`` of its own (``aib_import_new``: a new message over regions open here); this
        object takes over the caller's reference."""
        self = cls.__new__(cls)
        self.owner = ffi.gc(owner, lib.aib_owner_unref)
        self._d = lib.aib_owner_decoded(owner)
        self._message = message
        self._n_fds = 0
        self._allow_process_regions = False
        return self

    @property
    def raw(self) -> Any:
        """The ``aib_decoded *`` (valid while this object is open)."""
        return self._live()

    @property
    def n_fds(self) -> int:
        return self._n_fds

    @property
    def message(self) -> bytes:
        return self._message

    @property
    def closed(self) -> bool:
        return self._closed

    # close() (DeferredClose): drops this object's reference on the owner, after the last borrower
    # (a C call with the GIL released) is done.
    _closed_message = "this imported message was released"

    def _close_now(self) -> None:
        ffi.release(self.owner)

    def _live(self) -> Any:
        if self._closed:
            raise ClosedError(self._closed_message, reason="released")
        return self._d

    @property
    def is_stream(self) -> bool:
        return int(lib.aib_decoded_message_kind(self._live())) == MESSAGE_STREAM

    @property
    def minor_version(self) -> int:
        return int(lib.aib_decoded_minor_version(self._live()))

    @property
    def batch_count(self) -> int:
        return int(lib.aib_decoded_batch_count(self._live()))

    @property
    def node_count(self) -> int:
        return int(lib.aib_decoded_node_count(self._live()))

    def regions(self) -> list[Region]:
        """The regions the message names, in message order (buffers refer to them by index)."""
        d = self._live()
        n = int(lib.aib_decoded_region_count(d))
        raw = lib.aib_decoded_regions(d)
        buffer = ffi.buffer
        # Positional: the same fields in Region's order (kind, size, file_offset, identity,
        # fd_index, handle, flags), without keyword handling per region.
        return [
            Region(
                r.kind,
                r.size,
                r.file_offset,
                r.identity,
                r.fd_index,
                buffer(r.handle, r.handle_len)[:],
                r.flags,
            )
            for r in (raw[i] for i in range(n))
        ]

    def device(self) -> DeviceInfo:
        """The device the message's buffers live on: its type, identity (a GPU's UUID) and sync event."""
        info = lib.aib_decoded_device(self._live())
        return DeviceInfo(
            device_type=int(info.device_type),
            identity=ffi.buffer(info.identity, info.identity_len)[:],
            sync=ffi.buffer(info.sync, info.sync_len)[:],
        )

    def copy(self) -> Decoded:
        """The same message decoded again, with an owner of its own (for data copied elsewhere)."""
        self._live()
        return Decoded(self._message, self._n_fds, allow_process_regions=self._allow_process_regions)

    def depend_on(self, region_owner: Any) -> None:
        """Keep ``region_owner`` (a mapping) alive as long as this message's owner lives."""
        self._live()
        if lib.aib_owner_add_dependency(self.owner, region_owner):
            raise MemoryError("adding an owner dependency")

    def rebuild_schema(self, out: Any) -> None:
        """Fill the ``ArrowSchema`` struct ``out`` (a cffi pointer) with the message's schema."""
        err = new_error()
        rc = lib.aib_rebuild_schema(self._live(), out, err)
        if rc:
            raise_for(rc, err, "rebuilding the schema")

    def buffer_refs(self) -> list[tuple[int, int, int]]:
        """Every buffer reference of every batch: ``(slot code, offset, length)`` (see ``SLOT_*``)."""
        d = self._live()
        n = int(lib.aib_decoded_buffer_count(d))
        if n == 0:
            return []
        words = memoryview(ffi.buffer(lib.aib_decoded_buffers(d), n * _SLOT_WORDS * 8)).cast("B").cast("Q")
        return [(words[i + 2], words[i + 3], words[i + 1]) for i in range(0, n * _SLOT_WORDS, _SLOT_WORDS)]

    def rebuild_array(self, batch: int, region_bases: Any, out: Any, *, owner: Any = None) -> None:
        """Build batch ``batch`` into ``out``; ``region_bases`` is a ``uint64_t[]`` cdata.

        Every node holds a reference on ``owner`` (default: this message's owner); pass another
        owner when the buffers live elsewhere (a host copy of device data).
        """
        err = new_error()
        holder = self.owner if owner is None else owner
        rc = lib.aib_rebuild_array(self._live(), batch, region_bases, len(region_bases), holder, out, err)
        if rc:
            raise_for(rc, err, "rebuilding an array")


def process_region() -> Region:
    """The same-process region: base address 0, spanning the address space.

    Only the in-process fast path uses it; a session refuses it from a peer.
    """
    return Region(kind=REGION_PROCESS, size=_PROCESS_SPAN)


def _sharing_owner(decoded: Decoded, token: int, own_view: bool) -> Any:
    """A new owner (``token``, one reference: the caller's) sharing ``decoded``'s message, and its
    view unless ``own_view``; it keeps ``decoded``'s owner alive."""
    decoded._live()  # refuses a closed message before anything is allocated
    owner = lib.aib_owner_new(token)
    if owner == ffi.NULL:
        raise MemoryError("allocating an import owner")
    share = lib.aib_owner_share_decoded_only if own_view else lib.aib_owner_share_decoded
    if share(owner, decoded.owner):
        lib.aib_owner_unref(owner)
        raise MemoryError("adding an owner dependency")
    return owner
