"""The server with a draft model, through HTTP: concurrent greedy requests, plain and streamed,
answer what HF's greedy decoding gives, and ``/metrics`` shows the drafts, their acceptance,
tokens per step and the draft model's time. The model drafts for itself (a second engine over
the same compiled model, its own KV cache): nearly every draft is accepted."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import numpy as np
import pytest

from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.async_engine import AsyncEngine
from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.draft_model import DraftModel
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.metrics import ServingMetrics
from sandwich_tvm.tvm_compat import host_isa

from .conftest import CONTEXT, MODEL, POLICY, start_app
from .test_openai_api import _hf_greedy

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.compile
NEW = 16


@pytest.fixture(scope="module")
def drafting(served):
    """A second server over the served model, drafting 3 tokens per step with that model."""
    from dataclasses import replace

    from sandwich_tvm.server.app import Server, create_app

    compiled = served.engine.compiled
    params = load_params(served.model_dir, compiled.config, compiled.params, host_isa())

    def engine() -> Engine:
        return Engine(compiled, params, served.engine.plan, context=CONTEXT, max_batch=POLICY.max_batch,
                      prefill_chunk=POLICY.prefill_budget)

    target = engine()
    metrics = ServingMetrics(MODEL)
    batch = BatchEngine(target, replace(POLICY, num_speculative_tokens=3), eos_ids=served.tok.eos_ids,
                        metrics=metrics, drafter=DraftModel(engine(), target.use))
    async_engine = AsyncEngine(batch).start()
    url, stop = start_app(create_app(Server(async_engine, served.tok, MODEL, metrics)))
    yield url
    stop()
    async_engine.shutdown()


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + "{")).rsplit(" ", 1)[1])


def test_drafted_answers_are_hf_greedy_and_metrics_show_the_drafts(served, drafting):
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, served.engine.cfg.vocab_size, n)] for n in (5, 23, 40, 61)]

    def complete(prompt: list[int]) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{drafting}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == NEW
        return r.json()["choices"][0]["text"]

    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(complete, prompts))
    hf = [served.tok.decode(_hf_greedy(served.hf, p, NEW)) for p in prompts]
    assert got == hf
    drafted = _metric(drafting, "sandwich_spec_decode_num_draft_tokens_total")
    accepted = _metric(drafting, "sandwich_spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and accepted >= 0.9 * drafted
    assert _metric(drafting, "sandwich_spec_decode_acceptance_rate") == pytest.approx(accepted / drafted)
    assert _metric(drafting, "sandwich_spec_decode_tokens_per_step") > 2
    assert _metric(drafting, "sandwich_spec_decode_draft_seconds_total") > 0

    body = {"model": MODEL, "prompt": prompts[1], "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{drafting}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == hf[1]
