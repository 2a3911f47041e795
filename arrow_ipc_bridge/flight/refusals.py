"""How the Flight front refuses a request: the refusal is raised where it is found and answered by
the handler with the gRPC status that says what went wrong.

pyarrow sends the last frames of a NOT_FOUND or INVALID_ARGUMENT exception with it (it formats
every exception a handler raises that is not a Flight error): a refusal is therefore raised again
by the handler itself (:func:`answering`), so the client sees pyarrow's frame and the handler's
``raise`` line, nothing of the front's work behind it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import pyarrow as pa

from arrow_ipc_bridge.errors import closest_name, names_shown, shown_name

__all__ = ["Refused", "answering", "invalid", "not_found"]


class Refused(Exception):
    """A request the front refuses: raised where the refusal is found, answered by the handler."""

    def __init__(self, status: type[pa.ArrowException], message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def not_found(name: str, publications: Collection[str] = (), streams: Collection[str] = ()) -> Refused:
    """The refusal of an unknown ``name``: the closest of the ``publications`` and live ``streams``
    served when one is close (a mistyped name is the usual cause), and the first few of each,
    bounded in length whatever the publisher holds (``errors.names_shown``)."""
    head = f"no publication or live stream named {shown_name(name)}"
    if not publications and not streams:
        return Refused(pa.ArrowKeyError, f"{head}, and nothing is published or open now")
    close = closest_name(name, [*publications, *streams])
    guess = f"; did you mean {shown_name(close)}?" if close is not None else ""
    served = []
    if publications:
        served.append(f"publications: {names_shown(publications)}")
    if streams:
        served.append(f"live streams: {names_shown(streams)}")
    return Refused(pa.ArrowKeyError, f"{head}{guess} ({'; '.join(served)}; list_flights lists every name)")


def invalid(message: str) -> Refused:
    return Refused(pa.ArrowInvalid, message)


_Handler = TypeVar("_Handler", bound=Callable[..., Any])


def answering(handler: _Handler) -> _Handler:
    """Answer a refusal with its gRPC status (pyarrow maps ``KeyError`` to NOT_FOUND and
    ``ValueError`` to INVALID_ARGUMENT), raised here, outside the ``except`` block: the exception
    carries no context and one frame of ours, the ``raise`` below, whatever raised the refusal."""

    @functools.wraps(handler)
    def answer(*args: Any) -> Any:
        try:
            return handler(*args)
        except Refused as refused:
            status, message = refused.status, refused.message
        raise status(message)

    return answer  # type: ignore[return-value]
