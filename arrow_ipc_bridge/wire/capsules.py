"""PyCapsules in and out: capture any Arrow producer, serve owned data back through the protocol.

Capture moves the producer's C structs into an owner record of the C core (no data is copied); the
record keeps the producer's buffers alive until every struct handed out from it is released.
:class:`ArrowExporter` and its one-method mixins are the protocol surface of everything the bridge
hands to consumers (captured data here, imported data in ``consumer/imported.py``): each protocol call builds
fresh structs that share the same memory, so one object can feed pyarrow, then polars, then
nanoarrow.

Every capsule is made, read and destroyed by the core (``cffi_build/py_capsules.c``), through the
builtin functions it installs on ``arrow_ipc_bridge._ffi``; this module names the kinds and turns
addresses into typed cdata.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, cast, runtime_checkable

from arrow_ipc_bridge import _ffi
from arrow_ipc_bridge._ffi import ffi, lib, new_error, raise_for
from arrow_ipc_bridge.errors import BridgeError, ClosedError, InvalidArgumentError
from arrow_ipc_bridge.runtime.deferred_close import DeferredClose

if TYPE_CHECKING:
    from typing_extensions import CapsuleType

__all__ = [
    "ArrowArrayExportable",
    "ArrowDeviceArrayExportable",
    "ArrowStreamExportable",
    "ArrowDeviceStreamExportable",
    "ArrowInput",
    "ArrowExporter",
    "DeviceStreamExporter",
    "TableExporter",
    "HostStreamExporter",
    "DeviceArrayExporter",
    "ArrowArrayExporter",
    "CapturedData",
    "CapturedArray",
    "CapturedStream",
    "export_captured",
    "capture",
    "DEVICE_CPU",
    "DEVICE_CUDA",
    "array_capsules",
    "device_array_capsules",
    "owner_address",
]

DEVICE_CPU = int(lib.ARROW_DEVICE_CPU)
DEVICE_CUDA = int(lib.ARROW_DEVICE_CUDA)
# Device types whose memory this process can read directly (describe reads offsets there).
HOST_READABLE_DEVICES = frozenset({DEVICE_CPU, int(lib.ARROW_DEVICE_CUDA_HOST)})


@runtime_checkable
class ArrowArrayExportable(Protocol):
    """A producer of a host array or record batch (``__arrow_c_array__``: schema and array capsules)."""

    def __arrow_c_array__(self, requested_schema: object | None = None) -> tuple[object, object]: ...


@runtime_checkable
class ArrowDeviceArrayExportable(Protocol):
    """A producer of an array on any device (``__arrow_c_device_array__``: schema and device array)."""

    def __arrow_c_device_array__(
        self, requested_schema: object | None = None, **kwargs: object
    ) -> tuple[object, object]: ...


@runtime_checkable
class ArrowStreamExportable(Protocol):
    """A producer of a host stream of batches (``__arrow_c_stream__``: a stream capsule)."""

    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object: ...


@runtime_checkable
class ArrowDeviceStreamExportable(Protocol):
    """A producer of a stream of batches on any device (``__arrow_c_device_stream__``)."""

    def __arrow_c_device_stream__(
        self, requested_schema: object | None = None, **kwargs: object
    ) -> object: ...


ArrowInput: TypeAlias = (
    "ArrowDeviceArrayExportable | ArrowArrayExportable | ArrowDeviceStreamExportable | ArrowStreamExportable"
    " | tuple[CapsuleType, CapsuleType] | CapsuleType"
)
"""What :func:`capture` (and so ``export``, ``Publisher.publish``, ``to_device``) accepts: any
producer of the Arrow PyCapsule interface (tried in the order listed), a ``(schema, array)`` or
``(schema, device array)`` capsule pair, or a stream capsule."""


# ---------- capsules of the core -------------------------------------------------------------------
_KINDS = {
    "schema": (int(lib.AIB_CAPSULE_SCHEMA), "struct ArrowSchema *"),
    "array": (int(lib.AIB_CAPSULE_ARRAY), "struct ArrowArray *"),
    "device_array": (int(lib.AIB_CAPSULE_DEVICE_ARRAY), "struct ArrowDeviceArray *"),
    "stream": (int(lib.AIB_CAPSULE_STREAM), "struct ArrowArrayStream *"),
    "device_stream": (int(lib.AIB_CAPSULE_DEVICE_STREAM), "struct ArrowDeviceArrayStream *"),
}
_NAMES = {kind: ffi.string(lib.aib_capsule_name(code)) for kind, (code, _) in _KINDS.items()}
_CAPSULE_ADDRESS = {kind: _ffi.capsule_address[code] for kind, (code, _) in _KINDS.items()}

device_array_capsules = _ffi.device_array_capsules
"""``device_array_capsules(message, owner_address)``: the (schema, device array) capsule pair of batch
0 of ``message`` (a :class:`~arrow_ipc_bridge.wire.metadata.Decoded`), built in one C call from its owner's
view (``aib_owner_set_view``); ``None`` when the owner cannot build it (no view): the caller's
regular path then does the work and reports errors. Raises :class:`ClosedError` when ``message``
is closed — checked in the same call that uses the owner, which holds the GIL throughout, so
another thread's release cannot come in between."""
array_capsules = _ffi.array_capsules
"""``array_capsules(message, owner_address)``: the same with a host ``ArrowArray``."""


