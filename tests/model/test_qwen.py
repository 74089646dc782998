"""A Qwen2 (transformers' Qwen2ForCausalLM: Llama with biases on q, k and v) and a Qwen3
(Qwen3ForCausalLM: Llama with an RMSNorm over every q and k head, heads wider than the hidden
states) compiled and run against transformers: from the HF directory, from the GGUF llama.cpp's
conversion writes of it, in TVM's stock build and split over two processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.model.checkpoint import ModelLoadError, read_checkpoint
from sandwich_tvm.model.config import ModelConfigError, load_config
from sandwich_tvm.model.parallel import Shard
from sandwich_tvm.model.weights import convert, load_params
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.loader import open_engine
from sandwich_tvm.spec import RunSpec, resolve_run_spec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS, host_isa

from ..precompile import warm_up
from .hf_models import greedy_matches_hf, torch_baseline_reads_gguf_as

torch = pytest.importorskip("torch")
CPUS = tuple(sorted(PROCESS_CPUS))
STEPS = 12
PLAN = ExecPlan(CPUS, CPUS, "test")


KINDS = ("qwen2", "qwen3")


def _checkpoint(base: Path, kind: str = "qwen2") -> Path:
    """The session's Qwen2 or Qwen3 (written once at a fixed place, so its builds can start
    early): tied embeddings, GQA, Qwen's RoPE base and a sliding window that
    ``use_sliding_window`` leaves off (transformers then writes none); Qwen2's biases and
    Qwen3's norm weights drawn (transformers starts them at zero and one), Qwen3's 4 heads of 32
    wider than its 64 hidden states."""
    import transformers

    out = base / "hf" / f"{kind}-tiny"
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(7)
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=211, max_position_embeddings=256,
                  tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=False, sliding_window=64)
    if kind == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields)).eval()
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields, head_dim=32)).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            attn = layer.self_attn
            for drawn in ((attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias) if kind == "qwen2"
                          else (attn.q_norm.weight, attn.k_norm.weight)):
                drawn.normal_(1.0 if kind == "qwen3" else 0.0, 0.5)
    hf.save_pretrained(out)
    return out


def _spec(model_dir: Path, stock: bool = False) -> RunSpec:
    cfg = load_config(model_dir)
    return RunSpec(cfg.name, cfg, PLAN, stock=stock, kv_dtype="float32", max_batch=1)


def _tp2_spec(model_dir: Path) -> RunSpec:
    plan = ExecPlan.of_ranks([((CPUS[0],), (CPUS[0],)), ((CPUS[1],), (CPUS[1],))], "test: TP-2")
    return resolve_run_spec(model_dir, plan=plan, context=256, max_batch=1, kv_dtype="float32",
                            dtype="float32")


warm_up(__name__, "test_a_qwen_matches_hf_from_its_directory_its_gguf_and_the_stock_build",
        lambda base: [_spec(_checkpoint(base, k), stock) for k in KINDS for stock in (False, True)])
if len(CPUS) >= 2:
    warm_up(__name__, "test_two_processes_split_the_heads_with_their_biases_and_norms",
            lambda base: [_tp2_spec(_checkpoint(base, k)) for k in KINDS])


def _open(base: Path, kind: str):
    import transformers

    out = _checkpoint(base, kind)
    return out, transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(directory, HF model) of the session's Qwen2."""
    return _open(tmp_path_factory.getbasetemp(), "qwen2")


@pytest.fixture(scope="module", params=KINDS)
def qwen(request, tmp_path_factory):
    """(directory, HF model) of the session's Qwen2 and Qwen3."""
    return _open(tmp_path_factory.getbasetemp(), request.param)


@pytest.mark.compile
def test_a_qwen_matches_hf_from_its_directory_its_gguf_and_the_stock_build(qwen, tmp_path, precompiler):
    """Qwen2's q/k/v biases are added to the fused projection, Qwen3's q and k heads RMS-normed
    before RoPE: HF's logits from the HF directory; the GGUF llama.cpp's conversion writes of it
    (``qwen2``/``qwen3``: q/k rows as HF holds them, the biases or norms beside) loads into the
    same build and gives the same logits; TVM's stock build too; and llama.cpp on that GGUF
    gives the same greedy tokens, where it is installed."""
    from sandwich_tvm.bench.baselines import llamacpp

    model_dir, hf = qwen
    cfg = load_config(model_dir)
    qwen3 = model_dir.name.startswith("qwen3")
    assert (cfg.qkv_bias, cfg.qk_norm) == (not qwen3, qwen3) and cfg.max_position_embeddings == 256
    plan = PLAN
    compiled = precompiler.build(_spec(model_dir))
    own = "self_attn.k_norm.weight" if qwen3 else "self_attn.qkv_bias"
    assert any(name.endswith(own) for name, _ in compiled.params)
    assert compiled.meta["unscheduled"] == []  # the heads' slices and concat got schedules too
    engine = Engine(compiled, load_params(model_dir, cfg, compiled.params, host_isa()), plan)
    tokens = greedy_matches_hf(engine, hf, cfg.vocab_size, STEPS)

    path = llamacpp.write_gguf(cfg, read_checkpoint(model_dir), tmp_path / "qwen.gguf")
    from_gguf = load_config(path)
    flags = ("qkv_bias", "qk_norm", "head_dim")
    assert [getattr(from_gguf, f) for f in flags] == [getattr(cfg, f) for f in flags]
    assert (from_gguf.tie_word_embeddings, from_gguf.rope_theta) == (True, 1e6)
    del engine
    engine = Engine(compiled, load_params(path, from_gguf, compiled.params, host_isa()), plan)
    assert greedy_matches_hf(engine, hf, cfg.vocab_size, STEPS) == tokens

    # the torch baseline reads the same GGUF as a Qwen (transformers dequantizes it): HF's logits
    torch_baseline_reads_gguf_as(hf, path, from_gguf)

    stock = precompiler.build(_spec(model_dir, stock=True))
    greedy_matches_hf(Engine(stock, load_params(model_dir, cfg, stock.params, host_isa()), plan), hf,
                      cfg.vocab_size, STEPS)
    os.sched_setaffinity(0, CPUS)
    if llamacpp.available() is None:
        prompt = [int(t) for t in np.random.default_rng(3).integers(0, cfg.vocab_size, 30)]
        assert llamacpp.LlamaCpp(path, threads=len(CPUS), context=256).generate(prompt, STEPS)[2] == tokens


