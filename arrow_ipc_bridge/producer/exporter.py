"""Producer side: capture -> describe -> place buffers in shareable regions -> encode.

:func:`export` is the bring-your-own-channel entry point: it returns the message bytes and the file
descriptors to send beside them. :class:`~arrow_ipc_bridge.producer.publisher.Publisher` uses the same path
and caches the result per published name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Literal, cast

from arrow_ipc_bridge.errors import BridgeError, ClosedError
from arrow_ipc_bridge.host.placement import COPY_POLICIES, HostExport, export_host_buffers
from arrow_ipc_bridge.runtime import arguments
from arrow_ipc_bridge.runtime.file_limit import file_limit_error, is_out_of_descriptors
from arrow_ipc_bridge.wire.capsules import (
    DEVICE_CPU,
    DEVICE_CUDA,
    ArrowInput,
    CapturedArray,
    CapturedData,
    _CapturedSource,
    capture,
)
from arrow_ipc_bridge.wire.metadata import (
    REGION_FLAG_SEALED,
    REGION_FLAG_ZERO_COPY,
    REGION_HOST_FD,
    SLOT_FIRST_REGION,
    SLOT_UNPLACED,
    Described,
    DeviceInfo,
    Region,
)

if TYPE_CHECKING:
    from arrow_ipc_bridge.cuda.shared_event import SharedEvent

__all__ = [
    "Exported",
    "ExportStats",
    "export",
    "export_again",
    "export_captured",
    "record_in_place",
    "CopyPolicy",
    "copy_policy",
]

CopyPolicy = Literal["never", "if_needed", "always"]


@dataclass
class ExportStats:
    """What one export cost: regions made, bytes copied (0 when every buffer was zero-copy)."""

    regions: int = 0
    zero_copy_regions: int = 0
    copied_bytes: int = 0
    buffers: int = 0


@dataclass
class Exported:
    """One exported object: send ``message`` and ``fds`` to the consumer, then keep this alive
    until the consumer is done (or rely on the consumer's own mappings for host memory).

    ``close()`` releases the producer's hold: the captured structs, the region fds and, for device
    data, the sync event and any policy copies. :attr:`fds` then raises
    :class:`~arrow_ipc_bridge.errors.ClosedError`: the numbers were closed and the kernel hands
    them to the next files this process opens, so sending them would send unrelated files.
    """

    message: bytes
    #: the descriptors (:attr:`fds`); their numbers stay here after close, for no use but this
    #: module's own checks of what the export carried
    _fds: list[int]
    is_stream: bool
    stats: ExportStats
    _captured: CapturedData = field(repr=False)
    _closers: list[Callable[[], None]] = field(repr=False, default_factory=list)
    _closed: bool = field(default=False, repr=False)
    #: CUDA data exported by :func:`export_again`: the event its message names, which a later
    #: version of the same publication may name again
    _shared_event: SharedEvent | None = field(default=None, repr=False)
    #: ``CapturedArray.column_signature`` of what was exported, when its message names those
    #: columns' own memory (no copy, no descriptor): :func:`record_in_place` compares with it
    _column_signature: tuple[int, tuple[str, ...] | None, bytes] | None = field(default=None, repr=False)
    #: with a signature: every column announced the legacy default stream or none, so the shared
    #: event's record for a version in place needs no wait before it (``record_in_place``)
    _in_place_no_wait: bool = field(default=False, repr=False)

    @property
    def fds(self) -> list[int]:
        """The descriptors to send with :attr:`message`, in its ``fd_index`` order; owned by this
        export (send them, do not close them). After :meth:`close`:
        :class:`~arrow_ipc_bridge.errors.ClosedError`, never the closed numbers."""
        if self._closed:
            raise ClosedError(
                "this export is closed: its descriptors are closed (their numbers may name other "
                "files now); export the object again to send it",
                what="export",
            )
        return self._fds

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the producer-side resources (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for close in self._closers:
            close()
        self._captured.close()

    def __enter__(self) -> Exported:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _place_host_buffers(described: Described, copy: CopyPolicy) -> tuple[list[Region], HostExport]:
    slots = described.slots()
    wanted: list[int] = []
    buffers: list[tuple[int, int]] = []
    for i in range(0, len(slots), 4):
        if slots[i + 2] == SLOT_UNPLACED:
            wanted.append(i)
            buffers.append((slots[i], slots[i + 1]))
    host = export_host_buffers(buffers, copy=copy)
    try:
        for i, placement in zip(wanted, host.placements, strict=True):
            if placement is None:  # cannot happen for non-empty buffers; keep the invariant loud
                raise BridgeError(f"host export left a {slots[i + 1]}-byte buffer without a region")
            slots[i + 2] = SLOT_FIRST_REGION + placement.region
            slots[i + 3] = placement.offset
        regions = [
            Region(
                kind=REGION_HOST_FD,
                size=r.size,
                file_offset=r.file_offset,
                fd_index=index,
                flags=(REGION_FLAG_SEALED if r.sealed else 0) | (REGION_FLAG_ZERO_COPY if r.zero_copy else 0),
            )
            for index, r in enumerate(host.regions)
        ]
    except BaseException:
        host.close()
        raise
    return regions, host


def export_captured(
    captured: CapturedData,
    *,
    copy: CopyPolicy = "if_needed",
    pool_fds: bool = True,
    previous: Exported | None = None,
    share_event: bool = False,
    doing: str = "exporting",
) -> Exported:
    """Export data already captured (takes ownership of ``captured``); ``previous`` and
    ``share_event`` as for :func:`export_again`. Running out of descriptors is a
    :class:`~arrow_ipc_bridge.errors.LimitError` (``limit="file_descriptors"``) whose message
    starts with ``doing``."""
    try:
        if captured.device_type == DEVICE_CPU:
            return _export_host(captured, copy)
        if captured.device_type == DEVICE_CUDA:
            return _export_cuda(captured, copy, pool_fds, previous if share_event else None, share_event)
        raise BridgeError(
            f"exporting data on device type {captured.device_type} is not supported: "
            "host (CPU) and CUDA device memory are"
        )
    except BaseException as exc:
        captured.close()  # every placement closed what it opened before raising
        if is_out_of_descriptors(exc):
            raise file_limit_error(doing, exc) from exc
        raise


def _export_host(captured: CapturedData, copy: CopyPolicy) -> Exported:
    described = Described(captured)
    regions, host = _place_host_buffers(described, copy)
    try:
        message = described.encode(DeviceInfo(device_type=DEVICE_CPU), regions, n_fds=len(host.regions))
    except BaseException:
        host.close()
        raise
    stats = ExportStats(
        regions=len(regions),
        zero_copy_regions=sum(1 for r in host.regions if r.zero_copy),
        copied_bytes=host.copied_bytes,
        buffers=len(host.placements),
    )
    if stats.zero_copy_regions == 0:
        # Every byte the message names is in the sealed copy (or there is none): nothing reads the
        # source again, so its buffers go now (their release callbacks run once nobody else shares
        # them), not when the export closes. A published 1 GiB heap table held 1 GiB of heap beside
        # its 1 GiB copy until it was unpublished. A zero-copy region names the source's own
        # memory, which must stay: the capture is kept whole then (one capture holds every buffer).
        captured.close()
    return Exported(message, host.fds(), described.is_stream, stats, captured, [host.close])


def _export_cuda(
    captured: CapturedData, copy: CopyPolicy, pool_fds: bool, previous: Exported | None, share_event: bool
) -> Exported:
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda.placer import (
        CudaPlacer,
        event_pool,
        recorded_on_legacy_stream,
        remember_local_event,
        sync_handle_of,
    )
    from arrow_ipc_bridge.cuda.shared_event import SharedEvent

    device = captured.device_id
    described = Described(captured)
    placer = CudaPlacer(device, copy=copy, pool_fds=pool_fds)
    placer.resolve_pending_lengths(described)
    placement = placer.place(described)
    closers: list[Callable[[], None]] = [placement.close]
    n_regions = placement.region_count
    stats = ExportStats(
        regions=n_regions,
        zero_copy_regions=n_regions - len(placement.copies),
        copied_bytes=placement.copied_bytes,
        buffers=placement.buffers,
    )

    def encode(sync: bytes) -> bytes:
        info = DeviceInfo(device_type=DEVICE_CUDA, identity=cuda.device_uuid(device), sync=sync)
        return described.encode_region_array(
            info, placement.region_array, placement.region_count, n_fds=len(placement.fds)
        )

    try:
        producer_event = captured.arrays[0].sync_event if captured.arrays else None
        producer_handle = cuda.event_value(producer_event) if producer_event else 0
        if share_event:
            # A shared event is recorded on the legacy default stream: one recorded there already
            # (CuPy's default stream) needs no wait before it.
            if producer_handle and recorded_on_legacy_stream(producer_handle):
                producer_handle = 0
            again = None if placement.fds else _send_again(previous, device, encode, producer_handle)
            if again is None:  # a message of its own, naming an event later versions may name again
                events = event_pool(device)
                event = events.acquire()
                try:
                    shared = SharedEvent(events, event)
                except BaseException:
                    events.release(event)
                    raise
                closers.append(shared.drop)
                shared.record_after(producer_handle)  # and remembered for a same-process consumer
                again = shared, encode(shared.handle)
            else:  # the current version's message, its event re-recorded after the new work
                closers.append(again[0].drop)
            shared, message = again
            return Exported(
                message,
                list(placement.fds),
                described.is_stream,
                stats,
                captured,
                closers,
                _shared_event=shared,
            )
        # The consumer must not read before the producer's writes are done. Data from
        # from_cuda_array(s) carries a pooled interprocess event recorded on the producer's stream:
        # its handle travels as it is. Any other producer's sync event is waited on by one of ours,
        # recorded after it.
        sync = sync_handle_of(producer_handle) if producer_handle else None
        if sync is None:
            events = event_pool(device)
            event = events.acquire()
            closers.append(lambda: events.release(event))
            if producer_handle:
                cuda.stream_wait_event(0, producer_handle, device=device)
            event.record(0)
            sync = event.ipc_handle()
            remember_local_event(sync, event.handle)
        message = encode(sync)
    except BaseException:
        for close in closers:
            close()
        raise
    return Exported(message, list(placement.fds), described.is_stream, stats, captured, closers)


def _send_again(
    previous: Exported | None, device: int, encode: Callable[[bytes], bytes], producer_handle: int
) -> tuple[SharedEvent, bytes] | None:
    """The shared event of ``previous`` (the publication this export replaces) and its message,
    when the new message names exactly what ``previous``'s names (same regions, offsets, layout,
    device, no descriptor): the event then has a reference for the new export and is recorded
    after the producer's new work. None otherwise (nothing taken)."""
    shared = previous._shared_event if previous is not None else None
    if previous is None or shared is None or previous._fds or shared.device != device or not shared.take():
        return None
    try:
        if encode(shared.handle) != previous.message:
            shared.drop()
            return None
        shared.record_after(producer_handle)  # and remembered for a same-process consumer
    except BaseException:
        shared.drop()
        raise
    return shared, previous.message


