"""A Phi-3 (transformers' Phi3ForCausalLM: Llama whose checkpoint holds q|k|v and gate|up as one
matrix each) compiled and run against transformers: from its HF directory, from the F32 GGUF
llama.cpp's conversion writes of it (``attn_qkv``, and ``ffn_up`` holding gate|up), and from a
Q8_0 one whose fused blocks reach the kernels as they are."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.kernels.quant import QType, QuantBlocks
from sandwich_tvm.model.checkpoint import ModelLoadError, hf_shapes, random_checkpoint, read_checkpoint
from sandwich_tvm.model.config import ModelConfigError, load_config
from sandwich_tvm.model.gguf import hf_name, wider_linears
from sandwich_tvm.model.imatrix import importance_of, read_imatrix
from sandwich_tvm.model.weights import convert, load_params
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.loader import open_engine
from sandwich_tvm.spec import RunSpec, resolve_run_spec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS, host_isa

from ..precompile import warm_up
from .gguf_models import tiny_config, write_gguf, write_imatrix
from .hf_models import TINY, edited_config, greedy_matches_hf, save_tiny_hf, torch_baseline_reads_gguf_as

torch = pytest.importorskip("torch")
CPUS = tuple(sorted(PROCESS_CPUS))
STEPS = 12
PLAN = ExecPlan(CPUS, CPUS, "test")
QKV, GATE_UP = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"


def _checkpoint(base: Path) -> Path:
    """The session's Phi-3 (written once at a fixed place, so its builds can start early): GQA,
    an untied head, norm weights drawn (transformers starts them at one)."""
    import transformers

    out = base / "hf" / "tiny-phi"  # not "phi3": llama.cpp would look for a real Phi-3 vocabulary
    if (out / "config.json").is_file():
        return out
    config = transformers.Phi3Config(**TINY, max_position_embeddings=256,
                                     original_max_position_embeddings=256)
    return save_tiny_hf(out, "Phi3ForCausalLM", config, 11)


def _q8_gguf(base: Path) -> Path:
    """The session's Phi-3 as a Q8_0 GGUF (the head too), at a fixed place."""
    from sandwich_tvm.bench.baselines import llamacpp

    path = base / "gguf" / "tiny-phi-q8_0.gguf"
    if not path.is_file():
        model_dir = _checkpoint(base)
        llamacpp.write_gguf(load_config(model_dir), read_checkpoint(model_dir), path, dtype="q8_0")
    return path


def _spec(model_dir: Path) -> RunSpec:
    cfg = load_config(model_dir)
    return RunSpec(cfg.name, cfg, PLAN, kv_dtype="float32", max_batch=1)


def _q8_spec(path: Path) -> RunSpec:
    return resolve_run_spec(path, activations="float32", kv_dtype="float32", needed_tokens=64, max_batch=1)


warm_up(__name__, "test_a_phi3_matches_hf_from_its_directory_and_its_gguf",
        lambda base: [_spec(_checkpoint(base))])
warm_up(__name__, "test_a_q8_0_phi3_gguf_runs_its_fused_blocks_as_they_are",
        lambda base: [_q8_spec(_q8_gguf(base))])


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(directory, HF model) of the session's Phi-3."""
    import transformers

    out = _checkpoint(tmp_path_factory.getbasetemp())
    return out, transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.compile
def test_a_phi3_matches_hf_from_its_directory_and_its_gguf(phi3, tmp_path, precompiler):
    """The checkpoint's fused qkv_proj and gate_up_proj are the model's own fused Linears: HF's
    logits from the HF directory; the GGUF llama.cpp's conversion writes of it (``phi3``:
    ``attn_qkv`` with q/k rows as HF holds them, ``ffn_up`` holding gate|up) loads into the same
    build and gives the same logits; transformers reads that GGUF as the same model; and
    llama.cpp on it gives the same greedy tokens, where it is installed."""
    from sandwich_tvm.bench.baselines import llamacpp
    model_dir, hf = phi3
    cfg = load_config(model_dir)
    assert cfg.fused_checkpoint and not cfg.tie_word_embeddings and cfg.max_position_embeddings == 256
    state = read_checkpoint(model_dir)
    assert QKV in state and "model.layers.0.self_attn.q_proj.weight" not in state
    compiled = precompiler.build(_spec(model_dir))
    engine = Engine(compiled, load_params(model_dir, cfg, compiled.params, host_isa()), PLAN)
    tokens = greedy_matches_hf(engine, hf, cfg.vocab_size, STEPS)

    path = llamacpp.write_gguf(cfg, state, tmp_path / "phi3.gguf")
    from_gguf = load_config(path)
    assert from_gguf.fused_checkpoint and from_gguf.num_key_value_heads == 2
    del engine
    engine = Engine(compiled, load_params(path, from_gguf, compiled.params, host_isa()), PLAN)
    assert greedy_matches_hf(engine, hf, cfg.vocab_size, STEPS) == tokens

    torch_baseline_reads_gguf_as(hf, path, from_gguf)
    os.sched_setaffinity(0, CPUS)
    if llamacpp.available() is None:
        prompt = [int(t) for t in np.random.default_rng(3).integers(0, cfg.vocab_size, 30)]
        assert llamacpp.LlamaCpp(path, threads=len(CPUS), context=256).generate(prompt, STEPS)[2] == tokens


