"""Argument types the command line's parsers share: a value that is not one is an
``argparse.ArgumentTypeError``, which argparse reports as a usage error naming the option."""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int", "positive_int"]


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value
