"""Imported columns as arrays: zero-copy views and arrays for NumPy, CuPy and PyTorch.

- :func:`column_view` shows one numeric column of imported data to array libraries: DLPack
  (``numpy.from_dlpack``, ``cupy.from_dlpack``, ``torch.from_dlpack``; the versioned capsule for
  consumers that ask for it, read-only for host memory) and, for CUDA data,
  ``__cuda_array_interface__``;
- :func:`column_arrays` makes every numeric column of a batch an array of one library in one call.

Both work on any batch of an imported record batch, table or stream (``batch=``), on the host or on
a CUDA device, and never copy: every view and array holds a reference on the imported message, so
the data (and the producer's lease) live until the last of them is gone, whatever happens to the
imported object. The per-column facts (name, type, length, address) come from one C call per batch
(``batch_columns`` in ``cffi_build/py_capsules.c`` over ``cffi_build/columns.c``).
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Sequence
from typing import Any, Literal

from arrow_ipc_bridge import _ffi
from arrow_ipc_bridge._ffi import ffi
from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream, _ImportedBase
from arrow_ipc_bridge.errors import BridgeError, closest_name, names_shown, shown_name
from arrow_ipc_bridge.runtime import arguments
from arrow_ipc_bridge.wire.capsules import DEVICE_CPU, DEVICE_CUDA

__all__ = ["column_view", "column_arrays", "ColumnView"]

# The array-interface typestr of each numeric type, in the order of columns.c's numeric table
# (int8, int16, int32, int64, uint8, ..., uint64, float16, float32, float64).
_TYPESTRS = ("|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8")
# What batch_columns hands back per column (its `form` argument).
_AS_ADDRESSES, _AS_LEGACY_CAPSULES, _AS_DLPACK_COLUMNS = 0, 1, 2
# batch_columns' `select` for no column at all (only the lease and the event are wanted)
_SELECT_NONE = -1
_LIBRARIES = ("numpy", "cupy", "torch")

Imported = ImportedArray | ImportedStream
# (name, numeric type index or -1, length, null count (-1: unknown), address / capsule / column)
_Fact = tuple[str, int, int, int, Any]
# batch_columns gives None for columns a `select` left out
_Facts = tuple[_Fact | None, ...]


class ColumnView:
    """A zero-copy view of one numeric column of imported data, for array libraries.

    Made by :func:`column_view`. Speaks DLPack for host and CUDA data and, for CUDA data,
    ``__cuda_array_interface__`` (v3). ``__dlpack__(*, stream=None, max_version=None,
    dl_device=None, copy=None)`` follows the Python array API standard:

    - ``max_version`` ``(1, 0)`` or higher gives the versioned capsule (``dltensor_versioned``,
      DLPack 1.0), flagged read-only for host memory (the consumer's mappings are read-only);
      ``None`` or a lower version gives the legacy ``dltensor`` capsule;
    - ``dl_device`` other than where the data is, and ``copy=True``, raise ``BufferError``: the
      bridge never copies;
    - for CUDA data, ``stream`` (``None``: the legacy default stream; ``-1``: none) waits for the
      producer's writes while they are pending; host data ignores it.

    Both DLPack methods are one C call each (the column's facts are kept in C). Every capsule holds
    a reference on the imported message, so the data (and the lease) live as long as the view or
    anything built from it.
    """

    __dlpack__: Callable[..., object]
    __dlpack_device__: Callable[[], tuple[int, int]]

    def __init__(self, column: Any, name: str, length: int, typestr: str, device_type: int) -> None:
        # The C object's bound methods, so a consumer's call costs that call and nothing else.
        self._column = column
        self.__dlpack__ = column.__dlpack__
        self.__dlpack_device__ = column.__dlpack_device__
        self.name = name
        self.shape = (length,)
        self.typestr = typestr
        if device_type == DEVICE_CUDA:
            self.__cuda_array_interface__ = {
                "shape": (length,),
                "typestr": typestr,
                "data": (column.address, True),
                "version": 3,
                "strides": None,
                "stream": None,  # ordering was settled by column_view (event wait or host sync)
            }

    def __repr__(self) -> str:
        device = self.__dlpack_device__()
        return f"<ColumnView {self.name!r} {self.typestr} shape={self.shape} dlpack_device={device}>"


def column_view(
    imported: Imported, column: int | str = 0, *, batch: int = 0, stream: int | None = None
) -> ColumnView:
    """A zero-copy view of a numeric column (int8..uint64, float16/32/64, no nulls) of imported data.

    Parameters
    ----------
    imported
        An imported record batch (or a numeric array: ``column=0``), table or stream, in host memory
        or on a CUDA device.
    column
        Index or field name.
    batch
        Which batch of a table or stream (0 for a record batch or array).
    stream
        CUDA data only: a stream (``cupy.cuda.Stream.ptr``, ``torch.cuda.Stream.cuda_stream``) that
        should wait for the producer's writes before anything it runs reads the view; without one,
        this call waits on the host until they are done.

    Raises
    ------
    ClosedError
        ``imported`` was released.
    BridgeError
        No such column or batch, or a column a plain array cannot show (not a number, nulls).

    Examples
    --------
    >>> import numpy as np
    >>> values = np.from_dlpack(aib.column_view(imported, "x"))  # doctest: +SKIP
    >>> gpu = cupy.asarray(aib.column_view(imported_gpu, "x", stream=s.ptr))  # doctest: +SKIP
    """
    _check_imported(imported)
    if type(column) is not str:
        column = arguments.count(column, "column", least=0)  # an index (a name is any str)
    batch = arguments.count(batch, "batch", least=0)
    stream = arguments.stream_handle(stream)
    device_id = imported.device_id
    waiter = _stream_waiter(device_id) if imported.device_type == DEVICE_CUDA else None
    _lease, event, facts, is_record_batch = _read_batch(imported, batch, _AS_DLPACK_COLUMNS, column, waiter)
    if not is_record_batch and column not in (0, None):
        raise BridgeError("a plain array has one column: 0")
    # The C call gave the selected column only (the others are None).
    fact = next((f for f in facts if f is not None), None)
    if fact is None:
        if isinstance(column, str):
            # The C call gave the selected column's facts only: ask again for every column's name.
            _, _, every, _ = _read_batch(imported, batch, _AS_ADDRESSES, None, None)
            raise BridgeError(_no_column_message(column, every))
        raise BridgeError(f"no column {column!r} (the batch has {len(facts)})")
    name, numeric, length, null_count, dlpack_column = fact
    _check_plain(name, numeric, null_count)
    if event:
        from arrow_ipc_bridge import cuda

        if stream is None:
            cuda.event_synchronize(event)
        else:
            cuda.stream_wait_event(stream, event, device=device_id)
    return ColumnView(dlpack_column, name, length, _TYPESTRS[numeric], imported.device_type)


def column_arrays(
    imported: Imported,
    like: Literal["numpy", "cupy", "torch"] | Any,
    *,
    batch: int = 0,
    names: Sequence[str] | None = None,
    stream: int | None = None,
) -> dict[str, Any]:
    """Every numeric column of a batch as an array of one library, in one call, without copying.

    Returns ``{name: 1-D array}`` in column order: NumPy arrays (read-only: the imported host
    memory is mapped read-only), CuPy arrays or PyTorch tensors over the imported memory. Each array
    holds the batch alive on its own: the imported object may be released and the arrays stay
    valid; the lease ends when the last of them (and everything else built from the import) is gone.
    On a session that keeps standing leases (any but one with ``pool_linger=0``) a re-get's call
    may return the same CuPy array objects as an earlier call for the same remembered message, when
    nothing holds them any more (``docs/lifetime.md``, "Kept CuPy arrays"); arrays still held are
    never handed out twice.

    Parameters
    ----------
    imported
        An imported record batch, table or stream.
    like
        ``"numpy"`` (host data), ``"cupy"`` (CUDA data) or ``"torch"`` (CUDA data), or the module
        itself. PyTorch tensors cannot be read-only, so host data is refused for ``"torch"``: take
        NumPy arrays (``torch.from_numpy`` then warns that they are read-only) or ``to_host()``.
    batch
        Which batch of a table or stream (0 for a record batch).
    names
        The columns to take, in this order; each must be numeric without nulls. Default: every
        column of a numeric type (int8..uint64, float16/32/64), in order; other types (strings,
        lists, dictionary-encoded columns) are left out, and a numeric column with nulls raises.
    stream
        CUDA data only: the stream that waits for the producer's writes (``cuStreamWaitEvent``)
        while they are pending; default: the library's current stream on the data's device. The
        wait is made once for the batch and the host never blocks, so work on another stream must
        be ordered after that one by the caller.

    Raises
    ------
    ClosedError
        ``imported`` was released.
    BridgeError
        No such batch or column, a column with nulls, duplicate column names, data on a device the
        library cannot hold (``"numpy"`` and CUDA data, ``"cupy"``/``"torch"`` and host data), or a
        plain array (use :func:`column_view`).

    Examples
    --------
    >>> arrays = aib.column_arrays(imported, "cupy")  # doctest: +SKIP
    >>> arrays["x"].sum()                              # doctest: +SKIP
    """
    _check_imported(imported)
    library = _library_name(like)
    batch = arguments.count(batch, "batch", least=0)
    stream = arguments.stream_handle(stream)
    if names is not None:
        if isinstance(names, str) or not isinstance(names, Sequence):
            arguments.fail_type("names", "a sequence of column names (str), not one string, or None", names)
        for column_name in names:
            if not isinstance(column_name, str):
                arguments.fail_type("names", "a sequence of column names (str)", column_name)
    device_type = imported.device_type
    if library == "numpy" and device_type != DEVICE_CPU:
        raise BridgeError(
            "NumPy arrays need host data and this is on a CUDA device: use like='cupy' or 'torch', "
            "or copy it with to_host()"
        )
    if library != "numpy" and device_type != DEVICE_CUDA:
        why = "PyTorch has no read-only tensors; use like='numpy', or a copy (to_host())"
        raise BridgeError(
            f"like={library!r} needs CUDA data and this is in host memory (read-only mappings): "
            + (why if library == "torch" else "use like='numpy'")
        )
    device_id = imported.device_id
    # A standing-lease session's re-get: the CuPy arrays made for this message before may be handed
    # out again (consumer/array_cache.py); their facts are known, so C reads only the lease and the event.
    kept = imported._kept_arrays if library == "cupy" else None
    name = imported.name
    if kept is not None and name is not None:
        cache, message = kept
        key = (name, batch, None if names is None else tuple(names))
        known = cache.facts_of(key, message)
        if known is not None:
            lease, event, _, _ = _read_batch(imported, batch, _AS_ADDRESSES, _SELECT_NONE, None)
            if event:
                _wait_once(library, event, device_id, stream)
            return cache.hand_out(key, message, known, lease, device=device_id, build=_cupy_parts)
    else:
        kept = None
    form = {"numpy": _AS_DLPACK_COLUMNS, "cupy": _AS_ADDRESSES, "torch": _AS_LEGACY_CAPSULES}[library]
    lease, event, facts, is_record_batch = _read_batch(imported, batch, form, None, None)
    if not is_record_batch:
        raise BridgeError("column_arrays takes record batches; a plain array is one column: use column_view")
    chosen = _choose(facts, names)
    if event:
        _wait_once(library, event, device_id, stream)
    if kept is not None:
        return cache.hand_out(key, message, chosen, lease, device=device_id, build=_cupy_parts)
    if library == "cupy":
        arrays, _, _ = _cupy_parts(chosen, lease, device_id)
        return dict(zip((fact[0] for fact in chosen), arrays, strict=True))
    if library == "torch":
        torch = importlib.import_module("torch")  # optional, and untyped here
        return {name: torch.from_dlpack(capsule) for name, _, _, _, capsule in chosen}
    import numpy

    return {name: numpy.from_dlpack(column) for name, _, _, _, column in chosen}


# ---------- helpers ---------------------------------------------------------------------------------
def _check_imported(imported: object) -> None:
    # Any imported object (arrays, tables, streams, and their subclasses): the facts come from what
    # they all hold, the decoded message and the regions' bases.
    if not isinstance(imported, _ImportedBase):
        arguments.fail_type(
            "imported", "data imported by the bridge (ImportedArray or ImportedStream)", imported
        )
    if imported.device_type not in (DEVICE_CPU, DEVICE_CUDA):
        raise BridgeError(f"column views support host and CUDA data, not device type {imported.device_type}")


def _read_batch(
    imported: Imported,
    batch: int,
    form: int,
    select: int | str | None,
    waiter: Callable[[int, int], None] | None,
) -> tuple[object, int, _Facts, bool]:
    """One C call: (lease, the producer's event if pending else 0, the batch's columns, whether the
    root is a record batch); ``select`` (an index, a name, None: all) says which columns get their
    capsule or DLPack column (the others are None). ClosedError when ``imported`` was released;
    BridgeError when the columns cannot be read."""
    decoded = imported._borrow()  # the owner lives through the call, whichever thread releases
    try:
        result = _ffi.batch_columns(
            int(ffi.cast("uintptr_t", decoded.owner)),
            int(ffi.cast("uintptr_t", imported._bases)),
            imported._n_bases,
            imported.device_type,
            imported.device_id,
            int(ffi.cast("uintptr_t", imported._sync)),
            batch,
            form,
            select,
            waiter,
        )
    finally:
        decoded.unborrow()
    if isinstance(result, str):
        raise BridgeError(result)
    return result


def _check_plain(name: str, numeric: int, null_count: int, facts: _Facts | None = None) -> None:
    """Refuse a column a plain array cannot show, saying what to do instead; ``facts``: the batch's
    columns when the caller chose them all (column_arrays), to name those it can take."""
    if numeric < 0:
        raise BridgeError(f"column {shown_name(name)} has no plain-array equivalent (numbers only)")
    if null_count != 0:
        leave_out = ""
        if facts is not None:
            plain = [f[0] for f in facts if f is not None and f[1] >= 0 and f[3] == 0]
            without = names_shown(plain) if plain else "none"
            leave_out = f"pass names= without it (numeric columns without nulls: {without}), "
        raise BridgeError(
            f"column {shown_name(name)} has nulls (or an unknown null count), which a plain array "
            f"cannot show: {leave_out}fill the nulls before publishing (pyarrow.compute.fill_null), "
            "or read the column through Arrow (pa.table(imported); to_host() for device data)"
        )


def _no_column_message(name: str, facts: _Facts) -> str:
    names = [fact[0] for fact in facts if fact is not None]
    close = closest_name(name, names)
    guess = f"; did you mean {shown_name(close)}?" if close is not None else ""
    return f"no column named {shown_name(name)}{guess} (columns: {names_shown(names) or 'none'})"


def _choose(facts: _Facts, names: Sequence[str] | None) -> list[_Fact]:
    """The columns to make arrays of: the numeric ones, or ``names`` in their order."""
    if names is None:
        chosen = [fact for fact in facts if fact is not None and fact[1] >= 0]
        # The common case in few passes (this runs per batch): numbers without nulls, names unique.
        if all(fact[3] == 0 for fact in chosen) and len({fact[0] for fact in chosen}) == len(chosen):
            return chosen
    every = [fact for fact in facts if fact is not None]  # all of them: nothing was selected
    if names is None:
        chosen = [fact for fact in every if fact[1] >= 0]
    else:
        by_name = {fact[0]: fact for fact in every}
        missing = [name for name in names if name not in by_name]
        if missing:
            raise BridgeError(_no_column_message(missing[0], facts))
        chosen = [by_name[name] for name in names]
    seen: set[str] = set()
    for name, numeric, _, null_count, _ in chosen:
        _check_plain(name, numeric, null_count, facts if names is None else None)
        if name in seen:
            raise BridgeError(f"two columns are named {name!r}: pick them with column_view by index")
        seen.add(name)
    return chosen


def _library_name(like: object) -> str:
    allowed = f"one of {', '.join(map(repr, _LIBRARIES))} (or the module)"
    if isinstance(like, str):
        name = like
    elif isinstance(like, types.ModuleType):
        name = like.__name__
    else:
        arguments.fail_type("like", allowed, like)
    if name not in _LIBRARIES:
        arguments.fail_value("like", allowed, like)
    return name


_WAITERS: dict[int, Callable[[int, int], None]] = {}


def _stream_waiter(device: int) -> Callable[[int, int], None]:
    """waiter(stream, event): ``stream`` waits for ``event`` (the DLPack columns call it from C while
    the producer's event is pending). One per device, made once."""
    waiter = _WAITERS.get(device)
    if waiter is None:
        from arrow_ipc_bridge import cuda

        def waiter(stream: int, event: int) -> None:
            cuda.stream_wait_event(stream, event, device=device)

        _WAITERS[device] = waiter
    return waiter


def _wait_once(library: str, event: int, device: int, stream: int | None) -> None:
    """The batch's one wait for the producer: ``stream``, or the library's current stream, waits."""
    from arrow_ipc_bridge import cuda

    if stream is None:
        if library == "cupy":
            import cupy

            stream = int(cupy.cuda.get_current_stream(device).ptr)
        else:
            torch = importlib.import_module("torch")
            stream = int(torch.cuda.current_stream(device).cuda_stream)
    cuda.stream_wait_event(stream, event, device=device)


_CUPY_DTYPES: list[Any] = []


def _cupy_parts(
    chosen: Sequence[_Fact], owner: object, device: int
) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
    """CuPy arrays over the columns' memory, with their ``MemoryPointer`` and ``UnownedMemory``
    objects (consumer/array_cache.py counts references on all three), each memory owning ``owner`` (a batch
    lease, a reference on the message, or array_cache's holder of one); the device is given, so
    CuPy asks the driver nothing."""
    import cupy

    if not _CUPY_DTYPES:
        _CUPY_DTYPES.extend(cupy.dtype(typestr) for typestr in _TYPESTRS)
    dtypes = _CUPY_DTYPES
    unowned = cupy.cuda.UnownedMemory
    pointer = cupy.cuda.MemoryPointer
    ndarray = cupy.ndarray
    memories = tuple([unowned(f[4], f[2] * dtypes[f[1]].itemsize, owner, device) for f in chosen])
    pointers = tuple([pointer(memory, 0) for memory in memories])
    arrays = tuple([ndarray((f[2],), dtypes[f[1]], p) for f, p in zip(chosen, pointers, strict=True)])
    return arrays, pointers, memories
