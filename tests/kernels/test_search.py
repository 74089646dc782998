"""Search logic on fake timings (no hardware): fast start, finetune, window, reuse."""

from __future__ import annotations

from dataclasses import replace

from sandwich_tvm.kernels.microkernel import REGISTRY, MicroKernel, enumerate_microkernels, microkernels
from sandwich_tvm.kernels.schedule import GemmSchedule, Polymerization, Slice, polymerizations
from sandwich_tvm.kernels.search import (
    AMX_KC,
    FAIR_ROWS,
    Problem,
    SequenceTuner,
    caps,
    confirmed,
    fast_start,
    model_score,
    refine,
    run_search,
    seed,
    slice_search,
)

MK = MicroKernel("avx2", 6, 16)


def test_microkernels_fit_the_register_file():
    for isa, regs in (("avx2", 16), ("avx512", 32), ("neon", 32)):
        mks = enumerate_microkernels(isa)
        assert mks and all(mk.registers_used <= regs for mk in mks)
    names = {mk.name for mk in REGISTRY["avx2"]}
    assert "gemm_f32_avx2_6x16" in names and "gemm_f32_avx2_7x16" not in names  # 7x16 spills
    assert MicroKernel("avx2", 1, 16).k_partials > 1  # thin tiles get k-partial chains


def test_amx_tiles_fit_the_tile_registers():
    """AMX: tm x tn accumulator tiles + tm A tiles + tn B tiles within its 8 tile registers."""
    names = {mk.name for mk in enumerate_microkernels("amx", "bfloat16")}
    assert names == {f"gemm_bf16_amx_{r}x{c}" for r, c in
                     ((16, 16), (16, 32), (16, 48), (32, 16), (32, 32), (48, 16))}
    assert MicroKernel("amx", 32, 32, "bfloat16").registers_used == 8
    assert not enumerate_microkernels("amx", "float32")
    # the same packed weight also serves small m with avx512bf16 register tiles
    both = microkernels("amx", "bfloat16")
    assert MicroKernel("avx512bf16", 1, 64, "bfloat16") in both and len(both) > len(names)
    # the prior prefers AMX tiles once m fills a tile, the register tile for a decode row
    amx, vec = MicroKernel("amx", 16, 32, "bfloat16"), MicroKernel("avx512bf16", 4, 64, "bfloat16")
    assert model_score(amx, 64) > model_score(vec, 64)
    assert model_score(amx, 1) < model_score(MicroKernel("avx512bf16", 1, 64, "bfloat16"), 1)


def test_polymerizations_cover_split_k():
    assert set(polymerizations(2)) == {Polymerization(1, 2, 1), Polymerization(2, 1, 1),
                                       Polymerization(1, 1, 2)}
    assert all(p.threads == 8 for p in polymerizations(8))


def test_fast_start_grows_exponentially_and_rolls_back():
    p = Problem(m=512, n=4096, k=4096, threads=2)
    seen: list[Slice] = []

    def measure(batch: list[GemmSchedule]) -> list[float]:
        out = []
        for s in batch:
            seen.append(s.slice)
            # GFLOPS rise with MC up to 4 tiles (24 rows), then fall; N and K are flat
            out.append(100.0 - abs(s.slice.mc - 24) + 0.0 * s.slice.nc)
        return out

    best, _ = run_search(fast_start(p, MK, Polymerization(1, 2, 1)), measure)
    assert best.slice.mc == 24
    mcs = [s.mc for s in seen if s.nc == MK.nr and s.kc == seen[0].kc]
    assert mcs[:5] == [6, 12, 24, 48][:4] + mcs[4:5]  # 6 -> 12 -> 24 (2^t steps) -> 48 rolled back
    assert 48 in mcs and best.slice.nc == MK.nr  # N did not help: rolled back at once


def test_fast_start_respects_parallel_caps():
    p = Problem(m=128, n=64, k=64, threads=2)
    best, _ = run_search(fast_start(p, MK, Polymerization(1, 2, 1)), lambda b: [float(
        s.slice.mc * s.slice.nc * s.slice.kc) for s in b])  # bigger is always "faster"
    cap = caps(p, MK, Polymerization(1, 2, 1))
    assert best.slice.nc <= cap.nc == 32 and best.slice.mc <= 128 and best.slice.kc <= 64


def test_split_k_is_chosen_when_it_measures_faster():
    p = Problem(m=4, n=256, k=8192, threads=2)
    mk = MicroKernel("avx2", 4, 16)

    def measure(batch):
        return [50.0 + (30.0 if s.poly.pk == 2 else 0.0) for s in batch]

    best, g = run_search(slice_search(p, [mk]), measure)
    assert best.poly == Polymerization(1, 1, 2) and g == 80.0


def _fake_search(winner_for):
    calls = []

    def search_one(p: Problem, mks: list[MicroKernel], finetune_top: int):
        calls.append((p.m, list(mks)))
        assert finetune_top == 1  # the best fast start is finetuned over every polymerization
        mk = winner_for(p.m, mks)
        return GemmSchedule(mk, Slice(mk.mr, mk.nr, 256), Polymerization(1, p.threads, 1)), 100.0
    return search_one, calls


