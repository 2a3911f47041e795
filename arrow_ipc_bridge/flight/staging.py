"""Device data made host record batches for gRPC, the copy of the next chunk overlapping the send of
the current one, through a bounded pool of pinned host buffers.

gRPC sends host memory only. A GPU publication is staged chunk by chunk (:class:`StagedPublication`):
a chunk is one record batch of the import, or a slice of rows of a batch larger than
``chunk_bytes`` whose columns are all fixed-width (numbers, booleans, temporal types, decimals,
fixed-size binary; other batches are staged whole). Each chunk is copied with
``cuMemcpyDtoHAsync`` on a stream of the front's own, ordered after the producer's event, into a
pinned buffer of a :class:`StagingPool`; the copy of chunk k+1 is queued before chunk k is handed
to gRPC, so the DMA engine fills the next buffer while gRPC sends the current one.

A buffer goes back to the pool only when the last pyarrow object over it is gone, which is when
gRPC has sent the chunk and dropped it: nothing gRPC still holds is ever overwritten. Whole batches
are rebuilt by the C core over the pinned copy, and the owner of the rebuilt structs gives the
buffer back when it dies (a reaper notice); slices are ``pa.foreign_buffer`` views whose ``base``
gives it back when collected.

Memory is bounded: a pool never holds more than ``max_bytes`` of pinned memory (buffers idle and
lent together), whatever the number of clients; a chunk that cannot get a buffer waits until one
comes back (a slow client holds the buffers of the chunks gRPC has not sent yet). One chunk needs at
most ``max(chunk_bytes, its own size)``; a batch that cannot be sliced and is larger than
``max_bytes`` is refused (:class:`StagingLimitError`).

A GPU live stream's batches go through the same pool, copier and rule (:func:`stage_live_batch`),
staged on a worker thread one chunk ahead of the sender (:class:`Prefetcher`), so the copy of the
next chunk overlaps the send of the current one; each batch's lease, the producer's credit, is
given back as soon as its last chunk is copied.

The device is reached through a :class:`Copier`; :class:`CudaCopier` is the real one, and the tests
give a host copier so that the staging runs, and is checked, without a GPU.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import pyarrow as pa

from arrow_ipc_bridge._ffi import ffi
from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream, message_schema
from arrow_ipc_bridge.errors import BridgeError
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.wire.capsules import new_capsule
from arrow_ipc_bridge.wire.metadata import SLOT_FIRST_REGION, Decoded

__all__ = [
    "CHUNK_BYTES",
    "MAX_STAGING_BYTES",
    "Copier",
    "CudaCopier",
    "Prefetcher",
    "StagedPublication",
    "StagingCancelledError",
    "StagingLimitError",
    "StagingPool",
    "stage_live_batch",
]

CHUNK_BYTES = 64 << 20  # a chunk's size: large enough that per-chunk costs vanish, small enough to overlap
MAX_STAGING_BYTES = 256 << 20  # pinned memory of one front per device: four chunks in flight
_ALIGN = 64  # each copied buffer starts 64-byte aligned, as Arrow recommends
_POLL_S = 0.25  # how often a chunk waiting for a buffer looks whether its client went away
_ADDRESS_MOD = 1 << 64  # the C rebuild adds offsets to bases modulo 2**64

T = TypeVar("T")
R = TypeVar("R")

_DONE = object()


class StagingLimitError(BridgeError, MemoryError):
    """A batch that cannot be sliced needs more pinned memory than the staging pool may hold."""


class StagingCancelledError(BridgeError):
    """The client went away while its chunk waited for a staging buffer."""


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


# ---------------------------------------------------------------------------------------------------
# The device side: a copier
# ---------------------------------------------------------------------------------------------------


class Copier(Protocol):
    """What staging needs of a device: host memory to copy into, and ordered asynchronous copies."""

    def allocate(self, nbytes: int) -> int:
        """``nbytes`` of host memory the device copies into fast (pinned); its address."""
        ...

    def free(self, address: int) -> None:
        """Free memory of :meth:`allocate`."""
        ...

    def order_after_producer(self, imported: ImportedArray | ImportedStream) -> None:
        """Make the copies queued from now on wait for the producer's work on ``imported``."""
        ...

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy of ``nbytes`` from device address ``src`` to host address ``dst``."""
        ...

    def fence(self) -> object:
        """A mark after the copies queued so far (give it to :meth:`wait`)."""
        ...

    def wait(self, fence: object) -> None:
        """Block until the copies before ``fence`` are done, and forget the fence."""
        ...

    def close(self) -> None:
        """Drop the copier's device resources (queued copies are waited for)."""
        ...