def owner_address(owner: Any) -> int:
    """An owner's address, the argument of :data:`device_array_capsules` and :data:`array_capsules`."""
    return int(ffi.cast("uintptr_t", owner))


def new_capsule(kind: str) -> tuple[object, Any]:
    """A capsule owning a fresh zeroed struct of ``kind``, and the struct's cdata pointer.

    The capsule is built before anything is moved into the struct, so an error on the way never
    leaks: the destructor frees the struct and releases it only if it holds data.
    """
    code, ctype = _KINDS[kind]
    capsule, address = _ffi.new_struct_capsule(code)
    return capsule, ffi.cast(ctype, address)


def capsule_struct(capsule: object, kind: str) -> Any:
    """The struct a capsule of ``kind`` holds (borrowed), checking the capsule's name."""
    address = _CAPSULE_ADDRESS[kind](capsule)
    if not address:
        raise InvalidArgumentError(
            f"expected a PyCapsule named {_NAMES[kind].decode()!r}, got {_capsule_name(capsule)}: pass "
            "the object that implements the Arrow PyCapsule interface, or its capsules in the order it "
            "returns them"
        )
    return ffi.cast(_KINDS[kind][1], address)


def _capsule_name(obj: object) -> str:
    if type(obj).__name__ != "PyCapsule":
        return f"a {type(obj).__name__}"
    raw = _ffi.capsule_name(obj)
    return f"a capsule named {raw.decode('utf-8', 'replace') if raw is not None else None!r}"


# ---------- capture ----------------------------------------------------------------------------------
def _check_kwargs(kwargs: dict[str, object]) -> None:
    for key, value in kwargs.items():
        if value is not None:
            raise NotImplementedError(
                f"arrow_ipc_bridge does not support the {key!r} keyword (got {value!r})"
            )


_Borrowed = TypeVar("_Borrowed", bound=DeferredClose)


def call_borrowed(target: _Borrowed, what: str, call: Callable[[_Borrowed, Any], int]) -> None:
    """``call(target, err)``, a C call returning an aib error code, for a ``target`` the caller has
    just borrowed (the call releases the GIL: a close() meanwhile waits for it); unborrows it after
    and raises the error the call reported."""
    try:
        err = new_error()
        rc = call(target, err)
    finally:
        target.unborrow()
    if rc:
        raise_for(rc, err, what)


