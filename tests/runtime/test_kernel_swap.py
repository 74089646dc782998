"""Swapping kernels while serving: another build of the same model (new records) takes over
between two steps, over the same weights and KV cache, and greedy tokens do not change."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from sandwich_tvm.compiler.artifact import compile_model
from sandwich_tvm.host import host_signature
from sandwich_tvm.kernels.database import KernelRecord, save_record
from sandwich_tvm.kernels.microkernel import kernel_isa, microkernels
from sandwich_tvm.kernels.schedule import GemmSchedule, Polymerization, Slice
from sandwich_tvm.kernels.search import Problem, Tuned, caps
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.shapes import linear_shapes
from sandwich_tvm.runtime.engine import Engine, EngineError
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import host_isa

from ..model.hf_models import hf_checkpoint
from ..precompile import warm_up

pytestmark = pytest.mark.compile


def split_k_records(cfg, threads: int, root) -> None:
    """A record for every GEMM whose one schedule splits k over the threads (another reduction
    order than the default schedules')."""
    from sandwich_tvm.host import cpu_flags

    for shape in linear_shapes(cfg).values():
        mk = min(microkernels(kernel_isa(host_isa(), shape.dtype, cpu_flags()), shape.dtype),
                 key=lambda mk: (mk.mr, -mk.nr))
        poly = Polymerization(1, 1, threads)
        cap = caps(Problem(1, shape.n, shape.k, threads), mk, poly)
        sch = GemmSchedule(mk, Slice(mk.mr, mk.nr, min(cap.kc, mk.kc_align * 2)), poly)
        save_record(KernelRecord(shape, threads, host_signature(), [Tuned(1, sch, 1.0, True)]), root)


def _split_k_spec(base: Path) -> RunSpec:
    """``tiny_model``'s build on split-k records (written once a session)."""
    cfg, plan, root = load_config(hf_checkpoint(base, "mha-untied")), ExecPlan.all_cpus(), base / "split-k"
    if not root.is_dir():
        for threads in {plan.prefill_threads, plan.decode_threads}:
            split_k_records(cfg, threads, root)
    return RunSpec(cfg.name, cfg, plan, max_batch=8, kv_dtype="float32", records=root)


warm_up(__name__, "test_a_swap_mid_generation_keeps_the_greedy_tokens", lambda base: [_split_k_spec(base)])


def test_a_swap_mid_generation_keeps_the_greedy_tokens(tiny_model, precompiler, tmp_path_factory):
    _, compiled, params, plan = tiny_model
    spec = _split_k_spec(tmp_path_factory.getbasetemp())
    assert spec.plan == plan and spec.config == compiled.config
    precompiler.ready(spec)
    tuned = compile_model(spec)
    assert tuned.path != compiled.path and tuned.meta["kernels"] != compiled.meta["kernels"]
    prompt = [3, 17, 5, 9, 28, 2, 11]
    ref = Engine(compiled, params, plan, max_batch=8).generate(prompt, 16).tokens
    alone = Engine(tuned, params, plan, max_batch=8).generate(prompt, 16).tokens
    engine = Engine(compiled, params, plan, max_batch=8)
    seen: list[int] = []

    def after(token: int) -> None:  # between two decode steps, as the serving loop does it
        seen.append(token)
        if len(seen) == 6:
            engine.swap_kernels(tuned)

    got = engine.generate(prompt, 16, on_token=after)
    assert engine.kernel_swaps == 1 and engine.compiled is tuned
    assert got.tokens == ref == alone
    # a build of another model shape, batch or dtype is refused, and the engine goes on
    other = replace(tuned, meta={**tuned.meta, "max_batch": 4})
    with pytest.raises(EngineError, match="max_batch"):
        engine.swap_kernels(other)
    assert engine.generate(prompt, 16).tokens == ref