class CudaCopier:
    """Pinned host memory (``cuMemHostAlloc``) and ``cuMemcpyDtoHAsync`` copies on a non-blocking
    stream of ``device``'s primary context; fences are events of an :class:`EventPool`."""

    def __init__(self, device: int) -> None:
        from arrow_ipc_bridge.cuda._declarations import CU_STREAM_NON_BLOCKING
        from arrow_ipc_bridge.cuda._driver import _api, _check
        from arrow_ipc_bridge.cuda.devices import device_context
        from arrow_ipc_bridge.cuda.events import EventPool

        self.device = device
        lib, cffi = _api()
        out = cffi.new("CUstream *")
        with device_context(device):
            _check("cuStreamCreate", lib.cuStreamCreate(out, CU_STREAM_NON_BLOCKING))
        self._stream = out[0]
        self._stream_value = int(cffi.cast("uintptr_t", out[0]))
        self._events = EventPool(device)
        self._closed = False

    def allocate(self, nbytes: int) -> int:
        from arrow_ipc_bridge.cuda._driver import _api, _check
        from arrow_ipc_bridge.cuda.devices import device_context

        lib, cffi = _api()
        out = cffi.new("void **")
        with device_context(self.device):
            _check(
                "cuMemHostAlloc",
                lib.cuMemHostAlloc(out, nbytes, 0),
                "the host could not pin that much memory (ulimit -l, or serve(staging_bytes=...))",
            )
        return int(cffi.cast("uintptr_t", out[0]))

    def free(self, address: int) -> None:
        from arrow_ipc_bridge.cuda._driver import _api, _check, _usable_in_this_process
        from arrow_ipc_bridge.cuda.devices import device_context

        if not _usable_in_this_process():
            return  # a forked child: the parent's pinned memory is not this process's to free
        lib, cffi = _api()
        with device_context(self.device):
            _check("cuMemFreeHost", lib.cuMemFreeHost(cffi.cast("void *", address)))

    def order_after_producer(self, imported: ImportedArray | ImportedStream) -> None:
        from arrow_ipc_bridge.cuda.events import event_value, stream_wait_event

        sync = imported._sync_event()  # NULL once the producer's work completed
        if sync != ffi.NULL:
            stream_wait_event(self._stream_value, event_value(sync), device=self.device)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        from arrow_ipc_bridge.cuda._driver import _api, _check
        from arrow_ipc_bridge.cuda.devices import device_context

        lib, cffi = _api()
        with device_context(self.device):
            _check(
                "cuMemcpyDtoHAsync_v2",
                lib.cuMemcpyDtoHAsync_v2(cffi.cast("void *", dst), src, nbytes, self._stream),
            )

    def fence(self) -> object:
        event = self._events.acquire()
        try:
            event.record(self._stream_value)
        except BaseException:
            self._events.release(event)
            raise
        return event

    def wait(self, fence: object) -> None:
        from arrow_ipc_bridge.cuda.events import Event

        assert isinstance(fence, Event)
        try:
            fence.synchronize()
        finally:
            self._events.release(fence)

    def close(self) -> None:
        from arrow_ipc_bridge.cuda._driver import _api, _check, _usable_in_this_process
        from arrow_ipc_bridge.cuda.devices import device_context

        if self._closed:
            return
        self._closed = True
        if _usable_in_this_process():
            lib, _ = _api()
            with device_context(self.device):
                _check("cuStreamSynchronize", lib.cuStreamSynchronize(self._stream))
                _check("cuStreamDestroy_v2", lib.cuStreamDestroy_v2(self._stream))
        self._events.close()


# ---------------------------------------------------------------------------------------------------
# The pool of pinned buffers
# ---------------------------------------------------------------------------------------------------


class _Loan:
    """A pool buffer lent to one chunk; :meth:`give_back` (idempotent, any thread) returns it."""

    __slots__ = ("__weakref__", "_lock", "_pool", "address", "size")

    def __init__(self, pool: StagingPool, address: int, size: int) -> None:
        self._pool: StagingPool | None = pool
        self._lock = threading.Lock()
        self.address = address
        self.size = size

    def give_back(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self.address, self.size)


