"""Reserved batch memory for producers that fill batches in place (``StreamWriter.reserve``).

A :class:`SlotLayout` says what every batch of such a stream looks like: a schema of fixed-width
columns and a row count. Each slot holds one batch's memory for the stream's life and is reused
once every consumer released the batch last committed from it, so the producer copies nothing.

- Host slots: one :func:`~arrow_ipc_bridge.allocate_shared` region per slot, the columns laid out in
  it; the slot's message is encoded once, so every commit re-sends the same bytes and descriptor
  and a consumer imports it as a message it remembers (one per slot).
- CUDA slots: CuPy arrays carved out of the slab allocator's kept slabs (consumers import each slab
  once); each commit is exported anew so its event records the producer's work queued so far:
  a consumer waits on it and never sees a half-written batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import pyarrow as pa

from arrow_ipc_bridge.errors import InvalidArgumentError, StreamError
from arrow_ipc_bridge.producer.exporter import Exported, export
from arrow_ipc_bridge.runtime import arguments

__all__ = ["HostSlot", "SlotLayout", "StreamSlot", "make_slot"]

_ALIGN = 64


@dataclass(frozen=True)
class SlotLayout:
    """The shape of a reserved batch.

    Parameters
    ----------
    schema
        Fixed-width primitive columns (integers, floats), no nulls.
    rows
        Rows of every batch (a commit may send fewer, never more: see :meth:`StreamSlot.commit`).
    count
        Slots to allocate; ``None``: twice the stream's ``max_in_flight`` (a producer can fill one
        while consumers hold the others).
    device
        ``"cpu"`` (shared host memory) or ``"cuda"`` (CuPy arrays from the slab allocator).
    device_id
        The CUDA device, for ``"cuda"``.
    """

    schema: pa.Schema
    rows: int
    count: int | None = None
    device: str = "cpu"
    device_id: int = 0

    def check(self) -> None:
        """Check every field (``Publisher.open_stream`` calls it): ``InvalidArgumentError`` or
        ``InvalidArgumentError`` naming the field."""
        if not isinstance(self.schema, pa.Schema):
            arguments.fail_type("SlotLayout.schema", "a pyarrow.Schema", self.schema)
        if len(self.schema) == 0:
            arguments.fail_value("SlotLayout.schema", "a schema with at least one field", self.schema)
        for f in self.schema:
            if not (pa.types.is_integer(f.type) or pa.types.is_floating(f.type)):
                raise InvalidArgumentError(
                    "SlotLayout.schema must be of fixed-width numeric columns (integers, floats); "
                    f"{f.name!r} is {f.type}",
                    argument="SlotLayout.schema",
                )
        arguments.count(self.rows, "SlotLayout.rows", least=1)
        if self.count is not None:
            arguments.count(self.count, "SlotLayout.count", least=1, most=65536)
        arguments.choice(self.device, "SlotLayout.device", ("cpu", "cuda"))
        arguments.device_ordinal(self.device_id, "SlotLayout.device_id")


class StreamSlot:
    """One reserved batch: fill :attr:`columns` in place, then :meth:`commit` it (or
    :meth:`abandon` it). After a commit the slot belongs to the stream again until consumers
    released the batch; writing its columns then would change data they read.

    A slot neither committed nor abandoned stays reserved: the stream counts it among its slots
    (a later ``reserve`` may wait for it) and keeps its memory until the writer itself is
    collected. Use it as a context manager to give it back whatever happens::

        with writer.reserve() as slot:
            slot.columns[0][:] = values  # an exception here abandons the slot
            slot.commit()
    """

    def __init__(self, index: int, layout: SlotLayout, columns: list[Any]) -> None:
        self.index = index
        self.layout = layout
        self.columns = columns
        """The columns, writable: NumPy arrays (host) or CuPy arrays (CUDA), ``layout.rows`` long."""
        self.reserved = False
        self._writer: Any = None

    def commit(self, rows: int | None = None, *, stream: Any = None) -> int:
        """Send the batch to every subscriber; returns its sequence number. ``rows``: how many of
        the rows to send (default all); more than the slot holds is a
        :class:`~arrow_ipc_bridge.errors.StreamError` (``reason="schema"``; the slot is not resized or
        copied). ``stream`` (CUDA): the stream the columns were written on (default: CuPy's current stream);
        consumers wait for the work queued on it so far."""
        if not self.reserved or self._writer is None:
            raise ValueError("commit of a slot that is not reserved (reserve() it again)")
        if rows is not None:
            rows = arguments.count(rows, "rows", least=0)
        if rows is not None and rows > self.layout.rows:
            raise StreamError(
                f"commit of {rows} rows into a slot reserved for {self.layout.rows}: a batch larger than "
                "the reserved memory is refused (write() it instead, or reserve larger slots)",
                reason="schema",
            )
        result: int = self._writer._commit_slot(self, self.layout.rows if rows is None else rows, stream)
        return result

    def abandon(self) -> None:
        """Give the slot back unsent (nothing when it is not reserved: committed, or abandoned
        already)."""
        if self.reserved and self._writer is not None:
            self._writer._abandon_slot(self)

    def __enter__(self) -> StreamSlot:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Not committed in the block (an exception, a commit refused, or simply none): the slot
        # goes back to the stream's free slots now instead of staying reserved.
        self.abandon()

    def export(self, rows: int) -> Exported:  # pragma: no cover - overridden
        """The first ``rows`` rows of the slot's columns as an export (no copy); the writer sends it
        on commit."""
        raise NotImplementedError

    @property
    def fixed_message(self) -> tuple[bytes, list[int]] | None:
        """The message sent for every full commit (encoded once), and its descriptors."""
        return None

    def before_send(self, stream: Any) -> None:
        """Called by a full commit before the batch is sent (CUDA: record the event)."""

    def close(self) -> None:
        """Free the slot's memory (the stream ended and nobody holds it)."""


class HostSlot(StreamSlot):
    """A slot in shared host memory; its full-batch message is encoded once."""

    def __init__(self, index: int, layout: SlotLayout, name: str) -> None:
        import numpy as np  # the columns are NumPy arrays (only reserved host slots need NumPy)

        from arrow_ipc_bridge.host import allocate_shared

        offsets = []
        # Host messages name no file, so two slots laid out alike would encode to the same bytes,
        # and a consumer remembers one message per byte string: each slot starts its columns at
        # its own offset, so its message is its own and every slot stays remembered.
        total = index * _ALIGN
        for f in layout.schema:
            offsets.append(total)
            total += -(-layout.rows * f.type.bit_width // 8 // _ALIGN) * _ALIGN
        self._buffer = allocate_shared(total, name=f"aib-stream-{name}")
        whole = self._buffer.as_pyarrow()
        view = np.frombuffer(self._buffer.view(), dtype=np.uint8)
        columns = []
        self._arrays = []
        for f, offset in zip(layout.schema, offsets, strict=True):
            nbytes = layout.rows * f.type.bit_width // 8
            columns.append(view[offset : offset + nbytes].view(f.type.to_pandas_dtype()))
            self._arrays.append(whole.slice(offset, nbytes))
        super().__init__(index, layout, columns)
        self._full = self._export(layout.rows)

    def _export(self, rows: int) -> Exported:
        arrays = [
            pa.Array.from_buffers(f.type, rows, [None, buf])
            for f, buf in zip(self.layout.schema, self._arrays, strict=True)
        ]
        return export(pa.RecordBatch.from_arrays(arrays, schema=self.layout.schema), copy="never")

    def export(self, rows: int) -> Exported:
        return self._export(rows)

    @property
    def fixed_message(self) -> tuple[bytes, list[int]] | None:
        return self._full.message, list(self._full.fds)

    def close(self) -> None:
        self._full.close()
        # The memory (and its descriptor) goes when nothing refers to it any more: the column
        # arrays and buffers made over it hold it too.
        self.columns = []
        self._arrays = []
        self._buffer.close()


class CudaSlot(StreamSlot):
    """A slot of CuPy arrays carved from kept slabs. Its full-batch message is encoded once, with
    the interprocess event the export made; each commit re-records that event on the producer's
    stream, so consumers (who keep the event open with the remembered message) wait for exactly
    the work queued before the commit. Re-recording is sound because a slot is reused only after
    every consumer released its last batch."""

    def __init__(self, index: int, layout: SlotLayout, allocator: Any) -> None:
        import cupy

        self._cupy = cupy
        with cupy.cuda.Device(layout.device_id), cupy.cuda.using_allocator(allocator):
            columns = [cupy.zeros(layout.rows, dtype=f.type.to_pandas_dtype()) for f in layout.schema]
        super().__init__(index, layout, columns)
        self._full = self.export(layout.rows)
        self._event = _local_event_of(self._full)

    def export(self, rows: int) -> Exported:
        from arrow_ipc_bridge.arrays.device import from_cuda_arrays

        cols = {f.name: c[:rows] for f, c in zip(self.layout.schema, self.columns, strict=True)}
        return export(from_cuda_arrays(cols), copy="never")

    @property
    def fixed_message(self) -> tuple[bytes, list[int]] | None:
        return self._full.message, list(self._full.fds)

    def before_send(self, stream: Any) -> None:
        """Record the message's event after the producer's work on ``stream`` (None: CuPy's current
        stream): consumers wait on it."""
        cupy = self._cupy
        with cupy.cuda.Device(self.layout.device_id):
            ptr = cupy.cuda.get_current_stream().ptr if stream is None else _stream_pointer(stream)
            cupy.cuda.runtime.eventRecord(self._event, ptr)

    def close(self) -> None:
        self._full.close()
        self.columns = []  # the slab allocator takes the memory back when CuPy drops the arrays


def _stream_pointer(stream: Any) -> int:
    """A stream object's ``cudaStream_t`` (CuPy / PyTorch streams, or an int)."""
    if isinstance(stream, int):
        return stream
    for attribute in ("ptr", "cuda_stream"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"not a CUDA stream: {stream!r} (pass a CuPy or PyTorch stream, or its pointer)")


def _local_event_of(exported: Exported) -> int:
    """The ``CUevent`` behind the interprocess event an export's message names."""
    from arrow_ipc_bridge.cuda import _state
    from arrow_ipc_bridge.wire.metadata import Decoded

    decoded = Decoded(exported.message, len(exported.fds))
    try:
        sync = decoded.device().sync
    finally:
        decoded.close()
    with _state.lock:
        event = _state.local_events.get(sync)
    if not sync or event is None:
        raise StreamError("the slot's export carries no event of this process to re-record")
    return event


def make_slot(index: int, layout: SlotLayout, name: str, allocator: Any) -> StreamSlot:
    if layout.device == "cpu":
        return HostSlot(index, layout, name)
    return CudaSlot(index, layout, allocator)
