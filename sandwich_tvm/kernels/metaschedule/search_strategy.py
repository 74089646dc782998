"""``SandwichSearchStrategy``: Sandwich's kernel search as a MetaSchedule search strategy.

A ``PySearchStrategy`` that runs ``slice_search`` (fast start, then finetune over every
polymerization) by emitting annotated candidates, or ``refine`` from a reused schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from tvm.ir.utils import derived_object  # noqa: E402,I001
from tvm.s_tir import meta_schedule as ms  # noqa: E402

from ..schedule import GemmSchedule
from ..search import Problem, Search, confirmed, refine, slice_search
from .workload import annotate, schedule_of, workload_shape


@derived_object
class SandwichSearchStrategy(ms.search_strategy.PySearchStrategy):
    """Fast start then finetune (``slice_search``) over the micro-kernels of the design spaces;
    with ``start``, ``refine`` that reused schedule against ``alternatives`` instead."""

    def __init__(self, threads: int, finetune_top: int = 2, start: GemmSchedule | None = None,
                 alternatives: Sequence[GemmSchedule] = (),
                 on_measured: Callable[[int, Sequence[GemmSchedule], list[float]], None] | None = None,
                 search: Callable[[Problem], Search] | None = None, confirm: bool = True) -> None:
        super().__init__()
        self.threads = threads
        self.finetune_top = finetune_top
        self.start, self.alternatives = start, tuple(alternatives)
        self.on_measured = on_measured  # (m, schedules, GFLOPS) of every timed batch
        self.search = search  # a search of its own (``ranked``) instead of slice_search / refine
        self.confirm = confirm  # end with the finalists' play-off (``search.confirmed``)
        self.best: tuple[GemmSchedule, float] | None = None

    def _initialize_with_tune_context(self, context) -> None:
        self.mod = context.mod

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None):
        mks = [schedule_of(s.mod).mk for s in design_spaces if schedule_of(s.mod) is not None]
        m, shape = workload_shape(self.mod)
        self.trials_left = max_trials
        problem = Problem(m, shape.n, shape.k, self.threads)
        if self.search is not None:
            self._search: Search = self.search(problem)
        elif self.start is None:
            self._search = slice_search(problem, mks, self.finetune_top)
        else:
            self._search = refine(problem, self.start, self.alternatives)
        if self.confirm:
            self._search = confirmed(self._search)
        self._pending: list[GemmSchedule] | None = next(self._search)
        self.best = None

    def post_tuning(self) -> None:
        self._pending = None

    def generate_measure_candidates(self):
        if self._pending is None or self.trials_left <= 0:
            return None
        args = ms.arg_info.ArgInfo.from_prim_func(self.mod["main"])
        return [ms.MeasureCandidate(annotate(self.mod, s), args) for s in self._pending]

    def notify_runner_results(self, measure_candidates, results) -> None:
        m, shape = workload_shape(self.mod)
        gflops = []
        for res in results:
            secs = [float(x) for x in res.run_secs] if res.run_secs else []
            ok = res.error_msg is None and secs
            gflops.append(shape.flops(m) / float(np.median(secs)) / 1e9 if ok else 0.0)
        self.trials_left -= len(results)
        if self.on_measured is not None and self._pending:
            self.on_measured(m, self._pending, gflops)
        for s, g in zip(self._pending or [], gflops, strict=False):
            if self.best is None or g > self.best[1]:
                self.best = (s, g)
        try:
            self._pending = self._search.send(gflops)
        except StopIteration as done:  # the search's own pick (a play-off may overrule the fastest timing)
            self._pending = None
            if done.value is not None:
                self.best = done.value

    def clone(self):
        return SandwichSearchStrategy(self.threads, self.finetune_top, self.start, self.alternatives,
                                      self.on_measured, self.search, self.confirm)
