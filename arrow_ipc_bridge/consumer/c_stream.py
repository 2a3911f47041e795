"""A live stream as an Arrow C stream (``ArrowArrayStream`` / ``ArrowDeviceArrayStream``) whose
``get_next`` waits for the next batch (docs/streams.md, "The C stream").

The stream's callbacks are Python functions behind cffi callbacks: each ``get_next`` is one
``LiveStream.next_batch`` and one struct rebuilt by the C core from the batch's import (the struct
holds the batch's lease until its consumer releases it). The end of the stream is the end of the
C stream; any error (producer failure, publisher gone, timeout) makes ``get_next`` return ``EIO``
and ``get_last_error`` return the error's type and message. Callbacks run with the GIL, on the
consumer's thread, and never let an exception escape into C.
"""

from __future__ import annotations

import errno
import threading
from typing import TYPE_CHECKING, Any, Protocol

from arrow_ipc_bridge._ffi import ffi, lib, new_error
from arrow_ipc_bridge.wire.capsules import new_capsule

if TYPE_CHECKING:
    from arrow_ipc_bridge.consumer.imported import ImportedArray

__all__ = ["stream_capsule"]


class BatchSource(Protocol):
    """What a C stream reads from (a ``LiveStream``; named by what it does, so this module needs
    nothing above it)."""

    def next_batch(self) -> ImportedArray | None: ...


# Streams handed out and not released yet: the callbacks (and what they use) must outlive any C
# caller; release drops the entry.
_live_streams: dict[int, _CStream] = {}
_lock = threading.Lock()


class _CStream:
    """What one C stream's callbacks work with."""

    def __init__(self, live: BatchSource, first: ImportedArray, *, device: bool) -> None:
        self.live = live
        self.device = device
        self.first: ImportedArray | None = first  # peeked for the schema; handed out first
        self.schema = lib.aib_schema_alloc()
        if self.schema == ffi.NULL:
            raise MemoryError("allocating a stream's schema")
        first._fill_schema(self.schema)
        self.error = ffi.new("char[]", 1)
        self.ended = False
        kind = "struct ArrowDeviceArrayStream *" if device else "struct ArrowArrayStream *"
        out = "struct ArrowDeviceArray *" if device else "struct ArrowArray *"
        self.get_schema_cb = ffi.callback(f"int({kind}, struct ArrowSchema *)", self.get_schema)
        self.get_next_cb = ffi.callback(f"int({kind}, {out})", self.get_next)
        self.get_last_error_cb = ffi.callback(f"const char *({kind})", self.get_last_error)
        self.release_cb = ffi.callback(f"void({kind})", self.release)

    def _failed(self, exc: BaseException) -> int:
        text = f"{type(exc).__name__}: {exc}"
        self.error = ffi.new("char[]", text.encode("utf-8", "replace"))
        return errno.EIO

    def get_schema(self, _stream: Any, out: Any) -> int:
        try:
            err = new_error()
            if lib.aib_schema_copy(self.schema, out, err):
                raise MemoryError("copying the stream's schema")
            return 0
        except BaseException as exc:
            return self._failed(exc)

    def get_next(self, _stream: Any, out: Any) -> int:
        try:
            batch = self.first
            self.first = None
            if batch is None and not self.ended:
                batch = self.live.next_batch()
            if batch is None:  # the end: a released struct
                self.ended = True
                (out.array if self.device else out).release = ffi.NULL
                return 0
            with batch:  # the struct holds the lease from here on
                if self.device:
                    schema = lib.aib_schema_alloc()
                    try:
                        batch._fill_device_array(schema, out)
                    finally:
                        lib.aib_schema_free(schema)
                else:
                    batch._fill_batch(0, out)
            return 0
        except BaseException as exc:
            return self._failed(exc)

    def get_last_error(self, _stream: Any) -> Any:
        return self.error if self.error[0] != b"\0" else ffi.NULL

    def release(self, stream: Any) -> None:
        stream.release = ffi.NULL
        with _lock:
            _live_streams.pop(int(ffi.cast("uintptr_t", stream.private_data)), None)
        lib.aib_schema_free(self.schema)
        self.schema = ffi.NULL
        if self.first is not None:
            self.first.release()
            self.first = None


def stream_capsule(live: BatchSource, first: ImportedArray, *, device: bool) -> object:
    """A capsule holding a C stream over ``live`` (``first``: its next batch, already received)."""
    state = _CStream(live, first, device=device)
    capsule, stream = new_capsule("device_stream" if device else "stream")
    with _lock:
        key = id(state)
        _live_streams[key] = state
    stream.private_data = ffi.cast("void *", key)
    stream.get_schema = state.get_schema_cb
    stream.get_next = state.get_next_cb
    stream.get_last_error = state.get_last_error_cb
    if device:
        stream.device_type = first.device_type
    stream.release = state.release_cb  # last: from here on the capsule releases it
    return capsule
