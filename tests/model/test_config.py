"""Model presets and HF config.json loading, including bad input."""

from __future__ import annotations

import json
from dataclasses import replace

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
    assert 0.49e9 < PRESETS["qwen2.5-0.5b"].num_params() < 0.5e9  # Qwen2.5-0.5B's 494M, biases included
    assert 0.59e9 < PRESETS["qwen3-0.6b"].num_params() < 0.6e9  # Qwen3-0.6B's 596M


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
    (json.dumps({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}), "not supported"),
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


GOOD = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 128}


@pytest.mark.parametrize(("change", "message"), [
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be >= 1, got 0"),
    ({"vocab_size": -5}, "vocab_size must be >= 1, got -5"),
    ({"hidden_size": "64"}, "hidden_size must be an integer, got a string '64'"),
    ({"hidden_size": 64.5}, "hidden_size must be an integer"),
    ({"intermediate_size": True}, "intermediate_size must be an integer, got a boolean"),
    ({"num_attention_heads": 0}, "num_attention_heads must be >= 1"),
    ({"hidden_size": 62}, "hidden_size 62 is not a multiple of num_attention_heads 4"),
    ({"hidden_size": 20}, "head_dim 5 .* is odd"),
    ({"head_dim": 15}, "head_dim 15 is odd"),
    ({"head_dim": 0}, "head_dim must be >= 1, got 0"),
    ({"hidden_size": 62, "head_dim": "16"}, "head_dim must be an integer, got a string"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be >= 1"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a positive number"),
    ({"rope_theta": "big"}, "rope_theta must be a positive number, got a string"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"rope_scaling": [1, 2]}, "must be an object, got an array"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 RoPE scaling needs low_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 64}}, "high_freq_factor 1.0 must exceed"),
])
def test_bad_fields_name_the_file_field_and_value(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps(GOOD | change))
    with pytest.raises(ModelConfigError, match=message) as err:
        load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("content", "what"), [("[1, 2]", "an array"), ('"llama"', "a string"),
                                               ("null", "null"), ("3", "a number")])
def test_config_json_that_is_not_an_object(tmp_path, content, what):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelConfigError, match=f"expected a JSON object of model fields, got {what}"):
        load_config(tmp_path)


def test_integers_written_as_floats_and_nulls_are_accepted(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        GOOD | {"max_position_embeddings": 1e9, "num_key_value_heads": None, "head_dim": None}))
    cfg = load_config(tmp_path)
    assert cfg.max_position_embeddings == 10**9 and isinstance(cfg.max_position_embeddings, int)
    assert cfg.num_key_value_heads == 4  # null: the HF default, one KV head per query head


def test_presets_are_validated_too():
    from dataclasses import replace

    with pytest.raises(ModelConfigError, match="num_key_value_heads 5 does not divide"):
        replace(PRESETS["llama-160m"], num_key_value_heads=5)


def test_an_explicit_head_dim_and_mistral(tmp_path):
    """Heads wider than the hidden states (Mistral-Nemo: 32 x 128 != 5120) are read, kept in the
    config's dict only where explicit, and a Mistral's sliding window is kept beside its whole
    context (the attention kernels apply it); one as long as the context is none."""
    mistral = GOOD | {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 40,
                      "head_dim": 16, "sliding_window": 96}
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    cfg = load_config(tmp_path)
    assert (cfg.head_dim, cfg.explicit_head_dim, cfg.max_position_embeddings, cfg.sliding_window) == (
        16, True, 128, 96)
    assert cfg.to_dict()["sliding_window"] == 96 and type(cfg)(**cfg.to_dict()) == cfg
    (tmp_path / "config.json").write_text(json.dumps(mistral | {"sliding_window": 128}))
    whole = load_config(tmp_path)
    assert whole.sliding_window is None and "sliding_window" not in whole.to_dict()
    unnamed = {k: v for k, v in mistral.items() if k != "sliding_window"} | {"max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(unnamed))
    assert load_config(tmp_path).sliding_window == 4096  # transformers' MistralConfig default
    (tmp_path / "config.json").write_text(json.dumps(mistral | {"sliding_window": 0}))
    with pytest.raises(ModelConfigError, match="sliding_window must be >= 1, got 0"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    assert cfg.layer_params() == 40 * 16 * (4 + 2 * 2) + 4 * 16 * 40 + 3 * 40 * 128
    assert type(cfg)(**cfg.to_dict()) == cfg and cfg.to_dict()["head_dim"] == 16
    (tmp_path / "config.json").write_text(json.dumps(mistral | {"sliding_window": None, "head_dim": 10,
                                                                "hidden_size": 40}))
    assert load_config(tmp_path).max_position_embeddings == 128
    derived = load_config("llama-160m")
    assert derived.head_dim == 64 and not derived.explicit_head_dim and "head_dim" not in derived.to_dict()
    assert replace(derived, head_dim=64) == derived
