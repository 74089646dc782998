"""A Granite (transformers' GraniteForCausalLM: Llama with four scalar multipliers) compiled and
run against transformers: from its HF directory (Sandwich's build and TVM's stock one), from the
F32 GGUF our writer makes of it (llama.cpp's ``granite``: q/k rows permuted as a Llama's, the
multipliers as its embedding, residual, attention and logit scales), and by llama.cpp where it
is installed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.model.config import ModelConfigError, load_config
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS

from ..precompile import warm_up
from .gguf_models import llamacpp_gguf, write_gguf
from .hf_models import (
    TINY,
    edited_config,
    greedy_matches_hf,
    hf_logits,
    save_tiny_hf,
    torch_baseline_reads_gguf_as,
)

CPUS = tuple(sorted(PROCESS_CPUS))
PLAN = ExecPlan(CPUS, CPUS, "test")
STEPS = 12
# far from 1 (and the attention's from 1 / sqrt(16)), so that a missed one shows in every logit
MULTIPLIERS = {"embedding_multiplier": 3.0, "residual_multiplier": 0.4, "attention_multiplier": 0.07,
               "logits_scaling": 2.5}


def _checkpoint(base: Path) -> Path:
    """The session's Granite (at a fixed place, so its builds can start early): 4 heads of 16
    over 2 KV heads, an untied head, drawn norm weights."""
    import transformers

    out = base / "hf" / "tiny-granite"
    if (out / "config.json").is_file():
        return out
    config = transformers.GraniteConfig(**TINY, max_position_embeddings=256, **MULTIPLIERS)
    return save_tiny_hf(out, "GraniteForCausalLM", config, 13)


def _gguf(base: Path) -> Path:
    return llamacpp_gguf(_checkpoint(base), base / "gguf" / "tiny-granite.gguf")


def _spec(model_dir: Path, stock: bool = False) -> RunSpec:
    cfg = load_config(model_dir)
    return RunSpec(cfg.name, cfg, PLAN, kv_dtype="float32", max_batch=1, stock=stock)


warm_up(__name__, "test_granite_matches_hf_from_its_directory_its_gguf_and_the_stock_build",
        lambda base: [_spec(_checkpoint(base)), _spec(_checkpoint(base), stock=True)])


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """(directory, HF model) of the session's Granite."""
    torch = pytest.importorskip("torch")
    import transformers

    out = _checkpoint(tmp_path_factory.getbasetemp())
    return out, transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.compile
def test_granite_matches_hf_from_its_directory_its_gguf_and_the_stock_build(granite, tmp_path_factory,
                                                                           precompiler):
    """transformers' logits (1e-4) and greedy tokens from the directory, on Sandwich's build and on
    TVM's stock one; the GGUF reads back the same multipliers and, loaded into the same build (its
    q/k rows permuted back), gives the same; the torch baseline reads that GGUF as the model too."""
    from sandwich_tvm.model.weights import load_params
    from sandwich_tvm.runtime.engine import Engine
    from sandwich_tvm.tvm_compat import host_isa

    model_dir, hf = granite
    cfg = load_config(model_dir)
    assert cfg.granite and {k: getattr(cfg, k) for k in MULTIPLIERS} == MULTIPLIERS
    for stock in (False, True):
        compiled = precompiler.build(_spec(model_dir, stock))
        engine = Engine(compiled, load_params(model_dir, cfg, compiled.params, host_isa()), PLAN)
        tokens = greedy_matches_hf(engine, hf, cfg.vocab_size, STEPS)
        del engine
    compiled = precompiler.build(_spec(model_dir))
    path = _gguf(tmp_path_factory.getbasetemp())
    from_gguf = load_config(path)
    assert {k: getattr(from_gguf, k) for k in MULTIPLIERS} == MULTIPLIERS  # as written, in float32
    engine = Engine(compiled, load_params(path, from_gguf, compiled.params, host_isa()), PLAN)
    assert greedy_matches_hf(engine, hf, cfg.vocab_size, STEPS) == tokens
    torch_baseline_reads_gguf_as(hf, path, from_gguf)


def test_llamacpp_on_a_granite_gguf_gives_hfs_greedy_tokens(granite, tmp_path_factory):
    """llama.cpp's granite graph on the GGUF our writer makes: transformers' greedy tokens, and its
    logits at the last position (which the logit scale divides)."""
    import os

    from sandwich_tvm.bench.baselines import llamacpp

    if (why := llamacpp.available()) is not None:
        pytest.skip(why)
    model_dir, hf = granite
    vocab = load_config(model_dir).vocab_size
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, vocab, 30)]
    for _ in range(STEPS):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    os.sched_setaffinity(0, CPUS)
    run = llamacpp.LlamaCpp(_gguf(tmp_path_factory.getbasetemp()), threads=len(CPUS), context=256)
    assert run.generate(tokens[:30], STEPS)[2] == tokens[30:]
    want = hf_logits(hf, tokens[:-1])[-1]  # the last position llama.cpp evaluated: the logit scale too
    np.testing.assert_allclose(run.logits(), want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))


def test_granite_configs_and_ggufs_are_read_and_refused_as_they_should_be(granite, tmp_path):
    """transformers' defaults for a Granite's missing multipliers (1, the attention's too), which
    a Llama config does not take; llama.cpp's for a GGUF's (no attention scale: 1 / sqrt(head_dim));
    a multiplier that is not a positive number, a GGUF without its logit scale or without RoPE are
    one-line errors; a Llama's config keys stay as they were."""
    from sandwich_tvm.model.checkpoint import read_checkpoint

    model_dir, _ = granite

    def config(name: str, fields: dict):
        return edited_config(model_dir, tmp_path / name, fields)

    bare = edited_config(model_dir, tmp_path / "bare", {}, drop=tuple(MULTIPLIERS))
    assert bare.granite and bare.attention_scale == 1.0 and bare.logits_scaling == 1.0
    llama = config("llama", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert not llama.granite and llama.attention_scale == 0.25
    assert not set(MULTIPLIERS) & set(llama.to_dict())
    with pytest.raises(ModelConfigError, match="residual_multiplier must be a positive number") as err:
        config("negative", {"residual_multiplier": -1.0})
    assert "\n" not in str(err.value)

    cfg, state = load_config(model_dir), read_checkpoint(model_dir)
    with_scales = {"granite.logit_scale": 2.5, "granite.residual_scale": 0.4,
                   "granite.embedding_scale": 3.0}
    read = load_config(write_gguf(tmp_path / "no-attention.gguf", cfg, state, arch="granite",
                                  meta=with_scales))
    assert read.attention_scale == 0.25 and read.logits_scaling == 2.5 and read.residual_multiplier == 0.4
    for name, meta, match in (("no-logit", {}, "granite.logit_scale is missing"),
                              ("negative", with_scales | {"granite.residual_scale": -0.5},
                               "granite.residual_scale -0.5 must be a positive number; re-convert"),
                              ("nope", with_scales | {"granite.rope.scaling.finetuned": False},
                               "without RoPE .* is not supported")):
        path = write_gguf(tmp_path / f"{name}.gguf", cfg, state, arch="granite", meta=meta)
        with pytest.raises(ModelConfigError, match=match) as err:
            load_config(path)
        assert "\n" not in str(err.value)
    with pytest.raises(ModelConfigError, match="logits_scaling must be a positive number"):
        replace(cfg, logits_scaling=0.0)

