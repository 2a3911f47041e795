"""How the Flight front refuses a request: the refusal is raised where it is found and answered by
the handler with the gRPC status that says what went wrong.

pyarrow sends the last frames of a NOT_FOUND or INVALID_ARGUMENT exception with it (it formats
every exception a handler raises that is not a Flight error): a refusal is therefore raised again
by the handler itself (:func:`answering`), so the client sees pyarrow's frame and the handler's
``raise`` line, nothing of the front's work behind it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import pyarrow as pa

__all__ = ["Refused", "answering", "invalid", "not_found"]


class Refused(Exception):
    """A request the front refuses: raised where the refusal is found, answered by the handler."""

    def __init__(self, status: type[pa.ArrowException], message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def not_found(name: str) -> Refused:
    return Refused(pa.ArrowKeyError, f"no publication or live stream named {name!r}")


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