class CapturedData(DeferredClose):
    """A producer's Arrow data moved into an owner record of the C core: schema plus batches.

    Inert while alive; :meth:`close` (or garbage collection) drops this object's reference, and
    the producer's release callbacks run once nothing shares the data any more.
    """

    def __init__(self, schema: Any, arrays: list[Any], *, is_stream: bool, token: int = 0) -> None:
        array_list = ffi.new("struct ArrowDeviceArray *[]", max(len(arrays), 1))
        for i, a in enumerate(arrays):
            array_list[i] = a
        owner = lib.aib_owner_new_capture(token, schema, array_list, len(arrays))
        if owner == ffi.NULL:
            lib.aib_schema_free(schema)
            for a in arrays:
                lib.aib_device_array_free(a)
            raise MemoryError("allocating a capture record")
        self.owner = owner
        self.schema = schema
        self.arrays = arrays
        self.is_stream = is_stream
        self._finalizer = weakref.finalize(self, lib.aib_owner_unref, owner)

    @classmethod
    def sharing(cls, other: CapturedData) -> CapturedData:
        """Another reference on ``other``'s record (the same structs, no copy, no capsule round):
        the data lives until both are closed. ClosedError when ``other`` is closed."""
        other.borrow()
        try:
            lib.aib_owner_ref(other.owner)
            shared = cls.__new__(cls)
            shared.owner = other.owner
            shared.schema = other.schema
            shared.arrays = other.arrays
            shared.is_stream = other.is_stream
            shared._finalizer = weakref.finalize(shared, lib.aib_owner_unref, other.owner)
        finally:
            other.unborrow()
        return shared

    @property
    def device_type(self) -> int:
        return int(self.arrays[0].device_type) if self.arrays else DEVICE_CPU

    @property
    def device_id(self) -> int:
        return int(self.arrays[0].device_id) if self.arrays else -1

    @property
    def closed(self) -> bool:
        return self._closed or not self._finalizer.alive

    # close() (DeferredClose): drops this record's reference, after the last borrower (a C call
    # with the GIL released) is done; shared structs keep the data alive.
    _closed_message = "this captured data was closed"

    def _close_now(self) -> None:
        self._finalizer()


def _move_schema(capsule: object) -> Any:
    source = capsule_struct(capsule, "schema")
    if source.release == ffi.NULL:
        raise ClosedError("the schema capsule was already consumed or released", reason="released")
    schema = lib.aib_schema_alloc()
    lib.aib_schema_move(source, schema)
    return schema


def _move_device_array(capsule: object, *, host: bool) -> Any:
    target = lib.aib_device_array_alloc()
    if host:
        source = capsule_struct(capsule, "array")
        rc = lib.aib_array_move_to_device(source, target)
    else:
        source = capsule_struct(capsule, "device_array")
        rc = lib.aib_device_array_move(source, target)
    if rc != lib.AIB_OK:
        lib.aib_device_array_free(target)
        raise ClosedError("the array capsule was already consumed or released", reason="released")
    return target


def _drain_stream(capsule: object, *, device: bool) -> tuple[Any, list[Any]]:
    """Move every batch out of a producer stream (eagerly: we publish a snapshot)."""
    kind = "device_stream" if device else "stream"
    source = capsule_struct(capsule, kind)
    if source.release == ffi.NULL:
        raise ClosedError("the stream capsule was already consumed or released", reason="released")
    # Take the stream over first (into a capsule of ours), so it is released exactly once, when
    # `owned` goes away, whatever happens below.
    owned, stream = new_capsule(kind)
    (lib.aib_device_stream_move if device else lib.aib_stream_move)(source, stream)
    schema = lib.aib_schema_alloc()
    arrays: list[Any] = []
    try:
        _stream_call(stream, stream.get_schema(stream, schema), "get_schema")
        while True:
            target = lib.aib_device_array_alloc()
            arrays.append(target)
            if device:
                _stream_call(stream, stream.get_next(stream, target), "get_next")
                if target.array.release == ffi.NULL:
                    break
            else:
                batch = ffi.new("struct ArrowArray *")
                _stream_call(stream, stream.get_next(stream, batch), "get_next")
                if batch.release == ffi.NULL:
                    break
                lib.aib_array_move_to_device(batch, target)
        lib.aib_device_array_free(arrays.pop())  # the end-of-stream marker
    except BaseException:
        lib.aib_schema_free(schema)
        for a in arrays:
            lib.aib_device_array_free(a)
        raise
    finally:
        del owned  # releases the producer's stream
    return schema, arrays


def _stream_call(stream: Any, rc: int, what: str) -> None:
    if rc != 0:
        text = stream.get_last_error(stream)
        detail = ffi.string(text).decode("utf-8", "replace") if text != ffi.NULL else "no message"
        raise BridgeError(f"the producer's stream {what} failed with errno {rc}: {detail}")


