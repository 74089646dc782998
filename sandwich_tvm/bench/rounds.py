"""``bench e2e``'s rounds: every system runs one request per round, the systems taking turns.

Decode is bound by memory bandwidth, which this VM shares with its host and which drifts over
minutes, so a system timed minutes after another is not compared with it. In each round every
system runs one whole request of the prompt length in turn, the order reversed every other
round and at every other prompt length; TTFT and TPOT are medians over the rounds, and a ratio
between two systems is the median of their per-round ratios (``paired_ratio``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Runner = Callable[[int], "dict | None"]  # prompt length -> one request's row (None: not run)


def round_order(count: int, length_index: int, round_index: int) -> list[int]:
    """The runners' indices in the order they run in this round of this prompt length."""
    order = list(range(count))
    return order if (length_index + round_index) % 2 == 0 else order[::-1]


def interleaved(runners: Sequence[tuple[str, Runner]], prompt: int, length_index: int, repeat: int,
                order: list[dict] | None = None) -> list[dict]:
    """One row per named runner for ``prompt``: ``repeat`` rounds, each running every runner
    once in ``round_order``, merged into medians (``merge_rounds``). ``order`` gets
    ``{"prompt", "round", "system"}`` for every request, in run order."""
    rounds: list[list[dict]] = [[] for _ in runners]
    for r in range(max(1, repeat)):
        for j in round_order(len(runners), length_index, r):
            name, run = runners[j]
            if order is not None:
                order.append({"prompt": prompt, "round": r, "system": name})
            row = run(prompt)
            if row is not None:
                rounds[j].append(row)
    return [merge_rounds(x) for x in rounds if x]


def merge_rounds(rounds: list[dict]) -> dict:
    """One row per (system, prompt): medians over the rounds, the per-round values kept."""
    row = dict(rounds[0])
    for key in ("ttft_ms", "tpot_ms"):
        runs = [r[key] for r in rounds]
        row[key.replace("_ms", "_runs_ms")] = runs
        row[key] = float(np.median(runs))
    if rounds[0].get("switch_ms") is not None:
        row["switch_ms"] = float(np.median([r["switch_ms"] for r in rounds]))
    return row


def paired_ratio(row: dict, base: dict, key: str) -> float:
    """Median of the per-round ratios when both systems ran the same interleaved rounds."""
    a, b = row.get(f"{key}_runs_ms"), base.get(f"{key}_runs_ms")
    if a and b and len(a) == len(b):
        return float(np.median([x / y for x, y in zip(a, b, strict=True)]))
    return row[f"{key}_ms"] / base[f"{key}_ms"]
