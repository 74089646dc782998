"""LongRoPE and a partial rotary (Phi-3.5, the 128k Phi-3s, Phi-4-mini): a random HF Phi-3 whose
RoPE turns 12 of each head's 16 dimensions, by two sets of per-frequency factors, compiled and run
against transformers at a context within the original one (the short set) and beyond it (the
long set), read from the GGUF llama.cpp's conversion writes of it, and run by llama.cpp where it
is installed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.model.checkpoint import read_checkpoint
from sandwich_tvm.model.config import ModelConfigError, load_config
from sandwich_tvm.model.rope import at_context, attention_factor, inv_freq
from sandwich_tvm.spec import RunSpec, resolve_run_spec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS

from ..precompile import warm_up
from .gguf_models import llamacpp_gguf, write_gguf
from .hf_models import TINY, edited_config, greedy_matches_hf, save_tiny_hf, torch_baseline_reads_gguf_as

CPUS = tuple(sorted(PROCESS_CPUS))
PLAN = ExecPlan(CPUS, CPUS, "test")
ORIGINAL = 256  # the original context: llama.cpp rounds its context up to 256, so no shorter one
SHORT, LONG = 30, 270  # prompt lengths: within the original context, and beyond it
STEPS = 12
PAIRS = 6  # 12 of 16 dimensions turn
ROPE = {"rope_type": "longrope", "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(PAIRS)],
        "long_factor": [2.0 + 0.7 * i for i in range(PAIRS)]}


def _checkpoint(base: Path) -> Path:
    """The session's LongRoPE Phi-3 with a partial rotary (at a fixed place, so its builds can
    start early): 4 heads of 16 over 2 KV heads, 4x the original context, drawn norm weights."""
    import transformers

    out = base / "hf" / "tiny-phi-longrope"
    if (out / "config.json").is_file():
        return out
    config = transformers.Phi3Config(**TINY, max_position_embeddings=4 * ORIGINAL,
                                     original_max_position_embeddings=ORIGINAL, rope_parameters=dict(ROPE))
    return save_tiny_hf(out, "Phi3ForCausalLM", config, 12)


_META = {"phi3.rope.dimension_count": 12, "phi3.rope.scaling.original_context_length": ORIGINAL,
         "phi3.rope.scaling.attn_factor": float(np.sqrt(1.25))}  # llama.cpp's keys, by hand


def _factors(cfg) -> dict[str, np.ndarray]:
    """``cfg``'s LongRoPE sets as a GGUF's tensors."""
    return {f"rope_factors_{x}.weight": np.asarray(cfg.rope_scaling[f"{x}_factor"], np.float32)
            for x in ("long", "short")}


def _spec(model_dir: Path, context: int) -> RunSpec:
    cfg = load_config(model_dir)
    return RunSpec(cfg.name, cfg, PLAN, kv_dtype="float32", max_batch=1, context=context)


warm_up(__name__, "test_longrope_matches_hf_within_and_beyond_the_original_context",
        lambda base: [_spec(_checkpoint(base), ORIGINAL), _spec(_checkpoint(base), 2 * ORIGINAL)])


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    """(directory, HF model) of the session's LongRoPE Phi-3."""
    torch = pytest.importorskip("torch")
    import transformers

    out = _checkpoint(tmp_path_factory.getbasetemp())
    return out, transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def test_longrope_is_read_as_transformers_computes_it(phi):
    """The factors, the turned dimensions and the attention factor as transformers' rotary
    embedding holds them; the run's context picks the set, once, in the run spec."""
    model_dir, hf = phi
    cfg = load_config(model_dir)
    assert cfg.rotary_dim == 2 * PAIRS and cfg.rope_dims == 12 and cfg.head_dim == 16
    rotary = hf.model.rotary_emb
    np.testing.assert_allclose(inv_freq(cfg), rotary.inv_freq.numpy(), rtol=1e-6)
    assert attention_factor(cfg) == pytest.approx(rotary.attention_scaling) == pytest.approx(np.sqrt(1.25))
    for context, long in ((ORIGINAL, False), (ORIGINAL + 1, True)):
        spec = _spec(model_dir, context)
        assert spec.config.rope_scaling["long"] is long
        assert ("long factors" if long else "short factors") in spec.describe()
        assert at_context(spec.config, context) is spec.config  # chosen once
    want = 1.0 / (10000.0 ** (np.arange(0, 12, 2) / 12) * np.array(ROPE["long_factor"]))
    np.testing.assert_allclose(inv_freq(_spec(model_dir, 2 * ORIGINAL).config), want, rtol=1e-6)
    assert replace(_spec(model_dir, 2 * ORIGINAL), context=ORIGINAL).config.rope_scaling["long"] is False
    # a resolved spec too, and a changed set is a different build
    assert resolve_run_spec(model_dir, context=2 * ORIGINAL, max_batch=1).config.rope_scaling["long"]
    short, long = (_spec(model_dir, c).config.to_dict() for c in (ORIGINAL, 2 * ORIGINAL))
    assert short != long and short["rotary_dim"] == 12


