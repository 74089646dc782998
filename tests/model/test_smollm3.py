"""SmolLM3 (transformers' SmolLM3ForCausalLM): a Llama whose every fourth layer attends without
RoPE, compiled and run against transformers."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.compiler.artifact import CompileError, compile_model
from sandwich_tvm.model.config import ModelConfigError, load_config
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.loader import open_engine
from sandwich_tvm.runtime.sampling import SamplingParams
from sandwich_tvm.runtime.scheduler import SchedulerPolicy
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS, host_isa

from ..precompile import warm_up
from .gguf_models import llamacpp_gguf
from .hf_models import (
    TINY,
    edited_config,
    greedy_matches_hf,
    hf_greedy,
    hf_logits,
    save_tiny_hf,
    torch_baseline_reads_gguf_as,
)
from .test_pipeline_parallel import assert_hf_greedy
from .test_weight_attention import _wa_spec, two_cpus

torch = pytest.importorskip("torch")
CPUS = tuple(sorted(PROCESS_CPUS))
PLAN = ExecPlan(CPUS, CPUS, "test")
FIELDS = TINY | dict(num_hidden_layers=4, max_position_embeddings=256, rope_theta=5e4,
                     tie_word_embeddings=True)


def _checkpoint(base: Path) -> Path:
    """The session's SmolLM3, written once at a fixed place (so its build can start early)."""
    import transformers

    out = base / "hf" / "smollm3"
    if not (out / "config.json").is_file():
        save_tiny_hf(out, "SmolLM3ForCausalLM", transformers.SmolLM3Config(**FIELDS), seed=9)
    return out


def _gguf(base: Path) -> Path:
    """The SmolLM3 as llama.cpp's ``smollm3`` GGUF (F32), by the benchmarks' writer."""
    return llamacpp_gguf(_checkpoint(base), base / "gguf" / "tiny-smollm3.gguf")


def _spec(model_dir: Path, kv_dtype: str = "float32") -> RunSpec:
    cfg = load_config(model_dir)
    return RunSpec(cfg.name, cfg, PLAN, kv_dtype=kv_dtype, max_batch=4)


warm_up(__name__, "test_smollm3_gives_hfs_logits_and_tokens", lambda base: [_spec(_checkpoint(base))])
if len(CPUS) >= 2:
    warm_up(__name__, "test_separated_smollm3_turns_q_and_k_on_the_weight_side",
            lambda base: [_wa_spec(_checkpoint(base))])


