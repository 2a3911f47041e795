"""The writer's ring: reusable shared segments that small written batches are copied into
(docs/streams.md, "The data path").

A written host batch of at most :data:`SMALL_BATCH_BYTES` is copied into a free segment of its
stream's ring instead of a new sealed memfd: no memfd is created, sealed, sent or mapped per batch.
Each segment is one ``allocate_shared`` region (sealed against shrinking, growing and writes by
anyone but the producer's own mapping), sent to a subscriber with its descriptor the first time;
the subscriber keeps the message and a copy of the descriptor, so a later batch in the same
segment with the same layout (the same message bytes: a message describes where buffers lie, not
what they hold) is a BATCH that names the segment alone. A segment is free again once every
subscriber released the batch in it (``Batch.on_free``); the ring grows when none is free (the
stream's policy bounds how many batches subscribers hold, so it stops growing).
"""

from __future__ import annotations

import threading

from arrow_ipc_bridge._ffi import ffi
from arrow_ipc_bridge.host import allocate_shared
from arrow_ipc_bridge.host.shared_alloc import SharedHostBuffer
from arrow_ipc_bridge.wire.capsules import DEVICE_CPU, CapturedData
from arrow_ipc_bridge.wire.metadata import (
    REGION_HOST_FD,
    SLOT_FIRST_REGION,
    SLOT_UNPLACED,
    Described,
    DeviceInfo,
    Region,
)

__all__ = ["SMALL_BATCH_BYTES", "HostRing", "RingSegment"]

SMALL_BATCH_BYTES = 1 << 20
"""The most bytes of buffers a written host batch may have to be copied into the ring; a larger
one is exported as before (shared as it is when it lies in shareable memory, else one sealed copy)."""
_ALIGN = 64  # Arrow's recommended buffer alignment
_PAGE = 4096
_MIN_SEGMENT = 64 << 10


class RingSegment:
    """One reusable segment: an ``allocate_shared`` region of its own. ``generation`` changes when
    the segment is replaced by a larger one (another file), so no subscriber is told to reuse a
    descriptor of the old file."""

    __slots__ = ("buffer", "generation", "index", "size")

    def __init__(self, index: int, size: int, name: str, generation: int) -> None:
        self.index = index
        self.size = size
        self.generation = generation
        self.buffer: SharedHostBuffer = allocate_shared(size, name=f"aib-ring-{name}"[:200])

    @property
    def start(self) -> int:
        """Where the segment's first buffer goes: each segment starts at its own offset, so that
        two segments' messages differ (a consumer remembers one message per byte string)."""
        return (self.index * _ALIGN) % _PAGE

    def close(self) -> None:
        self.buffer.close()


class HostRing:
    """A stream's segments and the free ones (guarded by the stream's condition)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._segments: list[RingSegment] = []
        self._free: list[RingSegment] = []
        self._lock = threading.Lock()  # write() takes segments, any thread's release frees them
        self.closed = False

    @property
    def segments(self) -> int:
        """Segments made so far (free or holding a batch)."""
        return len(self._segments)

    def place(self, captured: CapturedData) -> tuple[bytes, RingSegment] | None:
        """Copy ``captured``'s buffers into a free segment and encode the message naming them;
        None when the batch is not small (the caller exports it instead). The segment is the
        caller's until it gives it back with :meth:`free` (or :meth:`free` on a failure)."""
        described = Described(captured)
        slots = described.slots()
        wanted: list[int] = []
        total = 0
        for i in range(0, len(slots), 4):
            if slots[i + 2] == SLOT_UNPLACED:
                wanted.append(i)
                total += -(-slots[i + 1] // _ALIGN) * _ALIGN
                if total > SMALL_BATCH_BYTES:
                    return None
        segment = self._take(total)
        try:
            base = segment.buffer.address
            offset = segment.start
            for i in wanted:
                nbytes = slots[i + 1]
                if nbytes:
                    ffi.memmove(ffi.cast("char *", base + offset), ffi.cast("char *", slots[i]), nbytes)
                slots[i + 2] = SLOT_FIRST_REGION
                slots[i + 3] = offset
                offset += -(-nbytes // _ALIGN) * _ALIGN
            region = Region(kind=REGION_HOST_FD, size=segment.size, file_offset=0, fd_index=0, flags=0)
            message = described.encode(DeviceInfo(device_type=DEVICE_CPU), [region], n_fds=1)
        except BaseException:
            self.free(segment)
            raise
        return message, segment

    def _take(self, nbytes: int) -> RingSegment:
        """A free segment holding ``nbytes`` from its start (replaced by a larger one if too small),
        or a new one."""
        if self._free:
            segment = self._free.pop()
            if segment.start + nbytes <= segment.size:
                return segment
            # Too small for this batch: a larger file under the same index (a new generation).
            self._segments.remove(segment)
            segment.close()
            index, generation = segment.index, segment.generation + 1
        else:
            index, generation = len(self._segments), 0
        size = max(_MIN_SEGMENT, -(-(((index * _ALIGN) % _PAGE) + nbytes) // _PAGE) * _PAGE)
        segment = RingSegment(index, size, self._name, generation)
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
