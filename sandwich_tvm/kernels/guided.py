"""``tune_gemm_guided``: tuning in minutes. The cost model ranks every schedule of each m and only
its top few, the transferred guesses and the schedule of the nearest m tuned so far are
measured (``search.ranked``).

The ladder is walked best first: m = 1 (every decoded token), then coarse to fine (the largest
m, then the points halving the gaps), so a tuning stopped by its deadline has measured points
across the whole range; the points left take the schedule of their nearest measured m (clipped
to their caps, marked unsearched), and a later run resumes and measures them.

With time left once every GEMM's ladder is tuned, ``refine=True`` walks the ladder again, best
first: each m measures its current schedule beside the cost model's next candidates (the top
``2 * top`` that were never measured at that m on this CPU) and the winner's neighbours, and
keeps whichever times best now. The budget the first pass left is spent where the model was
least sure, not returned.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..host import cpu_flags, host_signature, require_own_cpu
from ..tvm_compat import host_isa, host_target
from .costmodel import CostModel, training_roots
from .database import KernelRecord, record_path, save_record
from .defaults import default_schedule
from .measurements import MeasurementLog, measurements_path, read_measurements
from .microkernel import ISAS, MicroKernel, kernel_isa, microkernels
from .schedule import GemmSchedule, GemmShape
from .search import Problem, SequenceTuner, Tuned, clipped
from .transfer import guess, transfer_sources
from .tuner import MetaScheduleSearch, record_writer, resume_record


def best_first(ladder: list[int]) -> list[int]:
    """m = 1, the largest m, then breadth-first midpoints (in ladder index) of the gaps left."""
    if not ladder:
        return []
    out, seen = [ladder[0]], {0}
    if len(ladder) > 1:
        out.append(ladder[-1])
        seen.add(len(ladder) - 1)
    gaps = [(0, len(ladder) - 1)]
    while gaps:
        nxt = []
        for lo, hi in gaps:
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            if mid not in seen:
                seen.add(mid)
                out.append(ladder[mid])
            nxt += [(lo, mid), (mid, hi)]
        gaps = nxt
    return out


def fitting(mks: tuple[MicroKernel, ...], m: int) -> list[MicroKernel]:
    """Micro-kernels without wasted rows at ``m`` (AMX tiles always compete), else the shortest."""
    fit = [mk for mk in mks if mk.mr <= m or ISAS[mk.isa].tile_rows]
    return fit or sorted(mks, key=lambda mk: mk.mr)[:1]


def nearest_tuned(tuned: list[Tuned], m: int) -> Tuned | None:
    done = [t for t in tuned if t.searched]
    return min(done, key=lambda t: (abs(math.log2(t.m / m)), t.m), default=None)


def tune_gemm_guided(
    n: int, k: int, *, threads: int, model: CostModel, max_m: int = 512, root: Path | None = None,
    dtype: str = "float32", epilogue: str = "none", deadline: float | None = None,
    progress: Callable[[Tuned], None] | None = None, log: Callable[[str], None] = lambda _msg: None,
    search: MetaScheduleSearch | None = None, clock: Callable[[], float] = time.monotonic,
    transfer_roots: Sequence[Path] | None = None, top: int = 4, refine: bool = False,
) -> KernelRecord:
    """Tune ``Y = X @ W.T`` for every m of the ladder up to ``max_m`` with the cost model, until
    ``deadline`` (on ``clock``; the first m, m = 1, is tuned even past it: a GEMM earlier ones
    overran still gets its decode kernel); saved after every m under ``root`` (resumable). Transferred
    guesses come from the records under ``transfer_roots`` (default: ``root`` or the user's
    records directory, and the shipped records). ``refine``: then search the tuned m again with the
    model's next candidates, until ``deadline`` (the module's docstring)."""
    require_own_cpu("tuning")  # it measures kernels here
    shape, here = GemmShape(n, k, dtype, epilogue), host_signature()
    isa = kernel_isa(host_isa(), dtype, cpu_flags())
    mks = microkernels(isa, dtype)
    if not mks:
        raise ValueError(f"no {dtype} micro-kernels for this CPU's ISA ({isa})")
    rec = resume_record(record_path(shape, threads, root), log) or KernelRecord(shape, threads, here)
    rec.search = "model"
    rec.tuned = [t for t in rec.tuned if t.searched]  # points filled by an earlier deadline: measure now
    roots = training_roots(root) if transfer_roots is None else transfer_roots
    sources = transfer_sources(shape, threads, here, roots)
    rec.transferred_from = sorted(set(rec.transferred_from) | {label for _, label in sources})
    if search is None:
        search = MetaScheduleSearch(host_target(threads), isa, None, dtype=dtype, epilogue=epilogue)
    search.on_measured = MeasurementLog(shape, threads, here, root).record
    ladder = SequenceTuner(n, k, threads, (), max_m=max_m).ladder()

    def score(q: Problem, schs: list[GemmSchedule]) -> list[float]:
        return list(model.predict(here, threads, shape, q.m, schs))

    def filled(r: KernelRecord) -> KernelRecord:  # the untuned m on their nearest tuned m's schedule
        return with_fill(r, ladder, n, k, threads)

    write = record_writer(rec, root, progress, saved=filled)  # an interrupted run leaves no gaps
    for m in best_first(ladder):
        if any(t.m == m for t in rec.tuned):
            continue
        if deadline is not None and clock() >= deadline and rec.tuned:  # the first m always runs
            log(f"{shape.name}: budget spent before m={m}; the untuned m reuse their nearest tuned m")
            break
        p = Problem(m, n, k, threads)
        guesses: list[GemmSchedule] = [g for src, _ in sources if (g := guess(src, shape, m, threads, isa))]
        near = nearest_tuned(rec.tuned, m)
        guesses += [near.schedule] if near else [default_schedule(shape, m, threads, isa)]
        sch, g = search.ranked(p, fitting(mks, m), score, list(dict.fromkeys(guesses)), top=top)
        write(Tuned(m, sch, g, searched=True))
    missing = [m for m in ladder if not any(t.m == m for t in rec.tuned)]
    if refine and not missing and deadline is not None:
        measured: dict[int, set[GemmSchedule]] = {}
        for x in read_measurements(measurements_path(shape, threads, here, root)):
            measured.setdefault(x.m, set()).add(x.schedule)
        for m in best_first(ladder):
            if clock() >= deadline:
                break
            now = next(t for t in rec.tuned if t.m == m)
            sch, g = search.ranked(Problem(m, n, k, threads), fitting(mks, m), score, [now.schedule],
                                   top=2 * top, skip=measured.get(m, set()))
            rec.tuned = [t for t in rec.tuned if t.m != m]
            write(Tuned(m, sch, g, searched=True))
    if missing and rec.tuned:
        rec = filled(rec)
        save_record(rec, root)
    return rec


def with_fill(rec: KernelRecord, ladder: Sequence[int], n: int, k: int, threads: int) -> KernelRecord:
    """``rec`` with every m of ``ladder`` it lacks on its nearest tuned m's schedule (clipped to
    that m, marked unsearched: a later run measures them); ``rec`` itself unchanged."""
    out = dataclasses.replace(rec, tuned=list(rec.tuned))
    for m in ladder:
        near = nearest_tuned(rec.tuned, m)
        if near is not None and not any(t.m == m for t in rec.tuned):
            out.add(Tuned(m, clipped(Problem(m, n, k, threads), near.schedule), math.nan, searched=False))
    return out