def _gguf(base: Path) -> Path:
    """The session's LongRoPE Phi-3 as the F32 GGUF our writer makes (llama.cpp's conversion's
    keys: ``rope_factors_long/short``, ``rope.dimension_count`` 12, the original context and the
    attention factor)."""
    return llamacpp_gguf(_checkpoint(base), base / "gguf" / "tiny-phi-longrope.gguf")


def _hf_greedy(hf, vocab: int, prompt_len: int) -> list[int]:
    """transformers' greedy tokens after the seeded prompt ``greedy_matches_hf`` uses."""
    from .hf_models import hf_logits

    tokens = [int(t) for t in np.random.default_rng(3).integers(0, vocab, prompt_len)]
    for _ in range(STEPS):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[prompt_len:]


@pytest.mark.compile
def test_longrope_matches_hf_within_and_beyond_the_original_context(phi, precompiler):
    """Within the original context (the short set) a 30-token prompt, beyond it (the long set) a
    270-token one: transformers' logits and greedy tokens either way (it turns a sequence by the
    long set once the sequence is that long)."""
    from sandwich_tvm.model.weights import load_params
    from sandwich_tvm.runtime.engine import Engine
    from sandwich_tvm.tvm_compat import host_isa

    model_dir, hf = phi
    for context, prompt_len in ((ORIGINAL, SHORT), (2 * ORIGINAL, LONG)):
        spec = _spec(model_dir, context)
        compiled = precompiler.build(spec)
        engine = Engine(compiled, load_params(model_dir, spec.config, compiled.params, host_isa()), PLAN)
        greedy_matches_hf(engine, hf, spec.config.vocab_size, STEPS, prompt_len)
        del engine


def test_a_longrope_gguf_holds_the_same_rope_and_transformers_reads_it_so(phi, tmp_path_factory):
    """The GGUF holds the directory's RoPE (both sets, 12 turned dimensions, the attention factor);
    transformers reads it as the same model within and beyond the original context; and llama.cpp's
    type name for it (``rope.scaling.type`` longrope) reads the same."""
    model_dir, hf = phi
    cfg, path = load_config(model_dir), _gguf(tmp_path_factory.getbasetemp())
    from_gguf = load_config(path)
    assert from_gguf.rotary_dim == 12
    assert from_gguf.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    for context in (ORIGINAL, 2 * ORIGINAL):
        np.testing.assert_allclose(inv_freq(at_context(from_gguf, context)),
                                   inv_freq(at_context(cfg, context)), rtol=1e-6)
    assert attention_factor(from_gguf) == pytest.approx(attention_factor(cfg), rel=1e-6)
    for prompt_len in (20, LONG):
        torch_baseline_reads_gguf_as(hf, path, from_gguf, prompt_len)
    typed = write_gguf(tmp_path_factory.mktemp("typed") / "typed.gguf", cfg, read_checkpoint(model_dir),
                       arch="phi3", extra=_factors(cfg), meta=_META | {"phi3.rope.scaling.type": "longrope"})
    assert load_config(typed).rope_scaling == from_gguf.rope_scaling


def test_llamacpp_on_a_longrope_gguf_gives_hfs_greedy_tokens(phi, tmp_path_factory):
    """llama.cpp picks LongRoPE's set by its context, as the run spec does: at a context within the
    original one and beyond it, its greedy tokens on the GGUF are transformers' (which the engine's
    are, above)."""
    import os

    from sandwich_tvm.bench.baselines import llamacpp

    if (why := llamacpp.available()) is not None:
        pytest.skip(why)
    model_dir, hf = phi
    path, vocab = _gguf(tmp_path_factory.getbasetemp()), load_config(model_dir).vocab_size
    os.sched_setaffinity(0, CPUS)
    for context, prompt_len in ((ORIGINAL, SHORT), (2 * ORIGINAL, LONG)):
        prompt = [int(t) for t in np.random.default_rng(3).integers(0, vocab, prompt_len)]
        run = llamacpp.LlamaCpp(path, threads=len(CPUS), context=context)
        assert run.generate(prompt, STEPS)[2] == _hf_greedy(hf, vocab, prompt_len), context


