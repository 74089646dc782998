"""The Sandwich kernel search, free of TVM so it runs on fake timings in tests (paper §6).

``slice_search`` is a generator: it yields batches of schedules to measure and receives
their GFLOPS, so MetaSchedule's strategy (``strategy.py``), the benchmark and the unit tests
drive the same logic. ``SequenceTuner`` walks the sequence lengths of one (n, k) group with
the micro-kernel sliding window and schedule reuse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Generator, Sequence
from dataclasses import dataclass, field, replace

from .microkernel import ISAS, MicroKernel
from .schedule import GemmSchedule, Polymerization, Slice, cdiv, polymerizations

Measure = Callable[[Sequence[GemmSchedule]], Sequence[float]]
Search = Generator[list[GemmSchedule], list[float], tuple[GemmSchedule, float]]

GAIN = 1.01  # a step must beat the best by 1% to count as a gain (timing noise)
KC_START = 64
# AMX's starting KC in k-pairs: blocks of 256 rows of A and 256 columns of B, 1024 pairs deep,
# fill the 2 MB L2 of every AMX core so far (down_proj, k = 8192, at m = 256: 2.25 TFLOPS
# against 1.9 at KC = 4096 pairs on a Xeon with AMX).
AMX_KC = 1024
FAIR_ROWS = 8  # the window keeps a micro-kernel of r rows at least until m = 8r


@dataclass(frozen=True)
class Problem:
    m: int
    n: int
    k: int
    threads: int


def caps(p: Problem, mk: MicroKernel, poly: Polymerization) -> Slice:
    """Largest slice that still leaves every thread of ``poly`` a block (the paper's cap)."""
    mc = max(mk.mr, cdiv(cdiv(p.m, poly.pm), mk.mr) * mk.mr)
    nc = max(mk.nr, cdiv(cdiv(p.n, poly.pn), mk.nr) * mk.nr)
    align = mk.kc_align
    kc = max(align, cdiv(cdiv(p.k, poly.pk), align) * align)
    return Slice(mc, nc, kc)


def seed(p: Problem, mk: MicroKernel, poly: Polymerization) -> GemmSchedule:
    """One tile and KC_START; an AMX tile starts with KC = the thread's k up to AMX_KC: its
    accumulators stay in tile registers over the reduction, and every KC block costs a tile
    store plus a read-modify-write of Y (KC = 256 ran gate_up at m = 512 at 0.78x KC = 1024)."""
    cap = caps(p, mk, poly)
    kc = min(cap.kc, AMX_KC) if ISAS[mk.isa].tile_rows else min(KC_START, cap.kc)
    return GemmSchedule(mk, Slice(mk.mr, mk.nr, kc), poly)


def _grow(s: Slice, dim: str, step: int, cap: Slice) -> Slice | None:
    new = replace(s, **{dim: getattr(s, dim) + step})
    return None if getattr(new, dim) > getattr(cap, dim) else new


def _tile(mk: MicroKernel, dim: str) -> int:
    return {"mc": mk.mr, "nc": mk.nr, "kc": mk.kc_align}[dim]


def fast_start(p: Problem, mk: MicroKernel, poly: Polymerization,
               start: tuple[GemmSchedule, float] | None = None) -> Search:
    """Grow each dimension by 2^t x tile while GFLOPS rise; roll a dimension back when they do not.

    ``start`` (a measured schedule) replaces the one-tile seed: ``refine`` grows a reused slice.
    """
    if start is None:
        best = seed(p, mk, poly)
        (best_g,) = yield [best]
    else:
        best, best_g = start
    cap = caps(p, mk, poly)
    steps = {"mc": 0, "nc": 0, "kc": 0}
    active = ["mc", "nc", "kc"]
    while active:
        for dim in list(active):
            step = (2 ** steps[dim]) * _tile(mk, dim)
            if dim == "kc":  # KC starts above one tile: double it
                step = best.slice.kc
            grown = _grow(best.slice, dim, step, cap)
            if grown is None:
                active.remove(dim)
                continue
            cand = replace(best, slice=grown)
            (g,) = yield [cand]
            if g > best_g * GAIN:
                best, best_g = cand, g
                steps[dim] += 1
            else:  # roll back: keep ``best`` and stop growing this dimension
                active.remove(dim)
    return best, best_g


def refine(p: Problem, start: GemmSchedule, alternatives: Sequence[GemmSchedule] = ()) -> Search:
    """Re-check a reused schedule at a larger m (paper §6 reuse, checked): measure it, clipped to
    this m's caps, next to ``alternatives``, then fast-start the winner's slice further. A slice
    found at m ~ 100 can starve at m = 512 when k is long (its MC x KC block of A no longer
    stays in cache); growing it here keeps reuse from running into that."""
    cands = [clipped(p, s) for s in (start, *alternatives)]
    gs = yield cands
    i = max(range(len(cands)), key=lambda j: gs[j])
    best, best_g = cands[i], gs[i]
    return (yield from fast_start(p, best.mk, best.poly, start=(best, best_g)))


def clipped(p: Problem, s: GemmSchedule) -> GemmSchedule:
    """``s`` with its slice cut to ``p``'s caps (a schedule found at another m or shape)."""
    cap = caps(p, s.mk, s.poly)
    return replace(s, slice=Slice(*(min(a, b) for a, b in zip(_t(s.slice), _t(cap), strict=True))))


def finetune(p: Problem, start: GemmSchedule, start_g: float) -> Search:
    """Under every thread polymerization, grow the slice one tile at a time along the best dimension."""
    best, best_g = start, start_g
    for poly in polymerizations(p.threads):
        cap = caps(p, start.mk, poly)
        cur = clipped(p, replace(start, poly=poly))
        if poly == start.poly:
            cur_g = start_g
        else:
            (cur_g,) = yield [cur]
        while True:
            cands = []
            for dim in ("mc", "nc", "kc"):
                tile = _tile(cur.mk, dim)  # linear steps, a quarter of the size at most
                grown = _grow(cur.slice, dim, tile * max(1, getattr(cur.slice, dim) // (4 * tile)), cap)
                if grown is not None:
                    cands.append(replace(cur, slice=grown))
            if not cands:
                break
            gs = yield cands
            i = max(range(len(cands)), key=lambda j: gs[j])
            if gs[i] <= cur_g * GAIN:
                break
            cur, cur_g = cands[i], gs[i]
        if cur_g > best_g:
            best, best_g = cur, cur_g
    return best, best_g


def _t(s: Slice) -> tuple[int, int, int]:
    return (s.mc, s.nc, s.kc)


def slice_search(p: Problem, mks: Sequence[MicroKernel], finetune_top: int = 2) -> Search:
    """Fast start for every micro-kernel, then finetune the best few; the global best wins."""
    default = Polymerization(1, p.threads, 1)
    started: list[tuple[float, GemmSchedule]] = []
    for mk in mks:
        sch, g = yield from fast_start(p, mk, default)
        started.append((g, sch))
    started.sort(key=lambda x: -x[0])
    best_g, best = started[0]
    for g, sch in started[:finetune_top]:
        tuned, tg = yield from finetune(p, sch, g)
        if tg > best_g:
            best, best_g = tuned, tg
    return best, best_g


def run_search(search: Search, measure: Measure) -> tuple[GemmSchedule, float]:
    """Drive a search generator with a measure callable to its result."""
    try:
        batch = next(search)
        while True:
            batch = search.send(list(measure(batch)))
    except StopIteration as done:
        return done.value


def model_score(mk: MicroKernel, m: int) -> float:
    """Analytic prior (Triton-style pruning): useful rows x FMA share x FMA-chain occupancy
    (AMX: x its peak over the vector units', one tile product per load of tm + tn tiles)."""
    useful = m / (cdiv(m, mk.mr) * mk.mr)
    spec = ISAS[mk.isa]
    if spec.tile_rows:
        tm, tn = mk.tiles
        return useful * tm * tn / (tm * tn + tm + tn) * spec.peak_ratio
    vectors = mk.nr // mk.lanes
    fma = mk.mr * vectors
    share = fma / (fma + vectors + mk.mr)
    chains = min(1.0, fma * mk.k_partials / 8)
    return useful * share * chains


@dataclass
class Tuned:
    """One tuned sequence length."""

    m: int
    schedule: GemmSchedule
    gflops: float
    searched: bool  # False: reused without search


SearchOne = Callable[[Problem, list[MicroKernel], int], tuple[GemmSchedule, float]]
RefineOne = Callable[[Problem, GemmSchedule], tuple[GemmSchedule, float]]


@dataclass
class SequenceTuner:
    """Tune one (n, k) GEMM for every m in [1, max_m] (paper §6, sliding window and reuse).

    Up to ``min_reuse_m - 1`` (the dense part of the ladder, where m's remainder decides the
    tile) each m fast-starts ``prune`` micro-kernels, past it (the shape is no longer skinny)
    ``prune_large``; the best one is finetuned over every polymerization.
    """

    n: int
    k: int
    threads: int
    mks: Sequence[MicroKernel]
    max_m: int = 2048
    window: int = 16  # σ
    prune: int = 4  # micro-kernels kept per m by the analytic prior (dense part)
    prune_large: int = 3  # ... and past it
    patience: int = 3  # stable winners in a row before the schedule is reused
    tolerance: float = 0.05  # "stable": GFLOPS within 5% of the previous winners' average
    min_reuse_m: int = 17  # every m up to 16 is searched: tails still decide the tile there
    chosen: list[MicroKernel] = field(default_factory=list)

    def ladder(self) -> list[int]:
        """Every m up to 16, then 4 points per octave; m in between inherit the lower point."""
        ms = list(range(1, min(16, self.max_m) + 1))
        x = 16.0
        while True:
            x *= 2 ** 0.25
            m = int(round(x))
            if m > self.max_m:
                break
            if m > ms[-1]:
                ms.append(m)
        if ms[-1] != self.max_m:
            ms.append(self.max_m)
        return ms

    def dense(self, m: int) -> bool:
        return m < self.min_reuse_m

    def candidates(self, m: int) -> list[MicroKernel]:
        """The window: every micro-kernel for the first σ shapes, then the σ last chosen ones
        and those too tall to have had a fair trial yet."""
        pool = list(self.mks)
        if len(self.chosen) >= self.window:
            recent: list[MicroKernel] = []
            for mk in reversed(self.chosen):
                if mk not in recent:
                    recent.append(mk)
                if len(recent) == self.window:
                    break
            # A tile taller than m / FAIR_ROWS has not had a fair trial yet (its empty rows, not
            # its speed, lost it the earlier shapes: AMX's 32x32 never wins at m <= 16 and is the
            # fastest from m ~ 256): it stays in the pool until m reaches FAIR_ROWS x its rows.
            pool = recent + [mk for mk in self.mks if m < FAIR_ROWS * mk.mr and mk not in recent]
        # A register tile taller than m wastes whole rows; an AMX tile is 16 rows whatever m
        # is (the prior's useful-row share weighs that), so tiles compete from m = 1.
        fitting = ([mk for mk in pool if mk.mr <= m or ISAS[mk.isa].tile_rows]
                   or sorted(pool, key=lambda mk: mk.mr)[:1])
        fitting.sort(key=lambda mk: -model_score(mk, m))
        keep = fitting[: self.prune if self.dense(m) else self.prune_large]
        if self.dense(m):  # small m is bandwidth-bound: the prior cannot rank tile against vector
            missing = {_is_tile(mk) for mk in fitting} - {_is_tile(mk) for mk in keep}
            for family in missing:
                keep[-1] = next(mk for mk in fitting if _is_tile(mk) == family)
        return keep

    def tune(self, search_one: SearchOne, progress: Callable[[Tuned], None] | None = None,
             refine_one: RefineOne | None = None) -> list[Tuned]:
        """Search each m of the ladder until the winner is stable, then reuse it for the rest.

        With ``refine_one``, the reused schedule is re-checked (``refine``) at every power of
        two: its slice may grow there, and the grown one is reused from then on.
        """
        out: list[Tuned] = []
        streak = 0
        for m in self.ladder():
            problem = Problem(m, self.n, self.k, self.threads)
            if streak >= self.patience:
                if refine_one is not None and m & (m - 1) == 0:
                    sch, g = refine_one(problem, out[-1].schedule)
                    t = Tuned(m, sch, g, searched=True)
                else:
                    t = Tuned(m, out[-1].schedule, math.nan, searched=False)
            else:
                sch, g = search_one(problem, self.candidates(m), 1)
                self.chosen.append(sch.mk)
                # Stable: past the dense part of the ladder (where m's remainder still decides
                # the tile and flat plateaus are common), GFLOPS within tolerance of the last
                # winners'. Winners with near-equal GFLOPS alternate between tiles, so the
                # micro-kernel itself is not required to repeat.
                recent = [t for t in out[-self.patience:] if t.searched]
                stable = (not self.dense(m) and len(recent) == self.patience
                          and _stable([t.gflops for t in recent], g, self.tolerance))
                streak = streak + 1 if stable else 0
                t = Tuned(m, sch, g, searched=True)
            out.append(t)
            if progress:
                progress(t)
        return out


def _is_tile(mk: MicroKernel) -> bool:
    return ISAS[mk.isa].tile_rows > 0


def _stable(recent: list[float], g: float, tolerance: float) -> bool:
    """The paper's early stop: the new best is within ``tolerance`` of the recent average."""
    avg = sum(recent) / len(recent)
    return abs(g - avg) <= tolerance * avg


# --- the model-guided search: rank the whole space, measure the top few -------------------------

Score = Callable[[Problem, Sequence[GemmSchedule]], Sequence[float]]


def _doublings(tile: int, cap: int) -> list[int]:
    """tile, 2 x tile, 4 x tile, ... up to ``cap``, and ``cap`` itself."""
    out, x = [], tile
    while x < cap:
        out.append(x)
        x *= 2
    return [*out, cap]


def space(p: Problem, mks: Sequence[MicroKernel]) -> list[GemmSchedule]:
    """Every micro-kernel x polymerization x slice whose sides are the tile doubled (or the cap):
    the candidates the cost model ranks."""
    out = []
    for mk in mks:
        for poly in polymerizations(p.threads):
            cap = caps(p, mk, poly)
            for mc in _doublings(mk.mr, cap.mc):
                for nc in _doublings(mk.nr, cap.nc):
                    for kc in _doublings(mk.kc_align, cap.kc):
                        out.append(GemmSchedule(mk, Slice(mc, nc, kc), poly))
    return out


def neighbours(p: Problem, s: GemmSchedule) -> list[GemmSchedule]:
    """One step from ``s``: each slice side doubled, halved or one tile longer or shorter, and the
    same slice under the other polymerizations."""
    cap = caps(p, s.mk, s.poly)
    out = []
    for dim in ("mc", "nc", "kc"):
        tile, cur = _tile(s.mk, dim), getattr(s.slice, dim)
        for v in (cur * 2, cur // 2, cur + tile, cur - tile):
            v = min(getattr(cap, dim), v - v % tile)
            if v >= tile and v != cur:
                out.append(replace(s, slice=replace(s.slice, **{dim: v})))
    out += [clipped(p, replace(s, poly=q)) for q in polymerizations(p.threads) if q != s.poly]
    return list(dict.fromkeys(out))


PLAY_OFF = (4, 2)  # finalists (their micro-kernels' best) and rounds of ``confirmed``'s play-off


def confirmed(search: Search, top: int = PLAY_OFF[0], rounds: int = PLAY_OFF[1]) -> Search:
    """``search``, then a play-off: the best schedule of each of its ``top`` fastest micro-kernels
    timed again side by side, ``rounds`` times in alternating order; the best mean of those
    timings wins. A search measures one candidate after another, and a VM's memory bandwidth
    drifts between phases over minutes, so a tile timed in a fast phase could beat a better one
    timed in a slow one (the Zen 5's q4_0 gate_up at m = 1 kept a two-panel tile; the one-panel
    tile ran 1.33x as fast side by side). Re-timing needs no build: every finalist is built."""
    seen: dict[GemmSchedule, float] = {}
    try:
        batch = next(search)
        while True:
            gs = yield batch
            for sch, g in zip(batch, gs, strict=False):
                seen[sch] = max(g, seen.get(sch, 0.0))
            batch = search.send(gs)
    except StopIteration as done:
        result = done.value
    best: dict[MicroKernel, GemmSchedule] = {}
    for sch in sorted((x for x in seen if seen[x] > 0), key=lambda x: -seen[x]):
        best.setdefault(sch.mk, sch)
    finalists = list(best.values())[:top]
    if len(finalists) < 2 or rounds < 1:
        return result
    order = [sch for r in range(rounds) for sch in (finalists if r % 2 == 0 else finalists[::-1])]
    gs = yield order
    timed: dict[GemmSchedule, list[float]] = {sch: [] for sch in finalists}
    for sch, g in zip(order, gs, strict=True):
        if g > 0:  # a failed run (0) is no timing
            timed[sch].append(g)
    mean = {sch: sum(ts) / len(ts) for sch, ts in timed.items() if ts}
    if not mean:
        return result
    win = max(mean, key=mean.__getitem__)
    return win, mean[win]


def measure_all(cands: Sequence[GemmSchedule]) -> Search:
    """Measure ``cands`` in one batch; the fastest wins."""
    gs = yield list(cands)
    i = max(range(len(gs)), key=gs.__getitem__)
    return cands[i], gs[i]


def diverse(cands: Sequence[GemmSchedule], pred: Sequence[float], top: int) -> list[GemmSchedule]:
    """The ``top`` best-predicted schedules, each of another micro-kernel while there are others
    (a model that misjudges one register tile shape cannot fill the batch with it; the neighbour
    steps then search the winner's tiles), best first."""
    order = sorted(range(len(cands)), key=lambda i: -pred[i])
    out, shapes = [], set()
    for i in order:
        if cands[i].mk not in shapes:
            shapes.add(cands[i].mk)
            out.append(cands[i])
            if len(out) == top:
                return out
    return out + [cands[i] for i in order if cands[i] not in out][:top - len(out)]


def ranked(p: Problem, mks: Sequence[MicroKernel], score: Score, guesses: Sequence[GemmSchedule] = (),
           top: int = 4, steps: int = 2, step_top: int = 2, skip: Container[GemmSchedule] = ()) -> Search:
    """Measure the cost model's ``top`` schedules of ``space`` (those not in ``skip``: measured
    before), one per micro-kernel (``diverse``), beside the ``guesses`` (transferred or reused
    schedules, clipped to this m); then up to ``steps`` times the best ``step_top`` of the
    measured winner's unmeasured ``neighbours`` (its tiles), while they gain."""
    cands = [c for c in space(p, mks) if c not in skip]
    pred = list(score(p, cands))
    first = list(dict.fromkeys([*(clipped(p, g) for g in guesses), *diverse(cands, pred, top)]))
    gs = yield first
    seen = dict(zip(first, gs, strict=True))
    best = max(seen, key=seen.__getitem__)
    for _ in range(steps):
        near = [x for x in neighbours(p, best) if x not in seen and x not in skip]
        if not near:
            break
        pn = list(score(p, near))
        pick = [near[i] for i in sorted(range(len(near)), key=lambda i: -pn[i])[:step_top]]
        gs = yield pick
        seen.update(zip(pick, gs, strict=True))
        new = max(pick, key=seen.__getitem__)
        if seen[new] <= seen[best] * GAIN:
            break
        best = new
    return best, seen[best]
