"""Token authentication for the Flight front, through Flight's own middleware.

A client sends ``authorization: Bearer <token>`` with every call (plain pyarrow clients do it with
``FlightCallOptions(headers=[bearer_header(token)])``); the server's middleware refuses a call
without a known token before any handler runs (``FlightUnauthenticatedError``, gRPC status
UNAUTHENTICATED). Tokens are compared in constant time, and only their SHA-256 digests are kept.
A token travels in the clear on a plain ``grpc://`` location: serve over ``grpc+tls://`` anywhere
but loopback.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Any

from pyarrow import flight

__all__ = ["AUTH_HEADER", "TokenAuthMiddlewareFactory", "bearer_header", "call_options"]

AUTH_HEADER = "authorization"
_SCHEME = "Bearer "
MIN_TOKEN_LENGTH = 16  # a short token is guessable over the network; refuse it at serve()


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def bearer_header(token: str) -> tuple[bytes, bytes]:
    """The header a client sends with every call to authenticate with ``token``."""
    return AUTH_HEADER.encode(), (_SCHEME + token).encode()


def call_options(token: str | None, timeout: float | None = None) -> flight.FlightCallOptions:
    """Call options carrying ``token`` (none when ``None``) and a per-call ``timeout``."""
    headers = [bearer_header(token)] if token is not None else []
    return flight.FlightCallOptions(headers=headers, timeout=timeout)


class TokenAuthMiddlewareFactory(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    """Admits a call only when it carries one of ``tokens`` as a bearer token."""

    def __init__(self, tokens: Iterable[str]) -> None:
        super().__init__()
        digests = []
        for token in tokens:
            if not isinstance(token, str):
                raise TypeError(f"a token must be a str, not {type(token).__name__}")
            if len(token) < MIN_TOKEN_LENGTH or token != token.strip() or "\n" in token:
                raise ValueError(
                    f"a token must be at least {MIN_TOKEN_LENGTH} characters without surrounding "
                    "blanks or line breaks (make one with secrets.token_urlsafe())"
                )
            digests.append(_digest(token.encode()))
        if not digests:
            raise ValueError("no token given: pass at least one, or serve without tokens explicitly")
        self._digests = tuple(digests)

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> None:
        values = headers.get(AUTH_HEADER, [])
        if len(values) != 1:
            # Two headers are refused whatever they hold: a proxy in front may judge one and this
            # server the other. The message says which case it is, so that a client sending two
            # does not go looking for a header it sent.
            raise flight.FlightUnauthenticatedError(
                f"the call carries {len(values)} authorization headers: send exactly one "
                "('authorization: Bearer <token>')"
                if values
                else "this Flight server needs a bearer token (header 'authorization: Bearer <token>')"
            )
        value = values[0]
        raw = value if isinstance(value, bytes) else str(value).encode()
        if not raw.startswith(_SCHEME.encode()):
            raise flight.FlightUnauthenticatedError("the authorization header is not 'Bearer <token>'")
        presented = _digest(raw[len(_SCHEME) :])
        # Every digest is compared (no early exit), each in constant time.
        known = False
        for digest in self._digests:
            known |= hmac.compare_digest(presented, digest)
        if not known:
            raise flight.FlightUnauthenticatedError("unknown token")
