"""argparse types that refuse nonsense at the command line, naming the option's rule."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (``--max-m 0`` or ``--threads -1`` is an error, not a default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value
