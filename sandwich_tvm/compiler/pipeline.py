"""The ``sandwich`` Relax pipeline: stock CPU passes plus default schedules for what we did not generate.

Linear layers arrive as calls to Sandwich's generated kernels (already scheduled). Everything
Relax legalizes afterwards (RMSNorm, SiLU·mul, residual adds, softmax, embedding gathers) is
fused by ``FuseOps``/``FuseTIR`` and then scheduled by DLight's CPU rules or, for injective
functions, by ``Elementwise`` below, so no PrimFunc reaches LLVM as naive serial loops.
"""

from __future__ import annotations

from tvm import relax, s_tir, tirx
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline, try_inline_contiguous_spatial
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

from ..kernels.microkernel import ISAS
from ..tvm_compat import target_isa, tvm

PARALLEL_GRAIN = 256  # elements per parallel chunk of an elementwise function


def _normalized(rule: CPUScheduleRule, func: tirx.PrimFunc, target: tvm.target.Target):
    """(schedule, block infos) of a PrimFunc this CPU rule may schedule, else None."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    return None if infos is None else (sch, infos)


class Elementwise(CPUScheduleRule):
    """DLight-style rule for injective functions: inline into the last block, fuse its loops,
    parallel chunks of ``PARALLEL_GRAIN`` elements, vectorized inside."""

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _tunable: bool):
        found = _normalized(self, func, target)
        if found is None:
            return None
        sch, infos = found
        infos = try_inline(sch, infos)
        if len(infos) != 1 or not infos[0].is_injective():
            return None
        loops = sch.get_loops(infos[0].block_rv)
        if not loops:
            return None
        fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        outer, inner = sch.split(fused, factors=[None, PARALLEL_GRAIN])
        sch.parallel(outer)
        _, vec = sch.split(inner, factors=[None, ISAS.get(target_isa(target), ISAS["neon"]).lanes])
        sch.vectorize(vec)
        return sch


class InlinedReduction(dl.cpu.Reduction):
    """DLight's CPU reduction rule after inlining the spatial producers (RMSNorm's casts and
    squares would otherwise be materialized as full [rows, hidden] workspaces on every call)."""

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, tunable: bool):
        found = _normalized(self, func, target)
        if found is None:
            return None
        sch, infos = found
        try_inline_contiguous_spatial(sch, infos)
        return super().apply(sch.mod["main"], target, tunable)


# The KV cache's per-token kernels arrive as serial loop nests over the tokens; their token
# loop is independent, so it runs in parallel.
PARALLEL_TOKEN_LOOP = ("fused_rope", "tir_kv_cache_transpose_append")


def _parallel_outer(func: tirx.PrimFunc) -> tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    loops = sch.get_loops(blocks[0]) if blocks else []
    if loops:
        sch.parallel(loops[0])
    return sch.mod["main"]


@tvm.transform.module_pass(opt_level=0, name="MarkGeneratedScheduled")
def mark_generated_scheduled(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """PrimFuncs present before legalization (our kernels, the KV cache's CPU kernels) are final;
    the cache's per-token kernels get their token loop parallelized first."""
    for gv, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc) and "tirx.is_scheduled" not in func.attrs:
            if gv.name_hint in PARALLEL_TOKEN_LOOP:
                func = _parallel_outer(func)
            mod[gv] = func.with_attr("tirx.is_scheduled", True)
    return mod


def default_schedule_pass() -> tvm.transform.Pass:
    return dl.ApplyDefaultSchedule(dl.cpu.GEMV(), InlinedReduction(), Elementwise())


def schedule_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    """Up to and including the default schedules: afterwards every operator PrimFunc is scheduled."""
    return ([mark_generated_scheduled] + cpu_generic.library_dispatch_passes(target)
            + cpu_generic.legalize_passes(target) + [default_schedule_pass()])


def lowering_passes(target: tvm.target.Target) -> list[tvm.transform.Pass]:
    return cpu_generic.dataflow_lower_passes(target) + cpu_generic.finalize_passes(target)


def sandwich_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """Stock CPU lowering with DLight default schedules after fusion (registered as "sandwich")."""

    @tvm.transform.module_pass(opt_level=0, name="SandwichPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(schedule_passes(target) + lowering_passes(target))(mod)

    return _pipeline


def unscheduled(mod: tvm.IRModule) -> list[str]:
    """PrimFuncs no rule scheduled (should be empty after the pipeline's schedule step)."""
    return sorted(gv.name_hint for gv, f in mod.functions_items()
                  if isinstance(f, tirx.PrimFunc) and "tirx.is_scheduled" not in f.attrs)


if "sandwich" not in relax.pipeline.PIPELINE_MAP:
    relax.register_pipeline("sandwich")(sandwich_pipeline)