def copy_policy(value: object, what: str = "copy") -> CopyPolicy:
    """``value`` checked as a copy policy (``InvalidArgumentError`` / ``InvalidArgumentError``)."""
    return cast(CopyPolicy, arguments.choice(value, what, COPY_POLICIES))


def export_again(
    obj: ArrowInput,
    previous: Exported | None,
    *,
    copy: CopyPolicy = "if_needed",
    pool_fds: bool = True,
    doing: str = "exporting",
) -> Exported:
    """:func:`export` for the next version of a publication whose current version is ``previous``
    (None: the first). CUDA data gets an event that later versions may name again, and when its
    message would name exactly what ``previous``'s names (the same arrays, updated in place) it is
    ``previous.message``, the same bytes, with ``previous``'s event re-recorded after the producer's
    new work (``cuda/shared_event.py`` says why that is sound): a consumer's get then finds the
    message it remembers. Host data is exported as by :func:`export`."""
    captured = CapturedData.sharing(obj._live()) if isinstance(obj, _CapturedSource) else capture(obj)
    exported = export_captured(
        captured, copy=copy, pool_fds=pool_fds, previous=previous, share_event=True, doing=doing
    )
    signature = obj.column_signature if isinstance(obj, CapturedArray) else None
    # Only a message naming the columns' own memory (no policy copy, no descriptor) stands for a
    # later in-place version of them (record_in_place).
    names_own_memory = not exported.fds and exported.stats.copied_bytes == 0
    if signature is not None and exported._shared_event is not None and names_own_memory:
        from arrow_ipc_bridge.arrays.device import hold_checked_columns

        try:
            # While this export is open its columns' facts spare from_cuda_arrays the device
            # query for the same columns; taken out first when it closes, before the arrays go.
            exported._closers.insert(0, hold_checked_columns(signature[2], signature[0], exported._captured))
        except BaseException:
            exported.close()
            raise
        exported._column_signature = signature
        exported._in_place_no_wait = bool(getattr(obj, "streams_need_no_wait", False))
    return exported