@pytest.mark.compile
@pytest.mark.skipif(len(CPUS) < 2, reason="a two-process plan needs two CPUs")
def test_two_processes_split_the_heads_with_their_biases_and_norms(qwen, precompiler):
    """Split over two processes (Megatron's rows: each rank its q, k and v heads), each rank adds
    its own part of Qwen2's biases, and normalizes its heads by Qwen3's whole norm weights: HF's
    logits and greedy tokens."""
    model_dir, hf = qwen
    cfg = load_config(model_dir)
    spec = _tp2_spec(model_dir)
    compiled = precompiler.build(spec)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    if cfg.qkv_bias:
        assert compiled.shards["model.layers.0.self_attn.qkv_bias"] == Shard(0, (q, kv, kv))
    else:
        assert "model.layers.0.self_attn.q_norm.weight" not in compiled.shards  # on every rank whole
    engine, _ = open_engine(spec)
    try:
        greedy_matches_hf(engine, hf, cfg.vocab_size, STEPS)
    finally:
        engine.shutdown()
        os.sched_setaffinity(0, CPUS)


@pytest.mark.parametrize(("preset", "cls"), [("qwen2.5-0.5b", "Qwen2ForCausalLM"),
                                            ("qwen3-0.6b", "Qwen3ForCausalLM")])
def test_the_torch_baseline_builds_a_qwen_preset_with_its_biases_or_norms(monkeypatch, preset, cls):
    """A preset with q/k/v biases (``qwen2.5-0.5b``'s kind) is a Qwen2ForCausalLM in the torch
    baseline, one with q/k norms (``qwen3-0.6b``'s) a Qwen3ForCausalLM, holding the preset's
    seeded weights, biases and norms included."""
    from dataclasses import replace

    from sandwich_tvm.bench.baselines.torch_hf import hf_model
    from sandwich_tvm.model import config
    from sandwich_tvm.model.checkpoint import random_checkpoint

    tiny = replace(config.PRESETS[preset], name="tiny-qwen", hidden_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=128,
                   head_dim=32)
    monkeypatch.setitem(config.PRESETS, "tiny-qwen", tiny)
    model = hf_model("tiny-qwen", tiny, seed=3)
    assert type(model).__name__ == cls
    state = model.state_dict()
    for name, want in random_checkpoint(tiny, 3).items():
        np.testing.assert_array_equal(state[name].numpy(), want, err_msg=name)


def test_qwen2_configs_and_checkpoints_are_read_and_refused_as_they_should_be(qwen2, tmp_path):
    """A window ``use_sliding_window`` turns on is the model's where every layer slides (from
    ``max_window_layers``, or as ``layer_types`` names them), caps the context where only some
    do (exact within it: there the layers attend alike), is nothing where none does or where it
    is left off; a Llama with
    ``attention_bias`` (o_proj's too) is refused; a Qwen2 checkpoint without its biases says which
    tensor is missing."""
    model_dir, _ = qwen2
    raw = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "on").mkdir()
    # transformers writes layer_types (all full here, the window being off): as it reads them, they win
    windowed = {k: v for k, v in raw.items() if k != "layer_types"} | {"use_sliding_window": True,
                                                                       "sliding_window": 64}
    assert raw["layer_types"] == ["full_attention"] * raw["num_hidden_layers"]
    layers = raw["num_hidden_layers"]
    for fields, want in [({"max_window_layers": 0}, (256, 64)), ({"max_window_layers": 1}, (64, None)),
                         ({"max_window_layers": layers}, (256, None)), ({}, (256, None)),  # 28 by default
                         ({"layer_types": ["sliding_attention"] * layers, "max_window_layers": 1},
                          (256, 64))]:
        (tmp_path / "on" / "config.json").write_text(json.dumps(windowed | fields))
        cfg = load_config(tmp_path / "on")
        assert (cfg.max_position_embeddings, cfg.sliding_window) == want, fields
    # a window named but off (DeepSeek-R1-Distill-Qwen's config), and the architecture without a model_type
    (tmp_path / "off").mkdir()
    off = raw | {"use_sliding_window": False, "sliding_window": 64}
    del off["model_type"]
    (tmp_path / "off" / "config.json").write_text(json.dumps(off))
    unwindowed = load_config(tmp_path / "off")
    assert (unwindowed.max_position_embeddings, unwindowed.qkv_bias) == (256, True)
    (tmp_path / "llama").mkdir()
    llama = raw | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": True}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ModelConfigError, match="attention_bias.*not supported"):
        load_config(tmp_path / "llama")
    cfg = load_config(model_dir)
    state = {k: v for k, v in read_checkpoint(model_dir).items() if not k.endswith("v_proj.bias")}
    with pytest.raises(ModelLoadError, match="v_proj.bias.*missing"):
        convert(cfg, state, [("model.layers.0.self_attn.qkv_bias", (128,))], host_isa())
