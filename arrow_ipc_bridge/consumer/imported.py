"""What a consumer holds: imported data served through the Arrow PyCapsule protocol.

An imported object wraps a validated :class:`~arrow_ipc_bridge.wire.metadata.Decoded` message plus the
base address of each of its regions in this process. Every protocol call rebuilds fresh structs
that point into the same mapped regions, each holding a reference on the message's owner; the lease
ends when the object is released *and* the last struct handed out is released by its consumer.
:func:`to_host` copies imported data (device data included) into host memory as pyarrow objects.

The class is chosen when the data is imported (:func:`imported_class`), by its kind and where it
lives: host data (:class:`ImportedHostArray`, :class:`ImportedHostStream`) offers the host protocol
methods, device data (:class:`ImportedDeviceArray`, :class:`ImportedDeviceStream`) does not have
them at all, so that a consumer probing with ``hasattr`` (pylibcudf's ``from_arrow`` tries
``__arrow_c_device_array__``, then ``__arrow_c_stream__``) is never offered a method that could
only refuse. Every kind keeps one path per operation: the classes differ in which mixins of
``wire/capsules.py`` they take, not in how a struct is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, cast

import pyarrow as pa

from arrow_ipc_bridge._ffi import ImportState, ffi, lib
from arrow_ipc_bridge.errors import BridgeError, ClosedError
from arrow_ipc_bridge.runtime import arguments, reaper
from arrow_ipc_bridge.wire.capsules import (
    DEVICE_CPU,
    DEVICE_CUDA,
    HOST_READABLE_DEVICES,
    ArrowArrayExporter,
    DeviceArrayExporter,
    DeviceStreamExporter,
    HostStreamExporter,
    TableExporter,
    array_capsules,
    call_borrowed,
    capsule_struct,
    device_array_capsules,
    new_capsule,
    owner_address,
)
from arrow_ipc_bridge.wire.metadata import SLOT_FIRST_REGION, Decoded

if TYPE_CHECKING:
    from arrow_ipc_bridge.consumer.array_cache import KeptCupyArrays

__all__ = [
    "ImportedArray",
    "ImportedStream",
    "ImportedHostArray",
    "ImportedDeviceArray",
    "ImportedHostStream",
    "ImportedDeviceStream",
    "ImportedBatch",
    "batch_lengths",
    "device_label",
    "imported_class",
    "imported_from",
    "message_schema",
    "referenced_bytes",
    "to_host",
]


class _ImportedBase(ImportState, DeviceStreamExporter):
    # The state of each import is in the slots of the C base type (ImportState,
    # cffi_build/py_state.c), which the C core's local getter fills by offset: no class default may
    # shadow one of them (an unset slot reads as None).
    _decoded: Decoded
    _bases: Any  # uint64_t[] of region bases (shared with the session's remembered message)
    _n_bases: int
    _device_type: int
    _device_id: int
    _sync: Any  # the owner's slot for the producer's event, or ffi.NULL
    name: str | None
    _on_release: Callable[[], None] | None
    _owner_address: int  # the owner as a number (arrays, whose capsules C builds from it)
    # Set on objects got by waiting (Session.get(wait=...), Session.get_next) or from the version
    # board: the publication's version and the publisher it came from (versions are per
    # publisher); None otherwise.
    version: int | None
    publisher_id: str | None
    # Set on a standing-lease session's re-gets of a remembered message: (the session's
    # KeptCupyArrays, the remembered message), so column_arrays may hand out the CuPy arrays it made
    # for that message before (consumer/array_cache.py); None otherwise.
    _kept_arrays: tuple[KeptCupyArrays, object] | None
    # Set on objects from readable_on whose legacy regions were opened in another GPU's context:
    # (that GPU's ordinal, the indexes of those regions), for copies, which read each region
    # through the context its pointer is mapped in; None otherwise.
    _mapped_on: tuple[int, frozenset[int]] | None
    # The row count, worked out on first use (the message never changes); None before.
    _num_rows: int | None

    # Arrays build their capsule pairs in C from the owner's view; streams are rebuilt from the
    # bases they are given and need no view.
    _capsules_from_owner = False
    _kind_name: str  # the kind's public name, for repr

    def __init__(
        self,
        decoded: Decoded,
        region_bases: Sequence[int] | Any,
        *,
        device_type: int,
        device_id: int,
        sync_event: Any = None,
        name: str | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._decoded = decoded
        if isinstance(region_bases, ffi.CData):  # a uint64_t[] shared with the session's cache
            self._bases = region_bases
        else:
            self._bases = ffi.new("uint64_t[]", list(region_bases) or [0])
        self._n_bases = len(region_bases)
        self._device_type = device_type
        self._device_id = device_id
        self._sync = sync_event if sync_event is not None else ffi.NULL
        self.name = name
        self._on_release = on_release
        if self._capsules_from_owner:
            # Lets the C core build this object's capsules from the owner alone
            # (device_array_capsules). An owner sharing a remembered decode has the template's view
            # already (AIB_E_STATE); out of memory leaves it without one: the protocol calls then
            # take the Python path.
            lib.aib_owner_set_view(decoded.owner, self._bases, self._n_bases, device_type, device_id)
            self._owner_address = owner_address(decoded.owner)

    @classmethod
    def adopt(
        cls,
        decoded: Decoded,
        bases: Any,
        *,
        n_bases: int,
        device_type: int,
        device_id: int,
        sync_event: Any,
        name: str | None,
        owner_address: int,
    ) -> Self:
        """The steady-state constructor: ``bases`` is the ``uint64_t[]`` every import of the message
        shares (``n_bases`` long), made once; nothing needs checking (a get per hand-off makes every
        call count). ``owner_address`` is ``decoded``'s owner as a number (the C core returns it).
        For a message the C core imported new (``MessageImporter.adopt_new``); a remembered
        message's imports are made by ``RememberedMessage.adopt``."""
        self = cls.__new__(cls)
        self._decoded = decoded
        self._bases = bases
        self._n_bases = n_bases
        self._device_type = device_type
        self._device_id = device_id
        self._owner_address = owner_address
        self._sync = sync_event if sync_event is not None else ffi.NULL
        self.name = name
        return self

    # -- lifetime --
    @property
    def released(self) -> bool:
        return self._decoded.closed

    def release(self) -> None:
        """Give this object's hold back (idempotent). Structs already handed to consumers stay valid
        until they are released; the lease ends after the last one."""
        decoded = self._decoded
        if not decoded._closed:
            # When that was the last hold, the lease ends just now: deliver the notice on this
            # thread instead of waking the reaper thread (a thread switch and GIL hand-off less).
            lib.aib_reaper_quiet(1)
            try:
                decoded.close()
                on_release = self._on_release
                if on_release is not None:
                    on_release()
            finally:
                lib.aib_reaper_quiet(0)
                reaper.drain()

    def __enter__(self) -> _ImportedBase:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def _borrow(self) -> Decoded:
        """The message, borrowed (``Decoded.borrow``): the caller unborrows it when done."""
        try:
            self._decoded.borrow()
        except ClosedError:
            self._live()  # the error that names this object
            raise
        return self._decoded

    def _live(self) -> Decoded:
        if self._decoded.closed:
            raise ClosedError(
                f"imported {self.name or 'data'} was released; get it again from the session to use it",
                reason="released",
            )
        return self._decoded

    # -- facts --
    @property
    def device_type(self) -> int:
        return self._device_type

    @property
    def device_id(self) -> int:
        return self._device_id

    @property
    def batch_count(self) -> int:
        return self._live().batch_count

    @property
    def device(self) -> str:
        """Where the data lives, as a label: ``"cpu"``, ``"cuda:N"`` (this process's ordinal)."""
        return device_label(self._device_type, self._device_id)

    @property
    def schema(self) -> pa.Schema:
        """The data's schema as pyarrow: the columns of a record batch, table or stream; a plain
        array's root as the one field of a schema (``type`` is that field's type). No data is read."""
        decoded = self._borrow()
        try:
            return message_schema(decoded)
        finally:
            decoded.unborrow()

    @property
    def type(self) -> pa.DataType:
        """The root's Arrow type (a struct for record batches and tables)."""
        decoded = self._borrow()
        try:
            capsule, out = new_capsule("schema")
            decoded.rebuild_schema(out)
            return pa.DataType._import_from_c_capsule(capsule)
        finally:
            decoded.unborrow()

    @property
    def num_rows(self) -> int:
        """Rows over every batch (the root arrays' lengths), read from the message: no data is read
        or copied."""
        if self._num_rows is None:
            decoded = self._borrow()
            try:
                self._num_rows = sum(batch_lengths(decoded, self._bases))
            finally:
                decoded.unborrow()
        return self._num_rows

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory the data's buffers span: the union of the byte ranges the
        message's buffers reference (memory shared by several batches or arrays counts once).
        Nothing is read."""
        decoded = self._borrow()
        try:
            return referenced_bytes(decoded)
        finally:
            decoded.unborrow()

    def _sync_event(self) -> Any:
        """The ``sync_event`` for a struct built now: the producer's event while its work is
        pending, NULL once the driver says it completed (``sync_event.c``)."""
        if self._sync == ffi.NULL:
            return self._sync
        return lib.aib_sync_event_if_pending(self._device_type, self._sync)

    @property
    def root_format(self) -> str:
        """The Arrow format string of the root (``"+s"`` for record batches and tables)."""
        capsule = self.__arrow_c_schema__()
        return str(ffi.string(capsule_struct(capsule, "schema").format).decode())

    def to_host(self) -> pa.Array | pa.RecordBatch | pa.Table:
        """A host copy as pyarrow (``Table`` for streams, ``RecordBatch`` for struct roots, else
        ``Array``); device data is copied after waiting for the producer's sync event."""
        return to_host(self)  # type: ignore[arg-type]

    def to_device(self, device: int, *, stream: object = None) -> ImportedArray | ImportedStream:
        """A copy of this GPU data on GPU ``device`` (this process's ordinal), owned by this process.

        One new allocation on ``device`` (the bridge's IPC pool, so the copy can be published
        again), one ``cuMemcpyPeerAsync`` per contiguous run of buffers, queued on ``stream`` (a
        CuPy / PyTorch stream or ``CUstream`` of ``device``; None: its legacy default stream) after
        the producer's event; the host does not wait. The copy's ``sync_event`` is recorded after
        the copies, its ``device_id`` is ``device``; this object stays usable (release it when done:
        the copy does not need it once the copies ran). Works between any two GPUs (direct over
        NVLink / PCIe where the pair has a peer path, staged by the driver otherwise) and on the
        same GPU. ``docs/gpu.md``, "Several GPUs".

        Raises
        ------
        BridgeError
            Host data (``aib.to_device(imported, device)`` uploads it), or a released object.
        TypeError
            ``device`` is not an int.
        CudaError
            ``device`` is not visible here, or a driver call failed.
        """
        from arrow_ipc_bridge.cuda.cross_gpu import copy_to_device

        copy, bases, sync_event = copy_to_device(self, device, stream)
        return imported_from(
            copy, bases, device_type=DEVICE_CUDA, device_id=device, sync_event=sync_event, name=self.name
        )

    def readable_on(self, device: int) -> ImportedArray | ImportedStream:
        """This GPU data as an object whose pointers kernels on GPU ``device`` can read in place.

        Peer access (or an IPC pool's or VMM mapping's access) is given to ``device`` as
        ``arrow_ipc_bridge.cuda.cross_gpu.grant_in_place`` does. A legacy (``cudaMalloc``)
        allocation of another process is mapped for the GPU whose context opened its IPC
        handle only, so where the data has such memory on another GPU, its handles are opened
        again in ``device``'s context (once per handle and GPU in a process, held open like
        the others) and a new object naming those pointers is returned: same data, same
        ``device_id`` (where the bytes live), ``sync_event``, ``name``, ``version`` and
        ``publisher_id``. It holds this object's lease until it is released; this object stays
        usable on its own GPU (release it when done). Otherwise this object itself is
        returned. ``aib.connect(path, reader_device=k)`` does this on every get.
        ``docs/gpu.md``, "Several GPUs".

        Raises
        ------
        CudaError (``reason="no_peer_access"``)
            The two GPUs have no peer path, or the driver refused access: both GPUs named.
        BridgeError
            Host data, or a released object.
        """
        from arrow_ipc_bridge.cuda.cross_gpu import reader_mappings

        mapped = reader_mappings(self, device)
        if mapped is None:
            return self  # type: ignore[return-value]
        decoded, bases, remapped = mapped
        readable = imported_from(
            decoded,
            bases,
            device_type=DEVICE_CUDA,
            device_id=self._device_id,
            sync_event=None if self._sync == ffi.NULL else self._sync,
            name=self.name,
        )
        readable.version = self.version
        readable.publisher_id = self.publisher_id
        readable._mapped_on = (device, remapped)
        return readable

    # -- struct builders --
    # Each holds a borrow on the message across its C calls (which release the GIL), so that a
    # release() on another thread meanwhile cannot free what the call is reading: the release then
    # takes effect when the call is done.
    def _fill_schema(self, out: Any) -> None:
        decoded = self._borrow()
        try:
            decoded.rebuild_schema(out)
        finally:
            decoded.unborrow()

    def _fill_batch(self, index: int, out: Any) -> None:
        decoded = self._borrow()
        try:
            decoded.rebuild_array(index, self._bases, out)
        finally:
            decoded.unborrow()

    def _fill_device_array(self, schema: Any, array: Any, batch: int = 0) -> None:
        call_borrowed(
            self._borrow(),
            "rebuilding a device array",
            lambda d, err: lib.aib_rebuild_device_array(
                d.raw,
                batch,
                self._bases,
                self._n_bases,
                d.owner,
                self._device_type,
                self._device_id,
                self._sync_event(),
                schema,
                array,
                err,
            ),
        )

    def _fill_device_stream(self, out: Any) -> None:
        call_borrowed(
            self._borrow(),
            "creating a device stream",
            lambda d, err: lib.aib_device_stream_from_decoded(
                d.owner, self._bases, self._n_bases, self._device_type, self._device_id, self._sync, out, err
            ),
        )

    def _fill_stream(self, out: Any) -> None:
        call_borrowed(
            self._borrow(),
            "creating a stream",
            lambda d, err: lib.aib_stream_from_decoded(d.owner, self._bases, self._n_bases, out, err),
        )

    def __repr__(self) -> str:
        # The kind's name (ImportedArray, ImportedStream): where the data lives is in the facts.
        kind = self._kind_name
        label = f" {self.name!r}" if self.name is not None else ""
        if self.released:
            return f"<{kind}{label} released>"
        try:
            schema = self.schema
            what = _describe_root(self._decoded.is_stream, self.root_format, self.batch_count)
            columns = ", ".join(f"{field.name}: {field.type}" for field in schema)
            facts = f"{what}, {self.num_rows} rows, {self.nbytes} bytes, {self.device}, [{columns}]"
        except BridgeError:  # released by another thread meanwhile: a repr never raises
            facts = "released"
        return f"<{kind}{label} {facts}>"


