"""The command line: ``arrow-ipc-bridge`` (the console script) and ``python -m arrow_ipc_bridge``.

Subcommands, one module each: ``demo`` (demo.py), ``list`` (listing.py), ``inspect``
(inspect_message.py), ``doctor`` (doctor.py), ``bench`` (bench.py; its two processes in
_bench_pair.py, its timed steps in _bench_steps.py).
``_producer`` and ``_consumer`` are ``demo``'s two processes, hidden from the help. A failure the
user can act on (a missing file, a message the decoder refuses, a publisher that does not answer)
prints one line on stderr and exits 1; bad arguments exit 2 (argparse's usage error). Output cut
short by its reader (``| head``) ends the command quietly with status 141, as for other Unix tools.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from arrow_ipc_bridge.cli import bench, serve_flight
from arrow_ipc_bridge.cli._argtypes import non_negative_int, positive_int
from arrow_ipc_bridge.cli._output import CommandError

__all__ = ["main"]

_PUBLIC_COMMANDS = "{demo,list,inspect,doctor,bench,serve-flight}"
# The status a shell reports for a command killed by SIGPIPE (128 + 13): what `cmd | head` gives for
# other Unix tools whose reader went away. Python ignores SIGPIPE, so the write raises instead.
_EXIT_BROKEN_PIPE = 141


def _prog() -> str:
    """The name the user typed: ``python -m arrow_ipc_bridge`` runs ``__main__.py``; the console
    script and anything else run under their own name."""
    invoked = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if invoked in ("", "__main__.py", "-c"):
        return "python -m arrow_ipc_bridge"
    return invoked


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The parser (one help text for both ways of running the command line)."""
    from arrow_ipc_bridge import __version__
    from arrow_ipc_bridge._ffi import WIRE_VERSION

    parser = argparse.ArgumentParser(
        prog=prog or _prog(),
        description="Zero-copy hand-off of Apache Arrow data between processes on one host.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"arrow_ipc_bridge {__version__} (wire format {WIRE_VERSION[0]}.{WIRE_VERSION[1]})",
    )
    # The metavar lists the public subcommands only: the internal ones are parsers without help,
    # which argparse leaves out of the command list.
    sub = parser.add_subparsers(dest="command", required=True, metavar=_PUBLIC_COMMANDS)

    p_demo = sub.add_parser(
        "demo",
        help="a producer and a consumer process sharing a table",
        description="Start a producer process that publishes a table of ROWS rows and COLUMNS float64 "
        "columns (copied into shared memory, memory-mapped with no copy, and on the GPU too when a "
        "CUDA GPU is here) and a consumer process that lists the names and reads each one 20 times, "
        "printing the median time from request to a usable table and the sum of the last column. "
        "Exit status: nonzero when either process failed.",
    )
    p_demo.add_argument("--rows", type=positive_int, default=1_000_000, help="rows of the table (>= 1)")
    p_demo.add_argument("--columns", type=positive_int, default=16, help="float64 columns (>= 1)")

    p_list = sub.add_parser(
        "list",
        help="the names a running publisher serves, with kind, rows, device and size",
        description="List what the publisher at SOCKET serves. Each name is fetched once and "
        "released (a get per name) to read its kind, rows, device and size; live streams are not "
        "listed (the publisher lists its publications only).",
    )
    p_list.add_argument("socket", metavar="SOCKET", help="the publisher's Unix socket path")
    p_list.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p_list.add_argument("--timeout", type=_timeout, default=5.0, help="seconds to wait for each answer")

    p_inspect = sub.add_parser(
        "inspect",
        help="decode a message file and print what it holds",
        description="Decode a message file (the bytes of Exported.message) and print its kind, "
        "batches, rows, bytes, device, regions and schema. The regions are described, not opened.",
    )
    p_inspect.add_argument("path", metavar="FILE")
    p_inspect.add_argument(
        "--fds", type=non_negative_int, default=1, help="how many fds travelled with it (default 1)"
    )
    p_inspect.add_argument("--json", action="store_true", help="print JSON")

    p_doctor = sub.add_parser(
        "doctor",
        help="what this machine supports, and what to change when something fails",
        description="Check memfd and its seals, the kernel, the open-file limit, the socket "
        "directory, container namespaces and, with a CUDA GPU, each CUDA handle kind between two "
        "processes. Exit 1 when a check failed.",
    )
    p_doctor.add_argument("--socket-dir", help="where sockets will live (default: the temp directory)")
    p_doctor.add_argument(
        "--no-cuda-processes", action="store_true", help="skip the CUDA checks between two processes"
    )
    p_doctor.add_argument("--json", action="store_true", help="print JSON")

    bench.register(sub)  # bench (bench.py)
    serve_flight.register(sub)  # serve-flight (serve_flight.py)

    p_prod = sub.add_parser("_producer")
    p_prod.add_argument("socket")
    p_prod.add_argument("rows", type=int)
    p_prod.add_argument("columns", type=int)
    p_prod.add_argument("shm_dir")
    p_cons = sub.add_parser("_consumer")
    p_cons.add_argument("socket")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    try:
        try:
            return _main(argv)
        finally:
            # Flushed here rather than at interpreter exit, so that a reader gone away is seen below
            # (and not reported by the interpreter as an ignored exception after the command ended).
            sys.stdout.flush()
    except BrokenPipeError:
        # stdout's reader went away (`... | head`): stop quietly like other Unix tools. What is still
        # buffered goes to /dev/null, so the interpreter's own flush at exit cannot fail a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return _EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except CommandError as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if hasattr(args, "run"):  # subcommands that name their own runner (serve-flight)
        return int(args.run(args))
    if args.command == "demo":
        from arrow_ipc_bridge.cli.demo import demo

        return demo(args.rows, args.columns)
    if args.command == "list":
        from arrow_ipc_bridge.cli.listing import list_names

        return list_names(args.socket, timeout=args.timeout, as_json=args.json)
    if args.command == "inspect":
        from arrow_ipc_bridge.cli.inspect_message import inspect

        return inspect(args.path, args.fds, as_json=args.json)
    if args.command == "doctor":
        from arrow_ipc_bridge.cli.doctor import doctor

        return doctor(
            socket_dir=args.socket_dir, cuda_between_processes=not args.no_cuda_processes, as_json=args.json
        )
    if args.command == "bench":
        return bench.bench(args, prog=f"{_prog()} bench")
    if args.command == "_producer":
        from arrow_ipc_bridge.cli.demo import run_producer

        return run_producer(args.socket, args.rows, args.columns, args.shm_dir)
    from arrow_ipc_bridge.cli.demo import run_consumer

    return run_consumer(args.socket)
