"""The one exception hierarchy of the bridge.

Every exception the bridge raises on purpose derives from :class:`BridgeError` and, where one fits,
from the builtin a caller would already catch (``ValueError`` for bad data, ``TimeoutError`` for
waits, ...). All of them pickle (a consumer may forward an error to another process) and carry a
message that says what failed and what to do about it.
"""

from __future__ import annotations

import difflib
import heapq
from collections.abc import Collection
from typing import Any

__all__ = [
    "BridgeError",
    "BuildMismatchError",
    "UnsupportedFormatError",
    "CapsuleError",
    "ReleasedError",
    "WireFormatError",
    "RegionError",
    "CopyRequiredError",
    "CudaError",
    "TransportError",
    "PeerClosedError",
    "PeerRejectedError",
    "ProtocolError",
    "BridgeTimeoutError",
    "NotPublishedError",
    "ForeignProcessError",
    "PublisherLimitError",
    "ConnectionLimitError",
    "LeaseLimitError",
    "UnreadAnswersError",
    "DescriptorsInFlightError",
    "HandshakeTimeoutError",
    "WaitTimeoutError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "ClosedError",
    "FileLimitError",
]


class BridgeError(Exception):
    """Base of every error the bridge raises on purpose.

    Extra keyword details (``field=...``, ``path=...``, ``code=...``) are kept as attributes and survive
    pickling, so a handler can branch on them without parsing the message.
    """

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        for key, value in details.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), self.message, self.details))

    def __str__(self) -> str:
        return self.message


def _rebuild_error(cls: type[BridgeError], message: str, details: dict[str, Any]) -> BridgeError:
    return cls(message, **details)


class BuildMismatchError(BridgeError, ImportError):
    """The compiled C core does not match the Python package (a stale build).

    Rebuild it with ``pip install .`` (or ``python setup.py build_ext --inplace`` in a checkout).
    """


class UnsupportedFormatError(BridgeError, ValueError):
    """An Arrow format string the bridge does not understand, or a layout that breaks the format's rules."""


class CapsuleError(BridgeError, TypeError):
    """An object is not an Arrow PyCapsule producer, or a capsule has the wrong name."""


class ReleasedError(BridgeError, ValueError):
    """A struct was already released or moved out (a capsule consumed twice, an object used after close)."""


class WireFormatError(BridgeError, ValueError):
    """A metadata message is malformed: truncated, corrupted, over a limit, or inconsistent.

    ``field`` names the offending field and ``path`` the node path (for example
    ``batch0/root/child2/dictionary``).
    """


class RegionError(BridgeError, ValueError):
    """Memory could not be exported or mapped as a shared region."""


class CopyRequiredError(RegionError):
    """The memory cannot be shared zero-copy and the copy policy forbids a copy.

    Pass ``copy="if_needed"`` to let the bridge copy it into a shareable region (counted in the stats).
    """


class CudaError(BridgeError, RuntimeError):
    """A CUDA driver call failed; ``call``, ``code`` and ``name`` say which and why."""


class TransportError(BridgeError, ConnectionError):
    """The socket between publisher and session failed."""


class PeerClosedError(TransportError):
    """The peer closed the connection or died."""


class PeerRejectedError(TransportError, PermissionError):
    """The peer's credentials (SO_PEERCRED uid) are not allowed."""


class ProtocolError(TransportError):
    """The peer sent a frame that breaks the protocol (bad magic, size over a limit, unexpected type)."""


class PublisherLimitError(TransportError):
    """The publisher refused a request or a connection because this client is over one of its
    limits (``Publisher(max_connections=, max_leases_per_connection=, max_unread_fds=)``,
    ``docs/protocol.md``). Other clients are served as before; the subclass says which limit."""


class ConnectionLimitError(PublisherLimitError):
    """The publisher closed this connection at a connection limit: it serves ``max_connections``
    already and none is idle to close for it, or this process or uid holds its cap
    (``max_connections_per_process``, ``max_connections_per_uid``), or this idle connection was
    closed to make room for another client. Close sessions that are not needed, or connect again
    later."""


class LeaseLimitError(PublisherLimitError):
    """This connection holds ``max_leases_per_connection`` leases: the GET was refused (nothing was
    leased) and the session goes on. Release imported objects, then get again."""


