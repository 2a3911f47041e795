"""``serve-flight SOCKET --location grpc://0.0.0.0:PORT``: a Flight front for a running publisher.

Serves the publications of the publisher at SOCKET (and the live streams named with ``--stream``)
to Arrow Flight clients until SIGINT or SIGTERM. Clients authenticate with a bearer token from
``--token-file`` (one token a line; a file, so that tokens stay out of the process list) or a
client certificate (``--client-ca``); ``--allow-unauthenticated`` is the explicit way to serve
anyone who reaches the port. ``docs/flight.md`` describes the front.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from arrow_ipc_bridge.cli._output import CommandError

__all__ = ["register", "serve_flight"]


def register(sub: Any) -> None:
    """Add the ``serve-flight`` subcommand to the command line's subparsers."""
    p = sub.add_parser(
        "serve-flight",
        help="serve a running publisher's publications over Arrow Flight (gRPC)",
        description="Serve the publisher at SOCKET to Arrow Flight clients until interrupted. "
        "Needs --token-file, --client-ca, or --allow-unauthenticated.",
    )
    p.add_argument("socket", metavar="SOCKET", help="the publisher's Unix socket path")
    p.add_argument(
        "--location",
        default="grpc://127.0.0.1:0",
        help="where to listen: grpc://HOST:PORT or grpc+tls://HOST:PORT (default: grpc://127.0.0.1:0)",
    )
    p.add_argument("--token-file", help="file of bearer tokens clients must send, one a line")
    p.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key and a grpc+tls:// location)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--client-ca", help="PEM CA: ask every client for a certificate it signed")
    p.add_argument(
        "--allow-unauthenticated", action="store_true", help="serve clients that present no credential"
    )
    p.add_argument(
        "--stream", action="append", default=[], metavar="NAME", help="a live stream to serve (repeat)"
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for each request to the publisher")
    p.set_defaults(run=serve_flight)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise CommandError(f"cannot read the {what} {path}: {exc.strerror}") from None


def _tokens(path: str | None) -> list[str] | None:
    if path is None:
        return None
    lines = _read(path, "token file").decode("utf-8", "replace").splitlines()
    tokens = [line.strip() for line in lines if line.strip()]
    if not tokens:
        raise CommandError(f"the token file {path} holds no token")
    return tokens


def serve_flight(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; exit 1 when the front cannot start."""
    from arrow_ipc_bridge.errors import BridgeError
    from arrow_ipc_bridge.flight import serve

    if args.token_file is None and args.client_ca is None and not args.allow_unauthenticated:
        # Checked here so that the message names this command's flags (serve() names its arguments).
        raise CommandError(
            "this front would let anyone who reaches it read every publication: pass --token-file "
            "FILE, --client-ca FILE (with --tls-cert, --tls-key and a grpc+tls:// location), or "
            "--allow-unauthenticated"
        )
    if args.client_ca is not None and args.tls_cert is None:
        # A client certificate is asked for only over TLS: without it --client-ca would check nothing.
        raise CommandError("--client-ca needs TLS: --tls-cert, --tls-key and a grpc+tls:// location")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CommandError("--tls-cert and --tls-key go together")
    tls = [(_read(args.tls_cert, "certificate"), _read(args.tls_key, "key"))] if args.tls_cert else None
    client_ca = _read(args.client_ca, "client CA") if args.client_ca else None
    try:
        front = serve(
            args.socket,
            args.location,
            tokens=_tokens(args.token_file),
            tls_certificates=tls,
            verify_client=client_ca is not None,
            root_certificates=client_ca,
            allow_unauthenticated=args.allow_unauthenticated,
            streams=args.stream,
            timeout=args.timeout,
        )
    except (BridgeError, OSError, ValueError) as exc:
        raise CommandError(str(exc).splitlines()[0]) from None
    stop = threading.Event()

    def _stop(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"serving {args.socket} at {front.location}", flush=True)
        while not stop.wait(0.5):  # short waits let the signal handlers run
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        front.close()
    return 0