class ImportedArray(_ImportedBase, DeviceArrayExporter):
    """An imported array or record batch: an :class:`ImportedHostArray` or an
    :class:`ImportedDeviceArray`, by where the data lives.

    Use it wherever an Arrow PyCapsule producer is accepted: ``pa.array(imported)`` /
    ``pa.record_batch(imported)``, ``polars.DataFrame(imported)``, ``nanoarrow.c_array(imported)``
    for host data, ``pylibcudf.Table.from_arrow(imported)`` for device data.
    ``release()`` (or the ``with`` block) gives the lease back.
    """

    _capsules_from_owner = True
    _kind_name = "ImportedArray"

    # The hand-off's hot path: both capsules made by one C call (py_capsules.c) from the owner's
    # view, the message borrowed around it; the generic path when the owner has no view.
    def _device_array_capsules(self) -> tuple[object, object]:
        pair = self._pair_from_owner(device_array_capsules)
        return pair if pair is not None else super()._device_array_capsules()

    def _pair_from_owner(
        self, build: Callable[[int], tuple[object, object] | None]
    ) -> tuple[object, object] | None:
        """``build(owner address)`` (a capsule-pair builtin) with the message borrowed around it."""
        decoded = self._borrow()
        try:
            return build(self._owner_address)
        finally:
            decoded.unborrow()

    def __enter__(self) -> ImportedArray:
        return self


