"""Cold weights for ``bench gemm``: a rotation of weight copies that no CPU's cache holds.

``host.cold_weight_bytes`` sizes the rotation by CPU 0's last-level cache, which is one of
several on a chip whose cores share an L3 per complex (a Zen's CCDs): a GEMM on all of them
keeps a slice of the weights in each. So the rotation also covers twice the caches of the
benchmark's CPUs added up, and the run checks it: at m = 1 a GEMM reads each weight once, so
no library may read its weights faster than the same run's streaming read of memory; if one
does, its weights came from cache, and the rotation doubles and is timed again, up to half the
memory available.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

SLACK = 1.1  # a GEMM within 10% above the streaming read still counts as reading memory
SYSFS_CPUS = Path("/sys/devices/system/cpu")

Measure = Callable[[int], tuple[float, dict[str, float]]]  # copies -> (read GB/s, {library: GB/s})


def _size_bytes(text: str) -> int | None:
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not match:
        return None
    return int(match[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[match[2]]


def llc_bytes_of(cpus: Iterable[int], root: Path = SYSFS_CPUS) -> int:
    """The last-level caches ``cpus`` use, added up, each shared cache counted once (sysfs)."""
    caches: dict[tuple[int, str], int] = {}  # (level, CPUs sharing it) -> bytes
    for cpu in cpus:
        for index in sorted((root / f"cpu{cpu}" / "cache").glob("index*")):
            try:
                kind, level = (index / "type").read_text().strip(), (index / "level").read_text().strip()
                size = _size_bytes((index / "size").read_text())
                shared = (index / "shared_cpu_list").read_text().strip()
            except OSError:
                continue
            if kind != "Instruction" and level.isdigit() and size:
                caches[(int(level), shared)] = size
    if not caches:
        return 0
    top = max(level for level, _ in caches)
    return sum(size for (level, _), size in caches.items() if level == top)


def stream_read_gbs(data: np.ndarray, cpus: list[int], repeats: int = 3) -> float:
    """GB/s of the fastest of ``repeats`` streaming reads of ``data``: one thread per CPU of
    ``cpus`` reduces its slice (``max``: numpy's pairwise ``sum`` is bound by its adds)."""
    parts = np.array_split(data.reshape(-1), len(cpus))

    def work(part: np.ndarray, cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        part.max()

    best = float("inf")
    for _ in range(repeats):
        threads = [threading.Thread(target=work, args=(p, c)) for p, c in zip(parts, cpus, strict=True)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best / 1e9


def grow_rotation(copies: int, measure: Measure, can_grow: Callable[[int], bool],
                  slack: float = SLACK) -> dict:
    """Double ``copies`` while some library's m = 1 GEMM reads faster than the streaming read
    allows (``measure(copies)``: the read's GB/s and each library's weight bytes per second),
    as long as ``can_grow(copies)`` allows the larger count. Returns the count and every try."""
    attempts = []
    while True:
        read_gbs, speeds = measure(copies)
        fast = sorted(lib for lib, gbs in speeds.items() if gbs > read_gbs * slack)
        attempts.append({"copies": copies, "read_gbs": read_gbs, "m1_weight_gbs": speeds,
                         "faster_than_read": fast})
        if not fast:
            outcome = "cold: no library read its weights faster than memory"
            break
        if not can_grow(2 * copies):
            outcome = (f"cache-resident: {', '.join(fast)} still read faster than memory at the memory "
                       "bound on the rotation")
            break
        copies *= 2
    return {"copies": copies, "cold": not fast, "outcome": outcome, "slack": slack, "attempts": attempts}


def cold_rotation(copies: int, add_copies: Callable[[int], None],
                  calls_at_m1: Callable[[], dict[str, Callable[[], object]]], weight_bytes: dict[str, int],
                  host_bytes: int, cpus: list[int], log: Callable[[str], None], pause_s: float = 0.3,
                  min_read_bytes: int = 1 << 30) -> dict:
    """The module docstring's check on a live rotation of ``copies`` (``add_copies(c)`` makes it
    ``c`` long; ``calls_at_m1()`` each library's next-copy call at m = 1; ``weight_bytes`` what
    one call reads; ``host_bytes`` one copy's memory, every library's together). The read covers
    at least twice the rotation and the CPUs' caches, and ``min_read_bytes``, so memory answers it."""
    import psutil

    from ..memory import aligned_empty
    from .timing import median_seconds

    llc = llc_bytes_of(cpus)
    data = aligned_empty((max(2 * copies * max(weight_bytes.values()), 2 * llc, min_read_bytes) // 4,))
    data[...] = 1.0
    limit = copies * host_bytes + psutil.virtual_memory().available // 2

    def measure(count: int) -> tuple[float, dict[str, float]]:
        add_copies(count)
        before = stream_read_gbs(data, cpus)
        secs = {}
        for lib, call in calls_at_m1().items():
            secs[lib] = median_seconds(call)
            time.sleep(pause_s)
        read = max(before, stream_read_gbs(data, cpus))  # the faster of the reads either side
        speeds = {lib: weight_bytes[lib] / s / 1e9 for lib, s in secs.items()}
        log(f"cold check, {count} copies: streaming read {read:.1f} GB/s; at m = 1 "
            + ", ".join(f"{lib} {gbs:.1f}" for lib, gbs in speeds.items()) + " GB/s of weights")
        return read, speeds

    out = grow_rotation(copies, measure, lambda count: count * host_bytes <= limit)
    return out | {"read_bytes": int(data.nbytes), "llc_bytes_of_cpus": llc, "weight_bytes": weight_bytes,
                  "rotation_bytes": {lib: out["copies"] * b for lib, b in weight_bytes.items()},
                  "memory_bound_bytes": limit}
