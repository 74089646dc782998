"""A Mistral (transformers' MistralForCausalLM) with YaRN compiled and run against transformers."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.compiler.artifact import compile_model
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS, host_isa

from ..precompile import warm_up

torch = pytest.importorskip("torch")
CPUS = tuple(sorted(PROCESS_CPUS))
PLAN = ExecPlan(CPUS, CPUS, "test")
ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e6}
FIELDS = dict(hidden_size=160, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, vocab_size=211, max_position_embeddings=64,
              sliding_window=128)


def _checkpoint(base: Path) -> Path:
    """The session's Mistral, written once at a fixed place (so its build can start early)."""
    import transformers

    out = base / "hf" / "mistral-yarn"
    if not (out / "config.json").is_file():
        torch.manual_seed(4)
        cfg = transformers.MistralConfig(**FIELDS, rope_parameters=ROPE)
        transformers.MistralForCausalLM(cfg).save_pretrained(out)
    return out


def _spec(model_dir: Path) -> RunSpec:
    cfg = load_config(model_dir)
    return RunSpec(cfg.name, cfg, PLAN, kv_dtype="float32", max_batch=1)


warm_up(__name__, "test_a_mistral_with_narrower_attention_and_yarn_matches_hf",
        lambda base: [_spec(_checkpoint(base))])


@pytest.mark.compile
def test_a_mistral_with_narrower_attention_and_yarn_matches_hf(tmp_path_factory, precompiler):
    """Mistral-Nemo's and Mistral Small 3's kind: heads narrower than the hidden states (4 x 32 =
    0.8 x 160, as their 32 x 128 = 0.8 x 5120), from transformers' MistralForCausalLM with a
    sliding window and YaRN (Yarn-Mistral's: a 4x longer context than trained, the prompt beyond
    it; cos and sin scaled by 0.1 ln 4 + 1). The context is the 128 positions YaRN reaches (32 x
    4), past ``max_position_embeddings`` (64), as vLLM takes it, within the window; the run goes
    to position 73. TVM's stock build, whose YaRN lacks that factor, is refused."""
    import transformers

    from sandwich_tvm.compiler.artifact import CompileError

    model_dir = _checkpoint(tmp_path_factory.getbasetemp())
    hf = transformers.MistralForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = load_config(model_dir)
    assert (cfg.num_attention_heads * cfg.head_dim, cfg.max_position_embeddings) == (128, 128)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    plan = PLAN
    with pytest.raises(CompileError, match="YaRN"):
        compile_model(RunSpec(cfg.name, cfg, plan, stock=True, kv_dtype="float32"))
    compiled = precompiler.build(_spec(model_dir))
    engine = Engine(compiled, load_params(model_dir, cfg, compiled.params, host_isa()), plan)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, cfg.vocab_size, 40)]
    logits: list[np.ndarray] = []
    gen = engine.generate(prompt, 33, logits_out=logits)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + gen.tokens[:-1]])).logits[0, len(prompt) - 1:].numpy()
    np.testing.assert_allclose(np.stack(logits), ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    assert gen.tokens == [int(t) for t in ref.argmax(-1)]
    plain = transformers.MistralForCausalLM(transformers.MistralConfig(**FIELDS)).eval()
    plain.load_state_dict(hf.state_dict())
    with torch.no_grad():
        unscaled = plain(torch.tensor([prompt + gen.tokens[:-1]])).logits[0, len(prompt) - 1:].numpy()
    assert np.abs(unscaled - ref).max() > 1e-3 * float(np.abs(ref).max())  # 10x the tolerance: scaled
    os.sched_setaffinity(0, CPUS)
