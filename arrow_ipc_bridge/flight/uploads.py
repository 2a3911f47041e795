"""Uploads: ``do_put`` publishing a client's record batches into the front's publisher.

An upload is held in memory until its last batch arrives, then published whole (to a GPU when the
descriptor names one). Two bounds keep the front's memory in check (``docs/flight.md``,
"Uploads"): one upload holds at most ``max_put_bytes``, counted as the memory its batches keep
alive (:func:`held_bytes`), and all uploads in progress at most ``max_put_total_bytes``
(:class:`UploadShares`). An upload whose client went away before its end publishes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pyarrow as pa
from pyarrow import flight

from arrow_ipc_bridge.flight.refusals import invalid
from arrow_ipc_bridge.flight.tickets import cuda_ordinal
from arrow_ipc_bridge.producer.publisher import Publisher

__all__ = ["UploadShares", "Uploads", "held_bytes"]


class Uploads:
    """The ``do_put`` side of a front: refused unless ``allowed`` and the front serves a
    :class:`~arrow_ipc_bridge.Publisher` of this process, which uploads are published into."""

    def __init__(
        self, publisher: Publisher | None, *, allowed: bool, max_put_bytes: int, max_put_total_bytes: int
    ) -> None:
        self._publisher = publisher
        self._allow_put = allowed
        self._max_put_bytes = max_put_bytes
        self._shares = UploadShares(max(max_put_bytes, 1), max_put_total_bytes)

    @property
    def running(self) -> int:
        """Uploads in progress now, each holding a share of ``max_put_total_bytes``."""
        return self._shares.running

    def put(
        self,
        name: str,
        device: str | None,
        reader: flight.MetadataRecordBatchReader,
        cancelled: Callable[[], bool],
    ) -> None:
        """Publish the batches of ``reader`` as ``name`` (on GPU ``device``, ``"cuda:N"``, when
        given) once the last one arrived; nothing when the client went away before (``cancelled``)."""
        if not self._allow_put or self._publisher is None:
            raise flight.FlightUnauthorizedError(
                "this Flight front does not take do_put (serve(publisher, allow_put=True) does)"
            )
        ordinal = cuda_ordinal(device) if device is not None else None
        # Taken before the first batch is read: until the front reads, gRPC holds no more of the
        # stream than its flow-control window, so a refused upload's batches stay with its client.
        self._shares.take()
        try:
            table = self._received(reader)
            if cancelled():
                # The reader ends the same way when the client finished and when it went away
                # (its process died, its connection broke): only the call tells them apart.
                raise flight.FlightCancelledError(
                    "the client went away before the end of its upload: nothing was published"
                )
            if ordinal is not None:
                from arrow_ipc_bridge.arrays.device import to_device

                self._publisher.publish(name, to_device(table, ordinal))
            else:
                self._publisher.publish(name, table)
            del table
        finally:
            self._shares.give_back()

    def _received(self, reader: flight.MetadataRecordBatchReader) -> pa.Table:
        """The upload as a table, refused as soon as a batch puts what it holds over
        ``max_put_bytes``. Each batch is counted by the memory it keeps alive (``held_bytes``), not
        by what it describes."""
        batches: list[pa.RecordBatch] = []
        roots: dict[tuple[int, int], int] = {}
        held = 0
        while True:
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                break
            if chunk.data is None:
                continue
            held += held_bytes(chunk.data, roots)
            if held > self._max_put_bytes:
                # Dropped before the refusal travels: the exception's frames would hold them.
                batches.clear()
                del chunk
                raise invalid(
                    f"the upload is over max_put_bytes ({self._max_put_bytes} bytes): its batches "
                    f"hold {held} bytes"
                )
            batches.append(chunk.data)
        return pa.Table.from_batches(batches, schema=reader.schema)


class UploadShares:
    """The uploads a front takes at once: each may hold up to ``max_put_bytes`` before it is
    published, and all together no more than ``max_put_total_bytes``, so ``total // share`` of
    them run at once and one more is refused before it reads a batch (``docs/flight.md``,
    "Uploads"). A share is taken whole at the start: gRPC receives a message whole before the
    front can see its size, so what an upload will hold is only known as it arrives."""

    def __init__(self, share: int, total: int) -> None:
        self.share = share
        self.total = total
        self.at_once = total // share
        self._lock = threading.Lock()
        self._running = 0

    @property
    def running(self) -> int:
        """Uploads in progress now."""
        return self._running

    def take(self) -> None:
        with self._lock:
            if self._running < self.at_once:
                self._running += 1
                return
        uploads = "upload" if self.at_once == 1 else "uploads"
        raise flight.FlightUnavailableError(
            f"the front is taking {self.at_once} {uploads} already, as many as max_put_total_bytes "
            f"({self.total} bytes) allows at max_put_bytes ({self.share} bytes) each: try again "
            "when one is published"
        )

    def give_back(self) -> None:
        with self._lock:
            self._running -= 1


def held_bytes(batch: pa.RecordBatch, roots: dict[tuple[int, int], int]) -> int:
    """Bytes of memory ``batch`` keeps alive that ``roots`` (those an upload holds already, by
    address and size) does not count yet. A batch read from IPC is slices of its message's body, and
    a slice keeps its whole body alive: each buffer is counted by its outermost parent, once. Not
    ``nbytes``: a crafted message may describe a few bytes of a body of any size."""
    added = 0
    for column in batch.columns:
        for array in _with_dictionaries(column):
            for buffer in array.buffers():
                if buffer is None:
                    continue
                root = buffer
                while root.parent is not None:
                    root = root.parent
                key = (root.address, root.size)
                if key not in roots:
                    roots[key] = root.size
                    added += root.size
    return added


def _with_dictionaries(array: pa.Array) -> Iterator[pa.Array]:
    """``array`` and every dictionary in it, at any depth (``buffers()`` covers an array's children
    but not dictionaries)."""
    yield array
    pending = [array]
    while pending:
        current = pending.pop()
        if isinstance(current, pa.ExtensionArray):
            current = current.storage
        dtype = current.type
        if pa.types.is_dictionary(dtype):
            yield current.dictionary
            pending.append(current.dictionary)
        elif isinstance(current, (pa.StructArray, pa.UnionArray)):
            pending.extend(current.field(i) for i in range(dtype.num_fields))
        elif isinstance(
            current,
            (
                pa.ListArray,
                pa.LargeListArray,
                pa.FixedSizeListArray,
                pa.ListViewArray,
                pa.LargeListViewArray,
                pa.RunEndEncodedArray,
            ),
        ):
            pending.append(current.values)