class ImportedHostArray(ImportedArray, ArrowArrayExporter):
    """An imported array or record batch in host memory: ``__arrow_c_array__``,
    ``__arrow_c_stream__``, ``__arrow_c_device_array__``, ``__arrow_c_device_stream__`` and
    ``__arrow_c_schema__``."""

    def _array_capsules(self) -> tuple[object, object]:
        # The C call as for the device pair (ImportedArray._device_array_capsules).
        pair = self._pair_from_owner(array_capsules)
        return pair if pair is not None else super()._array_capsules()

    def __enter__(self) -> ImportedHostArray:
        return self


class ImportedDeviceArray(ImportedArray):
    """An imported array or record batch in device (CUDA) memory: ``__arrow_c_device_array__``,
    ``__arrow_c_device_stream__`` and ``__arrow_c_schema__`` only; the host methods are absent
    (``to_host()`` copies it to the host)."""

    def __enter__(self) -> ImportedDeviceArray:
        return self


class ImportedStream(_ImportedBase, TableExporter):
    """An imported table or stream of record batches: an :class:`ImportedHostStream` (read it with
    ``pa.table(imported)``, polars, nanoarrow) or an :class:`ImportedDeviceStream`
    (``pylibcudf.Table.from_arrow(imported)`` for one batch; :meth:`batch` for each of several)."""

    _kind_name = "ImportedStream"

    def batch(self, index: int) -> ImportedBatch:
        """Batch ``index`` of this table as its own producer of ``__arrow_c_device_array__`` (zero
        copy, on the table's device): what a consumer that reads one record batch takes, such as
        ``pylibcudf.Table.from_arrow(imported.batch(i))`` for each ``i`` in
        ``range(imported.batch_count)``. It uses this object's lease: this object must not be
        released while it is used (the structs it hands out hold the lease on their own).

        Raises
        ------
        InvalidArgumentError
            ``index`` is not from 0 to ``batch_count - 1``.
        InvalidArgumentError
            ``index`` is not an int.
        ClosedError
            This object was released.
        """
        count = self.batch_count
        if count == 0:
            arguments.fail_value("index", "a batch index, and this table has no batches", index)
        return ImportedBatch(self, arguments.count(index, "index", least=0, most=count - 1))

    def __enter__(self) -> ImportedStream:
        return self


