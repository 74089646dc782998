"""BatchEngine over the compiled tiny model: batching, preemption, cancellation and a failed
step change no request's tokens and leave no page behind."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.engine import Engine, EngineError
from sandwich_tvm.runtime.sampling import SamplingParams
from sandwich_tvm.runtime.scheduler import SchedulerPolicy
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import host_isa

from ..model.hf_models import hf_checkpoint
from ..precompile import warm_up

pytestmark = pytest.mark.compile
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _spec(model_dir) -> RunSpec:
    cfg = load_config(model_dir)
    return RunSpec(cfg.name, cfg, ExecPlan.all_cpus(), max_batch=8, kv_dtype="float32")


# the session's MHA checkpoint (tests/model/hf_models.py): its build can start ahead
warm_up(__name__, "model", lambda base: [_spec(hf_checkpoint(base, "mha-untied"))])


@pytest.fixture(scope="module")
def model(tmp_path_factory, precompiler):
    out = hf_checkpoint(tmp_path_factory.getbasetemp(), "mha-untied")
    spec = _spec(out)
    compiled = precompiler.build(spec)
    return compiled, load_params(out, spec.config, compiled.params, host_isa()), spec.plan


def _engine(model, context: int, kv_tokens: int | None = None) -> Engine:
    compiled, params, plan = model
    return Engine(compiled, params, plan, context=context, max_batch=8, prefill_chunk=64, kv_tokens=kv_tokens)


def _drain(batch: BatchEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while batch.has_work():
        for e in batch.step():
            if e.token is not None:
                out.setdefault(e.request_id, []).append(e.token)
        assert batch.engine.available_pages() == batch.scheduler.pages.free()  # our count is the cache's
    return out


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in (1, 6, 23, 47, 70, 9)]


def test_greedy_batch_equals_the_single_request_path(model):
    engine = _engine(model, 256)
    prompts = _prompts(engine.cfg.vocab_size)
    alone = [engine.generate(p, GREEDY.max_tokens).tokens for p in prompts]
    one = BatchEngine(engine, SchedulerPolicy(max_batch=1, prefill_budget=64, chunk=64))
    one.add("x", prompts[3], GREEDY)
    assert _drain(one)["x"] == alone[3]  # one request: the same tokens as Engine.generate
    batch = BatchEngine(engine, SchedulerPolicy(max_batch=4, prefill_budget=48, chunk=16))
    for i, p in enumerate(prompts):
        batch.add(str(i), p, GREEDY)
    got = _drain(batch)
    assert [got[str(i)] for i in range(len(prompts))] == alone
    assert batch.scheduler.pages_used() == 0


def test_preemption_recomputes_without_changing_tokens(model):
    engine = _engine(model, 96)  # 7 pages; 6 short prompts that each grow to 3-4 pages
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, engine.cfg.vocab_size, n)] for n in (5, 9, 3, 12, 7, 10)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = [engine.generate(p, params.max_tokens).tokens for p in prompts]
    batch = BatchEngine(engine, SchedulerPolicy(max_batch=8, prefill_budget=64, chunk=64))
    seqs = [batch.add(str(i), p, params) for i, p in enumerate(prompts)]
    got = _drain(batch)
    assert any(s.preemptions for s in seqs)
    assert [got[str(i)] for i in range(len(prompts))] == alone
    assert batch.scheduler.pages_used() == 0


def test_abort_and_a_failed_step_free_every_page(model, monkeypatch):
    engine = _engine(model, 128, kv_tokens=512)
    assert engine.total_pages > 128 // engine.page_size + 1  # the pool is larger than one request
    prompts = _prompts(engine.cfg.vocab_size)
    batch = BatchEngine(engine, SchedulerPolicy(max_batch=4, prefill_budget=64, chunk=64))
    for i, p in enumerate(prompts[:3]):
        batch.add(str(i), p, GREEDY)
    batch.step()
    assert batch.pages_in_use() > 0
    event = batch.abort("1")
    assert event.finish_reason == "abort" and batch.abort("1") is None
    batch.step()

    def broken(*_a, **_k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine, "batch_decode", broken)
    events = batch.step()
    assert {e.finish_reason for e in events} == {"error"} and "kernel exploded" in events[0].error
    assert batch.pages_in_use() == 0 and not batch.has_work()  # the cache was cleared, entries too
    monkeypatch.undo()
    batch.add("again", prompts[2], GREEDY)  # still serving
    assert len(_drain(batch)["again"]) == GREEDY.max_tokens


def test_requests_that_cannot_fit_are_refused(model):
    engine = _engine(model, 64)
    batch = BatchEngine(engine, SchedulerPolicy(max_batch=2, prefill_budget=32, chunk=32))
    with pytest.raises(EngineError, match="context of 64 tokens"):
        batch.add("a", list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(EngineError, match="vocabulary"):
        batch.add("b", [engine.cfg.vocab_size], GREEDY)
    assert batch.check(list(range(10)), None) == 54  # no max_tokens: the rest of the context
