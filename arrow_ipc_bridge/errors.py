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
    "InvalidArgumentError",
    "ClosedError",
    "TransportError",
    "PeerClosedError",
    "NotPublishedError",
    "BridgeTimeoutError",
    "LimitError",
    "ProtocolError",
    "UnsupportedFormatError",
    "RegionError",
    "CopyRequiredError",
    "CudaError",
    "StreamError",
    "BuildMismatchError",
]


class BridgeError(Exception):
    """Base of every error the bridge raises on purpose.

    Extra keyword details (``field=...``, ``limit=...``, ``code=...``) are kept as attributes and
    survive pickling, so a handler can branch on them without parsing the message. Each family
    below documents the attributes it always has (a class default stands in where a raise site
    does not know the value).
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


# Families. A caller catches the family it acts on; what used to be a subclass of its own is an
# attribute now (``LimitError.limit``, ``BridgeTimeoutError.waiting_for``, ...), so that there is
# one class per thing to do and the attributes still tell every cause apart.


class InvalidArgumentError(BridgeError, ValueError, TypeError):
    """An argument of a public function has a value or a type it does not take (a negative
    timeout, NaN, an unknown copy policy, an empty name, a bool where seconds go, an object that
    is not an Arrow PyCapsule producer, memory that is not where the call needs it, ...).
    ``argument`` names it (``""`` where no single argument is at fault); the message says what is
    allowed. Nothing was done. Both a ``ValueError`` and a ``TypeError``, as either builtin would
    have been raised by a plain function."""

    argument: str = ""


class ClosedError(BridgeError, ValueError):
    """An object was used when it can no longer be: ``reason`` is ``"closed"`` (a
    :class:`~arrow_ipc_bridge.Publisher`, :class:`~arrow_ipc_bridge.Session`, stream or export
    used after ``close()``; ``close()`` itself stays idempotent), ``"released"`` (imported data or
    a capsule used after its release, a capsule consumed twice) or ``"forked"`` (a publisher,
    session or connection used in a child of ``fork``: it belongs to the parent, and using its
    socket would interleave with the parent's frames). ``what`` says which object where known. A
    ``ValueError`` as for a closed file. Make a new one (get the data again)."""

    what: str = ""
    reason: str = "closed"


class TransportError(BridgeError, ConnectionError):
    """The connection to the peer could not be made or used: nothing listens at the address, the
    socket failed, or the publisher rejected this process (``reason == "rejected"``: its
    ``SO_PEERCRED`` uid is not allowed, or a Flight server refused its credentials). ``reason`` is
    ``None`` for the other causes."""

    reason: str | None = None


class PeerClosedError(TransportError):
    """The peer is gone: the publisher (or the consumer) closed the connection or its process
    ended, also in the middle of a live stream. For a stream, ``stream`` names it and ``received``
    counts the batches that came (``None`` otherwise); batches already received stay valid.
    ``reason`` is ``"client_gone"`` where a Flight server's client went away while its data waited
    for staging memory, ``None`` otherwise.
    Connect again (``wait_for_publisher=True`` waits for a publisher to come back)."""

    stream: str | None = None
    received: int | None = None


class NotPublishedError(BridgeError, KeyError):
    """No object is published under that name, or no live stream is open under it (the message
    lists the first names that are, with the closest one when one is close:
    :func:`not_published_message`)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class BridgeTimeoutError(BridgeError, TimeoutError):
    """A wait ran past its timeout. ``waiting_for`` says what was waited for:

    * ``"publisher"``, ``"name"``, ``"version"``: a wait for a publisher to listen, a name to be
      published, a newer version (a wait the publisher ended leaves the connection usable);
    * ``"handshake"``: the client did not complete HELLO/WELCOME within the publisher's
      ``handshake_timeout`` (the publisher closed the connection);
    * ``"credit"``: a write to a stream with the ``"block"`` policy waited ``block_timeout``
      seconds for a slow consumer to give credit back (the batch was sent to nobody);
    * ``"send"``, ``"receive"``, ``"answer"``: a frame could not be sent or did not come in time;
    * ``"flight"``: a Flight server did not answer in time.

    ``timeout`` is the limit in seconds where known (``None`` otherwise)."""

    waiting_for: str = ""
    timeout: float | None = None


class LimitError(BridgeError, OSError):
    """A limit was reached; ``limit`` says which, ``value`` its number where known (``None``
    otherwise). The publisher's limits (``Publisher(...)`` keywords; its other clients are served
    as before):

    * ``"max_connections"``, ``"max_connections_per_process"``, ``"max_connections_per_uid"``: the
      connection was refused or closed (an idle one is closed to make room for another client);
    * ``"max_leases_per_connection"``: a GET refused, nothing leased; release imports, get again;
    * ``"max_unread_fds"``: a GET refused while answers carrying descriptors were not read;
    * ``"max_waits_per_connection"``: a WAIT refused, nothing held;
    * ``"max_subscriptions"``: a SUBSCRIBE refused and its connection closed.

    And the system's: ``"descriptors_in_flight"`` (``ETOOMANYREFS``: the kernel refused to pass an
    answer's descriptors; nothing was leased, retry), ``"file_descriptors"`` (``EMFILE`` or
    ``ENFILE``: the process or the system ran out of file descriptors; ``errno`` is set, ``soft``
    and ``hard`` are ``RLIMIT_NOFILE``; nothing was published, exported or leaked) and
    ``"staging_bytes"`` (a Flight batch needs more pinned staging memory than the pool may hold).
    An ``OSError``, as the limits of the system are."""

    limit: str = ""
    value: int | None = None


class ProtocolError(BridgeError, ValueError):
    """Bad data from the peer, or in a message handed to :meth:`~arrow_ipc_bridge.Session.import_message`:
    a frame that breaks the protocol (bad magic, a size over a limit, an unexpected type), a
    metadata message that is truncated, corrupted, over a limit or inconsistent (``field`` names
    the offending field and ``path`` the node path, for example ``batch0/root/child2/dictionary``),
    or a region this process cannot map as described (a descriptor that is not a sealed file of
    the right size, a CUDA handle of the wrong size). A connection that received such a frame is
    closed."""

    field: str = ""
    path: str = ""


class UnsupportedFormatError(BridgeError, ValueError):
    """An Arrow format string the bridge does not understand, a layout that breaks the format's
    rules, or data on a device this build cannot import."""


class RegionError(BridgeError, OSError):
    """The operating system refused what sharing memory needs: creating, sealing, mapping or
    copying into a memfd, duplicating a received descriptor, reading ``/proc/self/maps``. The
    message carries the system's reason (often memory or ``/dev/shm`` space)."""


class CopyRequiredError(BridgeError, ValueError):
    """The memory cannot be shared zero-copy and the copy policy forbids a copy.

    Pass ``copy="if_needed"`` to let the bridge copy it into a shareable region (counted in the stats).
    """


class CudaError(BridgeError, RuntimeError):
    """A CUDA driver call failed, or a CUDA requirement is not met; ``call``, ``code`` and ``name``
    say which driver call failed and why (``None`` where no call failed). ``reason`` is
    ``"no_peer_access"`` when GPU ``reader`` cannot read GPU ``owner``'s memory in place (both
    named by ordinal and by UUID in the message and the details ``reader``, ``owner``,
    ``reader_uuid``, ``owner_uuid``; a copy with ``imported.to_device(reader)`` works between any
    two GPUs), ``"not_visible"`` when a GPU a message names is not visible here, and ``None`` for
    a failed call."""

    call: str | None = None
    code: int | None = None
    name: str | None = None
    reason: str | None = None


class StreamError(BridgeError):
    """A live stream (``Publisher.open_stream`` / ``Session.subscribe``) cannot go on. ``reason``:

    * ``"failed"``: the producer ended the stream with an error (``StreamWriter.fail``, or the
      source of ``publish_stream`` raised); ``producer_error`` names the producer's exception type;
    * ``"slow_consumer"``: this consumer fell ``max_in_flight`` batches behind a stream whose
      slow-consumer policy is ``"error"``; the publisher ended its subscription (others go on);
    * ``"schema"``: a batch written to a stream does not have the stream's schema (set by its
      first batch) or does not fit the reserved memory of a slot; nothing was sent;
    * ``"usage"``: a call the stream's state does not allow (the message says which).

    Batches the consumer already holds stay valid. A publisher gone mid-stream is a
    :class:`PeerClosedError`, a blocked write a :class:`BridgeTimeoutError`."""

    reason: str = "usage"
    producer_error: str | None = None


class BuildMismatchError(BridgeError, ImportError):
    """The compiled C core does not match the Python package (a stale build).

    Rebuild it with ``pip install .`` (or ``python setup.py build_ext --inplace`` in a checkout).
    """


# ---------- the names retired into the families -------------------------------------------------------
# An older publisher names these in its ERROR frames, and older code catches them: each maps to
# its family and the attributes that say the same thing (transport/protocol.py turns a received
# name into its family; the module's __getattr__ says where a retired class went).
RETIRED: dict[str, tuple[type[BridgeError], dict[str, Any]]] = {
    "ArgumentTypeError": (InvalidArgumentError, {}),
    "CapsuleError": (InvalidArgumentError, {}),
    "ReleasedError": (ClosedError, {"reason": "released"}),
    "ForeignProcessError": (ClosedError, {"reason": "forked"}),
    "PeerRejectedError": (TransportError, {"reason": "rejected"}),
    "StreamInterruptedError": (PeerClosedError, {}),
    "WaitTimeoutError": (BridgeTimeoutError, {"waiting_for": "version"}),
    "HandshakeTimeoutError": (BridgeTimeoutError, {"waiting_for": "handshake"}),
    "StreamBlockedError": (BridgeTimeoutError, {"waiting_for": "credit"}),
    "PublisherLimitError": (LimitError, {}),
    "ConnectionLimitError": (LimitError, {"limit": "max_connections"}),
    "LeaseLimitError": (LimitError, {"limit": "max_leases_per_connection"}),
    "UnreadAnswersError": (LimitError, {"limit": "max_unread_fds"}),
    "WaitLimitError": (LimitError, {"limit": "max_waits_per_connection"}),
    "DescriptorsInFlightError": (LimitError, {"limit": "descriptors_in_flight"}),
    "SubscriptionLimitError": (LimitError, {"limit": "max_subscriptions"}),
    "FileLimitError": (LimitError, {"limit": "file_descriptors"}),
    "StagingLimitError": (LimitError, {"limit": "staging_bytes"}),
    "WireFormatError": (ProtocolError, {}),
    "PeerAccessError": (CudaError, {"reason": "no_peer_access"}),
    "StreamFailedError": (StreamError, {"reason": "failed"}),
    "SlowConsumerError": (StreamError, {"reason": "slow_consumer"}),
    "StreamSchemaError": (StreamError, {"reason": "schema"}),
}
"""Each retired exception name: its family and the attributes that tell the same cause."""


def retired_hint(name: str) -> str | None:
    """The message of the ``AttributeError`` for a retired class name (None: not a retired name)."""
    entry = RETIRED.get(name)
    if entry is None:
        return None
    family, attrs = entry
    how = " and ".join(f".{key} == {value!r}" for key, value in attrs.items())
    return f"{name} was retired: catch {family.__name__}" + (f" and check {how}" if how else "")


def __getattr__(name: str) -> Any:
    hint = retired_hint(name)
    raise AttributeError(hint or f"module {__name__!r} has no attribute {name!r}")


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
