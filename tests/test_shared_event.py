"""The event several versions of a publication name (cuda/shared_event.py) and the exporter's
choice to send the current version's message again (exporter._send_again), without a GPU: stand-ins
take the event pool's and the encoder's place."""

from __future__ import annotations

from typing import Any

from arrow_ipc_bridge import exporter
from arrow_ipc_bridge.cuda.shared_event import SharedEvent


class _Event:
    def __init__(self) -> None:
        self.handle = 0x5EED
        self.records: list[object] = []

    def ipc_handle(self) -> bytes:
        return b"h" * 64

    def record(self, stream: object = 0) -> None:
        self.records.append(stream)


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
        self.fds = fds or []


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