def capture(obj: ArrowInput, *, requested_schema: object | None = None) -> CapturedData:
    """Move the Arrow data of ``obj`` into a :class:`CapturedData` without copying buffers.

    Parameters
    ----------
    obj
        Anything with ``__arrow_c_device_array__``, ``__arrow_c_array__``,
        ``__arrow_c_device_stream__`` or ``__arrow_c_stream__`` (tried in that order; the bridge's
        own tables and streams, :class:`TableExporter`, through their device stream first), a
        ``(schema_capsule, array_capsule)`` or ``(schema_capsule, device_array_capsule)`` pair, or a
        stream capsule.
    requested_schema
        Passed on to the producer.

    Examples
    --------
    >>> import pyarrow as pa
    >>> captured = capture(pa.array([1, 2, 3]))
    >>> captured.close()
    """
    # The bridge's own tables keep their kind: an imported device table also offers its one batch as
    # a device array (for consumers that read one batch), which must not make it a record batch here.
    if isinstance(obj, TableExporter):
        schema, arrays = _drain_stream(obj.__arrow_c_device_stream__(requested_schema), device=True)
        return CapturedData(schema, arrays, is_stream=True)
    # hasattr, not isinstance on the runtime-checkable protocols: isinstance against a protocol goes
    # through the ABC machinery and tests every member it declares, where one attribute is the question.
    if hasattr(obj, "__arrow_c_device_array__"):
        device_producer = cast(ArrowDeviceArrayExportable, obj)
        schema_capsule, array_capsule = device_producer.__arrow_c_device_array__(requested_schema)
        return _capture_pair(schema_capsule, array_capsule, host=False)
    if hasattr(obj, "__arrow_c_array__"):
        schema_capsule, array_capsule = cast(ArrowArrayExportable, obj).__arrow_c_array__(requested_schema)
        return _capture_pair(schema_capsule, array_capsule, host=True)
    if hasattr(obj, "__arrow_c_device_stream__"):
        stream = cast(ArrowDeviceStreamExportable, obj).__arrow_c_device_stream__(requested_schema)
        schema, arrays = _drain_stream(stream, device=True)
        return CapturedData(schema, arrays, is_stream=True)
    if hasattr(obj, "__arrow_c_stream__"):
        stream = cast(ArrowStreamExportable, obj).__arrow_c_stream__(requested_schema)
        schema, arrays = _drain_stream(stream, device=False)
        return CapturedData(schema, arrays, is_stream=True)
    if isinstance(obj, tuple) and len(obj) == 2:
        host = _is_capsule(obj[1]) and _CAPSULE_ADDRESS["array"](obj[1]) != 0
        return _capture_pair(obj[0], obj[1], host=host)
    if _is_capsule(obj):
        for kind, device in (("device_stream", True), ("stream", False)):
            if _CAPSULE_ADDRESS[kind](obj) != 0:
                schema, arrays = _drain_stream(obj, device=device)
                return CapturedData(schema, arrays, is_stream=True)
    raise InvalidArgumentError(
        f"{type(obj).__name__} does not implement the Arrow PyCapsule interface "
        "(__arrow_c_device_array__, __arrow_c_array__, __arrow_c_device_stream__ or __arrow_c_stream__)"
    )


def _is_capsule(obj: object) -> bool:
    return type(obj).__name__ == "PyCapsule"


def _capture_pair(schema_capsule: object, array_capsule: object, *, host: bool) -> CapturedData:
    # Check both capsules before moving anything, so a bad pair leaves the producer's structs alone:
    # their names, and that the schema still holds data (a released one found after the array was
    # moved would release the caller's array with the failed capture).
    schema_source = capsule_struct(schema_capsule, "schema")
    capsule_struct(array_capsule, "array" if host else "device_array")
    if schema_source.release == ffi.NULL:
        raise ClosedError("the schema capsule was already consumed or released", reason="released")
    array = _move_device_array(array_capsule, host=host)
    try:
        schema = _move_schema(schema_capsule)
    except BaseException:
        lib.aib_device_array_free(array)
        raise
    return CapturedData(schema, [array], is_stream=False)


