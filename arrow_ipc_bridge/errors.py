"""The one exception hierarchy of the bridge.

Every exception the bridge raises on purpose derives from :class:`BridgeError` and, where one fits,
from the builtin a caller would already catch (``ValueError`` for bad data, ``TimeoutError`` for
waits, ...). All of them pickle (a consumer may forward an error to another process) and carry a
message that says what failed and what to do about it.
"""

from __future__ import annotations

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
    """The publisher serves ``max_connections`` connections already and closed this one. Close
    sessions that are not needed, or retry later."""


class LeaseLimitError(PublisherLimitError):
    """This connection holds ``max_leases_per_connection`` leases: the GET was refused (nothing was
    leased) and the session goes on. Release imported objects, then get again."""


class UnreadAnswersError(PublisherLimitError):
    """The GET was refused because this connection has not read answers carrying
    ``max_unread_fds`` descriptors (a client that sends requests without reading the replies);
    the connection goes on. A :class:`~arrow_ipc_bridge.Session` never gets it."""


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
    """No object is published under that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


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
