"""Speculative decoding with a draft model over the compiled tiny model: greedy tokens equal the
plain decode's with a draft that is often wrong (another random model) and with one that is
always right (the model itself), seeded sampling gives the plain run's tokens, preemption and
a draft cache too small for everyone change nothing, both caches' pages are accounted for after
every step, and a failing draft model turns drafting off without losing a request."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.compiler.artifact import compile_model
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.draft_model import DraftModel
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.sampling import SamplingParams
from sandwich_tvm.runtime.scheduler import SchedulerPolicy
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.tvm_compat import host_isa

from ..model.hf_models import hf_checkpoint

pytestmark = pytest.mark.compile
NEW = 24


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    """The one-layer draft checkpoint sharing the tiny model's vocabulary, compiled."""
    out = hf_checkpoint(tmp_path_factory.getbasetemp(), "mha-draft")
    cfg = load_config(out)
    compiled = compile_model(RunSpec(cfg.name, cfg, _plan(), max_batch=8, kv_dtype="float32"))
    return compiled, load_params(out, cfg, compiled.params, host_isa())


def _plan():
    from sandwich_tvm.topology.plan import ExecPlan

    return ExecPlan.all_cpus()


def _target(tiny_model, kv_tokens: int = 1024, context: int = 256) -> Engine:
    _out, compiled, params, plan = tiny_model
    return Engine(compiled, params, plan, context=context, max_batch=8, prefill_chunk=64, kv_tokens=kv_tokens)


def _batch(target: Engine, k: int, drafter=None) -> BatchEngine:
    return BatchEngine(target, SchedulerPolicy(max_batch=4, prefill_budget=64, chunk=32,
                                               num_speculative_tokens=k), drafter=drafter)


def _drafter(model, target: Engine, kv_tokens: int = 1024) -> DraftModel:
    compiled, params = model
    return DraftModel(Engine(compiled, params, target.plan, context=min(kv_tokens, 256), max_batch=8,
                             prefill_chunk=64, kv_tokens=kv_tokens), target.use)


def _serve(batch: BatchEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        batch.add(str(i), p, params)
    drafter = batch.scheduler.drafter
    while batch.has_work():
        for e in batch.step():
            if e.token is not None:
                out[e.request_id].append(e.token)
        assert batch.engine.available_pages() == batch.scheduler.pages.free()
        if isinstance(drafter, DraftModel):  # the draft cache's pages as counted, pops included
            assert drafter.engine.available_pages() == drafter.pages.free()
    if isinstance(drafter, DraftModel):  # every finished sequence released its draft cache
        assert drafter.pages.free() == drafter.pages.total and not drafter._seqs
    return [out[str(i)] for i in range(len(prompts))]


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in (3, 41, 70)]  # 70: three prefill chunks


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def test_greedy_with_a_draft_model_equals_plain_decode(tiny_model, draft_model):
    plain = _serve(_batch(_target(tiny_model), 0), _prompts(301), GREEDY)
    target = _target(tiny_model)
    spec = _batch(target, 3, _drafter(draft_model, target))
    assert _serve(spec, _prompts(301), GREEDY) == plain
    assert spec.drafted > 0 and spec.accepted < spec.drafted  # another random model: often wrong
    assert spec.scheduler.drafter.error is None and spec.scheduler.drafter.forwards > 0


def test_the_model_drafting_for_itself_is_accepted_and_takes_fewer_steps(tiny_model):
    plain_batch = _batch(_target(tiny_model), 0)
    plain = _serve(plain_batch, _prompts(301), GREEDY)
    target = _target(tiny_model)
    _out, compiled, params, _plan_ = tiny_model
    spec = _batch(target, 4, _drafter((compiled, params), target))
    assert _serve(spec, _prompts(301), GREEDY) == plain
    assert spec.accepted >= 0.9 * spec.drafted > 0  # the same weights: float noise only
    assert spec.steps["decode"] < plain_batch.steps["decode"] / 2


def test_seeded_sampling_with_a_draft_model_gives_the_plain_runs_tokens(tiny_model, draft_model):
    """Each emitted token is one sample from the target's own distribution, drawn in order from
    the request's generator: drafts change how many come per step, not which."""
    params = SamplingParams(max_tokens=NEW, temperature=0.9, seed=11, ignore_eos=True)
    plain = _serve(_batch(_target(tiny_model), 0), _prompts(301), params)
    target = _target(tiny_model)
    spec = _batch(target, 3, _drafter(draft_model, target))
    assert _serve(spec, _prompts(301), params) == plain and spec.drafted > 0


