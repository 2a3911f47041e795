"""The writer's ring: reusable shared segments that small written batches are copied into
(docs/streams.md, "The data path").

A written host batch of at most :data:`SMALL_BATCH_BYTES` is copied into a free segment of its
stream's ring instead of a new sealed memfd: no memfd is created, sealed, sent or mapped per batch.
Each segment is one ``allocate_shared`` region (sealed against shrinking, growing and writes by
anyone but the producer's own mapping), sent to a subscriber with its descriptor the first time;
the subscriber keeps the message and a copy of the descriptor, so a later batch in the same
segment with the same layout (the same message bytes: a message describes where buffers lie, not
what they hold) is a BATCH that names the segment alone. A segment is free again once every
subscriber released the batch in it (``RingSegment.free``); the ring grows when none is free (the
stream's policy bounds how many batches subscribers hold, so it stops growing).
"""

from __future__ import annotations

import threading
from typing import NoReturn

from arrow_ipc_bridge._ffi import ffi, lib, raise_for
from arrow_ipc_bridge.errors import ClosedError
from arrow_ipc_bridge.host import allocate_shared
from arrow_ipc_bridge.host.shared_alloc import SharedHostBuffer
from arrow_ipc_bridge.producer.stream_hub import Batch
from arrow_ipc_bridge.wire.capsules import DEVICE_CPU, CapturedData
from arrow_ipc_bridge.wire.metadata import (
    MAX_MESSAGE_BYTES,
    REGION_HOST_FD,
)

__all__ = ["SMALL_BATCH_BYTES", "HostRing", "RingSegment"]

SMALL_BATCH_BYTES = 1 << 20
"""The most bytes of buffers a written host batch may have to be copied into the ring; a larger
one is exported as before (shared as it is when it lies in shareable memory, else one sealed copy)."""
_ALIGN = 64  # Arrow's recommended buffer alignment
_PAGE = 4096
_MIN_SEGMENT = 64 << 10
_place = lib.aib_ring_place
_E_LIMIT = int(lib.AIB_E_LIMIT)


class RingSegment(Batch):
    """One reusable segment: an ``allocate_shared`` region of its own, and the batch it holds (a
    segment holds one batch at a time, so it is that batch's :class:`Batch`: a write makes no
    object of its own). ``generation`` changes when the segment is replaced by a larger one
    (another file), so no subscriber is told to reuse a descriptor of the old file. ``message``
    is the same bytes object while the segment's batches keep one layout, which makes the
    hub's check of what a subscriber holds (and the writer's schema check) a comparison of one
    object with itself."""

    __slots__ = ("buffer", "c", "host_ring", "kept", "size", "start")

    def __init__(self, ring: HostRing, index: int, size: int, name: str, generation: int) -> None:
        buffer: SharedHostBuffer = allocate_shared(size, name=f"aib-ring-{name}"[:200])
        super().__init__(b"", [buffer.fd], _no_free, index, ring=True, generation=generation)
        self.refs = 0  # free: no batch in it yet
        self.host_ring = ring
        self.size = size
        self.buffer = buffer
        # Where the segment's first buffer goes: each segment starts at its own offset, so that
        # two segments' messages differ (a consumer remembers one message per byte string).
        self.start = (index * _ALIGN) % _PAGE
        # What the C call reads of the segment, built once: its memory, and the message's one
        # region (every batch in it names the same file).
        self.c = ffi.new("aib_ring_segment *")
        self.c.base = buffer.address
        self.c.start = self.start
        self.c.capacity = size
        self.c.region.kind = REGION_HOST_FD
        self.c.region.size = size
        self.c.region.fd_index = 0
        self.kept: object = None  # the view of ``message`` the C struct points to

    def set_message(self, message: bytes) -> None:
        """The segment's batch has a message of its own (another layout than the last one)."""
        self.message = message
        self.kept = view = ffi.from_buffer(message)
        self.c.message = view
        self.c.message_len = len(message)

    @property
    def index(self) -> int:
        return self.slot

    def free(self) -> None:
        """Every holder let go of the segment's batch: reuse it (or close it once the ring is)."""
        self.host_ring.free(self)

    def close(self) -> None:
        self.buffer.close()


def _no_free() -> None:
    """A segment's ``on_free``: unused (:meth:`RingSegment.free` gives it back to its ring)."""


