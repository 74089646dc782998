"""``InProcessRunner``: a MetaSchedule ``PyRunner`` that times cached kernels in this process,
with the weight cold as the served model reads it."""

from __future__ import annotations

import math
import time

import numpy as np
from tvm.ir.utils import derived_object  # noqa: E402,I001
from tvm.s_tir import meta_schedule as ms  # noqa: E402

from ... import interrupts
from ...host import cold_weight_bytes
from ...tvm_compat import tvm
from ..packing import numpy_dtype
from .cache import KernelCache


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
            interrupts.check()
            mod = self.cache.modules.get(inp.artifact_path)
            if mod is None:
                futures.append(_Done(ms.runner.RunnerResult(None, f"no artifact {inp.artifact_path}")))
                continue
            times = self._time(mod["main"], self._tensors(inp.args_info))
            futures.append(_Done(ms.runner.RunnerResult(times, None)))
        return futures


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Normal values in ``dtype``; ``uint32`` (bf16 k-pairs) as the bits of two bf16 normals;
    ``uint8`` (quantized blocks) as bytes in 0x10..0x3b, so every fp16 d and m two of them make
    is a normal number below 1 (no NaN or subnormal to slow the timing)."""
    if dtype == "uint8":
        return rng.integers(0x10, 0x3C, size=shape, dtype=np.uint8)
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
