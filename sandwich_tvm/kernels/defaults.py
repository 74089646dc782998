"""Schedules for GEMMs nobody tuned: a fixed, reasonable choice per m range (DLight's role).

The compile pipeline uses these where ``schedules/`` holds no record for a shape and thread
count, so an untuned Linear still runs a blocked, vectorized, parallel kernel and never the
naive loops. Tuning (``python -m sandwich_tvm.tune kernels``) replaces them.
"""

from __future__ import annotations

from ..host import host_isa
from .codegen import Bucket
from .microkernel import ISAS, MicroKernel, microkernels
from .schedule import GemmSchedule, GemmShape, Polymerization, Slice, cdiv
from .search import Problem, caps


def _tiles(isa: str) -> tuple[tuple[int, int, int], ...]:
    if isa not in ISAS:
        raise ValueError(f"no micro-kernels for ISA {isa!r}; known: {sorted(ISAS)}")
    return ISAS[isa].default_tiles


def _mk(isa: str, mr: int, vectors: int, dtype: str = "float32") -> MicroKernel:
    kernels = microkernels(isa, dtype)
    if not kernels:
        raise ValueError(f"{isa} has no micro-kernels for {dtype} weights")
    for own in (isa, *ISAS[isa].extends):  # AMX's small-m tiles are avx512bf16 register tiles
        mk = MicroKernel(own, mr, vectors * ISAS[own].lanes, dtype)
        if mk in kernels:
            return mk
    # A tile the register file cannot hold: the largest one with at most ``mr`` rows.
    return max((m for m in kernels if m.mr <= mr), key=lambda m: (m.mr * m.nr, m.nr))


def default_schedule(shape: GemmShape, m: int, threads: int, isa: str | None = None) -> GemmSchedule:
    """One schedule for rows around ``m``: columns split over the threads, KC = 256; at m = 1
    (a GEMV, bound by reading the weights) one panel of columns per block, so each thread reads
    its panels whole, one after another, rather than 16 of them side by side in short runs (the
    records shipped for five CPUs chose one panel at m = 1 in 116 of 158 GEMMs, 16 in none)."""
    isa = isa or host_isa()
    m_rep = min(m, 256)
    mr, vectors = next((mr, v) for top, mr, v in _tiles(isa) if m_rep <= top)
    mk = _mk(isa, mr, vectors, shape.dtype)
    poly = Polymerization(1, threads, 1)
    cap = caps(Problem(m_rep, shape.n, shape.k, threads), mk, poly)
    mc = min(cap.mc, cdiv(64, mk.mr) * mk.mr)
    nc = mk.nr if m_rep == 1 else min(cap.nc, mk.nr * 16)
    kc = min(cap.kc, 256)
    return GemmSchedule(mk, Slice(mc, nc, kc), poly)


def default_buckets(shape: GemmShape, threads: int, max_m: int | None = None,
                    isa: str | None = None) -> list[Bucket]:
    """Default buckets, only those reachable when ``m <= max_m`` (decode kernels)."""
    isa = isa or host_isa()
    out = []
    for top, _, _ in _tiles(isa):
        rep = top if top < (1 << 62) else 256
        out.append(Bucket(top, default_schedule(shape, rep, threads, isa)))
        if max_m is not None and max_m <= top:
            break
    out[-1] = Bucket(1 << 62, out[-1].schedule)
    return out