@pytest.mark.compile
def test_smollm3_gives_hfs_logits_and_tokens(tmp_path_factory, precompiler):
    """Layer 3 of 4 without RoPE (transformers' default, every fourth), the others turned in the
    graph at the cache's query positions: HF's logits (1e-4) and greedy tokens from a prompt in
    one prefill call and in chunks of 7, and three requests decoded in one batch (each at its own
    position) give HF's tokens. RoPE in every layer differs from HF (the NoPE layer matters);
    TVM's stock build, whose cache turns every layer, is refused. Our ``smollm3`` GGUF (llama.cpp
    fixes every fourth layer) reads back the same layers and, loaded into the same build (its q/k
    rows permuted back), gives the same; the torch baseline reads it as the model."""
    import transformers

    model_dir = _checkpoint(tmp_path_factory.getbasetemp())
    hf = transformers.SmolLM3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = _spec(model_dir)
    cfg = spec.config
    assert cfg.nope_layers == (3,) and cfg.tie_word_embeddings and cfg.to_dict()["nope_layers"] == (3,)
    with pytest.raises(CompileError, match="stock build cannot run .*layers without it need"):
        compile_model(RunSpec(cfg.name, cfg, PLAN, stock=True, kv_dtype="float32"))
    compiled = precompiler.build(spec)
    params = load_params(model_dir, cfg, compiled.params, host_isa())
    for chunk in (64, 7):
        engine = Engine(compiled, params, PLAN, context=256, max_batch=4, prefill_chunk=chunk)
        tokens = greedy_matches_hf(engine, hf, cfg.vocab_size, steps=12, prompt_len=30)

    every = transformers.SmolLM3Config(**FIELDS, no_rope_layers=[1] * 4)
    roped = transformers.SmolLM3ForCausalLM(every).eval()
    roped.load_state_dict(hf.state_dict())
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, cfg.vocab_size, 30)] + tokens
    ref = hf_logits(hf, prompt)
    assert np.abs(hf_logits(roped, prompt) - ref).max() > 1e-3 * np.abs(ref).max()  # 10x the tolerance

    batch = BatchEngine(Engine(compiled, params, PLAN, context=256, max_batch=4, prefill_chunk=64),
                        SchedulerPolicy(max_batch=4, prefill_budget=64, chunk=64))
    rng = np.random.default_rng(12)
    asks = {f"r{i}": [int(t) for t in rng.integers(0, cfg.vocab_size, n)] for i, n in enumerate((5, 23, 11))}
    got: dict[str, list[int]] = {rid: [] for rid in asks}
    for rid, prompt in asks.items():
        batch.add(rid, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while batch.has_work():
        for event in batch.step():
            if event.token is not None:
                got[event.request_id].append(event.token)
    for rid, prompt in asks.items():
        assert got[rid] == hf_greedy(hf, prompt, 6), rid

    path = _gguf(tmp_path_factory.getbasetemp())
    from_gguf = load_config(path)
    assert from_gguf.nope_layers == (3,)
    engine = Engine(compiled, load_params(path, from_gguf, compiled.params, host_isa()), PLAN)
    assert greedy_matches_hf(engine, hf, cfg.vocab_size, steps=12, prompt_len=30) == tokens
    torch_baseline_reads_gguf_as(hf, path, from_gguf)


@pytest.mark.compile
@two_cpus
def test_separated_smollm3_turns_q_and_k_on_the_weight_side(tmp_path_factory, precompiler):
    """Weight-attention separation: the weight side turns q and k at its own cache's query
    positions (its cache keeps the attention side's sequences) before handing QKV over; HF's
    logits and greedy tokens."""
    import transformers

    model_dir = _checkpoint(tmp_path_factory.getbasetemp())
    hf = transformers.SmolLM3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = _wa_spec(model_dir)
    precompiler.ready(spec)
    engine, _ = open_engine(spec)
    try:
        assert_hf_greedy(engine, hf, [int(t) for t in np.random.default_rng(1).integers(0, 211, 45)])
    finally:
        engine.shutdown()
        os.sched_setaffinity(0, set(CPUS))


def test_llamacpp_on_a_smollm3_gguf_gives_hfs_greedy_tokens(tmp_path_factory):
    """llama.cpp's smollm3 graph on the GGUF our writer makes: transformers' greedy tokens."""
    import transformers

    from sandwich_tvm.bench.baselines import llamacpp

    if (why := llamacpp.available()) is not None:
        pytest.skip(why)
    model_dir = _checkpoint(tmp_path_factory.getbasetemp())
    hf = transformers.SmolLM3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 211, 30)]
    tokens = prompt + hf_greedy(hf, prompt, 12)
    os.sched_setaffinity(0, CPUS)
    run = llamacpp.LlamaCpp(_gguf(tmp_path_factory.getbasetemp()), threads=len(CPUS), context=256)
    assert run.generate(tokens[:30], 12)[2] == tokens[30:]


def test_smollm3_configs_are_read_and_refused_as_they_should_be(tmp_path):
    """``no_rope_layers`` as written (a longer list's first flags), or every
    ``no_rope_layer_interval``-th layer; a window, which SmolLM3 slides only over its layers without
    RoPE, caps the context; too short a flag list is refused in one line; transformers' SmolLM3
    defaults (tied embeddings, eps 1e-6) where the file leaves them out."""
    import transformers

    model_dir = save_tiny_hf(tmp_path / "m", "SmolLM3ForCausalLM", transformers.SmolLM3Config(**FIELDS), 1)
    assert edited_config(model_dir, tmp_path / "list", {"no_rope_layers": [0, 1, 1, 0]}).nope_layers == (0, 3)
    every = edited_config(model_dir, tmp_path / "every", {"no_rope_layer_interval": 2},
                          drop=("no_rope_layers",))
    assert every.nope_layers == (1, 3)
    windowed = edited_config(model_dir, tmp_path / "win", {"use_sliding_window": True,
                                                           "sliding_window": 32}, drop=("layer_types",))
    assert (windowed.max_position_embeddings, windowed.sliding_window) == (32, None)
    with pytest.raises(ModelConfigError, match="no_rope_layers must hold a 0 or 1 for each of the 4 layers"):
        edited_config(model_dir, tmp_path / "bad", {"no_rope_layers": [1, 0]})
    # a longer list's first flags, as transformers reads it; its defaults where a file leaves them out
    longer = edited_config(model_dir, tmp_path / "long", {"no_rope_layers": [1, 1, 0, 1, 0]})
    assert longer.nope_layers == (2,)
    bare = edited_config(model_dir, tmp_path / "bare", {}, drop=("tie_word_embeddings", "rms_norm_eps"))
    assert (bare.tie_word_embeddings, bare.rms_norm_eps) == (True, 1e-6)
