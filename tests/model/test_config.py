"""Model presets and HF config.json loading, including bad input."""

from __future__ import annotations

import json

import pytest

from sandwich_tvm.model.config import PRESETS, ModelConfigError, load_config


def test_presets_have_the_published_shapes():
    small = load_config("llama-160m")
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads,
            small.intermediate_size, small.vocab_size) == (768, 12, 12, 3072, 32000)
    assert 150e6 < small.num_params() < 175e6
    assert 1.05e9 < PRESETS["tinyllama-1.1b"].num_params() < 1.15e9
    assert 1.2e9 < PRESETS["llama-3.2-1b"].num_params() < 1.3e9  # tied embeddings
    assert 7.9e9 < PRESETS["llama-3-8b"].num_params() < 8.1e9


def test_hf_directory(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
           "vocab_size": 256, "tie_word_embeddings": True, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_config(tmp_path)
    assert model.head_dim == 16 and model.num_key_value_heads == 2 and model.tie_word_embeddings
    assert model.tp_degrees_ok(2) and not model.tp_degrees_ok(4)  # 2 KV heads


@pytest.mark.parametrize(("content", "message"), [
    (None, "no config.json"),
    ("{broken", "not valid JSON"),
    (json.dumps({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}), "not supported"),
    (json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}), "missing fields"),
])
def test_bad_model_directories(tmp_path, content, message):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelConfigError, match=message):
        load_config(tmp_path)


def test_unknown_name():
    with pytest.raises(ModelConfigError, match="neither a preset"):
        load_config("llama-9000")
