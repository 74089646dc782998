"""Linear RoPE scaling (positions divided by a factor: DeepSeek-Coder, LongChat) read from an HF
config and from a GGUF's metadata (both of llama.cpp's keys), written back for llama.cpp, and
compiled: our model and TVM's stock build against HF transformers on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.model.config import LlamaConfig, ModelConfigError, load_config
from sandwich_tvm.model.rope import inv_freq, linear_factor

from ..precompile import warm_up
from .gguf_models import tiny_config, tiny_tokenizer, write_gguf
from .hf_models import hf_checkpoint, write_hf_model


def _hf_dir(tmp_path, rope) -> str:
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 4, "vocab_size": 100, "rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_linear_scaling_from_an_hf_config(tmp_path):
    cfg = load_config(_hf_dir(tmp_path, {"type": "linear", "factor": 4.0}))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0} and linear_factor(cfg) == 4.0
    plain = LlamaConfig("plain", 64, 1, 4, 4, 128, 100)
    np.testing.assert_allclose(inv_freq(cfg), inv_freq(plain) / 4, rtol=1e-6)
    assert load_config(_hf_dir(tmp_path, {"rope_type": "linear", "factor": 1.0})).rope_scaling is None
    with pytest.raises(ModelConfigError, match="factor must be a positive number"):
        load_config(_hf_dir(tmp_path, {"rope_type": "linear", "factor": 0}))
    with pytest.raises(ModelConfigError, match="'dynamic' is not supported \\(llama3, linear, yarn or"):
        load_config(_hf_dir(tmp_path, {"rope_type": "dynamic", "factor": 4.0}))
    # transformers' defaults: the original context is max_position_embeddings (2048 here), betas of
    # 0 are 32 and 1, a null truncate truncates nothing
    yarn = load_config(_hf_dir(tmp_path, {"rope_type": "yarn", "factor": 4.0, "beta_fast": 0,
                                          "truncate": None})).rope_scaling
    assert yarn["original_max_position_embeddings"] == 2048 and yarn["beta_fast"] == 32.0
    assert yarn["truncate"] is False
    # the context YaRN reaches, as vLLM derives it: the original times the factor where longer
    # (Qwen2.5: 32768 positions, 4x over them), else max_position_embeddings (DeepSeek-V3's kind)
    for most, original, factor, context in ((2048, None, 4.0, 8192), (32768, 32768, 4.0, 131072),
                                            (163840, 4096, 40.0, 163840), (8192, 4096, 1.5, 8192)):
        raw = json.loads((tmp_path / "config.json").read_text()) | {"max_position_embeddings": most}
        raw["rope_scaling"] = {"rope_type": "yarn", "factor": factor} | (
            {"original_max_position_embeddings": original} if original else {})
        (tmp_path / "config.json").write_text(json.dumps(raw))
        assert load_config(tmp_path).max_position_embeddings == context, (most, original, factor)


@pytest.mark.parametrize("keys", [{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
                                  {"llama.rope.scaling.factor": 4.0}, {"llama.rope.scale_linear": 4.0}],
                         ids=["scaling-type", "no-type", "scale-linear"])
def test_linear_scaling_from_a_gguf(tmp_path, keys):
    """As llama.cpp reads a GGUF: the type defaults to linear, the factor to the older
    ``rope.scale_linear``."""
    from sandwich_tvm.bench.baselines.llamacpp import write_gguf as llamacpp_gguf
    from sandwich_tvm.model.checkpoint import random_checkpoint

    tok = tiny_tokenizer()
    cfg = tiny_config(tok.get_vocab_size())
    path = write_gguf(tmp_path / "linear.gguf", cfg, random_checkpoint(cfg, 1), tokenizer=tok, meta=keys)
    loaded = load_config(path)
    assert loaded.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    # written for llama.cpp as its own keys, and read back the same
    again = llamacpp_gguf(loaded, random_checkpoint(loaded, 1), tmp_path / "again.gguf", "float32")
    assert load_config(again).rope_scaling == {"rope_type": "linear", "factor": 4.0}


def _linear_rope_specs(base: Path) -> list:
    """The linear-RoPE checkpoint's builds, ours and the stock one (in that order)."""
    from sandwich_tvm.spec import RunSpec
    from sandwich_tvm.topology.plan import ExecPlan
    from sandwich_tvm.tvm_compat import PROCESS_CPUS

    cfg = load_config(hf_checkpoint(base, "mha-linear-rope", seed=3))
    cpus = tuple(sorted(PROCESS_CPUS))
    return [RunSpec(cfg.name, cfg, ExecPlan(cpus, cpus, "test"), stock=stock, kv_dtype="float32", max_batch=1)
            for stock in (False, True)]


warm_up(__name__, "test_linear_scaling_matches_hf", _linear_rope_specs)


@pytest.mark.compile
@pytest.mark.parametrize("stock", [False, True], ids=["sandwich", "stock"])
def test_linear_scaling_matches_hf(precompiler, tmp_path_factory, stock):
    torch = pytest.importorskip("torch")
    import transformers

    from sandwich_tvm.compiler.artifact import compile_model
    from sandwich_tvm.model.weights import load_params
    from sandwich_tvm.runtime.engine import Engine
    from sandwich_tvm.tvm_compat import host_isa

    base = tmp_path_factory.getbasetemp()
    path = hf_checkpoint(base, "mha-linear-rope", seed=3)
    hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    spec = _linear_rope_specs(base)[int(stock)]
    cfg, plan = spec.config, spec.plan
    assert linear_factor(cfg) == 4.0
    precompiler.ready(spec)
    compiled = compile_model(spec)
    params = load_params(path, cfg, compiled.params, host_isa(), layouts=compiled.layouts)
    engine = Engine(compiled, params, plan)
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, cfg.vocab_size, 60)]
    logits: list[np.ndarray] = []
    gen = engine.generate(prompt, 24, logits_out=logits)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + gen.tokens[:-1]])).logits[0].numpy()[len(prompt) - 1:]
        unscaled = type(hf)(type(hf.config)(**{**hf.config.to_dict(), "rope_scaling": None,
                                               "rope_parameters": {"rope_type": "default",
                                                                   "rope_theta": 10000.0}}))
        unscaled.load_state_dict(hf.state_dict())
        plain = unscaled.eval()(torch.tensor([prompt + gen.tokens[:-1]])).logits[0].numpy()[len(prompt) - 1:]
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(np.stack(logits), ref, rtol=1e-4, atol=1e-4 * scale)
    assert np.abs(plain - ref).max() > 1e-3 * scale  # 10x the tolerance: the scaling was applied


