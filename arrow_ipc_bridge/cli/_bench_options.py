"""``bench``'s options: what each one accepts, checked while the arguments are parsed.

Only the standard library here: the command line builds every subcommand's parser on each run, so
this module is imported by all of them.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Final

from arrow_ipc_bridge.cli._argtypes import positive_int

__all__ = [
    "DEFAULT_SIZES",
    "PEER_NAMES",
    "QUICK_REPEATS",
    "QUICK_SIZES",
    "DEFAULT_REPEATS",
    "add_bench_arguments",
    "format_size",
    "parse_peers",
    "parse_size",
    "parse_sizes",
]

PEER_NAMES: Final = ("torch", "ipc", "pickle")
DEFAULT_SIZES: Final = (1 << 20, 8 << 20, 64 << 20)
DEFAULT_REPEATS: Final = 20
# --quick: two small sizes and few samples, a smoke run of every case in a few seconds.
QUICK_SIZES: Final = (64 << 10, 1 << 20)
QUICK_REPEATS: Final = 5

_UNITS: Final = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_SIZE: Final = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864: a number, optionally with a fraction, and ``B``, ``KiB``, ``MiB`` or
    ``GiB`` (any case; none means bytes). Whole bytes, at least 1."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: use a number and B, KiB, MiB or GiB, e.g. 64MiB"
        )
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be a whole number of bytes, at least 1")
    return int(value)


def parse_sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of sizes, each given once; returned smallest first."""
    sizes: list[int] = []
    for part in text.split(","):
        size = parse_size(part)
        if size in sizes:
            raise argparse.ArgumentTypeError(f"{format_size(size)} is given twice")
        sizes.append(size)
    return tuple(sorted(sizes))


def parse_peers(text: str) -> str | tuple[str, ...]:
    """``auto`` (every installed peer), ``none``, or names from ``torch``, ``ipc``, ``pickle``, each
    once, separated by commas."""
    if text in ("auto", "none"):
        return text
    names: list[str] = []
    for name in text.split(","):
        if name not in PEER_NAMES:
            raise argparse.ArgumentTypeError(
                f"unknown peer {name!r}: use auto, none, or names from {', '.join(PEER_NAMES)}"
            )
        if name in names:
            raise argparse.ArgumentTypeError(f"peer {name!r} is given twice")
        names.append(name)
    return tuple(names)


def _plot_path(text: str) -> str:
    """Where the PNG goes: its directory must exist now, so that a long run does not end in a
    failure to write."""
    if not text or text.endswith(os.sep) or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name: give the PNG file's path")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"the directory {directory} does not exist")
    return text


def format_size(nbytes: int) -> str:
    """A size as the options spell it: ``64MiB``, ``1.5MiB``, ``100B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes}B"


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``bench``'s options on its subparser."""
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=None,
        help="total bytes of the columns, comma-separated (default "
        f"{','.join(map(format_size, DEFAULT_SIZES))}; --quick: {','.join(map(format_size, QUICK_SIZES))})",
    )
    parser.add_argument("--columns", type=positive_int, default=16, help="float64 columns (default 16)")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help=f"timed samples per case (default {DEFAULT_REPEATS}; --quick: {QUICK_REPEATS})",
    )
    parser.add_argument(
        "--device",
        choices=("host", "cuda", "auto"),
        default="auto",
        help="host memory, a CUDA GPU (needs CuPy), or auto: host, and the GPU too when there is one",
    )
    parser.add_argument(
        "--peers",
        type=parse_peers,
        default="auto",
        help="what the bridge is compared with: auto (every one installed), none, or a list from "
        "torch (torch.multiprocessing), ipc (Arrow IPC stream bytes), pickle",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (results and machine facts)")
    parser.add_argument(
        "--plot",
        type=_plot_path,
        metavar="PNG",
        help="write a log-log plot of time against size (matplotlib)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few samples: a smoke run")
