"""``InProcessBuilder``: a MetaSchedule ``PyBuilder`` that builds candidates in this process."""

from __future__ import annotations

from tvm.ir.utils import derived_object  # noqa: E402,I001
from tvm.s_tir import meta_schedule as ms  # noqa: E402

from ... import interrupts
from .cache import KernelCache
from .workload import schedule_of, workload_shape


@derived_object
class InProcessBuilder(ms.builder.PyBuilder):
    """Builds annotated candidates through the kernel cache; the artifact is the cache key."""

    def __init__(self, cache: KernelCache) -> None:
        super().__init__()
        self.cache = cache

    def build(self, build_inputs):
        out = []
        for inp in build_inputs:
            interrupts.check()
            schedule = schedule_of(inp.mod)
            if schedule is None:
                out.append(ms.builder.BuilderResult(None, "not a Sandwich GEMM candidate"))
                continue
            _, shape = workload_shape(inp.mod)
            try:
                key, _ = self.cache.get(shape, schedule)
                out.append(ms.builder.BuilderResult(key, None))
            except Exception as err:  # noqa: BLE001 - reported per candidate, like LocalBuilder
                if interrupts.requested():  # Ctrl-C that TVM handed back as an error
                    raise
                out.append(ms.builder.BuilderResult(None, str(err)))
        return out