def record_in_place(current: Exported, obj: ArrowInput, copy: CopyPolicy) -> bool:
    """Whether ``obj`` is a new version of ``current`` updated in place: columns from
    :func:`~arrow_ipc_bridge.from_cuda_arrays` whose facts (device, names, pointers, lengths, types,
    announced streams) are those ``current`` was exported from, with no copy asked for. Then
    ``current``'s message names exactly ``obj``'s memory, as :func:`export_again` would find after
    placing and encoding it all: the memory ``current`` names is alive (``current`` holds its arrays),
    so the same pointers are the same allocations. When True, ``current``'s shared event has been
    re-recorded after ``obj``'s pending work and ``current`` stands for ``obj`` (the publisher
    renews the entry's version); ``obj`` itself is not kept. False: nothing was done."""
    signature = current._column_signature
    if (
        signature is None
        or copy == "always"
        or current.closed
        or not isinstance(obj, CapturedArray)
        or obj.column_signature != signature
    ):
        return False
    shared = current._shared_event
    assert shared is not None  # a signature is kept only with a shared event (export_again)
    # The same facts, so the same announced streams as current's: on the legacy default stream or
    # none, the shared event's record there is ordered after the producer's work with no wait.
    producer_handle = 0 if current._in_place_no_wait else _pending_event(obj)
    shared.record_after(producer_handle)  # and remembered for a same-process consumer
    return True