# ---------- serving data out -------------------------------------------------------------------------
# The protocol surface is built from one-method mixins, so that each object offers exactly the
# methods that apply to its data: a consumer probing with hasattr (pyarrow, polars, pylibcudf) must
# not be offered a host method that can only refuse, or it takes that method and fails instead of
# using the device one. Imported data picks its classes when it is imported (consumer/imported.py); captured
# data, whose device is known only per call, takes the full set and refuses at call time.
class ArrowExporter:
    """The base of every protocol object the bridge hands out: ``__arrow_c_schema__``, the subclass
    hooks and the checks.

    Subclasses provide ``_fill_schema`` and the hooks of the methods they add. The methods come from
    :class:`DeviceStreamExporter` (``__arrow_c_device_stream__``), :class:`HostStreamExporter`
    (``__arrow_c_stream__``), :class:`DeviceArrayExporter` (``__arrow_c_device_array__``) and
    :class:`ArrowArrayExporter` (``__arrow_c_array__``, with the device array and the host stream).
    Streams (tables, several batches) of host data have no array methods, so consumers such as
    polars, which prefer ``__arrow_c_array__`` when it exists, take the stream path for them.
    ``requested_schema`` is checked before any work.
    """

    # -- subclass hooks --
    def _fill_schema(self, out: Any) -> None:
        raise NotImplementedError

    @property
    def device_type(self) -> int:
        raise NotImplementedError

    @property
    def device_id(self) -> int:
        raise NotImplementedError

    def _sync_event(self) -> Any:
        return ffi.NULL

    # -- protocol --
    def __arrow_c_schema__(self) -> object:
        capsule, schema = new_capsule("schema")
        self._fill_schema(schema)
        return capsule

    # -- checks --
    def _require_host(self, method: str) -> None:
        if self.device_type not in HOST_READABLE_DEVICES:
            raise BridgeError(
                f"{method} serves host memory only, and this data lives on device type {self.device_type} "
                f"(id {self.device_id}): use __arrow_c_device_array__/__arrow_c_device_stream__ with a "
                "device-aware consumer (cuDF, CuPy), or copy it to the host first"
            )

    def _check_requested(self, requested_schema: object | None) -> None:
        """Best effort per the PyCapsule interface: we never cast, so a compatible request gets our
        own schema, and a request that cannot describe this data is refused up front."""
        if requested_schema is None:
            return
        requested = capsule_struct(requested_schema, "schema")
        if requested.release == ffi.NULL:
            raise ClosedError("the requested_schema capsule was already released", reason="released")
        own = ffi.new("struct ArrowSchema *")
        self._fill_schema(own)
        try:
            own_struct = ffi.string(own.format) == b"+s"
            requested_struct = ffi.string(requested.format) == b"+s"
            if own_struct != requested_struct or (own_struct and own.n_children != requested.n_children):
                raise BridgeError(
                    f"requested_schema ({ffi.string(requested.format).decode()!r} with "
                    f"{requested.n_children} fields) is incompatible with this data "
                    f"({ffi.string(own.format).decode()!r} with {own.n_children} fields); "
                    "the bridge shares data as it is and does not cast"
                )
        finally:
            own.release(own)


class DeviceStreamExporter(ArrowExporter):
    """Adds ``__arrow_c_device_stream__``: every batch, on whatever device it lives."""

    def _fill_device_stream(self, out: Any) -> None:
        raise NotImplementedError

    def __arrow_c_device_stream__(self, requested_schema: object | None = None, **kwargs: object) -> object:
        _check_kwargs(kwargs)
        self._check_requested(requested_schema)
        capsule, stream = new_capsule("device_stream")
        self._fill_device_stream(stream)
        return capsule


class TableExporter(DeviceStreamExporter):
    """A table or stream (batches in order): :func:`capture` takes its device stream whatever array
    method it also offers, so that it is published as a stream again."""


class HostStreamExporter(ArrowExporter):
    """Adds ``__arrow_c_stream__``: every batch, host data only (refused at call time otherwise)."""

    def _fill_stream(self, out: Any) -> None:
        raise NotImplementedError

    def __arrow_c_stream__(self, requested_schema: object | None = None, **kwargs: object) -> object:
        _check_kwargs(kwargs)
        self._check_requested(requested_schema)
        self._require_host("__arrow_c_stream__")
        capsule, stream = new_capsule("stream")
        self._fill_stream(stream)
        return capsule


