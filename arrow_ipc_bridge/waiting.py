"""The session's side of waiting (feature ``"watch"``, docs/protocol.md "Waiting and versions").

A session waits for a name to be published, or for a version of it newer than one it has seen, with
one WAIT frame that the publisher holds open until it can answer: with a VERSIONED_ITEM (the newest
version, leased like a GET's ITEM) or with ERROR (:class:`~arrow_ipc_bridge.errors.WaitTimeoutError`
when the wait's time ran out, the connection staying usable;
:class:`~arrow_ipc_bridge.errors.PeerClosedError` when the publisher closes). Nothing polls: the
session sends one frame and reads one answer.

The session's request lock is held for the whole wait (requests are answered in order, one at a
time), the channel's send lock only while the WAIT goes out, so the lease releases of objects
dropped meanwhile still reach the publisher. The session allows the publisher ``grace`` seconds (its
request timeout) past the wait's own timeout to answer; a publisher silent longer is taken for
stuck: the connection is closed (a late answer would be misread) and
:class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` raised.
"""

from __future__ import annotations

import threading
import time

from arrow_ipc_bridge import _arguments, protocol
from arrow_ipc_bridge.channel import Channel, Frame
from arrow_ipc_bridge.errors import BridgeError, BridgeTimeoutError, ProtocolError
from arrow_ipc_bridge.process_stats import wait_counters

__all__ = ["MAX_WAIT", "Versioned", "check_after", "check_wait", "wait_for_version"]

MAX_WAIT = (protocol.WAIT_FOREVER - 1) / 1000
"""The longest finite wait, in seconds (~49.7 days: the WAIT frame's u32 milliseconds); ``None``
waits without a limit."""
_U64_MAX = (1 << 64) - 1


def check_wait(seconds: object, what: str) -> float | None:
    """``seconds`` as a wait's timeout: a number in [0, MAX_WAIT] or None (no limit); ``ValueError``
    / ``TypeError`` for anything else (negative, NaN, infinite, a bool, not a number)."""
    return _arguments.optional_seconds(seconds, what, maximum=MAX_WAIT)


def check_after(after: object) -> int:
    """``after`` as a version to wait past: an int in [0, 2**64 - 1] (0: any version)."""
    return _arguments.count(after, "after", least=0, most=_U64_MAX)


class Versioned:
    """What a wait's answer carried: the lease, the version and the message (``frame`` holds its fds)."""

    __slots__ = ("frame", "lease_id", "message", "version")

    def __init__(self, lease_id: int, version: int, message: bytes, frame: Frame) -> None:
        self.lease_id = lease_id
        self.version = version
        self.message = message
        self.frame = frame


def wait_for_version(
    channel: Channel,
    request_lock: threading.Lock,
    raw_name: bytes,
    *,
    after: int,
    timeout: float | None,
    grace: float | None,
) -> Versioned:
    """Send WAIT and read its answer; raises what the publisher answered instead of a version."""
    timeout_ms = protocol.WAIT_FOREVER if timeout is None else int(timeout * 1000 + 0.999)
    payload = protocol.encode_wait(after, timeout_ms, raw_name)
    with request_lock:
        channel.send(protocol.WAIT, payload, timeout=grace)
        next(wait_counters.waits_sent)
        read_for = None if timeout is None or grace is None else timeout + grace
        try:
            frame = _read_answer(channel, read_for)
        except BridgeTimeoutError as exc:
            channel.close()  # the publisher may still answer: that answer must not be misread
            raise BridgeTimeoutError(
                f"the publisher did not answer a wait of {timeout} s within {grace} s more "
                "(connection closed)",
                timeout=read_for,
            ) from exc
        except BaseException:
            channel.close()  # interrupted (KeyboardInterrupt): the held wait's answer would be misread
            raise
    if frame.kind == protocol.ERROR:
        frame.close_fds()
        protocol.raise_error(frame.payload)
    try:
        if frame.kind != protocol.VERSIONED_ITEM:
            raise ProtocolError(f"expected VERSIONED_ITEM answering WAIT, got frame kind {frame.kind}")
        lease_id, version, message = protocol.decode_versioned_item(frame.payload)
        if version <= after:
            raise ProtocolError(f"WAIT after version {after} answered with version {version}")
    except BridgeError:
        frame.close_fds()
        channel.close()  # out of step with the publisher
        raise
    return Versioned(lease_id, version, message, frame)


def _read_answer(channel: Channel, timeout: float | None) -> Frame:
    """The answer, read in slices of at most :data:`_SLICE` seconds: the C receive does not return
    for signals, and a wait may be long, so Python gets a chance to run its signal handlers (Ctrl-C)
    between slices. A slice that ends before the answer's first byte leaves the channel in step."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = _SLICE if deadline is None else min(_SLICE, max(deadline - time.monotonic(), 0.0))
        try:
            return channel.recv(timeout=left)
        except BridgeTimeoutError:
            if channel.closed or (deadline is not None and time.monotonic() >= deadline):
                raise


_SLICE = 1.0