class _LoanHolder:
    """The ``base`` of the ``pa.foreign_buffer`` views over a lent buffer: when pyarrow drops the
    last view (gRPC sent the chunk), this object is collected and the buffer goes back."""

    __slots__ = ("__weakref__",)


class StagingPool:
    """Pinned host buffers of ``buffer_bytes`` (more for a chunk that needs more), reused across
    chunks and ``do_get`` calls, never more than ``max_bytes`` in all (idle and lent).

    Thread-safe; a buffer is lent to one chunk at a time and comes back when the last object over it
    is gone. ``close()`` frees the idle buffers now and each lent one when it comes back.
    """

    def __init__(
        self, copier: Copier, *, buffer_bytes: int = CHUNK_BYTES, max_bytes: int = MAX_STAGING_BYTES
    ):
        if buffer_bytes < 1 or max_bytes < 2 * buffer_bytes:
            raise ValueError(
                f"staging needs max_bytes >= 2 * buffer_bytes (one chunk sent, one copied), "
                f"not {max_bytes} and {buffer_bytes}"
            )
        self.copier = copier
        self.buffer_bytes = buffer_bytes
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._idle: list[tuple[int, int]] = []  # (size, address)
        self._allocated = 0  # bytes of every buffer, idle and lent
        self._lent = 0
        self._allocations = 0
        self._closed = False

    # -- facts, for tests and the benchmark --
    @property
    def allocated_bytes(self) -> int:
        """Pinned bytes held now, idle and lent."""
        return self._allocated

    @property
    def lent(self) -> int:
        """Buffers lent to chunks now."""
        return self._lent

    @property
    def allocations(self) -> int:
        """Buffers allocated since the pool was made (reuse keeps this flat)."""
        return self._allocations

    def acquire(self, nbytes: int, cancelled: Callable[[], bool] = lambda: False) -> _Loan:
        """A buffer of at least ``nbytes``; waits while the pool is at ``max_bytes``.

        Raises
        ------
        StagingLimitError
            ``nbytes`` is more than ``max_bytes``.
        StagingCancelledError
            ``cancelled()`` turned true while waiting.
        """
        if nbytes > self.max_bytes:
            raise StagingLimitError(
                f"a batch of {nbytes} bytes that cannot be sliced needs more than the staging pool "
                f"may hold ({self.max_bytes} bytes): publish smaller record batches, or raise "
                "serve(staging_bytes=...)"
            )
        nbytes = max(nbytes, 1)
        to_free: list[int] = []
        with self._cond:
            while True:
                if self._closed:
                    raise BridgeError("the staging pool is closed")
                fits = [entry for entry in self._idle if entry[0] >= nbytes]
                if fits:
                    entry = min(fits)
                    self._idle.remove(entry)
                    self._lent += 1
                    return _Loan(self, entry[1], entry[0])
                size = max(nbytes, self.buffer_bytes)
                if self._allocated + size > self.max_bytes:
                    size = nbytes
                # Idle buffers too small for this chunk make room for one that fits.
                while self._allocated + size > self.max_bytes and self._idle:
                    idle_size, address = self._idle.pop(0)
                    self._allocated -= idle_size
                    to_free.append(address)
                if self._allocated + size <= self.max_bytes:
                    self._allocated += size
                    self._lent += 1
                    break
                if cancelled():
                    raise StagingCancelledError("the client went away while its chunk waited for a buffer")
                self._cond.wait(_POLL_S)
        try:
            for address in to_free:
                self.copier.free(address)
            address = self.copier.allocate(size)
        except BaseException:
            with self._cond:
                self._allocated -= size
                self._lent -= 1
                self._cond.notify_all()
            raise
        self._allocations += 1
        return _Loan(self, address, size)

    def _give_back(self, address: int, size: int) -> None:
        with self._cond:
            self._lent -= 1
            if not self._closed:
                self._idle.append((size, address))
                self._idle.sort()
                self._cond.notify_all()
                return
            self._allocated -= size
        self.copier.free(address)

    def close(self) -> None:
        """Free the idle buffers; buffers still lent are freed when they come back (idempotent)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._allocated -= sum(size for size, _ in idle)
            self._cond.notify_all()
        for _, address in idle:
            self.copier.free(address)


# ---------------------------------------------------------------------------------------------------
# Planning: which device bytes each chunk needs
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Column:
    """A fixed-width column of a batch, as the device struct describes it."""

    type: pa.DataType
    bit_width: int
    first_row: int  # the column's row of the batch's row 0 (struct and child offsets)
    null_count: int
    validity: int  # device address, 0 when the column has no nulls
    data: int
    validity_limit: int  # bytes readable at validity / data (from the message's buffer lengths)
    data_limit: int


@dataclass
class _Chunk:
    batch: int
    nbytes: int
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # whole batch: region -> (lo, hi)
    rows: tuple[int, int] | None = None  # a slice of rows of `columns`
    columns: list[_Column] | None = None


def _buffer_addresses(array: Any) -> list[int]:
    """The non-null buffer addresses of a rebuilt ``ArrowArray`` tree (children, dictionaries)."""
    found = []
    stack = [array]
    while stack:
        node = stack.pop()
        for i in range(node.n_buffers):
            if node.buffers[i] != ffi.NULL:
                found.append(int(ffi.cast("uintptr_t", node.buffers[i])))
        stack.extend(node.children[i] for i in range(node.n_children))
        if node.dictionary != ffi.NULL:
            stack.append(node.dictionary)
    return found


def _fixed_width(dtype: pa.DataType) -> int | None:
    """The bit width of a type a slice of rows can be copied of as byte ranges, else None."""
    if pa.types.is_dictionary(dtype) or isinstance(dtype, pa.ExtensionType) or pa.types.is_null(dtype):
        return None
    if pa.types.is_boolean(dtype):
        return 1
    try:
        width = int(dtype.bit_width)
    except (ValueError, AttributeError):
        return None
    return width if width % 8 == 0 and width > 0 else None


class _Planner:
    """Splits a device import into chunks, reading only the message and the rebuilt structs."""

    def __init__(self, decoded: Decoded, bases: Any, chunk_bytes: int) -> None:
        self._decoded = decoded
        self._bases = bases
        self._chunk_bytes = chunk_bytes
        self.schema = message_schema(decoded)
        capsule, out = new_capsule("schema")
        decoded.rebuild_schema(out)
        self.root_is_struct = ffi.string(out.format) == b"+s"
        del capsule
        # Every buffer of the message by its device address: (region, offset, length).
        self.refs: dict[int, tuple[int, int, int]] = {}
        for code, offset, length in decoded.buffer_refs():
            if code >= SLOT_FIRST_REGION and length:
                region = code - SLOT_FIRST_REGION
                address = (int(bases[region]) + offset) % _ADDRESS_MOD
                known = self.refs.get(address)
                if known is None or known[2] < length:
                    self.refs[address] = (region, offset, length)

    def chunks(self) -> Iterator[_Chunk]:
        for batch in range(self._decoded.batch_count):
            capsule, root = new_capsule("array")  # the capsule releases the rebuilt structs
            self._decoded.rebuild_array(batch, self._bases, root)
            yield from self._batch_chunks(batch, root)
            del capsule

    def _batch_chunks(self, batch: int, root: Any) -> Iterator[_Chunk]:
        spans: dict[int, tuple[int, int]] = {}
        for address in _buffer_addresses(root):
            ref = self.refs.get(address)
            if ref is None:
                continue  # an empty buffer: nothing to copy
            region, offset, length = ref
            lo, hi = spans.get(region, (offset, offset + length))
            spans[region] = (min(lo, offset), max(hi, offset + length))
        nbytes = sum(_aligned(hi - lo) for lo, hi in spans.values())
        columns = self._columns(root) if nbytes > self._chunk_bytes else None
        if columns is None or int(root.length) <= 8:
            yield _Chunk(batch, nbytes, spans=spans)
            return
        bits_per_row = sum(c.bit_width + (1 if c.validity else 0) for c in columns)
        slack = len(columns) * 2 * (_ALIGN + 1)  # alignment and partial bytes per buffer
        rows = max(8, ((self._chunk_bytes - slack) * 8 // max(bits_per_row, 1)) // 8 * 8)
        length = int(root.length)
        for start in range(0, length, rows):
            stop = min(length, start + rows)
            size = sum(_aligned(n) for c in columns for _, n in _column_ranges(c, start, stop))
            yield _Chunk(batch, size, rows=(start, stop), columns=columns)

    def _columns(self, root: Any) -> list[_Column] | None:
        """The batch's columns when every one can be sliced by rows, else None."""
        if not self.root_is_struct or len(self.schema) != root.n_children:
            return None
        if root.null_count != 0 or root.dictionary != ffi.NULL:
            return None
        columns = []
        for i, schema_field in enumerate(self.schema):
            width = _fixed_width(schema_field.type)
            child = root.children[i]
            if width is None or child.n_buffers != 2 or child.n_children or child.dictionary != ffi.NULL:
                return None
            validity = int(ffi.cast("uintptr_t", child.buffers[0])) if child.null_count != 0 else 0
            data = int(ffi.cast("uintptr_t", child.buffers[1]))
            columns.append(
                _Column(
                    type=schema_field.type,
                    bit_width=width,
                    first_row=int(root.offset) + int(child.offset),
                    null_count=int(child.null_count),
                    validity=validity,
                    data=data,
                    validity_limit=self.refs.get(validity, (0, 0, 0))[2] if validity else 0,
                    data_limit=self.refs.get(data, (0, 0, 0))[2],
                )
            )
        return columns


