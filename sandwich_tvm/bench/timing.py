"""Wall-clock timing shared by the benchmarks: a warmed-up median within a time budget."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import numpy as np


def median_seconds(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    """Median of 3 to 50 timed calls (as many as fit in ``budget_s``) after one warm-up call."""
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    reps = max(3, min(50, int(budget_s / one)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def rotating(fn: Callable, args_per_copy: list[tuple]) -> Callable[[], object]:
    """A no-argument call that runs ``fn`` on the next copy's arguments each time."""
    it = itertools.cycle(args_per_copy)
    return lambda: fn(*next(it))


def paired_median_ratio(ours: list[float], theirs: list[float]) -> float:
    """Median over rounds of ``theirs[r] / ours[r]`` (a speed-up: above 1 when ours is faster).

    Each round's two timings are taken seconds apart, so the host's drift over minutes cancels
    out of each ratio; a ratio of medians would mix rounds taken at different speeds.
    """
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired timings need equal, non-empty rounds ({len(ours)} vs {len(theirs)})")
    return float(np.median([t / o for o, t in zip(ours, theirs, strict=True)]))