def test_window_slides_to_recent_winners():
    mks = REGISTRY["avx2"]
    tuner = SequenceTuner(256, 256, 2, mks, max_m=128, window=2, prune=50, patience=100)
    rotating = [MicroKernel("avx2", 1, 8), MicroKernel("avx2", 1, 16), MicroKernel("avx2", 1, 32)]
    search_one, calls = _fake_search(lambda m, c: rotating[m % 3] if rotating[m % 3] in c else c[0])
    tuner.tune(search_one)
    # first σ=2 shapes see every fitting micro-kernel, later ones only the last 2 winners
    assert {mk.mr for mk in calls[0][1]} == {1} and len(calls[0][1]) == 4  # m=1: every 1xNR tile
    assert len(calls[1][1]) > 4  # m=2: still the whole pool (first σ shapes)
    # ... and the tiles still too tall for a fair trial (m < FAIR_ROWS x rows)
    later = [c for m, c in calls if m > 4]
    assert later and all(len(c) <= 2 + sum(m < FAIR_ROWS * mk.mr for mk in mks) for m, c in calls if m > 4)
    assert all(len(c) <= 2 for m, c in calls if m >= FAIR_ROWS * max(mk.mr for mk in mks))
    assert calls[-1][1][0] in tuner.chosen[-2:]


def test_reuse_takes_over_once_stable():
    mks = REGISTRY["avx2"]
    tuner = SequenceTuner(512, 512, 2, mks, max_m=2048, patience=3)
    search_one, calls = _fake_search(lambda m, c: MK if MK in c else c[0])
    tuned = tuner.tune(search_one)
    assert tuned[-1].m == 2048 and not tuned[-1].searched
    assert len(calls) < len(tuned) / 2  # large m are generated without search
    assert all(t.schedule == tuned[-1].schedule for t in tuned if not t.searched)


def test_a_flat_plateau_at_small_m_does_not_trigger_reuse():
    """The fake search always reports 100 GFLOPS (a plateau): every m up to 16 is still searched,
    and reuse starts after ``patience`` stable points past the dense part of the ladder."""
    mks = REGISTRY["avx2"]
    alternating = [MicroKernel("avx2", 4, 16), MK]
    tuner = SequenceTuner(512, 512, 2, mks, max_m=256, patience=3, prune=50)
    search_one, calls = _fake_search(lambda m, c: alternating[m % 2] if alternating[m % 2] in c else c[0])
    tuned = tuner.tune(search_one)
    searched = [t.m for t in tuned if t.searched]
    assert searched == [*range(1, 17), 19, 23, 27]  # m = 19, 23, 27 stable, then reuse
    assert all(not t.searched and t.schedule == tuned[18].schedule for t in tuned[19:])


def test_past_the_dense_ladder_fewer_micro_kernels_are_searched():
    tuner = SequenceTuner(512, 512, 2, REGISTRY["avx2"], max_m=64, patience=100, prune=5, prune_large=3)
    search_one, calls = _fake_search(lambda m, c: c[0])
    tuner.tune(search_one)
    assert all(len(c) == 5 for m, c in calls if 6 <= m <= 16)
    assert all(len(c) == 3 for m, c in calls if m > 16)


def test_small_m_measures_both_amx_tiles_and_register_tiles():
    """Up to m = 16 both kinds are measured (bandwidth decides there, not the prior); AMX
    tiles compete from m = 1 although they are 16 rows tall; large m searches tiles only."""
    tuner = SequenceTuner(2048, 2048, 2, microkernels("amx", "bfloat16"), max_m=64)
    for m in (1, 4, 8, 16):
        kinds = {mk.isa for mk in tuner.candidates(m)}
        assert kinds == {"amx", "avx512bf16"}, m
    assert {mk.isa for mk in tuner.candidates(64)} == {"amx"}
    # an AMX tile's search starts from the thread's whole k (no KC blocks to store between)...
    p = Problem(512, 2048, 2048, 2)
    tile, vec = MicroKernel("amx", 32, 32, "bfloat16"), MicroKernel("avx512bf16", 4, 64, "bfloat16")
    assert seed(p, tile, Polymerization(1, 2, 1)).slice.kc >= 1024  # 1024 k-pairs: the whole k
    long_k = Problem(512, 2048, 8192, 2)  # ... up to AMX_KC pairs, a block that fits L2
    assert seed(long_k, tile, Polymerization(1, 2, 1)).slice.kc == AMX_KC
    assert seed(p, vec, Polymerization(1, 2, 1)).slice.kc < caps(p, vec, Polymerization(1, 2, 1)).kc


