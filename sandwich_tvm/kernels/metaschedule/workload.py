"""The Linear workload MetaSchedule tunes, and the ``sandwich.gemm`` annotation on its block.

``linear_workload`` builds the pattern (static m, packed weight, optional epilogue);
``annotate``/``schedule_of`` write and read a ``GemmSchedule`` as an ordinary trace
instruction, so tuning records replay and live in any MetaSchedule database;
``materialize`` turns an annotated workload into the generated micro-kernel program.
"""

from __future__ import annotations

from tvm import te

from ... import interrupts
from ...tvm_compat import tvm
from ..codegen import Bucket, linear_primfunc
from ..packing import WeightLayout
from ..schedule import GemmSchedule, GemmShape

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
        {"global_symbol": "main", "tir.noalias": True, "sandwich.epilogue": epilogue,
         "sandwich.dtype": dtype})
    return tvm.IRModule({"main": func})


def workload_shape(mod: tvm.IRModule) -> tuple[int, GemmShape]:
    """(m, shape) of a Linear workload, read from its buffers and epilogue attribute."""
    func = mod["main"]
    a, wp, *_, y = func.params  # buffers in this TVM
    epilogue = str(func.attrs["sandwich.epilogue"]) if "sandwich.epilogue" in func.attrs else "none"
    m, k = (int(d) for d in a.shape)
    n = int(y.shape[1]) * (2 if epilogue == "silu_mul" else 1)
    if "sandwich.dtype" in func.attrs:  # quantized weights are bytes
        dtype = str(func.attrs["sandwich.dtype"])
    else:
        dtype = "bfloat16" if str(wp.dtype) == "uint32" else str(wp.dtype)
    return m, GemmShape(n, k, dtype, epilogue)


def _linear_block(sch: tvm.s_tir.Schedule) -> tvm.s_tir.schedule.SBlockRV | None:
    try:
        return sch.get_sblock(BLOCK, func_name="main")
    except Exception:  # noqa: BLE001 - not our pattern
        if interrupts.requested():  # Ctrl-C that TVM handed back as an error
            raise
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
    func = linear_primfunc(shape, [Bucket(1 << 62, schedule)], name="main", reuse=False)
    return tvm.IRModule({"main": func})
