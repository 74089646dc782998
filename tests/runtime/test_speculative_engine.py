"""Speculative decoding (prompt lookup) over the compiled tiny model: greedy tokens equal the
plain decode's and HF's, drafts get accepted, and the rejected positions leave the cache."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.sampling import SamplingParams
from sandwich_tvm.runtime.scheduler import SchedulerPolicy

pytestmark = pytest.mark.compile
NEW = 40


def _batch(tiny_model, k: int) -> BatchEngine:
    _out, compiled, params, plan = tiny_model
    engine = Engine(compiled, params, plan, context=256, max_batch=8, prefill_chunk=64, kv_tokens=1024)
    return BatchEngine(engine, SchedulerPolicy(max_batch=4, prefill_budget=64, chunk=64,
                                               num_speculative_tokens=k, prompt_lookup_min=1))


def _serve(batch: BatchEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        batch.add(str(i), p, params)
    while batch.has_work():
        for e in batch.step():
            if e.token is not None:
                out[e.request_id].append(e.token)
        assert batch.engine.available_pages() == batch.scheduler.pages.free()  # pops counted too
    return [out[str(i)] for i in range(len(prompts))]


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(21)
    motif = [int(t) for t in rng.integers(0, vocab, 6)]
    return [motif * 5 + [int(t) for t in rng.integers(0, vocab, n)] for n in (1, 4, 9)]


def test_greedy_with_drafts_equals_plain_decode_and_hf(tiny_model):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    spec, plain = _batch(tiny_model, 4), _batch(tiny_model, 0)
    prompts = _prompts(spec.engine.cfg.vocab_size)
    got = _serve(spec, prompts, greedy)
    assert got == _serve(plain, prompts, greedy)
    assert spec.drafted > 0 and spec.accepted > 0 and plain.drafted == 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_model[0], torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert got[0] == ref[0, len(prompts[0]):].tolist()


def test_sampling_with_drafts_runs_to_length_and_frees_its_pages(tiny_model):
    spec = _batch(tiny_model, 3)
    params = SamplingParams(max_tokens=NEW, temperature=0.8, seed=5, ignore_eos=True)
    outs = _serve(spec, _prompts(spec.engine.cfg.vocab_size), params)
    assert [len(o) for o in outs] == [NEW] * 3 and spec.drafted > 0
    assert spec.scheduler.pages_used() == 0
