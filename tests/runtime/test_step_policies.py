"""Mixed steps (decode tokens and prompt chunks in one forward) over the compiled tiny model:
greedy tokens equal the split policy's, whichever plan's cores a step lands on."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.sampling import SamplingParams
from sandwich_tvm.runtime.scheduler import SchedulerPolicy

pytestmark = pytest.mark.compile


def _serve(tiny_model, steps: str, prompts: list[list[int]]) -> tuple[list[list[int]], BatchEngine]:
    _out, compiled, params, plan = tiny_model
    engine = Engine(compiled, params, plan, context=256, max_batch=8, prefill_chunk=64, kv_tokens=1024)
    batch = BatchEngine(engine, SchedulerPolicy(max_batch=4, prefill_budget=48, chunk=16, steps=steps,
                                                mixed_prefill_tokens=20))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts[:2]):  # two decode while the rest arrive
        batch.add(str(i), p, greedy)
    for _ in range(4):
        for e in batch.step():
            out[e.request_id].append(e.token)
    for i, p in enumerate(prompts[2:], 2):
        batch.add(str(i), p, greedy)
    while batch.has_work():
        for e in batch.step():
            if e.token is not None:
                out[e.request_id].append(e.token)
        assert batch.engine.available_pages() == batch.scheduler.pages.free()
    return [out[str(i)] for i in range(len(prompts))], batch


def test_mixed_steps_give_the_split_policys_tokens(tiny_model):
    rng = np.random.default_rng(31)
    prompts = [[int(t) for t in rng.integers(0, 301, n)] for n in (5, 9, 40, 23, 3)]
    split, _ = _serve(tiny_model, "split", prompts)
    mixed, batch = _serve(tiny_model, "mixed", prompts)
    assert mixed == split
    assert batch.steps["mixed"] > 0
