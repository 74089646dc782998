"""Prefix caching over the compiled tiny model: requests forked from cached prefixes give the
tokens they give with the cache off (and HF's), and TVM's page count equals ours at every step."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.sampling import SamplingParams
from sandwich_tvm.runtime.scheduler import SchedulerPolicy

pytestmark = pytest.mark.compile
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _batch(tiny_model, caching: bool, kv_tokens: int = 1024, max_batch: int = 4) -> BatchEngine:
    _out, compiled, params, plan = tiny_model
    engine = Engine(compiled, params, plan, context=256, max_batch=8, prefill_chunk=64, kv_tokens=kv_tokens)
    policy = SchedulerPolicy(max_batch=max_batch, prefill_budget=64, chunk=64, prefix_caching=caching)
    return BatchEngine(engine, policy)


def _settled(batch: BatchEngine) -> None:
    """TVM's free pages are ours; used + cached + free = total."""
    s = batch.scheduler
    assert batch.engine.available_pages() == s.pages.free()
    assert s.pages_used() + s.pages_cached() + s.pages.free() == batch.engine.total_pages


def _serve(batch: BatchEngine, requests: dict[str, list[int]], params: SamplingParams = GREEDY
           ) -> dict[str, list[int]]:
    for rid, prompt in requests.items():
        batch.add(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while batch.has_work():
        for e in batch.step():
            if e.token is not None:
                out[e.request_id].append(e.token)
        _settled(batch)
    assert batch.scheduler.pages_used() == 0
    return out


def _tokens(rng, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


def test_requests_sharing_a_system_prompt_fork_it_and_keep_their_tokens(tiny_model):
    on, off = _batch(tiny_model, True), _batch(tiny_model, False)
    vocab = on.engine.cfg.vocab_size
    rng = np.random.default_rng(11)
    system = _tokens(rng, 40, vocab)
    asks = {f"r{i}": system + _tokens(rng, n, vocab) for i, n in enumerate((3, 9, 17, 1, 25))}
    first = {"r0": asks.pop("r0")}
    got = _serve(on, first) | _serve(on, asks)  # r0 fills the cache, the others share its pages
    want = _serve(off, first) | _serve(off, asks)
    assert got == want
    seqs_hit = on.scheduler.prefix.hit_tokens
    assert seqs_hit >= 4 * 32  # two whole pages of the system prompt per later request
    assert off.scheduler.prefix is None and off.scheduler.pages_cached() == 0


def test_multi_turn_chat_reuses_its_history_and_matches_hf(tiny_model):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    out_dir = tiny_model[0]
    on, off = _batch(tiny_model, True), _batch(tiny_model, False)
    vocab = on.engine.cfg.vocab_size
    rng = np.random.default_rng(12)
    history: list[int] = []
    hits_before = 0
    hf = AutoModelForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32).eval()
    for turn in range(3):
        prompt = history + _tokens(rng, 10 + 7 * turn, vocab)
        got = _serve(on, {f"t{turn}": prompt})[f"t{turn}"]
        assert got == _serve(off, {f"t{turn}": prompt})[f"t{turn}"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              min_new_tokens=GREEDY.max_tokens)[0, len(prompt):].tolist()
        assert got == ref
        if turn:  # the whole history was cached but its last token (page aligned)
            cached = on.scheduler.prefix.hit_tokens - hits_before
            assert cached == (len(history) - 1) // on.engine.page_size * on.engine.page_size > 0
        hits_before = on.scheduler.prefix.hit_tokens
        history = prompt + got


def test_eviction_under_a_small_cache_changes_no_tokens(tiny_model):
    on = _batch(tiny_model, True, kv_tokens=256, max_batch=3)
    off = _batch(tiny_model, False, kv_tokens=256, max_batch=3)
    vocab = on.engine.cfg.vocab_size
    rng = np.random.default_rng(13)
    stems = [_tokens(rng, 48, vocab) for _ in range(3)]
    requests = {f"r{i}": stems[i % 3] + _tokens(rng, 5 + i, vocab) for i in range(9)}
    got, want = {}, {}
    for rid, prompt in requests.items():  # one at a time: each finds the cache as the last left it
        got |= _serve(on, {rid: prompt})
        want |= _serve(off, {rid: prompt})
    assert got == want
    assert on.scheduler.evictions > 0 and on.scheduler.prefix.hit_tokens > 0


def test_a_request_can_opt_out(tiny_model):
    on = _batch(tiny_model, True)
    vocab = on.engine.cfg.vocab_size
    prompt = _tokens(np.random.default_rng(14), 40, vocab)
    _serve(on, {"a": prompt})
    cached = on.scheduler.pages_cached()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_prompt=False)
    seq = on.add("b", prompt, params)
    while on.has_work():
        on.step()
    assert seq.cached_tokens == 0 and on.scheduler.pages_cached() == cached  # b neither took nor left
    _settled(on)


def test_a_failed_sample_ends_its_request_and_the_others_go_on(tiny_model, monkeypatch):
    """NaN logits (or any error while sampling) end that request with an error; the request
    batched with it gets its own tokens, and so does the next one."""
    batch = _batch(tiny_model, True)
    vocab = batch.engine.cfg.vocab_size
    prompt = _tokens(np.random.default_rng(3), 12, vocab)
    want = _serve(_batch(tiny_model, False), {"x": prompt})["x"]
    batch.add("a", prompt[:5], GREEDY)
    batch.add("b", prompt, GREEDY)

    def fail(logits):
        raise ValueError("no finite maximum")

    batch.seqs["a"].sampler = fail
    events = batch.step()
    failed = [e for e in events if e.finish_reason == "error"]
    assert [e.request_id for e in failed] == ["a"] and "no finite maximum" in failed[0].error
    got = [e.token for e in events if e.request_id == "b" and e.token is not None]
    while batch.has_work():
        got += [e.token for e in batch.step() if e.token is not None]
        _settled(batch)
    assert got == want and batch.scheduler.pages_used() == 0
    # a failure outside the per-request sampling (the step itself) ends the step's requests
    batch.add("c", prompt, GREEDY)
    monkeypatch.setattr(batch, "_sample", lambda step, logits: (_ for _ in ()).throw(ValueError("bug")))
    events = batch.step()
    assert [(e.request_id, e.finish_reason) for e in events] == [("c", "error")] and not batch.has_work()
    monkeypatch.undo()
    assert _serve(batch, {"d": prompt})["d"] == want
