"""Checkpoint loading: sharded indexes, the conversion cache, packing, and bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.compiler.artifact import export_module
from sandwich_tvm.kernels.codegen import pack_weight
from sandwich_tvm.memory import aligned_empty
from sandwich_tvm.model.config import ModelConfigError, load_config
from sandwich_tvm.model.linear import KernelSet
from sandwich_tvm.model.weights import ModelLoadError, load_params, read_checkpoint

from .hf_models import write_hf_model

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("gqa")
    write_hf_model("gqa-tied-llama3", out)
    cfg = load_config(out)
    _, params = export_module(cfg, KernelSet(2, 1))
    return out, cfg, params


def test_config_reads_transformers5_rope_parameters(ckpt):
    _, cfg, _ = ckpt
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.tie_word_embeddings and cfg.num_key_value_heads == 2


def test_packed_params_and_cache(ckpt):
    model_dir, cfg, params = ckpt
    state = read_checkpoint(model_dir)
    first = load_params(model_dir, cfg, params, "avx2")
    names = [n for n, _ in params]
    qkv = first[names.index("model.layers.1.self_attn.qkv_proj.weight")]
    p = "model.layers.1.self_attn."
    fused = np.concatenate([state[p + f"{x}_proj.weight"] for x in "qkv"])
    np.testing.assert_array_equal(qkv, pack_weight(fused, "avx2"))
    # Tied: the embedding is stored once, packed, and read by both the gather and the lm_head.
    assert "lm_head.weight" not in names
    emb = first[names.index("model.embed_tokens.weight")]
    np.testing.assert_array_equal(emb, pack_weight(state["model.embed_tokens.weight"], "avx2"))
    assert all(a.ctypes.data % 64 == 0 for a in first)
    assert list(Path(os.environ["SANDWICH_CACHE"]).glob("weights/*.safetensors")), "conversion cached"
    again = load_params(model_dir, cfg, params, "avx2")
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_sharded_checkpoint_equals_single_file(ckpt, tmp_path):
    import transformers

    model_dir, cfg, params = ckpt
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a = read_checkpoint(model_dir)
    b = read_checkpoint(tmp_path)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_truncated_safetensors_names_the_file(ckpt, tmp_path):
    model_dir, cfg, params = ckpt
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    data = (model_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model.safetensors.*re-download"):
        load_params(tmp_path, cfg, params, "avx2")


def test_shape_mismatch_and_missing_tensor(ckpt, tmp_path):
    from safetensors.numpy import save_file

    model_dir, cfg, params = ckpt
    state = read_checkpoint(model_dir)
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"][:, :10]
    del state["model.layers.1.input_layernorm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj.weight has shape"):
        load_params(tmp_path, cfg, params, "avx2")
    state["model.layers.0.mlp.down_proj.weight"] = np.zeros((96, 200), np.float32)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="input_layernorm.weight' is missing"):
        load_params(tmp_path, cfg, params, "avx2")


def test_bad_model_directories(tmp_path):
    with pytest.raises(ModelConfigError, match="neither a preset"):
        load_config(tmp_path / "nope")
    with pytest.raises(ModelConfigError, match="has no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ModelConfigError, match="not supported"):
        load_config(tmp_path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_params(tmp_path, None, [], "avx2")


def test_large_arrays_are_huge_page_aligned():
    a = aligned_empty((1024, 1024))
    assert a.ctypes.data % (2 << 20) == 0 and a.flags.writeable