class ImportedHostStream(ImportedStream, HostStreamExporter):
    """An imported table or stream in host memory: ``__arrow_c_stream__``,
    ``__arrow_c_device_stream__`` and ``__arrow_c_schema__``. No array methods, so consumers that
    prefer arrays (polars) take the stream."""

    def __enter__(self) -> ImportedHostStream:
        return self


class ImportedDeviceStream(ImportedStream, DeviceArrayExporter):
    """An imported table or stream in device (CUDA) memory: ``__arrow_c_device_stream__``,
    ``__arrow_c_schema__`` and ``__arrow_c_device_array__``; the host methods are absent.

    ``__arrow_c_device_array__`` hands over the table's one batch as it is (zero copy), for
    consumers that take one record batch and cannot read device streams (pylibcudf's
    ``Table.from_arrow``). A table of several batches (or none) raises :class:`BridgeError` naming
    the count: one device array of several batches would be a concatenation, a copy on the GPU,
    which the bridge never makes unasked. Hand over each batch with :meth:`batch`, and concatenate
    in the consumer if one table is wanted (``pylibcudf.concatenate.concatenate``: a copy the
    caller chose).
    """

    def _device_array_capsules(self) -> tuple[object, object]:
        count = self.batch_count
        if count != 1:
            raise BridgeError(
                f"imported {self.name or 'data'} is a table of {count} batches on {self.device}, and "
                "__arrow_c_device_array__ hands over one batch as it is (one array of several would "
                "be a copy): take each with imported.batch(i) for i in range(imported.batch_count), "
                "or read them all through __arrow_c_device_stream__",
                batch_count=count,
            )
        return super()._device_array_capsules()

    def __enter__(self) -> ImportedDeviceStream:
        return self


