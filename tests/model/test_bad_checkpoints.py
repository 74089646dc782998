"""Bad input end to end: checkpoints that do not match their config, KV caches that do not fit,
CLI options out of range -- each a one-line error naming the file, value or limit -- and text
streamed through a tokenizer whose tokens split multi-byte characters."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from sandwich_tvm.cli import generate as generate_cli
from sandwich_tvm.compiler.artifact import export_module
from sandwich_tvm.model.checkpoint import ModelLoadError, check_checkpoint, read_checkpoint
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.linear import KernelSet
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.spec import SpecError, check_context, kv_cache_bytes, run_context
from sandwich_tvm.tvm_compat import PROCESS_CPUS

from ..precompile import generate_spec, warm_up
from .hf_models import byte_level_tokenizer, hf_checkpoint, write_hf_model

pytest.importorskip("torch")

ISA = "avx2"  # packing only: any ISA works on any host


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A GQA checkpoint (4 heads, 2 KV heads of 16: k_proj is [32, 64]), its config and params."""
    out = tmp_path_factory.mktemp("gqa-small")
    write_hf_model("gqa-small", out)
    cfg = load_config(out)
    return out, cfg, export_module(cfg, KernelSet(2, 1, isa=ISA))[1]


def variant(src: Path, dst: Path, state: dict[str, np.ndarray], **config_changes) -> Path:
    """``dst``: ``src``'s config.json (with ``config_changes``) and the tensors ``state``."""
    from safetensors.numpy import save_file

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text()) | config_changes
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(dst / "model.safetensors"))
    return dst


# --------------------------------------------------------------------------- checkpoint vs config

def test_k_proj_of_the_wrong_shape_is_refused(small, tmp_path):
    model_dir, cfg, params = small
    state = read_checkpoint(model_dir)
    state["model.layers.1.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)  # fits the panels
    bad = variant(model_dir, tmp_path / "m", state)
    with pytest.raises(ModelLoadError, match=r"k_proj.weight has shape \[48, 64\], but config.json implies "
                                             r"\[32, 64\] \(num_key_value_heads \* head_dim, hidden_size\)"):
        load_params(bad, cfg, params, ISA)


@pytest.mark.parametrize(("extra", "named"), [
    ({f"model.layers.5.{p}.weight": (64, 64) for p in ("self_attn.q_proj", "self_attn.o_proj")},
     "2 tensors are not part of the model config.json describes: 'model.layers.5.self_attn.o_proj.weight', "
     "'model.layers.5.self_attn.q_proj.weight'; config.json says num_hidden_layers 2"),
    ({"model.vision_tower.proj.weight": (8, 8)},
     "1 tensor is not part of the model config.json describes: 'model.vision_tower.proj.weight'; this is not "
     "a plain LlamaForCausalLM"),
])
def test_tensors_beyond_the_config_are_named(small, tmp_path, extra, named):
    model_dir, cfg, params = small
    state = read_checkpoint(model_dir) | {k: np.ones(s, np.float32) for k, s in extra.items()}
    bad = variant(model_dir, tmp_path / "m", state)
    with pytest.raises(ModelLoadError, match=f"{bad}: {named}"):
        load_params(bad, cfg, params, ISA)


def test_fewer_layers_in_the_config_than_the_checkpoint(small):
    model_dir, cfg, _ = small
    one_layer = replace(cfg, num_hidden_layers=1)
    first = "'model.layers.1.input_layernorm.weight'"
    with pytest.raises(ModelLoadError, match=f"9 tensors are not .*: {first}.* and 5 more; config.json says "
                                             "num_hidden_layers 1"):
        check_checkpoint(one_layer, read_checkpoint(model_dir), str(model_dir))


def test_rotary_inv_freq_buffers_are_ignored(small, tmp_path):
    model_dir, cfg, params = small
    state = read_checkpoint(model_dir)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    ok = variant(model_dir, tmp_path / "m", state)
    assert len(load_params(ok, cfg, params, ISA)) == len(params)


def test_tied_config_with_a_different_lm_head(small):
    model_dir, cfg, _ = small
    tied, state = replace(cfg, tie_word_embeddings=True), read_checkpoint(model_dir)
    with pytest.raises(ModelLoadError, match="lm_head.weight differs .* set tie_word_embeddings to false"):
        check_checkpoint(tied, state, str(model_dir))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # a stored copy is accepted
    check_checkpoint(tied, state, str(model_dir))


def test_bad_config_fails_before_the_checkpoint_is_read(small, tmp_path):
    from sandwich_tvm.model.config import ModelConfigError

    model_dir, _, _ = small
    bad = variant(model_dir, tmp_path / "m", read_checkpoint(model_dir), num_key_value_heads=3)
    with pytest.raises(ModelConfigError, match="num_key_value_heads 3 does not divide num_attention_heads 4"):
        load_config(bad)


# --------------------------------------------------------------------------- the KV cache

def test_kv_cache_is_sized_to_the_run(small):
    _, cfg, _ = small
    huge = replace(cfg, max_position_embeddings=10**9)
    assert run_context(huge, 20) == 256 and run_context(huge, 300) == 512
    assert run_context(cfg, 300) == 128  # capped at the model's context
    assert kv_cache_bytes(cfg, 100) == 2 * 2 * 2 * 16 * 4 * 100
    assert kv_cache_bytes(cfg, 100, "float16") == 2 * 2 * 2 * 16 * 2 * 100  # the cache's own dtype
    assert kv_cache_bytes(cfg, 100, "int8") == 2 * 2 * 2 * (16 + 4) * 100  # each row with its fp32 scale
    with pytest.raises(SpecError, match="--context 2000000000 exceeds the model's context of 1000000000"):
        check_context(huge, 2 * 10**9)
    need = "KV cache of 1000000000 tokens needs 476.8 GiB but only 1.0 GiB"
    with pytest.raises(SpecError, match=f"{need} of memory is available; lower --context"):
        check_context(huge, 10**9, available=2**30)
    check_context(huge, 256, available=2**30)


# --------------------------------------------------------------------------- the generate CLI

@pytest.mark.parametrize("argv", [["--prompt-len", "0"], ["--prompt-len", "4", "--max-batch", "0"],
                                  ["--prompt-len", "4", "--context", "0"],
                                  ["--prompt-len", "4", "--max-new-tokens", "-3"],
                                  ["--prompt-len", "four"]])
def test_out_of_range_options_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        generate_cli.main(argv)
    assert exit_.value.code == 2
    option = next(a for a in argv[::-1] if a.startswith("--"))
    assert f"argument {option}:" in capsys.readouterr().err


def test_context_beyond_the_model_or_memory_fails_before_compiling(small, tmp_path, monkeypatch, capsys):
    import psutil

    model_dir, _, _ = small
    assert generate_cli.main(["--model", str(model_dir), "--prompt-len", "4", "--context", "4096"]) == 2
    assert "--context 4096 exceeds the model's context of 128" in capsys.readouterr().err
    argv = ["--model", str(model_dir), "--prompt-len", "100", "--max-new-tokens", "29"]
    assert generate_cli.main(argv) == 2
    assert "exceeds the context of 128 tokens" in capsys.readouterr().err
    huge = variant(model_dir, tmp_path / "huge", read_checkpoint(model_dir), max_position_embeddings=1e9)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2**30))
    assert generate_cli.main(["--model", str(huge), "--prompt-len", "4", "--context", "900000000"]) == 2
    assert "GiB of memory is available; lower --context" in capsys.readouterr().err


