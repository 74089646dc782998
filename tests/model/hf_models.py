"""Tiny random HF Llama checkpoints written with transformers (the reference implementation)."""

from __future__ import annotations

from pathlib import Path

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# MHA + untied + plain RoPE; GQA + tied + Llama-3 scaling. Odd vocab/FFN widths exercise the
# kernels' column tails.
CONFIGS = {
    "mha-untied": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=301, max_position_embeddings=256,
                       tie_word_embeddings=False),
    "gqa-tied-llama3": dict(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                            num_attention_heads=6, num_key_value_heads=2, vocab_size=333,
                            max_position_embeddings=256, tie_word_embeddings=True, rope_theta=500000.0,
                            rope_scaling=LLAMA3_ROPE),
}


def write_hf_model(name: str, out: Path, seed: int = 0):
    """Save a random ``LlamaForCausalLM`` to ``out`` (safetensors) and return it (eval mode)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIGS[name])).eval()
    model.save_pretrained(out)
    return model
