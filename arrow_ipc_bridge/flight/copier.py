"""The device side of staging: host memory the GPU copies into fast, and ordered asynchronous copies.

Staging (``staging.py``) reaches the device only through a :class:`Copier`. :class:`CudaCopier` is
the real one: pinned host memory (``cuMemHostAlloc``) and ``cuMemcpyDtoHAsync`` copies on a
non-blocking stream of the front's own, ordered after the producer's event. The tests give a host
copier so that the staging runs, and is checked, without a GPU.
"""

from __future__ import annotations

from typing import Protocol

from arrow_ipc_bridge._ffi import ffi
from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream

__all__ = ["Copier", "CudaCopier"]


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
