"""``SandwichSearchStrategy`` on fake runner results (nothing built): the play-off batch comes
after the search, and the strategy keeps the play-off's winner at its side-by-side mean."""

from __future__ import annotations

from tvm.s_tir import meta_schedule as ms

from sandwich_tvm.kernels.metaschedule import SandwichSearchStrategy, linear_workload
from sandwich_tvm.kernels.microkernel import MicroKernel
from sandwich_tvm.kernels.schedule import GemmSchedule, GemmShape, Polymerization, Slice
from sandwich_tvm.kernels.search import measure_all

ONE, TWO = MicroKernel("avx512", 1, 16), MicroKernel("avx512", 1, 32)
A = GemmSchedule(ONE, Slice(1, 16, 256), Polymerization(1, 2, 1))
B = GemmSchedule(TWO, Slice(1, 32, 128), Polymerization(1, 2, 1))
SHAPE = GemmShape(512, 256)


def _drive(strategy: SandwichSearchStrategy, gflops) -> list[list[GemmSchedule]]:
    """Run ``strategy`` to its end, each candidate timed ``gflops(schedule, batch number)``."""
    strategy.mod = linear_workload(1, SHAPE.n, SHAPE.k, "avx512")
    strategy.pre_tuning(max_trials=100, num_trials_per_iter=8, design_spaces=[])
    batches = []
    while (cands := strategy.generate_measure_candidates()) is not None:
        batch = list(strategy._pending)
        batches.append(batch)
        secs = [[SHAPE.flops(1) / (gflops(s, len(batches)) * 1e9)] for s in batch]
        strategy.notify_runner_results(cands, [ms.runner.RunnerResult(t, None) for t in secs])
    strategy.post_tuning()
    return batches


def test_the_strategy_keeps_the_play_offs_winner_at_its_mean():
    def gflops(s: GemmSchedule, batch: int) -> float:
        if batch == 1:
            return 70.0 if s == B else 60.0  # B timed alone in a fast memory phase
        return 60.0 if s == A else 45.0 + batch  # side by side: A is the faster

    strategy = SandwichSearchStrategy(2, search=lambda _p: measure_all([A, B]))
    batches = _drive(strategy, gflops)
    assert batches == [[A, B], [B, A, A, B]]  # the search's batch, then the play-off
    assert strategy.best == (A, 60.0)


def test_measuring_without_a_play_off_keeps_every_timing_as_it_came():
    strategy = SandwichSearchStrategy(2, search=lambda _p: measure_all([A, B]), confirm=False)
    batches = _drive(strategy, lambda s, _b: 70.0 if s == B else 60.0)
    assert batches == [[A, B]] and strategy.best == (B, 70.0)