class ImportedBatch(DeviceArrayExporter):
    """One batch of an imported table or stream (:meth:`ImportedStream.batch`):
    ``__arrow_c_device_array__`` and ``__arrow_c_schema__`` of that batch, on the table's device,
    zero copy. It borrows the table's lease (the table must not be released while it is used;
    the structs it hands out hold the lease on their own)."""

    def __init__(self, table: ImportedStream, index: int) -> None:
        self.table = table
        self.index = index

    @property
    def device_type(self) -> int:
        return self.table.device_type

    @property
    def device_id(self) -> int:
        return self.table.device_id

    def _fill_schema(self, out: Any) -> None:
        self.table._fill_schema(out)

    def _fill_device_array(self, schema: Any, array: Any) -> None:
        self.table._fill_device_array(schema, array, self.index)

    def __repr__(self) -> str:
        return f"<ImportedBatch {self.index} of {self.table!r}>"


def imported_class(
    is_stream: bool, device_type: int
) -> type[ImportedHostArray | ImportedDeviceArray | ImportedHostStream | ImportedDeviceStream]:
    """The class of an import: by the message's kind (array or stream) and where its data lives
    (host-readable memory gets the host protocol methods, any other device does not)."""
    if device_type in HOST_READABLE_DEVICES:
        return ImportedHostStream if is_stream else ImportedHostArray
    return ImportedDeviceStream if is_stream else ImportedDeviceArray