def test_the_window_keeps_a_tall_tile_until_it_had_a_fair_trial():
    """32x32 AMX tiles lose every m <= 16 to 16-row tiles (half their rows are empty) but are
    the fastest at large m: the window keeps them in the pool until m = FAIR_ROWS x 32."""
    mks = microkernels("amx", "bfloat16")
    tall = MicroKernel("amx", 32, 32, "bfloat16")
    tuner = SequenceTuner(2048, 2048, 2, mks, max_m=512, patience=100)
    search_one, calls = _fake_search(lambda m, c: next(mk for mk in c if mk.mr <= 16))
    tuner.tune(search_one)
    assert tall not in tuner.chosen
    assert all(tall in c for m, c in calls if m in (19, 23, 27, 32, 64, 128))  # the prior ranks it first
    assert all(tall not in c for m, c in calls if m >= FAIR_ROWS * 32)  # never chosen: out of the window


def test_refine_grows_a_reused_slice_or_takes_the_alternative():
    p = Problem(m=512, n=2048, k=8192, threads=2)
    reused = GemmSchedule(MicroKernel("avx2", 2, 32), Slice(2, 32, 64), Polymerization(1, 2, 1))
    other = GemmSchedule(MK, Slice(60, 256, 256), Polymerization(1, 2, 1))

    def measure(batch):  # GFLOPS rise with MC up to 32 rows for the reused tile
        return [120.0 if s.mk == MK else 100.0 + min(s.slice.mc, 32) for s in batch]

    best, g = run_search(refine(p, reused), measure)
    assert best.mk == reused.mk and best.slice.mc == 32 and g == 132.0
    best, g = run_search(refine(p, reused, [other]), lambda b: [200.0 if s.mk == MK else 100.0 for s in b])
    assert best.mk == MK and g == 200.0


def test_reuse_is_rechecked_at_powers_of_two():
    tuner = SequenceTuner(512, 512, 2, REGISTRY["avx2"], max_m=2048, patience=3)
    search_one, _ = _fake_search(lambda m, c: MK if MK in c else c[0])
    refined = []

    def refine_one(p: Problem, start: GemmSchedule):
        refined.append(p.m)
        return replace(start, slice=Slice(start.slice.mc * 2, start.slice.nc, start.slice.kc)), 150.0

    tuned = tuner.tune(search_one, refine_one=refine_one)
    assert refined and all(m & (m - 1) == 0 and m > 16 for m in refined)
    assert refined[-1] == 2048
    last = next(t for t in tuned if t.m == refined[-2])
    after = [t for t in tuned if refined[-2] < t.m < 2048]
    assert after and all(t.schedule == last.schedule and not t.searched for t in after)


def test_a_play_off_overrules_a_tile_timed_in_a_fast_memory_phase():
    """The slice search times one micro-kernel after the other. The memory phase flips between
    them: the 1x32 tile is timed fast although it is the slower one side by side. The play-off
    re-times each micro-kernel's best, alternating, and keeps the 1x16 tile (at its side-by-side
    speed); without it the search keeps the 1x32 tile."""
    p = Problem(m=1, n=4096, k=2048, threads=2)
    one, two = MicroKernel("avx512", 1, 16), MicroKernel("avx512", 1, 32)
    speed = {one: 60.0, two: 45.0}  # side by side
    play_offs = []

    def measure(batch: list[GemmSchedule]) -> list[float]:
        if len(batch) == 4 and {s.mk for s in batch} == {one, two}:  # the play-off: side by side
            play_offs.append([s.mk for s in batch])
            return [speed[s.mk] for s in batch]
        # alone, the 1x32 tile met the host's memory in a fast phase
        return [speed[s.mk] * (1.5 if s.mk == two else 1.0) for s in batch]

    best, g = run_search(slice_search(p, [one, two]), measure)
    assert best.mk == two and not play_offs  # the fast phase fooled the plain search
    best, g = run_search(confirmed(slice_search(p, [one, two])), measure)
    assert best.mk == one and g == 60.0
    assert play_offs == [[two, one, one, two]]  # each finalist twice, the order reversed


def test_a_play_off_needs_two_micro_kernels():
    p = Problem(m=1, n=4096, k=2048, threads=2)
    batches = []

    def measure(batch):
        batches.append(batch)
        return [float(s.slice.kc) for s in batch]

    best, _ = run_search(confirmed(fast_start(p, MK, Polymerization(1, 2, 1))), measure)
    assert all(len(b) == 1 for b in batches)  # no play-off batch: one micro-kernel, nothing to re-time
    assert best.slice.kc == max(s.slice.kc for b in batches for s in b)


def test_a_play_off_whose_runs_all_fail_keeps_the_searchs_pick():
    p = Problem(m=1, n=4096, k=2048, threads=2)
    one, two = MicroKernel("avx512", 1, 16), MicroKernel("avx512", 1, 32)
    calls = []

    def measure(batch):
        calls.append(len(batch))
        return [0.0] * len(batch) if len(calls) > 1 and len(batch) == 4 else [
            60.0 if s.mk == one else 50.0 for s in batch]

    plain = run_search(slice_search(p, [one, two]), measure)
    calls.clear()
    assert run_search(confirmed(slice_search(p, [one, two])), measure) == plain
    assert calls[-1] == 4  # the play-off ran, and every one of its timings failed