class DeviceArrayExporter(ArrowExporter):
    """Adds ``__arrow_c_device_array__``: one batch, on whatever device it lives."""

    def _fill_batch(self, index: int, out: Any) -> None:
        raise NotImplementedError

    def __arrow_c_device_array__(
        self, requested_schema: object | None = None, **kwargs: object
    ) -> tuple[object, object]:
        # The hand-off's hot path (a consumer calls it per get): the checks cost nothing when unused.
        if kwargs:
            _check_kwargs(kwargs)
        if requested_schema is not None:
            self._check_requested(requested_schema)
        return self._device_array_capsules()

    def _device_array_capsules(self) -> tuple[object, object]:
        """The (schema, device array) capsule pair of batch 0 (subclasses may make it in one call)."""
        schema_capsule, schema = new_capsule("schema")
        array_capsule, array = new_capsule("device_array")
        self._fill_device_array(schema, array)
        return schema_capsule, array_capsule

    def _fill_device_array(self, schema: Any, array: Any) -> None:
        """Fill the schema and the device array of batch 0 (subclasses may do it in one call)."""
        self._fill_schema(schema)
        self._fill_batch(0, ffi.addressof(array, "array"))
        array.device_type = self.device_type
        array.device_id = self.device_id
        array.sync_event = self._sync_event()


class ArrowArrayExporter(DeviceArrayExporter, HostStreamExporter):
    """One array or record batch with the host methods: adds ``__arrow_c_array__`` (host data only)
    to the device array and the host stream."""

    def __arrow_c_array__(
        self, requested_schema: object | None = None, **kwargs: object
    ) -> tuple[object, object]:
        _check_kwargs(kwargs)
        self._check_requested(requested_schema)
        self._require_host("__arrow_c_array__")
        return self._array_capsules()

    def _array_capsules(self) -> tuple[object, object]:
        """The (schema, array) capsule pair of batch 0 (subclasses may make it in one call)."""
        schema_capsule, schema = new_capsule("schema")
        array_capsule, array = new_capsule("array")
        self._fill_schema(schema)
        self._fill_batch(0, array)
        return schema_capsule, array_capsule


class _CapturedSource(DeviceStreamExporter, HostStreamExporter):
    """Serves :class:`CapturedData` back out in this process (shares its buffers, no copy)."""

    def __init__(self, captured: CapturedData) -> None:
        self._captured = captured

    def _live(self) -> CapturedData:
        if self._captured.closed:
            raise ClosedError(CapturedData._closed_message, reason="released")
        return self._captured

    # Each C call below releases the GIL: the record is borrowed across it, so that a close() on
    # another thread meanwhile waits for the call instead of freeing what it reads.
    def _borrowed(self) -> CapturedData:
        captured = self._captured
        captured.borrow()  # ClosedError once closed
        return captured

    def _fill_schema(self, out: Any) -> None:
        call_borrowed(
            self._borrowed(), "copying the schema", lambda c, err: lib.aib_schema_copy(c.schema, out, err)
        )

    def _fill_batch(self, index: int, out: Any) -> None:
        call_borrowed(
            self._borrowed(),
            "sharing the array",
            lambda c, err: lib.aib_array_share(ffi.addressof(c.arrays[index], "array"), c.owner, out, err),
        )

    def _fill_device_stream(self, out: Any) -> None:
        call_borrowed(
            self._borrowed(),
            "creating a stream",
            lambda c, err: lib.aib_device_stream_from_capture(c.owner, out, err),
        )

    def _fill_stream(self, out: Any) -> None:
        call_borrowed(
            self._borrowed(),
            "creating a stream",
            lambda c, err: lib.aib_stream_from_capture(c.owner, out, err),
        )

    @property
    def device_type(self) -> int:
        return self._captured.device_type

    @property
    def device_id(self) -> int:
        return self._captured.device_id

    def _sync_event(self) -> Any:
        arrays = self._captured.arrays
        return arrays[0].sync_event if arrays else ffi.NULL


class CapturedArray(_CapturedSource, ArrowArrayExporter):
    """Captured single array or record batch, served back out."""

    #: What :func:`~arrow_ipc_bridge.from_cuda_arrays` read of its columns (device, names, and each
    #: column's pointer, length, type and announced stream), for a publisher to see that a new
    #: version names exactly the memory of the current one; None for other captured data.
    column_signature: tuple[int, tuple[str, ...] | None, bytes] | None = None


class CapturedStream(_CapturedSource, TableExporter):
    """Captured stream (table, chunked array, reader), served back out as a stream."""


def export_captured(captured: CapturedData) -> CapturedArray | CapturedStream:
    """The protocol object for captured data: an array exporter or a stream exporter."""
    return CapturedStream(captured) if captured.is_stream else CapturedArray(captured)
