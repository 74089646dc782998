"""``SandwichGemmRule``: MetaSchedule design spaces for the Linear pattern on a packed weight.

A ``PyScheduleRule`` that annotates the ``linear`` block with one seed ``GemmSchedule``
(``sandwich.gemm``) per micro-kernel: one design space per micro-kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm.ir.utils import derived_object  # noqa: E402,I001
from tvm.s_tir import meta_schedule as ms  # noqa: E402

from ..microkernel import MicroKernel
from ..schedule import Polymerization
from ..search import Problem, seed
from .workload import ANNOTATION, BLOCK, workload_shape


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