class UnreadAnswersError(PublisherLimitError):
    """The GET was refused because this connection has not read answers carrying
    ``max_unread_fds`` descriptors (a client that sends requests without reading the replies);
    the connection goes on. A :class:`~arrow_ipc_bridge.Session` never gets it."""


class WaitLimitError(PublisherLimitError):
    """This connection holds ``max_waits_per_connection`` waits already: the WAIT was refused
    (nothing was held) and the connection goes on. A :class:`~arrow_ipc_bridge.Session` waits for
    one thing at a time and never gets it."""


class DescriptorsInFlightError(PublisherLimitError):
    """The kernel refused to pass the answer's descriptors (``ETOOMANYREFS``: the publisher's user
    has too many descriptors in flight to peers that did not read them). Nothing was leased and the
    session goes on; retry the get."""


class HandshakeTimeoutError(TransportError, TimeoutError):
    """The client did not complete HELLO/WELCOME within the publisher's ``handshake_timeout``; the
    publisher closed the connection."""


class BridgeTimeoutError(BridgeError, TimeoutError):
    """A wait ran past its timeout."""


class WaitTimeoutError(BridgeTimeoutError):
    """A wait for a publisher, a published name or a newer version ran past its timeout. A wait the
    publisher ended (a name or a version) leaves the session's connection usable."""


class ForeignProcessError(BridgeError, RuntimeError):
    """A publisher, session or connection was used in a process other than the one that made it:
    a child of ``fork`` inherits them, but they belong to the parent (using the socket would
    interleave with the parent's frames). Make a new one in this process."""


class InvalidArgumentError(BridgeError, ValueError):
    """An argument of a public function has the right type but a value it does not allow (a
    negative timeout, NaN, an unknown copy policy, an empty name, ...). ``argument`` names it; the
    message says what is allowed. Nothing was done."""

    argument: str


class ArgumentTypeError(BridgeError, TypeError):
    """An argument of a public function has a type it does not take (a bool or a string where a
    number of seconds goes, a non-str name, ...). ``argument`` names it; the message says what is
    allowed. Nothing was done."""

    argument: str


class ClosedError(BridgeError, ValueError):
    """A :class:`~arrow_ipc_bridge.Publisher` or :class:`~arrow_ipc_bridge.Session` was used after
    ``close()``: every method raises it (``close()`` itself stays idempotent); ``what`` says which.
    A ``ValueError`` as for a closed file. Make a new one."""

    what: str


class FileLimitError(BridgeError, OSError):
    """The process (``EMFILE``: ``RLIMIT_NOFILE``) or the system (``ENFILE``) ran out of file
    descriptors while the bridge needed one: a host publication holds one per region (its sealed
    memfd, or its zero-copy file) for as long as it is published or leased. ``soft`` and ``hard``
    are the process's ``RLIMIT_NOFILE``; the message says how to raise it. Nothing was published,
    exported or leaked. An ``OSError`` with ``errno`` set, as the raw failure was."""

    soft: int
    hard: int


