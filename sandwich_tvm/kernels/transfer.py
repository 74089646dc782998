"""Transfer: a shape nobody tuned here starts from the records of its nearest tuned shapes.

Sources are records of the same weight dtype whose micro-kernels this CPU runs: first this
CPU's own (nearest (n, k) first, the epilogue a tie-breaker), then those of other CPUs of the
same ISA family. Their schedule for an m is a guess the guided search measures first
(``search.ranked``): the measurement confirms or rejects it. Records name their sources.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from ..host import CpuSignature
from .codegen import KernelError, check_schedule
from .database import SET_ASIDE, KernelRecord, ScheduleDbError, read_record
from .microkernel import kernel_isa, microkernels
from .schedule import GemmSchedule, GemmShape


def shape_distance(a: GemmShape, b: GemmShape) -> float:
    """log2 distance of n and k, half a unit for a different epilogue."""
    return (abs(math.log2(a.n / b.n)) + abs(math.log2(a.k / b.k))
            + (0.5 if a.epilogue != b.epilogue else 0.0))


def transfer_sources(shape: GemmShape, threads: int, here: CpuSignature, roots: Sequence[Path],
                     limit: int = 2) -> list[tuple[KernelRecord, str]]:
    """Up to ``limit`` records under ``roots`` to start ``shape`` from, best first, each with its
    label (``<cpu slug>/<file name>``)."""
    isa = kernel_isa(here.isa, shape.dtype, set(here.features or ()))
    found: dict[str, tuple[tuple[int, float], KernelRecord]] = {}
    for base in roots:
        for path in sorted(Path(base).glob(f"*/t{threads}/linear_*_{shape.dtype}*.json")):
            label = f"{path.parent.parent.name}/{path.name}"
            if label in found or SET_ASIDE in path.name:
                continue  # the user's file shadows the shipped one
            try:
                rec = read_record(path)
            except ScheduleDbError:
                continue
            if rec.shape.dtype != shape.dtype or rec.kernel_isa != isa:
                continue
            same_cpu = not here.differences(rec.cpu)
            if not same_cpu and rec.cpu.isa != here.isa:
                continue
            found[label] = ((0 if same_cpu else 1, shape_distance(shape, rec.shape)), rec)
    ranked = sorted(found.items(), key=lambda kv: kv[1][0])
    return [(rec, label) for label, (_, rec) in ranked[:limit]]


def guess(rec: KernelRecord, shape: GemmShape, m: int, threads: int, isa: str) -> GemmSchedule | None:
    """``rec``'s schedule for ``m`` if this shape can run it (its micro-kernel runs here)."""
    s = rec.schedule_for(m)
    if s.poly.threads != threads or s.mk not in microkernels(isa, shape.dtype):
        return None
    try:
        check_schedule(shape, s)
    except KernelError:
        return None
    return s
