"""``tune_gemm``: one tuning of a (n, k) GEMM that covers every sequence length.

Each m of the ladder is a MetaSchedule task: the workload is the Linear pattern with that
static m, the design spaces come from ``SandwichGemmRule``, the search from
``SandwichSearchStrategy``; candidates are built and timed by the in-process builder and
runner, and every measurement is committed to a MetaSchedule database when one is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence
from pathlib import Path

from tvm.s_tir import meta_schedule as ms  # noqa: E402,I001

from .. import interrupts
from ..host import cpu_flags, file_lock, host_signature, require_own_cpu
from ..tvm_compat import host_isa, host_target, preload_tensor_intrinsics, tvm
from .database import (
    LOCK_NAME,
    KernelRecord,
    ScheduleDbError,
    load_record,
    record_path,
    remember,
    save_record,
    set_aside,
)
from .defaults import default_schedule
from .measurements import MeasurementLog
from .metaschedule import (
    InProcessBuilder,
    InProcessRunner,
    KernelCache,
    SandwichGemmRule,
    SandwichSearchStrategy,
    linear_workload,
)
from .microkernel import MicroKernel, kernel_isa, microkernels
from .schedule import GemmSchedule, GemmShape
from .search import Problem, Score, SequenceTuner, Tuned, measure_all, ranked


class MetaScheduleSearch:
    """``search_one`` for ``SequenceTuner``: one MetaSchedule task per tuned m."""

    def __init__(self, target: tvm.target.Target, isa: str, database: ms.database.Database | None = None,
                 max_trials: int = 400, dtype: str = "float32", epilogue: str = "none") -> None:
        preload_tensor_intrinsics()  # what TuneContext imports, minus ~25 s of inspect.stack
        self.target, self.isa, self.database, self.max_trials = target, isa, database, max_trials
        self.dtype, self.epilogue = dtype, epilogue
        self.cache = KernelCache(target)
        self.builder, self.runner = InProcessBuilder(self.cache), InProcessRunner(self.cache)
        self.trials = 0
        self.on_measured: Callable[[int, Sequence[GemmSchedule], list[float]], None] | None = None

    def __call__(self, p: Problem, mks: list[MicroKernel], finetune_top: int = 2
                 ) -> tuple[GemmSchedule, float]:
        return self._run(p, mks, SandwichSearchStrategy(p.threads, finetune_top,
                                                        on_measured=self.on_measured))

    def refine(self, p: Problem, start: GemmSchedule) -> tuple[GemmSchedule, float]:
        """Re-check a reused schedule at m, next to the default schedule for m, and grow it."""
        default = default_schedule(GemmShape(p.n, p.k, self.dtype), p.m, p.threads, self.isa)
        alternatives = [default] if default != start else []
        return self._run(p, [start.mk], SandwichSearchStrategy(p.threads, start=start,
                                                               alternatives=alternatives,
                                                               on_measured=self.on_measured))

    def ranked(self, p: Problem, mks: Sequence[MicroKernel], score: Score,
               guesses: Sequence[GemmSchedule] = (), top: int = 4,
               skip: Container[GemmSchedule] = ()) -> tuple[GemmSchedule, float]:
        """The model-guided search (``search.ranked``): the ``top`` of the cost model's ranking
        (leaving out ``skip``) and the ``guesses`` measured, then the winner's best-ranked
        neighbours."""
        strategy = SandwichSearchStrategy(p.threads, on_measured=self.on_measured,
                                          search=lambda q: ranked(q, mks, score, guesses, top=top, skip=skip))
        return self._run(p, list(mks[:1]), strategy)

    def measure(self, p: Problem, cands: Sequence[GemmSchedule]) -> list[float]:
        """GFLOPS of each of ``cands`` at ``p`` (0 for one that failed to build or run)."""
        got: dict[GemmSchedule, float] = {}
        strategy = SandwichSearchStrategy(
            p.threads, search=lambda _q: measure_all(cands), confirm=False,
            on_measured=lambda _m, schs, gs: got.update(zip(schs, gs, strict=False)))
        self._run(p, [cands[0].mk], strategy)
        return [got.get(c, 0.0) for c in cands]

    def _run(self, p: Problem, mks: list[MicroKernel], strategy: SandwichSearchStrategy
             ) -> tuple[GemmSchedule, float]:
        mod = linear_workload(p.m, p.n, p.k, self.isa, self.dtype, self.epilogue)
        ctx = ms.TuneContext(
            mod, target=self.target, task_name=f"linear_m{p.m}_n{p.n}_k{p.k}", num_threads=1,
            space_generator=ms.space_generator.PostOrderApply(
                sch_rules=[SandwichGemmRule(mks, p.threads)], postprocs=[], mutator_probs={}),
            search_strategy=strategy,
        )
        spaces = ctx.generate_design_space()
        ctx.pre_tuning(max_trials=self.max_trials, num_trials_per_iter=8, design_spaces=spaces,
                       database=self.database, cost_model=None)
        workload = self.database.commit_workload(mod) if self.database is not None else None
        while (cands := ctx.generate_measure_candidates()) is not None:
            interrupts.check()  # a callback's error report may have swallowed Ctrl-C
            built = self.builder.build([ms.builder.BuilderInput(c.sch.mod, self.target) for c in cands])
            futures = self.runner.run([
                ms.runner.RunnerInput(b.artifact_path, "llvm", c.args_info)
                for b, c in zip(built, cands, strict=True)])
            results = [f.result() for f in futures]
            ctx.notify_runner_results(cands, results)
            self.trials += len(cands)
            if workload is not None:
                for c, r in zip(cands, results, strict=False):
                    if r.run_secs:
                        self.database.commit_tuning_record(ms.database.TuningRecord(
                            c.sch.trace, workload, r.run_secs, self.target, c.args_info))
        ctx.post_tuning()
        if strategy.best is None:
            raise RuntimeError(f"no candidate of m={p.m} n={p.n} k={p.k} built and ran")
        return strategy.best


def tune_gemm(
    n: int,
    k: int,
    *,
    threads: int,
    max_m: int = 2048,
    window: int = 16,
    root: Path | None = None,
    work_dir: Path | None = None,
    progress: Callable[[Tuned], None] | None = None,
    log: Callable[[str], None] = lambda _msg: None,
    search_one: Callable | None = None,
    refine_one: Callable | None = None,
    dtype: str = "float32",
    epilogue: str = "none",
) -> KernelRecord:
    """Tune ``Y = X @ W.T`` (W: n x k, stored in ``dtype``) with ``epilogue`` fused, as the model
    runs it, for every m in [1, max_m]; resume from a saved record.

    The result is saved (atomically, after every m) under ``schedules/`` or ``root``.
    """
    require_own_cpu("tuning")  # it measures kernels here
    if n < 1 or k < 1 or threads < 1 or max_m < 1 or window < 1:
        raise ValueError(f"n={n}, k={k}, threads={threads}, max_m={max_m} and window={window} "
                         "must all be positive")
    shape, isa = GemmShape(n, k, dtype, epilogue), kernel_isa(host_isa(), dtype, cpu_flags())
    if not microkernels(isa, dtype):
        raise ValueError(f"no {dtype} micro-kernels for this CPU's ISA ({isa})")
    path = record_path(shape, threads, root)
    rec = resume_record(path, log) or KernelRecord(shape, threads, host_signature())
    done = {t.m: t for t in rec.tuned}
    # resume: the tuner replays the record's searched m (``replay``), which rebuilds its window
    tuner = SequenceTuner(n, k, threads, microkernels(isa, dtype), max_m=max_m, window=window)
    if search_one is None:
        db = None
        if work_dir:
            Path(work_dir).mkdir(parents=True, exist_ok=True)
            db = ms.database.JSONDatabase(work_dir=str(work_dir))
        search_one = MetaScheduleSearch(host_target(threads), isa, db, dtype=dtype, epilogue=epilogue)
    if refine_one is None and isinstance(search_one, MetaScheduleSearch):
        refine_one = search_one.refine
    if isinstance(search_one, MetaScheduleSearch) and search_one.on_measured is None:
        search_one.on_measured = MeasurementLog(shape, threads, rec.cpu, root).record

    def replay(p: Problem) -> tuple[GemmSchedule, float] | None:
        t = done.get(p.m)
        return (t.schedule, t.gflops) if t is not None and t.searched else None

    def cached(p: Problem, mks: list[MicroKernel], finetune_top: int) -> tuple[GemmSchedule, float]:
        return replay(p) or search_one(p, mks, finetune_top)

    def cached_refine(p: Problem, start: GemmSchedule) -> tuple[GemmSchedule, float]:
        return replay(p) or refine_one(p, start)

    replayed = {m for m, t in done.items() if t.searched}  # a reused or filled m is searched again: kept
    tuner.tune(cached, record_writer(rec, root, progress, skip=replayed),
               cached_refine if refine_one is not None else None)
    return rec


def record_writer(rec: KernelRecord, root: Path | None, progress: Callable[[Tuned], None] | None = None,
                  skip: Container[int] = (),
                  saved: Callable[[KernelRecord], KernelRecord] | None = None) -> Callable[[Tuned], None]:
    """What a tuner calls with each tuned m: added to ``rec`` with the seconds since the previous
    one (an m in ``skip``, replayed from a resumed record, is not) and saved at once (``saved(rec)``
    where given: what an interrupted run should leave); then ``progress``."""
    last = time.perf_counter()

    def write(t: Tuned) -> None:
        nonlocal last
        if t.m not in skip:
            now = time.perf_counter()
            rec.tuned = [x for x in rec.tuned if x.m != t.m]  # a resumed fill or reuse, replaced
            rec.add(t, now - last)
            last = now
            save_record(saved(rec) if saved else rec, root)
        if progress:
            progress(t)

    return write


def resume_record(path: Path, log: Callable[[str], None]) -> KernelRecord | None:
    """The record to resume from; a damaged or foreign file is set aside (kept, renamed), not used."""
    if not path.exists():
        return None
    try:
        rec = load_record(path)
    except ScheduleDbError as err:
        with file_lock(path.parent / LOCK_NAME):  # another process may have set it aside and saved anew
            try:
                rec = load_record(path)
            except ScheduleDbError:
                log(f"{err}\nset it aside as {set_aside(path)} and tuning afresh")
                return None
    remember(path, rec)
    return rec
