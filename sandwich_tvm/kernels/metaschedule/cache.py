"""``KernelCache``: compiled dynamic-m kernels shared by the in-process builder and runner.

A generated kernel is symbolic in m, so one build serves every sequence length: builds are
cached by (shape, schedule), and the builder's artifact is the cache key the runner looks up.
"""

from __future__ import annotations

from ...tvm_compat import tvm
from ..codegen import Bucket, linear_primfunc
from ..schedule import GemmSchedule, GemmShape


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
            func = linear_primfunc(shape, [Bucket(1 << 62, schedule)], name="main", check_well_formed=False,
                                    reuse=False)
            self.modules[key] = tvm.compile(tvm.IRModule({"main": func}), target=self.target).mod
            self.builds += 1
            self.build_seconds += time.perf_counter() - t0
        return key, self.modules[key]