def test_gguf_keys_that_scale_nothing_or_conflict(tmp_path):
    from sandwich_tvm.model.checkpoint import random_checkpoint

    tok = tiny_tokenizer()
    cfg = tiny_config(tok.get_vocab_size())
    state = random_checkpoint(cfg, 1)
    for i, keys in enumerate([{"llama.rope.scaling.type": "none", "llama.rope.scale_linear": 4.0},
                              {"llama.rope.scaling.type": "linear"}, {"llama.rope.scaling.factor": 1.0}]):
        path = write_gguf(tmp_path / f"plain{i}.gguf", cfg, state, tokenizer=tok, meta=keys)
        assert load_config(path).rope_scaling is None, keys
    both = write_gguf(tmp_path / "both.gguf", cfg, state, tokenizer=tok,
                      meta={"llama.rope.scaling.factor": 4.0},
                      extra={"rope_freqs.weight": np.full(cfg.head_dim // 2, 2.0, np.float32)})
    with pytest.raises(ModelConfigError, match="both linear RoPE scaling and per-frequency factors"):
        load_config(both)


def test_hf_linear_scaling_needs_its_factor(tmp_path):
    with pytest.raises(ModelConfigError, match="linear RoPE scaling needs factor"):
        load_config(_hf_dir(tmp_path, {"rope_type": "linear"}))


def test_the_transformers_reference_keeps_a_gguf_s_scaling(tmp_path):
    """transformers' GGUF reader leaves Llama's RoPE scaling out; the benchmarks' reference puts
    the file's back (``bench.baselines.torch_hf.hf_model``)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers reads GGUF weights through accelerate")
    from sandwich_tvm.bench.baselines.torch_hf import hf_model
    from sandwich_tvm.model.checkpoint import random_checkpoint

    tok = tiny_tokenizer()
    cfg = tiny_config(tok.get_vocab_size())
    path = write_gguf(tmp_path / "linear.gguf", cfg, random_checkpoint(cfg, 1), tokenizer=tok,
                      meta={"llama.rope.scaling.factor": 4.0})
    cfg = load_config(path)
    model = hf_model(str(path), cfg, 0)
    np.testing.assert_allclose(model.model.rotary_emb.inv_freq.numpy(), inv_freq(cfg), rtol=1e-6)


def test_yarn_from_a_gguf_as_llama_cpp_reads_it(tmp_path):
    """A YaRN Llama from HF, written as llama.cpp's keys (type, factor, original context, an
    attention factor over 0.1 ln(factor) + 1), reads back the same; its frequencies and the
    factor cos and sin take are transformers'."""
    torch = pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sandwich_tvm.bench.baselines.llamacpp import write_gguf as llamacpp_gguf
    from sandwich_tvm.model.checkpoint import random_checkpoint
    from sandwich_tvm.model.rope import attention_factor

    hf = write_hf_model("mha-yarn", tmp_path / "hf")
    cfg = load_config(tmp_path / "hf")
    freqs, factor = ROPE_INIT_FUNCTIONS["yarn"](hf.config, torch.device("cpu"))
    np.testing.assert_allclose(inv_freq(cfg), freqs.numpy(), rtol=1e-6)
    assert attention_factor(cfg) == pytest.approx(factor) == pytest.approx(0.1 * np.log(4.0) + 1)
    path = llamacpp_gguf(cfg, random_checkpoint(cfg, 1), tmp_path / "yarn.gguf", "float32")
    back = load_config(path)
    assert back.rope_scaling == pytest.approx(cfg.rope_scaling)
    np.testing.assert_array_equal(inv_freq(back), inv_freq(cfg))
    tok = tiny_tokenizer()
    small = tiny_config(tok.get_vocab_size())
    bad = write_gguf(tmp_path / "bad.gguf", small, random_checkpoint(small, 1), tokenizer=tok,
                     meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": -2.0})
    with pytest.raises(ModelConfigError, match="yarn RoPE scaling needs factor, .* > 0 \\(got -2.0"):
        load_config(bad)
    unset = write_gguf(tmp_path / "unset.gguf", small, random_checkpoint(small, 1), tokenizer=tok,
                       meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.0,
                             "llama.rope.scaling.original_context_length": 0})  # llama.cpp: the context
    unset_scaling = load_config(unset).rope_scaling
    assert unset_scaling["original_max_position_embeddings"] == small.max_position_embeddings
    assert load_config(unset).max_position_embeddings == 2 * small.max_position_embeddings  # reached
    # llama.cpp scales cos and sin by attn_factor whatever the scaling: outside YaRN, refused
    scaled = write_gguf(tmp_path / "scaled.gguf", small, random_checkpoint(small, 1), tokenizer=tok,
                        meta={"llama.rope.scaling.attn_factor": 1.25})
    with pytest.raises(ModelConfigError, match="attn_factor 1.25 scales RoPE's cos and sin outside YaRN"):
        load_config(scaled)
