"""Schedules for GEMMs nobody tuned: a fixed, reasonable choice per m range (DLight's role).

The compile pipeline uses these where ``schedules/`` holds no record for a shape and thread
count, so an untuned Linear still runs a blocked, vectorized, parallel kernel and never the
naive loops. Tuning (``python -m sandwich_tvm.tune kernels``) replaces them.
"""

from __future__ import annotations

from ..tvm_compat import host_isa
from .codegen import Bucket
from .microkernel import REGISTRY, MicroKernel
from .schedule import GemmSchedule, GemmShape, Polymerization, Slice, cdiv
from .search import Problem, caps

# (largest m of the bucket, MR, NR): thin tiles for decode-sized m, 6x16 (BLIS's AVX2 tile) beyond.
_AVX2_TILES = ((1, 1, 32), (2, 2, 24), (4, 4, 24), (1 << 62, 6, 16))


def _mk(isa: str, mr: int, nr: int) -> MicroKernel:
    by_name = {(m.mr, m.nr): m for m in REGISTRY[isa]}
    if (mr, nr) in by_name:
        return by_name[(mr, nr)]
    # Other ISAs: the largest tile with at most ``mr`` rows.
    fits = [m for m in REGISTRY[isa] if m.mr <= mr]
    return max(fits, key=lambda m: (m.mr * m.nr, m.nr))


def default_schedule(shape: GemmShape, m: int, threads: int, isa: str | None = None) -> GemmSchedule:
    """One schedule for rows around ``m``: columns split over the threads, KC = 256."""
    isa = isa or host_isa()
    m_rep = min(m, 256)
    mr, nr = next((mr, nr) for top, mr, nr in _AVX2_TILES if m_rep <= top)
    mk = _mk(isa, mr, nr)
    poly = Polymerization(1, threads, 1)
    cap = caps(Problem(m_rep, shape.n, shape.k, threads), mk, poly)
    mc = min(cap.mc, cdiv(64, mk.mr) * mk.mr)
    nc = min(cap.nc, mk.nr * 16)
    kc = min(cap.kc, 256)
    return GemmSchedule(mk, Slice(mc, nc, kc), poly)


def default_buckets(shape: GemmShape, threads: int, max_m: int | None = None,
                    isa: str | None = None) -> list[Bucket]:
    """Default buckets, only those reachable when ``m <= max_m`` (decode kernels)."""
    out = []
    for top, _, _ in _AVX2_TILES:
        rep = top if top < (1 << 62) else 256
        out.append(Bucket(top, default_schedule(shape, rep, threads, isa)))
        if max_m is not None and max_m <= top:
            break
    out[-1] = Bucket(1 << 62, out[-1].schedule)
    return out
