"""Sandwich's kernel search plugged into MetaSchedule's own hooks.

- ``SandwichGemmRule`` (a ``PyScheduleRule``) recognises the Linear pattern on a packed
  weight and annotates its block with a ``GemmSchedule`` (``sandwich.gemm``), one design
  space per micro-kernel. The annotation is an ordinary trace instruction, so tuning
  records replay and live in any MetaSchedule database.
- ``SandwichSearchStrategy`` (a ``PySearchStrategy``) runs ``slice_search`` (fast start,
  then finetune over every polymerization) by emitting annotated candidates.
- ``materialize`` turns an annotated workload into the generated micro-kernel program;
  ``InProcessBuilder``/``InProcessRunner`` (``PyBuilder``/``PyRunner``) build and time
  candidates in this process. A generated kernel is symbolic in m, so one build serves
  every sequence length: builds are cached by schedule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
from tvm import te
from tvm.ir.utils import derived_object  # noqa: E402,I001
from tvm.s_tir import meta_schedule as ms  # noqa: E402

from ..host import cold_weight_bytes
from ..tvm_compat import tvm
from .codegen import Bucket, linear_primfunc
from .microkernel import MicroKernel
from .packing import WeightLayout, numpy_dtype
from .schedule import GemmSchedule, GemmShape, Polymerization
from .search import Problem, Search, refine, seed, slice_search

ANNOTATION = "sandwich.gemm"
BLOCK = "linear"


def linear_workload(m: int, n: int, k: int, isa: str, dtype: str = "float32",
                    epilogue: str = "none") -> tvm.IRModule:
    """The Linear pattern with static m on a packed weight, then its ``epilogue``: what the rule
    schedules (the ``linear`` block) and what the runner feeds (the epilogue's operands).

    Built with ``te`` (not a ``@T.prim_func`` closure, whose decorator walks the Python stack
    on every call): one workload per tuned m. A bf16 weight packed in k-pairs (``uint32``
    words) is read as the high half of an fp32 (its exact value). ``silu_mul`` reads a gate_up
    weight interleaved every ``lanes`` columns, as the model packs it.
    """
    layout = WeightLayout(isa, dtype)
    panels, k_red, lanes = layout.shape(n, k)
    a = te.placeholder((m, k), "float32", name="A")
    wp = te.placeholder((panels, k_red, lanes), layout.storage, name="Wp")
    r = te.reduce_axis((0, k), name="r")
    y = te.compute((m, n), lambda i, j: te.sum(a[i, r] * layout.element(wp, j, r), axis=r), name=BLOCK)
    params = [a, wp]
    if epilogue == "residual":
        res = te.placeholder((m, n), "float32", name="R")
        params.append(res)
        y = te.compute((m, n), lambda i, j: y[i, j] + res[i, j], name="epilogue")
    elif epilogue == "bias":
        bias = te.placeholder((n,), "float32", name="B")
        params.append(bias)
        y = te.compute((m, n), lambda i, j: y[i, j] + bias[j], name="epilogue")
    elif epilogue == "silu_mul":
        def gate_times_up(i, j):
            gate = y[i, j // lanes * 2 * lanes + j % lanes]
            return gate / (1 + te.exp(-gate)) * y[i, j // lanes * 2 * lanes + lanes + j % lanes]

        y = te.compute((m, n // 2), gate_times_up, name="epilogue")
    func = te.create_prim_func([*params, y]).with_attr(
        {"global_symbol": "main", "tir.noalias": True, "sandwich.epilogue": epilogue})
    return tvm.IRModule({"main": func})


def workload_shape(mod: tvm.IRModule) -> tuple[int, GemmShape]:
    """(m, shape) of a Linear workload, read from its buffers and epilogue attribute."""
    func = mod["main"]
    a, wp, *_, y = func.params  # buffers in this TVM
    epilogue = str(func.attrs["sandwich.epilogue"]) if "sandwich.epilogue" in func.attrs else "none"
    m, k = (int(d) for d in a.shape)
    n = int(y.shape[1]) * (2 if epilogue == "silu_mul" else 1)
    dtype = "bfloat16" if str(wp.dtype) == "uint32" else str(wp.dtype)
    return m, GemmShape(n, k, dtype, epilogue)


def _linear_block(sch: tvm.s_tir.Schedule) -> tvm.s_tir.schedule.SBlockRV | None:
    try:
        return sch.get_sblock(BLOCK, func_name="main")
    except Exception:  # noqa: BLE001 - not our pattern
        return None


def annotate(mod: tvm.IRModule, schedule: GemmSchedule) -> tvm.s_tir.Schedule:
    sch = tvm.s_tir.Schedule(mod)
    block = _linear_block(sch)
    if block is None:
        raise ValueError("workload has no Linear block")
    sch.annotate(block, ANNOTATION, schedule.dumps())
    return sch


def schedule_of(mod: tvm.IRModule) -> GemmSchedule | None:
    """The GemmSchedule annotated on a workload, if any."""
    sch = tvm.s_tir.Schedule(mod)
    block = _linear_block(sch)
    if block is None:
        return None
    annotations = sch.get(block).annotations
    return GemmSchedule.loads(str(annotations[ANNOTATION])) if ANNOTATION in annotations else None


def materialize(mod: tvm.IRModule) -> tvm.IRModule:
    """Replace an annotated Linear workload by its generated micro-kernel program."""
    schedule = schedule_of(mod)
    if schedule is None:
        return mod
    _, shape = workload_shape(mod)
    return tvm.IRModule({"main": linear_primfunc(shape, [Bucket(1 << 62, schedule)], name="main")})


@derived_object
class SandwichGemmRule(ms.schedule_rule.PyScheduleRule):
    """Design spaces for the Linear pattern: one seed schedule per micro-kernel."""

    def __init__(self, mks: Sequence[MicroKernel], threads: int) -> None:
        super().__init__()
        self.mks = list(mks)
        self.threads = threads

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch, block):
        if sch.get(block).name_hint != BLOCK:
            return [sch]
        m, shape = workload_shape(sch.mod)
        problem = Problem(m, shape.n, shape.k, self.threads)
        out = []
        for mk in self.mks:
            s = sch.copy()
            start = seed(problem, mk, Polymerization(1, self.threads, 1))
            s.annotate(block, ANNOTATION, start.dumps())
            out.append(s)
        return out

    def clone(self):
        return SandwichGemmRule(self.mks, self.threads)


@derived_object
class SandwichSearchStrategy(ms.search_strategy.PySearchStrategy):
    """Fast start then finetune (``slice_search``) over the micro-kernels of the design spaces;
    with ``start``, ``refine`` that reused schedule against ``alternatives`` instead."""

    def __init__(self, threads: int, finetune_top: int = 2, start: GemmSchedule | None = None,
                 alternatives: Sequence[GemmSchedule] = ()) -> None:
        super().__init__()
        self.threads = threads
        self.finetune_top = finetune_top
        self.start, self.alternatives = start, tuple(alternatives)
        self.best: tuple[GemmSchedule, float] | None = None

    def _initialize_with_tune_context(self, context) -> None:
        self.mod = context.mod

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None):
        mks = [schedule_of(s.mod).mk for s in design_spaces if schedule_of(s.mod) is not None]
        m, shape = workload_shape(self.mod)
        self.trials_left = max_trials
        problem = Problem(m, shape.n, shape.k, self.threads)
        self._search: Search = (slice_search(problem, mks, self.finetune_top) if self.start is None
                                else refine(problem, self.start, self.alternatives))
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
        for s, g in zip(self._pending or [], gflops, strict=False):
            if self.best is None or g > self.best[1]:
                self.best = (s, g)
        try:
            self._pending = self._search.send(gflops)
        except StopIteration:
            self._pending = None

    def clone(self):
        return SandwichSearchStrategy(self.threads, self.finetune_top, self.start, self.alternatives)


class KernelCache:
    """Compiled dynamic-m kernels keyed by (shape, schedule): built once, timed at any m."""

    def __init__(self, target: tvm.target.Target) -> None:
        self.target = target
        self.modules: dict[str, tvm.runtime.Module] = {}
        self.builds = 0
        self.build_seconds = 0.0

    def get(self, shape: GemmShape, schedule: GemmSchedule):
        key = f"{shape.name}:{schedule.key}"
        if key not in self.modules:
            import time

            t0 = time.perf_counter()
            func = linear_primfunc(shape, [Bucket(1 << 62, schedule)], name="main", check_well_formed=False)
            self.modules[key] = tvm.compile(tvm.IRModule({"main": func}), target=self.target).mod
            self.builds += 1
            self.build_seconds += time.perf_counter() - t0
        return key, self.modules[key]


@derived_object
class InProcessBuilder(ms.builder.PyBuilder):
    """Builds annotated candidates through the kernel cache; the artifact is the cache key."""

    def __init__(self, cache: KernelCache) -> None:
        super().__init__()
        self.cache = cache

    def build(self, build_inputs):
        out = []
        for inp in build_inputs:
            schedule = schedule_of(inp.mod)
            if schedule is None:
                out.append(ms.builder.BuilderResult(None, "not a Sandwich GEMM candidate"))
                continue
            _, shape = workload_shape(inp.mod)
            try:
                key, _ = self.cache.get(shape, schedule)
                out.append(ms.builder.BuilderResult(key, None))
            except Exception as err:  # noqa: BLE001 - reported per candidate, like LocalBuilder
                out.append(ms.builder.BuilderResult(None, str(err)))
        return out


@derived_object
class InProcessRunner(ms.runner.PyRunner):
    """Times cached kernels the way the model calls them: back to back, with weights cold.

    In a served model every Linear reads its own weight once per step, so the weight comes
    from DRAM, not from the last level cache. The runner therefore rotates through enough
    copies of the weight (``args[1]``) to overflow ``cold_bytes`` and times each call in that
    rotation (the median of ``repeat`` rounds). Without rotation a decode GEMV measures L3
    bandwidth and picks schedules that lose in the model.
    """

    def __init__(self, cache: KernelCache, min_repeat_ms: float = 10.0, repeat: int = 3,
                 cold_bytes: int | None = None) -> None:
        super().__init__()
        self.cache = cache
        self.min_repeat_ms = min_repeat_ms
        self.repeat = repeat
        self.cold_bytes = cold_weight_bytes() if cold_bytes is None else cold_bytes
        self._args: dict[tuple, list] = {}
        self._weights: list = []
        self._weights_key: tuple | None = None

    def _tensors(self, args_info) -> list:
        key = tuple((tuple(int(d) for d in a.shape), str(a.dtype)) for a in args_info)
        if key not in self._args:
            rng = np.random.default_rng(0)
            self._args.clear()  # keep one shape's tensors alive, not every m's
            self._args[key] = [
                tvm.runtime.tensor(_random(rng, shape, dtype)) for shape, dtype in key
            ]
            # The weight is the same for every m of a GEMM: its cold copies (twice the LLC,
            # ~1 GB on a 480 MiB L3) are made once per weight, not once per m.
            if len(key) > 1 and key[1] != self._weights_key:
                self._weights = []  # free the previous copies before making new ones
                w = self._args[key][1].numpy()
                copies = max(1, math.ceil(self.cold_bytes / max(w.nbytes, 1)))
                self._weights = [tvm.runtime.tensor(w) for _ in range(copies)]
                self._weights_key = key[1]
        return self._args[key]

    def _time(self, fn, args: list) -> list[float]:
        calls = [(args[0], w, *args[2:]) for w in self._weights] if self._weights else [tuple(args)]
        fn(*calls[-1])  # warm-up: first call of a new module, wakes the pool
        t0 = time.perf_counter()
        for c in calls:  # one pass sizes the rounds (the weights are cold again by its end)
            fn(*c)
        one = (time.perf_counter() - t0) / len(calls)
        rounds = max(1, math.ceil(self.min_repeat_ms / 1e3 / max(one * len(calls), 1e-6)))
        # A pass already as long as a round is the first sample (large m: one call per round).
        out = [one] if rounds == 1 else []
        while len(out) < self.repeat:
            t0 = time.perf_counter()
            for _ in range(rounds):
                for c in calls:
                    fn(*c)
            out.append((time.perf_counter() - t0) / (rounds * len(calls)))
        return out

    def run(self, runner_inputs):
        futures = []
        for inp in runner_inputs:
            mod = self.cache.modules.get(inp.artifact_path)
            if mod is None:
                futures.append(_Done(ms.runner.RunnerResult(None, f"no artifact {inp.artifact_path}")))
                continue
            times = self._time(mod["main"], self._tensors(inp.args_info))
            futures.append(_Done(ms.runner.RunnerResult(times, None)))
        return futures


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Normal values in ``dtype``; ``uint32`` (bf16 k-pairs) as the bits of two bf16 normals."""
    if dtype == "uint32":
        halves = rng.standard_normal((*shape, 2)).astype(numpy_dtype("bfloat16"))
        return np.ascontiguousarray(halves).view(np.uint32).reshape(shape)
    return rng.standard_normal(shape).astype(numpy_dtype(dtype))


@derived_object
class _Done(ms.runner.PyRunnerFuture):
    def __init__(self, result) -> None:
        super().__init__()
        self._result = result

    def done(self) -> bool:
        return True

    def result(self):
        return self._result

