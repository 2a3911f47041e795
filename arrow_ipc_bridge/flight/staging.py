"""Device data made host record batches for gRPC, the copy of the next chunk overlapping the send of
the current one.

gRPC sends host memory only. A GPU publication is staged chunk by chunk (:class:`StagedPublication`):
a chunk is one record batch of the import, or a slice of rows of a large batch of fixed-width
columns (``chunk_plan.py`` plans them). Each chunk is copied by the front's :class:`Copier`
(``copier.py``: ``cuMemcpyDtoHAsync`` on a stream of the front's own, ordered after the producer's
event) into a pinned buffer lent by a :class:`StagingPool` (``pinned_pool.py``, which bounds the
pinned memory); the copy of chunk k+1 is queued before chunk k is handed to gRPC, so the DMA engine
fills the next buffer while gRPC sends the current one.

A buffer goes back to the pool only when the last pyarrow object over it is gone, which is when
gRPC has sent the chunk and dropped it. Whole batches are rebuilt by the C core over the pinned
copy, and the owner of the rebuilt structs gives the buffer back when it dies (a reaper notice);
slices are ``pa.foreign_buffer`` views whose ``base`` gives it back when collected.

A GPU live stream's batches go through the same pool, copier and rule (:func:`stage_live_batch`),
staged on a worker thread one chunk ahead of the sender (``prefetch.py``); each batch's lease, the
producer's credit, is given back as soon as its last chunk is copied.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import pyarrow as pa

from arrow_ipc_bridge._ffi import ffi
from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream
from arrow_ipc_bridge.errors import BridgeError
from arrow_ipc_bridge.flight.chunk_plan import ADDRESS_MOD, Chunk, ChunkPlanner, aligned, column_ranges
from arrow_ipc_bridge.flight.pinned_pool import CHUNK_BYTES, Loan, StagingPool
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.wire.capsules import new_capsule
from arrow_ipc_bridge.wire.metadata import Decoded

__all__ = ["StagedPublication", "stage_live_batch"]


class _LoanHolder:
    """The ``base`` of the ``pa.foreign_buffer`` views over a lent buffer: when pyarrow drops the
    last view (gRPC sent the chunk), this object is collected and the buffer goes back."""

    __slots__ = ("__weakref__",)


@dataclass
class _InFlight:
    chunk: Chunk
    loan: Loan
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
            planner = ChunkPlanner(self._decoded, self._bases, chunk_bytes)
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

    def _start(self, chunk: Chunk) -> _InFlight:
        """Lend a buffer and queue the chunk's copies into it."""
        loan = self._pool.acquire(chunk.nbytes, self._cancelled)
        try:
            cursor = loan.address
            staged = _InFlight(chunk, loan, None)
            if chunk.columns is None:
                staged.host_bases = [loan.address] * len(self._bases)  # regions the batch does not use
                for region, (lo, hi) in chunk.spans.items():
                    self._copier.copy(cursor, (int(self._bases[region]) + lo) % ADDRESS_MOD, hi - lo)
                    staged.host_bases[region] = (cursor - lo) % ADDRESS_MOD
                    cursor += aligned(hi - lo)
            else:
                assert chunk.rows is not None
                for column in chunk.columns:
                    ranges = column_ranges(column, *chunk.rows)
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
                        cursor += aligned(nbytes)
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