def imported_from(
    decoded: Decoded,
    region_bases: Sequence[int] | Any,
    *,
    device_type: int,
    device_id: int,
    sync_event: Any = None,
    name: str | None = None,
    on_release: Callable[[], None] | None = None,
) -> ImportedArray | ImportedStream:
    """The right imported object for a decoded message (:func:`imported_class`)."""
    return imported_class(decoded.is_stream, device_type)(
        decoded,
        region_bases,
        device_type=device_type,
        device_id=device_id,
        sync_event=sync_event,
        name=name,
        on_release=on_release,
    )


# ---------- facts read from a message (also what ``inspect`` prints) ---------------------------------
def device_label(device_type: int, device_id: int) -> str:
    """``"cpu"``, ``"cuda:N"``, or the C Device interface's numbers for another device."""
    if device_type == DEVICE_CPU:
        return "cpu"
    if device_type == DEVICE_CUDA:
        return f"cuda:{device_id}"
    return f"device_type {device_type}:{device_id}"


def _describe_root(is_stream: bool, root_format: str, batches: int) -> str:
    if is_stream:
        return f"table of {batches} batch{'es' if batches != 1 else ''}"
    return "record batch" if root_format == "+s" else "array"


def message_schema(decoded: Decoded) -> pa.Schema:
    """The message's schema: a struct root's children, or a plain array's root as its one field."""
    capsule, out = new_capsule("schema")
    decoded.rebuild_schema(out)
    if ffi.string(out.format) == b"+s":
        return pa.Schema._import_from_c_capsule(capsule)
    return pa.schema([pa.Field._import_from_c_capsule(capsule)])


def batch_lengths(decoded: Decoded, bases: Any) -> list[int]:
    """The root length of every batch. Each batch's structs are rebuilt over ``bases`` (a
    ``uint64_t[]``) and released at once; only the lengths are read, never a buffer, so any nonzero
    bases do for a message whose regions are not mapped here (``inspect``)."""
    lengths = []
    for batch in range(decoded.batch_count):
        capsule, out = new_capsule("array")  # the capsule releases the rebuilt structs
        decoded.rebuild_array(batch, bases, out)
        lengths.append(int(out.length))
        del capsule
    return lengths