def _pending_event(obj: CapturedArray) -> int:
    """The event on the stream ``obj``'s columns announced (a real stream: made with the structs
    now, if not yet), for the shared event's record to wait on; 0 when one recorded on the legacy
    default stream, after which the shared event's record there comes anyway."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda.placer import recorded_on_legacy_stream

    captured = obj._live()
    producer_event = captured.arrays[0].sync_event if captured.arrays else None
    producer_handle = cuda.event_value(producer_event) if producer_event else 0
    if producer_handle and recorded_on_legacy_stream(producer_handle):
        return 0  # the shared event's record on the same stream comes after it
    return producer_handle


def export(
    obj: ArrowInput,
    *,
    copy: CopyPolicy = "if_needed",
    requested_schema: object | None = None,
    pool_fds: bool = True,
) -> Exported:
    """Export any Arrow PyCapsule producer for another process.

    Parameters
    ----------
    obj
        An array, record batch, table, stream or anything implementing the Arrow PyCapsule
        interface.
    copy
        ``"never"``: raise :class:`~arrow_ipc_bridge.errors.CopyRequiredError` unless every buffer
        already lives in shareable memory; ``"if_needed"`` (default): copy what must be copied into
        one sealed memfd (counted in ``Exported.stats`` and ``aib.stats().host``);
        ``"always"``: copy everything.
    pool_fds
        Attach the fd of each IPC-enabled memory pool the data lives in (default), so that a
        consumer can import the message from ``message`` and ``fds`` alone. ``False`` leaves them
        out (the pool regions' ``fd_index`` is -1): the consumer must have imported the pool
        already or ask for its fd, as a :class:`~arrow_ipc_bridge.Session` asks its publisher
        (once per pool per process, protocol feature ``"pool_fd"``). Publishers export this way,
        so their answers carry no descriptor for pool data.

    Examples
    --------
    >>> import pyarrow as pa, arrow_ipc_bridge as aib
    >>> exported = aib.export(pa.table({"x": [1, 2, 3]}))
    >>> imported = aib.Session().import_message(exported.message, exported.fds)
    >>> pa.table(imported).num_rows
    3
    >>> imported.release(); exported.close()
    """
    copy = copy_policy(copy)
    arguments.boolean(pool_fds, "pool_fds")
    if requested_schema is None and isinstance(obj, _CapturedSource):
        # Data captured already (from_cuda_arrays, a capture served back out): share its record
        # instead of a round of capsules, struct copies and a second capture of the same structs.
        return export_captured(CapturedData.sharing(obj._live()), copy=copy, pool_fds=pool_fds)
    return export_captured(capture(obj, requested_schema=requested_schema), copy=copy, pool_fds=pool_fds)
