"""argparse types that refuse nonsense at the command line, naming the option's rule."""

from __future__ import annotations

import argparse
import os

from ..host import tvm_num_threads


def _int_at_least(text: str, low: int, rule: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is {rule}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (``--max-m 0`` or ``--threads -1`` is an error, not a default)."""
    return _int_at_least(text, 1, "not a positive integer")


def positive_float(text: str) -> float:
    """A finite number > 0 (``--budget 0`` is an error, not "no budget")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value:g} is not a positive number")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0, "negative")


def positive_ints(text: str, option: str) -> list[int]:
    """``"4,1,2"`` -> ``[1, 2, 4]``; ValueError naming ``option`` unless all are integers >= 1."""
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise ValueError(f"{option} needs positive integers, e.g. 1,2,4,8")
    return values


def threads_beyond_cpus(threads: int, what: str = "") -> str | None:
    """The error for a ``--threads`` larger than the CPUs this process may use or than TVM's thread
    pool, else None: oversubscribed threads time (and tune for) a machine that is not this one,
    and a smaller pool times fewer workers than the records would say."""
    what = what or f"--threads {threads}"
    cpus = len(os.sched_getaffinity(0))
    if threads > cpus:
        return (f"{what} exceeds the {cpus} CPUs this process may use; oversubscribed "
                "threads time (and tune for) another machine")
    pool = tvm_num_threads()  # fixed when TVM's pool starts
    if threads > pool:
        return (f"{what} exceeds TVM's pool of {pool} (TVM_NUM_THREADS): its kernels would "
                f"be timed on {pool} workers; unset TVM_NUM_THREADS or lower --threads")
    return None
