"""Kernel choice per phase as a Relax pass: the model file stays a model.

Every Linear of the model calls its GEMM's *prefill* kernel (tuned for the prefill plan's
thread count, any m). ``SelectPhaseKernels`` rewrites the calls inside the decode functions
(``decode``, ``batch_decode``, a pipeline's ``decode_head``) to the same GEMM's decode kernel:
tuned for the decode plan's threads, buckets only up to the batch size; a call whose row count
is known when compiling (``decode``: one token) gets the kernel of that m's bucket alone. All
read the same prepacked weight, so the phases share one copy of it.
"""

from __future__ import annotations

from tvm import relax

from ..model.linear import KernelSet
from ..tvm_compat import tvm

DECODE_FUNCTIONS = ("decode", "batch_decode", "decode_head")


def _static_rows(call: relax.Call) -> int | None:
    """The GEMM's m (rows of its first argument, ``A[m, k]``) when it is a constant."""
    shape = call.args[1].fields[0].ty.shape
    if not isinstance(shape, relax.ShapeExpr):
        return None
    rows = shape.values[0]
    return int(rows) if isinstance(rows, tvm.tirx.IntImm) else None


@relax.expr_functor.mutator
class _ToDecode(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, kernels: KernelSet):
        super().__init__(mod)
        self.kernels = kernels
        self.call_tir = tvm.ir.Op.get("relax.call_tir")
        self.swapped: dict[tuple[str, int | None], relax.GlobalVar] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != self.call_tir or not isinstance(call.args[0], relax.GlobalVar):
            return call
        kernel = self.kernels.calls.get(call.args[0].name_hint)
        if kernel is None or kernel[1] != "prefill":
            return call
        shape, _, epilogue = kernel
        key = (call.args[0].name_hint, _static_rows(call))
        if key not in self.swapped:
            decode_name, func = self.kernels.primfunc(shape, "decode", epilogue, m=key[1])
            self.swapped[key] = self.builder_.add_func(func, decode_name)
        return relax.Call(self.call_tir, [self.swapped[key], *call.args[1:]], call.attrs, call.ty_args)

    def run(self) -> tvm.IRModule:
        for gv, func in list(self.builder_.get().functions_items()):
            if gv.name_hint in DECODE_FUNCTIONS and isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()


def select_phase_kernels(kernels: KernelSet) -> tvm.transform.Pass:
    """The pass: decode functions call the decode kernels of ``kernels``."""

    @tvm.transform.module_pass(opt_level=0, name="SelectPhaseKernels")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return _ToDecode(mod, kernels).run()

    return _pass