class NotPublishedError(BridgeError, KeyError):
    """No object is published under that name (the message lists the first names that are, with
    the closest one when one is close: :func:`not_published_message`)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


# ---------- messages that guide: what exists, and the closest name -----------------------------------
# Names and column names come from another process, and a publisher may hold many: a message shows
# a few of them, each cut short and escaped (repr), and the closest match is looked for among a
# bounded number of short names (difflib compares every pair of characters: quadratic in a name's
# length), so that the work of answering a request for an unknown name has a fixed bound.
NAMES_SHOWN = 5
"""How many names an error message lists (the first ones in sorted order)."""
_NAME_CHARS_SHOWN = 40
_SUGGEST_AMONG = 100
_SUGGEST_MAX_CHARS = 64


def shown_name(name: str) -> str:
    """``name`` for a message: escaped (``repr``: quotes, control characters as escapes) and cut
    to 40 characters, with ``...`` after the quote when cut."""
    if len(name) <= _NAME_CHARS_SHOWN:
        return repr(name)
    return f"{name[:_NAME_CHARS_SHOWN]!r}..."


def names_shown(names: Collection[str]) -> str:
    """The first :data:`NAMES_SHOWN` of ``names`` in sorted order, shown with :func:`shown_name`,
    and how many more there are: ``'a', 'b' and 3 more``."""
    first = heapq.nsmallest(NAMES_SHOWN, names)
    text = ", ".join(shown_name(name) for name in first)
    more = len(names) - len(first)
    return f"{text} and {more} more" if more else text


def closest_name(name: str, names: Collection[str]) -> str | None:
    """The name of ``names`` closest to ``name`` when one is close (``difflib.get_close_matches``),
    looked for among the first 100 in sorted order of those up to 64 characters; None otherwise."""
    if len(name) > _SUGGEST_MAX_CHARS:
        return None
    short = (candidate for candidate in names if len(candidate) <= _SUGGEST_MAX_CHARS)
    candidates = heapq.nsmallest(_SUGGEST_AMONG, short)
    matches = difflib.get_close_matches(name, candidates, n=1)
    return matches[0] if matches else None


def not_published_message(
    name: str, published: Collection[str], streams: Collection[str] = (), *, every: str = "Session.list()"
) -> str:
    """The message of :class:`NotPublishedError` for a get of ``name``: a live stream of that name
    is said to be one (subscribe to it), otherwise the closest published name and the first few
    published. ``every``: the call that lists every name."""
    head = f"nothing is published as {shown_name(name)}"
    if name in streams:
        return f"{head}: it is a live stream; subscribe to it (Session.subscribe) instead of get"
    if not published:
        return f"{head}, and nothing else is published now (get(name, wait=seconds) waits for a publish)"
    close = closest_name(name, published)
    guess = f"; did you mean {shown_name(close)}?" if close is not None else ""
    return f"{head}{guess} (published: {names_shown(published)}; {every} gives every name)"


def no_stream_message(name: str, streams: Collection[str], published: Collection[str] = ()) -> str:
    """The message for a subscription to ``name`` when no live stream of that name is open: a
    publication of that name is said to be one (read it with get), otherwise the closest open
    stream and the first few open."""
    head = f"no stream is open as {shown_name(name)}"
    if name in published:
        return f"{head}: it is a publication, not a live stream; read it with Session.get"
    if not streams:
        return f"{head}, and no live stream is open now (Publisher.open_stream opens one)"
    close = closest_name(name, streams)
    guess = f"; did you mean {shown_name(close)}?" if close is not None else ""
    return f"{head}{guess} (open streams: {names_shown(streams)})"


PUBLISHER_GONE_HINT = (
    "the publisher closed this connection (it stopped, or its process ended): connect again "
    "(arrow_ipc_bridge.connect; wait_for_publisher=True waits for a publisher to come back)"
)
"""What a session's :class:`PeerClosedError` tells the user to do when its publisher went away."""


# ---------- live streams (arrow_ipc_bridge.streams, docs/streams.md) ----------------------------------
class StreamError(BridgeError):
    """Base of the errors of live streams (``Publisher.open_stream`` / ``Session.subscribe``)."""


class StreamFailedError(StreamError):
    """The producer ended the stream with an error (``StreamWriter.fail``, or the source of
    ``publish_stream`` raised). ``producer_error`` names the producer's exception type. Batches the
    consumer already holds stay valid."""

    producer_error: str


class StreamInterruptedError(StreamError, PeerClosedError):
    """The publisher went away mid-stream (closed, or its process died) without ending the stream.
    Batches the consumer already holds stay valid; ``received`` counts the batches that came."""

    received: int


class SlowConsumerError(StreamError):
    """This consumer fell ``max_in_flight`` batches behind a stream whose slow-consumer policy is
    ``"error"``: the publisher ended its subscription (other consumers go on)."""


class StreamBlockedError(StreamError, BridgeTimeoutError):
    """A write to a stream with the ``"block"`` policy waited ``block_timeout`` seconds for a slow
    consumer to give credit back; the batch was sent to nobody (retry, or fail the stream)."""


class StreamSchemaError(StreamError, ValueError):
    """A batch written to a stream does not have the stream's schema (set by its first batch), or
    does not fit the reserved memory of a slot; nothing was sent."""


class SubscriptionLimitError(PublisherLimitError, StreamError):
    """The publisher serves ``max_subscriptions`` live-stream subscriptions already (each holds one
    of its threads for its whole life): this SUBSCRIBE was refused and its connection closed.
    Close subscriptions that are not needed, or raise the publisher's limit."""
