"""The compiled Relax Llama against HF transformers on the same random weights."""

from __future__ import annotations

import os

import numpy as np
import pytest

from sandwich_tvm.compiler.artifact import CompiledModel, compile_model
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.engine import Engine, EngineError
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS, host_isa

from ..precompile import selected, warm_up
from .hf_models import CONFIGS, hf_checkpoint

torch = pytest.importorskip("torch")

CPUS = tuple(sorted(PROCESS_CPUS))
PLAN = ExecPlan(CPUS, CPUS[:1], "test: decode on one core")  # a real switch between the phases
DECODE_STEPS = 32


def _spec(cfg, stock: bool = False, kv_dtype: str = "float32") -> RunSpec:
    return RunSpec(cfg.name, cfg, PLAN, stock=stock, kv_dtype=kv_dtype)


def _specs(base, **kw) -> list[RunSpec]:
    return [_spec(load_config(hf_checkpoint(base, case)), **kw) for case in sorted(CONFIGS)]


warm_up(__name__, "test_prefill_and_decode_match_hf",
        lambda base: _specs(base) + _specs(base, stock=True))
warm_up(__name__, "test_chunked_prefill_matches_hf",
        lambda base: [s for kv in ("bfloat16", "float16", "int8") for s in _specs(base, kv_dtype=kv)])


@pytest.fixture(scope="module", autouse=True)
def _half_in_background(hf_case, precompiler, request):
    """Per checkpoint, the stock and fp16-cache builds go to the second process (selected
    tests only), while the tests build the others here (when the session has not started
    them all already: ``warm_up``)."""
    cfg = load_config(hf_case[0])
    params = [p for test in ("test_prefill_and_decode_match_hf", "test_chunked_prefill_matches_hf")
              for p in selected(request, test) if hf_case[0].name.startswith(p["hf_case"])]
    precompiler.submit(*[_spec(cfg, **kw) for kw in ({"stock": True}, {"kv_dtype": "float16"})
                         if any(kw.items() <= p.items() for p in params)])


def _reference(hf, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


def _run(model_dir, compiled: CompiledModel, prompt: list[int]):
    cfg = compiled.config
    params = load_params(model_dir, cfg, compiled.params, host_isa())
    engine = Engine(compiled, params, PLAN)
    logits: list[np.ndarray] = []
    gen = engine.generate(prompt, DECODE_STEPS + 1, logits_out=logits)
    return engine, params, gen, np.stack(logits)


@pytest.mark.compile
@pytest.mark.parametrize("stock", [False, True], ids=["sandwich", "stock"])
def test_prefill_and_decode_match_hf(hf_case, stock, precompiler):
    model_dir, hf = hf_case
    cfg = load_config(model_dir)
    compiled = precompiler.build(_spec(cfg, stock))
    assert compiled.meta["unscheduled"] == []  # every operator got a schedule
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 45)]
    engine, params, gen, ours = _run(model_dir, compiled, prompt)
    ref = _reference(hf, prompt + gen.tokens[:-1])[len(prompt) - 1:]
    assert ours.shape == ref.shape == (DECODE_STEPS + 1, cfg.vocab_size)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    assert gen.tokens == [int(t) for t in ref.argmax(-1)]  # identical greedy tokens

    # Hot switching: prefill on every CPU, decode on the plan's subset, weights never copied.
    assert engine.phase == "decode" and len(engine.switches) == 2
    assert os.sched_getaffinity(0) == {PLAN.decode_cpus[0]}
    for arr, tensor in zip(params, engine.params, strict=True):
        assert np.from_dlpack(tensor).ctypes.data == arr.ctypes.data
    os.sched_setaffinity(0, CPUS)

    # The artifact reloads without recompiling.
    again = compile_model(_spec(cfg, stock))
    assert again.path == compiled.path and again.meta["seconds"] == compiled.meta["seconds"]

    # A prompt longer than the context is refused with the limit named.
    with pytest.raises(EngineError, match="exceeds the context of 256 tokens"):
        engine.generate([1] * 250, 10)
    os.sched_setaffinity(0, CPUS)


# fp32: HF's numerics; 16-bit K/V (llama.cpp's default): rounding of every cached K and V; int8:
# q, k, v and the attention output quantized per row (kernels.kv_int8)
KV_TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.5e-2, "int8": 1e-2}


@pytest.mark.compile
@pytest.mark.parametrize("kv_dtype", sorted(KV_TOLERANCE))
def test_chunked_prefill_matches_hf(hf_case, kv_dtype, precompiler):
    """Prompts longer than the prefill chunk: later chunks attend to the paged prefix and merge
    with the in-chunk (ragged) attention through its log-sum-exp; with a 16-bit KV cache too."""
    model_dir, hf = hf_case
    cfg = load_config(model_dir)
    compiled = precompiler.build(_spec(cfg, kv_dtype=kv_dtype))
    assert compiled.meta["kv_dtype"] == kv_dtype
    params = load_params(model_dir, cfg, compiled.params, host_isa())
    engine = Engine(compiled, params, PLAN, prefill_chunk=16)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, cfg.vocab_size, 45)]
    logits: list[np.ndarray] = []
    gen = engine.generate(prompt, DECODE_STEPS, logits_out=logits)
    ref = _reference(hf, prompt + gen.tokens[:-1])[len(prompt) - 1:]
    tol = KV_TOLERANCE[kv_dtype]
    np.testing.assert_allclose(np.stack(logits), ref, rtol=tol, atol=tol * float(np.abs(ref).max()))
    agree = np.mean(np.asarray(gen.tokens) == ref.argmax(-1))
    assert agree >= (1.0 if kv_dtype == "float32" else 0.95)  # greedy tokens (near-ties may part)
    os.sched_setaffinity(0, CPUS)

