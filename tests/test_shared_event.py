"""The event several versions of a publication name (cuda/shared_event.py) and the exporter's
choice to send the current version's message again (exporter._send_again), without a GPU: stand-ins
take the event pool's and the encoder's place."""

from __future__ import annotations

from typing import Any

from arrow_ipc_bridge.cuda.shared_event import SharedEvent
from arrow_ipc_bridge.producer import exporter


class _Event:
    def __init__(self) -> None:
        self.handle = 0x5EED
        self.records: list[object] = []

    def ipc_handle(self) -> bytes:
        return b"h" * 64

    def record(self, stream: object = 0) -> None:
        self.records.append(stream)

    def _record_on_legacy_stream(self, after: int) -> None:  # a wait for ``after``, then record(0)
        self.records.append(0)


class _Pool:
    device = 0

    def __init__(self) -> None:
        self.released: list[_Event] = []

    def release(self, event: _Event) -> None:
        self.released.append(event)


def _shared() -> tuple[SharedEvent, _Pool, _Event]:
    pool, event = _Pool(), _Event()
    return SharedEvent(pool, event), pool, event  # type: ignore[arg-type]


def test_the_event_goes_back_with_the_last_export_naming_it() -> None:
    shared, pool, event = _shared()
    assert shared.take()
    assert shared.take()
    shared.drop()
    shared.drop()
    assert pool.released == []
    shared.drop()
    assert pool.released == [event]
    assert not shared.take()  # gone: no later version may name it
    assert pool.released == [event]


class _Previous:
    def __init__(self, shared: SharedEvent | None, message: bytes, fds: list[int] | None = None) -> None:
        self._shared_event = shared
        self.message = message
        self._fds = fds or []  # what exporter._send_again reads (Exported.fds raises after close)


def _again(previous: Any, encoded: bytes, device: int = 0) -> Any:
    return exporter._send_again(previous, device, lambda sync: encoded + sync, 0)


def test_the_same_message_is_sent_again_only_when_it_names_the_same_things() -> None:
    shared, pool, event = _shared()
    message = b"m" + shared.handle
    again = _again(_Previous(shared, message), b"m")
    assert again == (shared, message)
    assert event.records == [0]  # re-recorded (on the legacy default stream) for the new version
    for previous, encoded, device in (
        (_Previous(shared, message), b"other regions", 0),
        (_Previous(shared, message), b"m", 1),  # another device
        (_Previous(shared, message, fds=[3]), b"m", 0),  # descriptors are per message
        (_Previous(None, message), b"m", 0),  # a message of no shared event
        (None, b"m", 0),  # the first version
    ):
        assert _again(previous, encoded, device) is None
    assert event.records == [0]
    shared.drop()  # the new version's reference
    shared.drop()  # the first's
    assert pool.released == [event]
    assert _again(_Previous(shared, message), b"m") is None  # returned to the pool: never again


def test_the_c_record_pushes_only_when_needed_and_pops_after_a_failure() -> None:
    """aib_cuda_record_after over stand-in driver functions: with the context current, a wait (when
    asked) and a record, nothing pushed; with another current, pushed and popped around them; a
    failing wait or record still pops, and the answer names the failing call and its CUresult."""
    from arrow_ipc_bridge._ffi import ffi, lib
    from arrow_ipc_bridge.cuda import _driver

    calls: list[tuple[str, int]] = []
    current = [0xC0]
    failing: dict[str, int] = {}

    @ffi.callback("int(uintptr_t *)")
    def get_current(out: Any) -> int:
        out[0] = current[-1]
        return 0

    @ffi.callback("int(uintptr_t)")
    def push(ctx: int) -> int:
        calls.append(("push", ctx))
        current.append(ctx)
        return 0

    @ffi.callback("int(uintptr_t *)")
    def pop(out: Any) -> int:
        calls.append(("pop", current[-1]))
        out[0] = current.pop()
        return 0

    @ffi.callback("int(uintptr_t, uintptr_t, unsigned int)")
    def wait(stream: int, event: int, flags: int) -> int:
        calls.append(("wait", event))
        return failing.get("wait", 0)

    @ffi.callback("int(uintptr_t, uintptr_t)")
    def record(event: int, stream: int) -> int:
        calls.append(("record", event))
        return failing.get("record", 0)

    def address(function: Any) -> int:
        return int(ffi.cast("uintptr_t", function))

    real = _driver._DRIVER.lib
    lib.aib_cuda_set_driver(ffi.new("aib_cuda_driver *"))
    try:
        assert lib.aib_cuda_record_after(0xC0, 0, 0xE0) == 3  # no driver: CUDA_ERROR_NOT_INITIALIZED
        table = {"ctx_get_current": get_current, "ctx_push_current": push, "ctx_pop_current": pop}
        table |= {"stream_wait_event": wait, "event_record": record}
        lib.aib_cuda_set_driver(ffi.new("aib_cuda_driver *", {k: address(f) for k, f in table.items()}))
        assert lib.aib_cuda_record_after(0xC0, 0, 0xE0) == 0
        assert lib.aib_cuda_record_after(0xC0, 0xAF, 0xE0) == 0
        assert calls == [("record", 0xE0), ("wait", 0xAF), ("record", 0xE0)]
        calls.clear()
        current[:] = [0]  # no context current on this thread
        assert lib.aib_cuda_record_after(0xC0, 0xAF, 0xE0) == 0
        assert calls == [("push", 0xC0), ("wait", 0xAF), ("record", 0xE0), ("pop", 0xC0)]
        assert current == [0]
        for call, code in (
            ("wait", lib.AIB_CUDA_RECORD_CALL_WAIT),
            ("record", lib.AIB_CUDA_RECORD_CALL_RECORD),
        ):
            calls.clear()
            failing.clear()
            failing[call] = 400  # CUDA_ERROR_INVALID_HANDLE
            assert lib.aib_cuda_record_after(0xC0, 0xAF, 0xE0) == (code << 16) | 400
            assert calls[-1] == ("pop", 0xC0)
            assert current == [0]
            assert ("record", 0xE0) in calls if call == "record" else ("record", 0xE0) not in calls
    finally:  # the driver's own functions (or none) back
        restore = _driver.core_driver_table(real, _driver._DRIVER.ffi) if real is not None else None
        lib.aib_cuda_set_driver(restore if restore is not None else ffi.new("aib_cuda_driver *"))