def _column_ranges(column: _Column, start: int, stop: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` from the column's validity and data addresses for rows [start, stop):
    from the byte holding the first row's bit, so the slice keeps an offset below 8."""
    first = column.first_row + start
    end = column.first_row + stop
    row0 = first - first % 8
    bitmap = (row0 // 8, (end + 7) // 8 - row0 // 8)
    ranges = [bitmap] if column.validity else [(0, 0)]
    if column.bit_width == 1:
        ranges.append(bitmap)
    else:
        width = column.bit_width // 8
        ranges.append((row0 * width, (end - row0) * width))
    return ranges


# ---------------------------------------------------------------------------------------------------
# Staging a publication
# ---------------------------------------------------------------------------------------------------


@dataclass
class _InFlight:
    chunk: _Chunk
    loan: _Loan
    fence: object
    host_bases: list[int] = field(default_factory=list)
    pieces: list[tuple[int, int]] = field(default_factory=list)  # sliced: (host address, nbytes)


class StagedPublication:
    """The record batches of a device import, staged in pinned memory chunk by chunk, ``lookahead``
    chunks copied ahead of the one being sent. Iterate it once; it takes over ``imported`` and
    releases it when the iteration ends (also when it is abandoned midway).

    ``keep_lease=True`` (a publication): the batches rebuilt whole share the import's message, so
    the lease ends when the last batch is dropped, as for host data. ``keep_lease=False`` (a live
    stream's batch, whose lease is the producer's credit): they are rebuilt over a decode of the
    message of their own (as ``to_host`` does), and the import is released as soon as the copy of
    its last chunk is done, before that chunk is handed out; the pinned buffers still go back only
    when their batches are dropped.
    """

    def __init__(
        self,
        imported: ImportedArray | ImportedStream,
        pool: StagingPool,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        cancelled: Callable[[], bool] = lambda: False,
        lookahead: int = 1,
        keep_lease: bool = True,
    ) -> None:
        if lookahead < 0:
            raise ValueError(f"lookahead must be at least 0, not {lookahead}")
        self._imported = imported
        self._pool = pool
        self._copier = pool.copier
        self._cancelled = cancelled
        self._lookahead = lookahead
        self._keep_lease = keep_lease
        self._detached: Decoded | None = None  # keep_lease=False: the decode rebuilt batches share
        self._released = False
        self._decoded = imported._borrow()  # unborrowed when the iteration ends
        try:
            self._bases = imported._bases
            planner = _Planner(self._decoded, self._bases, chunk_bytes)
            self.schema: pa.Schema = planner.schema
            self._plan = list(planner.chunks())
            self._refs = planner.refs
            self._copier.order_after_producer(imported)
        except BaseException:
            self._decoded.unborrow()
            raise
        self._iterator = self._generate()

    @property
    def chunk_sizes(self) -> list[int]:
        """Bytes each planned chunk copies (for tests and the benchmark)."""
        return [chunk.nbytes for chunk in self._plan]

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        return self._iterator

    def close(self) -> None:
        """Stop: wait for copies in flight, give their buffers back, release the import (also
        when the iteration never started: closing a generator that has not run runs nothing)."""
        self._iterator.close()
        self._release_import()

    def _generate(self) -> Generator[pa.RecordBatch, None, None]:
        pending: deque[_InFlight] = deque()
        try:
            for chunk in self._plan:
                pending.append(self._start(chunk))
                if len(pending) > self._lookahead:
                    batches = self._ready(pending.popleft())
                    while batches:  # popped as handed over: a reference here would hold the buffer
                        yield batches.pop(0)
            while pending:
                batches = self._ready(pending.popleft())
                while batches:
                    yield batches.pop(0)
        finally:
            while pending:
                staged = pending.popleft()
                try:
                    self._copier.wait(staged.fence)  # the copy still writes the buffer: let it end
                finally:
                    staged.loan.give_back()
            self._release_import()

    def _ready(self, staged: _InFlight) -> list[pa.RecordBatch]:
        """The chunk's batches once copied; without ``keep_lease``, the import released after the
        last chunk's copy (nothing handed out reads the device memory or holds the message)."""
        batches = self._finish(staged)
        if not self._keep_lease and staged.chunk is self._plan[-1]:
            self._release_import()
        return batches

    def _release_import(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            self._decoded.unborrow()
            self._imported.release()
        finally:
            if self._detached is not None:
                self._detached.close()  # the batches rebuilt over it share its owner

    def _start(self, chunk: _Chunk) -> _InFlight:
        """Lend a buffer and queue the chunk's copies into it."""
        loan = self._pool.acquire(chunk.nbytes, self._cancelled)
        try:
            cursor = loan.address
            staged = _InFlight(chunk, loan, None)
            if chunk.columns is None:
                staged.host_bases = [loan.address] * len(self._bases)  # regions the batch does not use
                for region, (lo, hi) in chunk.spans.items():
                    self._copier.copy(cursor, (int(self._bases[region]) + lo) % _ADDRESS_MOD, hi - lo)
                    staged.host_bases[region] = (cursor - lo) % _ADDRESS_MOD
                    cursor += _aligned(hi - lo)
            else:
                assert chunk.rows is not None
                for column in chunk.columns:
                    ranges = _column_ranges(column, *chunk.rows)
                    for source, limit, (offset, nbytes) in zip(
                        (column.validity, column.data),
                        (column.validity_limit, column.data_limit),
                        ranges,
                        strict=True,
                    ):
                        if nbytes and offset + nbytes > limit:
                            raise BridgeError(
                                f"column {column.type} of batch {chunk.batch}: rows {chunk.rows} reach "
                                f"byte {offset + nbytes} of a buffer of {limit}"
                            )
                        if nbytes:
                            self._copier.copy(cursor, source + offset, nbytes)
                        staged.pieces.append((cursor, nbytes))
                        cursor += _aligned(nbytes)
            staged.fence = self._copier.fence()
        except BaseException:
            loan.give_back()
            raise
        return staged

    def _finish(self, staged: _InFlight) -> list[pa.RecordBatch]:
        """Wait for the chunk's copies and build its record batches over the pinned buffer."""
        try:
            self._copier.wait(staged.fence)
        except BaseException:
            staged.loan.give_back()
            raise
        if staged.chunk.columns is None:
            return self._rebuilt(staged)
        return [self._sliced(staged)]

    def _rebuilt(self, staged: _InFlight) -> list[pa.RecordBatch]:
        """A whole batch rebuilt by the C core over the copy; its owner's death gives the buffer back."""
        loan = staged.loan
        if self._keep_lease:
            message = self._decoded
        else:
            if self._detached is None:
                self._detached = self._decoded.copy()  # one decode per import, no region opened
            message = self._detached
        token = reaper.register(loan.give_back)
        try:
            holder = Decoded.sharing(message, token)
        except BaseException:
            if reaper.unregister(token):
                loan.give_back()
            raise
        try:
            bases = ffi.new("uint64_t[]", staged.host_bases or [loan.address])
            schema_capsule, schema_out = new_capsule("schema")
            holder.rebuild_schema(schema_out)
            array_capsule, array_out = new_capsule("array")
            holder.rebuild_array(staged.chunk.batch, bases, array_out)
        finally:
            holder.close()  # the rebuilt structs hold the owner from here on
        if ffi.string(schema_out.format) == b"+s" and array_out.null_count == 0:
            return [pa.RecordBatch._import_from_c_capsule(schema_capsule, array_capsule)]
        from arrow_ipc_bridge.flight.tables import as_table

        array = pa.Array._import_from_c_capsule(schema_capsule, array_capsule)
        batches: list[pa.RecordBatch] = as_table(array, self.schema.field(0)).to_batches()
        return batches

    def _sliced(self, staged: _InFlight) -> pa.RecordBatch:
        """Rows of fixed-width columns as arrays over ``pa.foreign_buffer`` views of the copy."""
        chunk = staged.chunk
        assert chunk.columns is not None
        assert chunk.rows is not None
        holder = _LoanHolder()
        weakref.finalize(holder, staged.loan.give_back)
        start, stop = chunk.rows
        arrays = []
        pieces = iter(staged.pieces)
        for column in chunk.columns:
            (validity_at, validity_bytes), (data_at, data_bytes) = next(pieces), next(pieces)
            first = column.first_row + start
            validity = (
                pa.foreign_buffer(validity_at, validity_bytes, base=holder) if column.validity else None
            )
            data = pa.foreign_buffer(data_at, data_bytes, base=holder)
            arrays.append(
                pa.Array.from_buffers(
                    column.type,
                    stop - start,
                    [validity, data],
                    null_count=-1 if column.validity else 0,
                    offset=first % 8,
                )
            )
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


def stage_live_batch(
    imported: ImportedArray, pool: StagingPool, *, cancelled: Callable[[], bool] = lambda: False
) -> StagedPublication:
    """A device batch of a live stream staged as a publication is (:class:`StagedPublication`:
    the same pool, copier and no-overwrite rule), with two differences. Its lease, the producer's
    credit, is given back as soon as its last chunk is copied (``keep_lease=False``), not held
    while gRPC sends. No chunk is copied ahead inside it (``lookahead=0``): the sender runs it on a
    :class:`Prefetcher` thread one chunk ahead, so one client keeps three buffers busy (the chunk
    gRPC sends, the one queued, the one being copied; one more for a moment until gRPC drops a sent
    chunk), as a publication's ``do_get`` does.
    Takes over ``imported`` (released also when staging cannot start); iterate it, then
    ``close()`` it."""
    try:
        return StagedPublication(
            imported, pool, chunk_bytes=pool.buffer_bytes, cancelled=cancelled, lookahead=0, keep_lease=False
        )
    except BaseException:
        imported.release()
        raise


# ---------------------------------------------------------------------------------------------------
# Live streams: staged on a thread, one chunk ahead of the sender
# ---------------------------------------------------------------------------------------------------


class Prefetcher(Generic[T, R]):
    """Iterates ``convert(item)`` for each item of ``source``, converting up to ``depth`` items ahead
    on a thread of its own. An exception of ``source`` or ``convert`` is raised by ``__next__`` in
    order. ``close()`` (also when the consumer stops iterating early) stops the thread; items taken
    but not handed out are given to ``discard``."""

    def __init__(
        self,
        source: Iterator[T],
        convert: Callable[[T], R],
        *,
        depth: int = 1,
        discard: Callable[[R], None] | None = None,
        name: str = "aib-flight-staging",
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self._source = source
        self._convert = convert
        self._discard = discard
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        """Queue ``item`` unless stopped meanwhile (then False)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        outcome: object
        try:
            outcome = self._pump()
        except BaseException as exc:  # handed to the consumer, in order
            outcome = exc
        # A generator source ends here, on this thread (it cannot be closed from another while it
        # runs): its own cleanup (staging buffers, imports taken) runs now, not at its collection.
        close = getattr(self._source, "close", None)
        try:
            if close is not None:
                close()
        except BaseException as exc:
            outcome = exc if outcome is _DONE else outcome
        if outcome is not None:
            self._put(outcome)

    def _pump(self) -> object:
        """Convert and queue every item: ``_DONE`` at the source's end, None when stopped."""
        for item in self._source:
            if self._stop.is_set():
                return None
            converted = self._convert(item)
            # Dropped as soon as queued: a reference kept here while the next item is awaited
            # would hold what was handed out (a staging buffer, a lease) after gRPC dropped it.
            del item
            if not self._put(converted):
                if self._discard is not None:
                    self._discard(converted)
                return None
            del converted
        return _DONE

    def __iter__(self) -> Prefetcher[T, R]:
        return self

    def __next__(self) -> R:
        while True:
            if self._stop.is_set():
                raise StopIteration
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise StopIteration from None
                continue
            if item is _DONE:
                raise StopIteration
            if isinstance(item, BaseException):
                raise item
            return item  # type: ignore[return-value]

    def close(self, timeout: float = 5.0) -> None:
        """Stop converting; drop what was converted but not handed out (idempotent)."""
        self._stop.set()
        self._thread.join(timeout)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if self._discard is not None and item is not _DONE and not isinstance(item, BaseException):
                self._discard(item)  # type: ignore[arg-type]