def test_preemption_and_a_small_draft_cache_change_no_token(tiny_model, draft_model):
    """A target cache of 10 pages preempts; the draft cache cannot hold the longest sequence
    (94 tokens), so that one stops getting drafts when it outgrows it."""
    prompts = _prompts(301) + [[7, 8, 9] * 10]
    plain = _serve(_batch(_target(tiny_model, kv_tokens=160, context=128), 0), prompts, GREEDY)
    target = _target(tiny_model, kv_tokens=160, context=128)
    drafter = _drafter(draft_model, target, kv_tokens=64)
    spec = _batch(target, 3, drafter)
    preempted = []
    schedule = spec.scheduler.schedule

    def counted():
        step = schedule()
        preempted.extend(step.preempted if step else [])
        return step

    spec.scheduler.schedule = counted
    assert _serve(spec, prompts, GREEDY) == plain
    assert preempted and spec.drafted > 0 and drafter.pages.total * drafter.pages.page_size < 94


def test_a_failing_draft_model_turns_drafting_off_and_loses_nothing(tiny_model, draft_model, monkeypatch):
    plain = _serve(_batch(_target(tiny_model), 0), _prompts(301), GREEDY)
    target = _target(tiny_model)
    drafter = _drafter(draft_model, target)
    calls = {"n": 0}
    real = drafter.engine.batch_decode

    def flaky(slots, tokens):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("draft kernel fault")
        return real(slots, tokens)

    monkeypatch.setattr(drafter.engine, "batch_decode", flaky)
    spec = _batch(target, 3, drafter)
    assert _serve(spec, _prompts(301), GREEDY) == plain
    assert drafter.error == "RuntimeError: draft kernel fault" and calls["n"] == 3


def test_stop_tokens_and_an_abort_mid_draft_leave_both_caches_empty(tiny_model, draft_model):
    """A stop token inside an accepted draft ends the request there (the rest of the draft is
    not emitted), as without drafts; an aborted request gives its draft pages back."""
    prompts = _prompts(301)
    plain = _serve(_batch(_target(tiny_model), 0), prompts, GREEDY)
    stop = plain[1][9]  # the 10th token of the second request
    params = SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=(stop,))
    want = _serve(_batch(_target(tiny_model), 0), prompts, params)
    assert want[1][-1] == stop and len(want[1]) <= 10
    target = _target(tiny_model)
    _out, compiled, params_, _plan_ = tiny_model
    drafter = _drafter((compiled, params_), target)  # always right: the stop token comes inside drafts
    spec = _batch(target, 4, drafter)
    assert _serve(spec, prompts, params) == want and spec.accepted > 0

    spec.add("gone", prompts[2], GREEDY)
    spec.add("kept", prompts[0], GREEDY)
    got: list[int] = []
    while len(got) < 6:
        got += [e.token for e in spec.step() if e.request_id == "kept" and e.token is not None]
    assert "gone" in {s.request_id for s in spec.scheduler.running} and len(drafter._seqs) == 2
    spec.abort("gone")
    while spec.has_work():
        got += [e.token for e in spec.step() if e.token is not None]
    assert got == plain[0] and not drafter._seqs and drafter.pages.free() == drafter.pages.total
    assert drafter.engine.available_pages() == drafter.pages.total


def test_prefill_steps_feed_the_prompt_to_the_draft_model_too(tiny_model, draft_model):
    """By the first decode step the draft cache holds the prompt, chunk by chunk as the target
    took it, so that step feeds the draft model one token, not the prompt."""
    target = _target(tiny_model)
    drafter = _drafter(draft_model, target)
    spec = _batch(target, 3, drafter)
    prompt = _prompts(301)[2]  # 70 tokens: chunks of 32, 32, 6
    spec.add("r", prompt, GREEDY)
    held = []
    while not spec.scheduler.running or not spec.scheduler.running[0].decoding:
        spec.step()
        held.append(len(drafter._seqs["r"].tokens))
    assert held == [32, 64, 70] and drafter._seqs["r"].tokens == prompt
    fed = drafter.forwards
    spec.step()  # the first decode step: one token fed, two drafted
    assert drafter.forwards == fed + 3 and len(drafter._seqs["r"].tokens) == 70 + 1 + 2
    while spec.has_work():
        spec.step()
    assert not drafter._seqs