def _huge_args(base: Path) -> list[str]:
    """``generate`` on gqa-small claiming 1e9 positions, on a plan of every core to prefill and
    one to decode (both written once a session)."""
    out = base / "huge-context"
    plan = out / "plans.json"
    if not plan.is_file():
        src = hf_checkpoint(base, "gqa-small")
        variant(src, out / "huge", read_checkpoint(src), max_position_embeddings=1e9)
        cpus = sorted(PROCESS_CPUS)
        plan.write_text(json.dumps({"plans": [{"tp": 1, "prefill_cpus": [cpus], "decode_cpus": [cpus[:1]]}]}))
    return ["--model", str(out / "huge"), "--plan", str(plan), "--prompt-len", "6", "--dtype", "float32"]


warm_up(__name__, "test_huge_context_model_runs_with_a_small_cache_and_strict_json",
        lambda base: [generate_spec([*_huge_args(base), "--max-new-tokens", "2"])])


@pytest.mark.compile
def test_huge_context_model_runs_with_a_small_cache_and_strict_json(precompiler, tmp_path_factory, capsys):
    base = _huge_args(tmp_path_factory.getbasetemp())
    precompiler.ready(generate_spec([*base, "--max-new-tokens", "2"]))
    assert generate_cli.main([*base, "--max-new-tokens", "2"]) == 0
    assert "KV cache: 256 tokens" in capsys.readouterr().err
    for new in (1, 0):
        assert generate_cli.main([*base, "--max-new-tokens", str(new), "--json"]) == 0
        raw = capsys.readouterr().out
        out = json.loads(raw, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))
        assert out["tpot_ms"] is None and out["output_tokens"] == new and len(out["tokens"]) == new


# --------------------------------------------------------------------------- streamed text

# Bytes of "🦙b 世界": F0 9F A6 99 | 62 | 20 | E4 B8 96 | E7 95 8C; merges join the llama's last
# byte to "b" and 世's last byte to 界's first, so tokens end inside characters.
MERGES = [(b"\xf0", b"\x9f"), (b"\x99", b"b"), (b"\x96", b"\xe7")]
TEXT = "🦙b 世界"


def test_streaming_holds_back_split_characters():
    tok = byte_level_tokenizer(MERGES)
    ids = tok.encode(TEXT).ids
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))  # the case we guard
    out: list[str] = []
    stream = generate_cli.TextStream(tok, out.append)
    for t in ids:
        stream.push(t)
    stream.finish()
    assert "".join(out) == TEXT and not any("\ufffd" in piece for piece in out)


def test_streaming_flushes_an_incomplete_tail_at_the_end():
    tok = byte_level_tokenizer(MERGES)
    ids = tok.encode(TEXT).ids
    out: list[str] = []
    stream = generate_cli.TextStream(tok, out.append)
    for t in ids[:-1]:  # 界 lacks its last byte
        stream.push(t)
    assert "".join(out) == "🦙b "
    stream.finish()
    assert "".join(out) == tok.decode(ids[:-1]) and "".join(out).startswith("🦙b 世")