class HostRing:
    """A stream's segments and the free ones (guarded by the stream's condition)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._segments: list[RingSegment] = []
        self._free: list[RingSegment] = []
        self._lock = threading.Lock()  # write() takes segments, any thread's release frees them
        self.closed = False
        # What place() shares with the C call, which one writer thread makes at a time
        # (StreamWriter's rule): the limits, the device, the message's buffer, the answers.
        self._c = ffi.new("aib_ring *")
        self._c.limit = SMALL_BATCH_BYTES
        self._c.align = _ALIGN
        self._c.device.device_type = DEVICE_CPU
        self._set_out(4096)

    def _set_out(self, size: int) -> None:
        self._out = ffi.new("uint8_t[]", size)
        self._c.out = self._out
        self._c.out_cap = size

    @property
    def segments(self) -> int:
        """Segments made so far (free or holding a batch)."""
        return len(self._segments)

    def place(self, captured: CapturedData) -> RingSegment | None:
        """Copy ``captured``'s buffers into a free segment and encode the message naming them
        (``segment.message``); None when the batch is not small (the caller exports it instead).
        The segment is the caller's batch (one reference) until it is freed."""
        if captured.is_stream or len(captured.arrays) != 1:
            return None
        return self.place_at(
            int(ffi.cast("uintptr_t", captured.schema)), int(ffi.cast("uintptr_t", captured.arrays[0])), True
        )

    def place_at(self, schema: int, array: int, device_array: bool) -> RingSegment | None:
        """:meth:`place` for a host batch's ``struct ArrowSchema`` and ``struct ArrowArray`` (or
        ``struct ArrowDeviceArray``, ``device_array``) at these addresses, borrowed: a producer's
        capsules, kept alive by the caller while this runs. The buffers are copied, so nothing of
        the producer's is moved or kept (no capture record, no release to wait for: the capsules
        release the producer's structs when they go). None for data on a device, or not small.

        One C call (``aib_ring_place``) describes, copies, encodes and compares the message with
        the segment's last one (kept when equal). It copies nothing when the batch is not small
        or the segment is too small for it; with no segment at hand, a call only measures the
        batch, so a stream of large batches makes none. Raises
        :class:`~arrow_ipc_bridge.errors.ClosedError` (``reason="released"``) when a struct was
        released (the producer's capsule consumed already)."""
        ring = self._c
        segment = self._free.pop() if self._free else None  # list.pop is atomic: free() appends
        try:
            while True:
                if segment is None:
                    rc = _place(ring, ffi.NULL, schema, array, device_array)
                    if rc != _E_LIMIT:
                        self._raise(rc, "describing a batch")
                    if ring.needed > SMALL_BATCH_BYTES:
                        return None
                    segment = self._new_segment(len(self._segments), 0, int(ring.needed))
                rc = _place(ring, segment.c, schema, array, device_array)
                if rc == 0:
                    if ring.changed:
                        segment.set_message(ffi.buffer(self._out, ring.out_len)[:])
                    segment.refs = 1
                    segment.sequence = -1
                    return segment
                if rc != _E_LIMIT:
                    self._raise(rc, "placing a batch in the stream's ring")
                needed = int(ring.needed)
                if needed > SMALL_BATCH_BYTES:
                    self.free(segment)  # not small: exported instead
                    return None
                if segment.start + needed > segment.size:
                    # Too small for this batch: a larger file under the same index (a new
                    # generation, so no subscriber reuses its descriptor of the old one).
                    old, segment = segment, None
                    self._segments.remove(old)
                    old.close()
                    segment = self._new_segment(old.index, old.generation + 1, needed)
                    continue
                wanted = int(ring.out_len)
                if not len(self._out) < wanted <= MAX_MESSAGE_BYTES:
                    self._raise(rc, "encoding the message")
                self._set_out(wanted)  # kept: the next batch is alike
        except BaseException:
            if segment is not None:
                self.free(segment)
            raise

    def _raise(self, rc: int, what: str) -> NoReturn:
        if rc == lib.AIB_E_RELEASED:
            raise ClosedError(
                "the producer's schema or array capsule was already consumed or released", reason="released"
            )
        raise_for(rc, ffi.addressof(self._c, "err"), what)

    def _new_segment(self, index: int, generation: int, nbytes: int) -> RingSegment:
        """A new segment holding ``nbytes`` from its start (the writer's thread only)."""
        size = max(_MIN_SEGMENT, -(-(((index * _ALIGN) % _PAGE) + nbytes) // _PAGE) * _PAGE)
        segment = RingSegment(self, index, size, self._name, generation)
        self._segments.append(segment)
        return segment

    def free(self, segment: RingSegment) -> None:
        """Every holder let go of the segment's batch: reuse it (or close it once the ring is)."""
        with self._lock:
            if not self.closed:
                self._free.append(segment)
                return
        segment.close()

    def close(self) -> None:
        """The stream ended: free segments go now, held ones when their batch is freed."""
        with self._lock:
            self.closed = True
            free, self._free = self._free, []
        for segment in free:
            segment.close()