def test_longrope_and_partial_rotary_refusals(phi, tmp_path):
    """transformers' other names for LongRoPE (su, yarn with factors) read as it, its precedence
    and defaults too; TVM's stock build is refused in one line (it computes no attention factor);
    factor sets of the wrong length, a partial rotary outside Phi-3 or of an odd width, another
    scaling kind in a Phi-3, and a GGUF's factors outside a phi3, or only one set, or a missing
    original context, are one-line errors."""
    from sandwich_tvm.compiler.artifact import CompileError, compile_model
    from sandwich_tvm.model.checkpoint import random_checkpoint

    from .gguf_models import tiny_config

    model_dir, _ = phi
    raw = json.loads((model_dir / "config.json").read_text())
    rope = raw["rope_parameters"]
    want = load_config(model_dir)

    def config(name: str, fields: dict):
        return edited_config(model_dir, tmp_path / name, fields)

    for kind in ("su", "yarn"):
        old = {k: v for k, v in rope.items() if k not in ("rope_type", "partial_rotary_factor")}
        got = config(kind, {"rope_parameters": None, "rope_scaling": old | {"type": kind},
                            "partial_rotary_factor": 0.75})
        assert got.rope_scaling == want.rope_scaling and got.rotary_dim == 12
    assert config("attn", {"rope_parameters": rope | {"attention_factor": 1.5}}).rope_scaling[
        "attention_factor"] == 1.5
    # transformers' Phi3Config: the factor in the RoPE object wins, the original context beside it
    # wins, and without either it is 4096
    assert config("inner", {"partial_rotary_factor": 0.5}).rotary_dim == 12
    unset = {"rope_parameters": {k: v for k, v in rope.items() if k != "original_max_position_embeddings"},
             "original_max_position_embeddings": None}
    assert config("unset", unset).rope_scaling["original_max_position_embeddings"] == 4096
    assert config("outer", unset | {"original_max_position_embeddings": 128}).rope_scaling[
        "original_max_position_embeddings"] == 128
    with pytest.raises(ModelConfigError, match="factor sets hold 6 and 6 values, not one per pair .*\\(8\\)"):
        replace(want, rotary_dim=None)
    with pytest.raises(CompileError, match="cannot run .*: its RoPE has no LongRoPE attention"):
        compile_model(replace(_spec(model_dir, ORIGINAL), stock=True))
    bad = {"short": ({"rope_parameters": rope | {"short_factor": [1.0] * 8}},
                     "short_factor must be 6 positive"),
           "negative": ({"rope_parameters": rope | {"long_factor": [-1.0] * 6}},
                        "long_factor must be 6 positive"),
           "odd": ({"rope_parameters": rope | {"partial_rotary_factor": 0.35}}, "turns 5 of a head's 16"),
           "llama3": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
                      "Phi-3's RoPE scaling 'llama3' is not supported"),
           "llama": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                      "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
                     "partial_rotary_factor 0.5 is not supported outside Phi-3")}
    for name, (fields, match) in bad.items():
        with pytest.raises(ModelConfigError, match=match) as err:
            config(name, fields)
        assert "\n" not in str(err.value), name

    state = read_checkpoint(model_dir)
    factors, meta = _factors(want), _META
    llama = tiny_config(211, tied=False)
    one_set = {"rope_factors_long.weight": factors["rope_factors_long.weight"]}
    for name, (cfg, weights, arch, extra, keys, match) in {
            "llama": (llama, random_checkpoint(llama), "llama", factors, {}, "supported in phi3 GGUFs only"),
            "one-set": (want, state, "phi3", one_set, meta, "LongRoPE needs both"),
            "length": (want, state, "phi3", factors | {"rope_factors_short.weight": np.ones(8, np.float32)},
                       meta, "rope_factors_short.weight must hold 6 positive factors"),
            "original": (want, state, "phi3", factors, {"phi3.rope.dimension_count": 12},
                         "LongRoPE needs phi3.rope.scaling.original_context_length")}.items():
        path = write_gguf(tmp_path / f"{name}.gguf", cfg, weights, arch=arch, extra=extra, meta=keys)
        with pytest.raises(ModelConfigError, match=match) as err:
            load_config(path)
        assert "\n" not in str(err.value), name