@pytest.mark.compile
def test_a_q8_0_phi3_gguf_runs_its_fused_blocks_as_they_are(phi3, tmp_path_factory, precompiler,
                                                            monkeypatch):
    """A Q8_0 Phi-3 GGUF's ``attn_qkv`` and ``ffn_up`` blocks are the kernels' q8_0 blocks
    without a re-rounding (nothing is quantized at load: gate|up interleaved for the fused
    epilogue, whole blocks moved): with fp32 activations the engine gives the logits of
    transformers' Phi-3 holding the file's values, and its greedy tokens."""
    import transformers

    path = _q8_gguf(tmp_path_factory.getbasetemp())
    spec = _q8_spec(path)
    assert spec.weight_dtype == "q8_0" and spec.config.fused_checkpoint
    assert {(0, "qkv", "q8_0"), (1, "gate_up", "q8_0")} <= set(wider_linears(path))  # attn_qkv, ffn_up
    state = read_checkpoint(path)
    assert all(isinstance(state[n], QuantBlocks) and state[n].qtype.name == "q8_0" for n in (QKV, GATE_UP))
    precompiler.ready(spec)

    def rounding(*_a, **_k):
        raise AssertionError("a Q8_0 GGUF's weights were quantized again at load")

    monkeypatch.setattr(QType, "quantize", rounding)
    engine, _ = open_engine(spec)
    monkeypatch.undo()
    model_dir, hf = phi3
    runs = transformers.Phi3ForCausalLM(hf.config).eval()
    values = {n: t.qtype.dequantize(t.raw) if isinstance(t, QuantBlocks) else t for n, t in state.items()}
    runs.load_state_dict({n: torch.from_numpy(np.asarray(v, np.float32)) for n, v in values.items()})
    greedy_matches_hf(engine, runs, spec.config.vocab_size, STEPS)


def test_phi3_configs_and_ggufs_are_read_and_refused_as_they_should_be(phi3, tmp_path):
    """A Phi-3's window is kept beside its context as a Mistral's is; a llama GGUF with a fused
    attn_qkv and a phi3 GGUF without one are refused in one line; a checkpoint without its fused
    gate_up says which tensor is missing; a Phi-3 GGUF's and importance matrix's names are the
    fused ones (LongRoPE and a partial rotary: ``test_longrope.py``)."""
    model_dir, _ = phi3

    def config(name: str, fields: dict):
        return edited_config(model_dir, tmp_path / name, fields)

    windowed = config("window", {"sliding_window": 47})
    whole = load_config(model_dir).max_position_embeddings
    assert (windowed.sliding_window, windowed.max_position_embeddings) == (47, whole)

    cfg = load_config(model_dir)
    state = {k: v for k, v in read_checkpoint(model_dir).items() if k != GATE_UP}
    with pytest.raises(ModelLoadError, match="gate_up_proj.weight.*missing"):
        convert(cfg, state, [(GATE_UP, (256, 64))], host_isa())

    full = read_checkpoint(model_dir)
    llama = tiny_config(211, tied=False)
    for arch, weights, held in (("llama", full, "a fused attn_qkv"),
                                ("phi3", random_checkpoint(llama), "separate attn_q/k/v")):
        path = write_gguf(tmp_path / f"{arch}-{held[0]}.gguf", llama, weights, arch=arch)
        with pytest.raises(ModelConfigError, match=f"a {arch} GGUF with {held} is not supported") as err:
            load_config(path)
        assert "\n" not in str(err.value)
    imatrix = read_imatrix(write_imatrix(tmp_path / "imatrix.gguf", cfg), cfg)
    assert {QKV, GATE_UP} <= set(imatrix) and not any("up_proj" in n and "gate" not in n for n in imatrix)
    assert [hf_name(f"blk.3.{t}.weight", fused=True) for t in ("attn_qkv", "ffn_up", "ffn_down")] == [
        "model.layers.3.self_attn.qkv_proj.weight", "model.layers.3.mlp.gate_up_proj.weight",
        "model.layers.3.mlp.down_proj.weight"]
    assert hf_name("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj.weight"  # a Llama's
    table = {"model.layers.0.self_attn.qkv_proj.weight": np.ones(64),
             "model.layers.1.self_attn.q_proj.weight": np.zeros(64)}
    assert importance_of(table, "model.layers.0.self_attn.qkv_proj.weight")[0] == 1  # a Phi-3's own
    assert importance_of(table, "model.layers.1.self_attn.qkv_proj.weight")[0] == 0  # a Llama's q


def test_the_torch_baseline_builds_a_fused_preset_as_a_phi3(monkeypatch):
    """A preset whose checkpoint is fused is a Phi3ForCausalLM in the torch baseline, holding the
    preset's seeded weights."""
    from sandwich_tvm.bench.baselines.torch_hf import hf_model
    from sandwich_tvm.model import config

    tiny = replace(config.PRESETS["llama-160m"], name="tiny-phi3", hidden_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=128,
                   head_dim=None, fused_checkpoint=True)
    monkeypatch.setitem(config.PRESETS, "tiny-phi3", tiny)
    assert set(hf_shapes(tiny)) >= {QKV, GATE_UP}
    model = hf_model("tiny-phi3", tiny, seed=3)
    assert type(model).__name__ == "Phi3ForCausalLM"
    state = model.state_dict()
    for name, want in random_checkpoint(tiny, 3).items():
        np.testing.assert_array_equal(state[name].numpy(), want, err_msg=name)