def referenced_bytes(decoded: Decoded) -> int:
    """Bytes of region memory the message's buffers span: the union of the byte ranges every buffer
    references, per region, so that buffers shared or overlapping between batches (slices of one
    array) count once; null and empty buffers take no memory."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for code, offset, length in decoded.buffer_refs():
        if code >= SLOT_FIRST_REGION and length:
            spans.setdefault(code, []).append((offset, offset + length))
    total = 0
    for ranges in spans.values():
        ranges.sort()
        start, end = ranges[0]
        for lo, hi in ranges[1:]:
            if lo > end:  # a gap: the run so far is done
                total += end - start
                start, end = lo, hi
            else:
                end = max(end, hi)
        total += end - start
    return total


# ---------- copies to the host ----------------------------------------------------------------------
def to_host(imported: ImportedArray | ImportedStream) -> pa.Array | pa.RecordBatch | pa.Table:
    """Copy imported data into host memory as pyarrow: a ``Table`` for streams, a ``RecordBatch`` for
    struct-typed roots (record batches), an ``Array`` otherwise. Host data is not copied."""
    if not isinstance(imported, _ImportedBase):
        arguments.fail_type(
            "imported", "data imported by the bridge (ImportedArray or ImportedStream)", imported
        )
    if imported.device_type == DEVICE_CPU:
        return _to_pyarrow(imported)
    if imported.device_type != DEVICE_CUDA:
        raise BridgeError(f"cannot copy data from device type {imported.device_type}")
    # Borrowed for the copy: a release() on another thread meanwhile takes effect after it.
    decoded = imported._borrow()
    try:
        copy_decoded, host_bases = _copy_to_host(imported, decoded)
    finally:
        decoded.unborrow()
    copy = imported_from(copy_decoded, host_bases, device_type=DEVICE_CPU, device_id=-1, name=imported.name)
    try:
        return _to_pyarrow(copy)
    finally:
        copy.release()


def _copy_to_host(imported: ImportedArray | ImportedStream, decoded: Any) -> tuple[Any, list[int]]:
    """The device regions ``decoded`` uses, copied to one host buffer: a new decode of the message
    whose owner holds that buffer, and the regions' bases in it (the caller has ``decoded``
    borrowed)."""
    from arrow_ipc_bridge import cuda

    sync = imported._sync_event()
    if sync != ffi.NULL:
        cuda.event_synchronize(cuda.event_value(sync))
    bases = imported._bases
    spans: dict[int, tuple[int, int]] = {}
    for code, offset, length in decoded.buffer_refs():
        if code >= SLOT_FIRST_REGION and length:
            lo, hi = spans.get(code - SLOT_FIRST_REGION, (offset, offset + length))
            spans[code - SLOT_FIRST_REGION] = (min(lo, offset), max(hi, offset + length))
    total = sum((hi - lo + 63) // 64 * 64 for lo, hi in spans.values())
    address = ffi.new("void **")
    owner = lib.aib_owner_new_host_buffer(0, max(total, 64), address)
    if owner == ffi.NULL:
        raise MemoryError(f"allocating {total} bytes of host memory")
    try:
        host = int(ffi.cast("uintptr_t", address[0]))
        host_bases = [0] * len(decoded.regions())
        cursor = 0
        for region, (lo, hi) in spans.items():
            cuda.memcpy_dtoh(host + cursor, int(bases[region]) + lo, hi - lo, device=imported.device_id)
            # modulo 2**64: the C rebuild adds the buffer offset back with unsigned wrap-around
            # (offsets of same-process regions are device addresses, larger than `host`)
            host_bases[region] = (host + cursor - lo) % (1 << 64)
            cursor += (hi - lo + 63) // 64 * 64
        # A second decode of the same message gives the host copy its own owner, which keeps the
        # host buffer alive for as long as pyarrow holds what we build from it.
        copy_decoded = decoded.copy()
        copy_decoded.depend_on(owner)
    finally:
        lib.aib_owner_unref(owner)
    return copy_decoded, host_bases


def _to_pyarrow(source: ImportedArray | ImportedStream) -> pa.Array | pa.RecordBatch | pa.Table:
    """A stream becomes a Table; a struct root without top-level nulls a RecordBatch (what record
    batches export as); anything else an Array. ``source`` is host data (the host classes)."""
    if isinstance(source, ImportedStream):
        return pa.table(source)
    schema_capsule, array_capsule = cast(ImportedHostArray, source).__arrow_c_array__()
    root = capsule_struct(array_capsule, "array")
    if source.root_format == "+s" and root.null_count == 0:
        return pa.RecordBatch._import_from_c_capsule(schema_capsule, array_capsule)
    return pa.Array._import_from_c_capsule(schema_capsule, array_capsule)
