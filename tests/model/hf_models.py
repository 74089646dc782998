"""Tiny random HF Llama checkpoints written with transformers (the reference implementation),
and a byte-level BPE tokenizer whose tokens split multi-byte characters."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sandwich_tvm.model.tokenizer import byte_chars

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# MHA + untied + plain RoPE; GQA + tied + Llama-3 scaling + heads wider than the hidden states
# (head_dim 32: 6 x 32 != 96, as Mistral-Nemo's 32 x 128 != 5120). Odd vocab/FFN widths exercise
# the kernels' column tails.
CONFIGS = {
    "mha-untied": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=301, max_position_embeddings=256,
                       tie_word_embeddings=False),
    "gqa-tied-llama3": dict(hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                            num_attention_heads=6, num_key_value_heads=2, head_dim=32, vocab_size=333,
                            max_position_embeddings=256, tie_word_embeddings=True, rope_theta=500000.0,
                            rope_scaling=LLAMA3_ROPE),
}
# Only written, not compared with HF (test_llama_vs_hf runs every entry of CONFIGS).
# GQA with 2 KV heads of 16: k_proj/v_proj are [32, 64]; a short context of 128.
OTHER_CONFIGS = {
    "gqa-small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                      tie_word_embeddings=False),
    # linear RoPE scaling (DeepSeek-Coder's kind): positions divided by 4
    "mha-linear-rope": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, vocab_size=256, max_position_embeddings=256,
                            tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # YaRN (Yarn-Llama-2's kind): 4x the trained context, cos and sin scaled by 0.1 ln 4 + 1
    "mha-yarn": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=256, max_position_embeddings=256,
                     tie_word_embeddings=False, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 64}),
    # a draft model for mha-untied: its vocabulary, one narrower layer
    "mha-draft": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=301, max_position_embeddings=256,
                      tie_word_embeddings=False),
}


def write_hf_model(name: str, out: Path, seed: int = 0):
    """Save a random ``LlamaForCausalLM`` to ``out`` (safetensors) and return it (eval mode)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    fields = CONFIGS[name] if name in CONFIGS else OTHER_CONFIGS[name]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    model.save_pretrained(out)
    return model


def hf_checkpoint(base: Path, name: str, seed: int = 0) -> Path:
    """``name``'s checkpoint (weights drawn with ``seed``) at a fixed place in the session
    (``base``: its base directory), so that its compiled models can be named before a test asks
    for them; written if missing."""
    out = base / "hf" / (name if seed == 0 else f"{name}-seed{seed}")
    if not (out / "config.json").is_file():
        write_hf_model(name, out, seed)
    return out


def byte_level_tokenizer(merges: list[tuple[bytes, bytes]] = ()):
    """A byte-level BPE ``tokenizers.Tokenizer``: the 256 bytes plus ``merges`` (byte pairs), no
    pre-splitting, so a merge may join the tail of one character to the next."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    u = byte_chars()

    def text(bs: bytes) -> str:
        return "".join(u[b] for b in bs)

    vocab = {u[b]: b for b in range(256)}
    pairs = []
    for a, b in merges:
        pairs.append((text(a), text(b)))
        vocab[text(a + b)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def save_tiny_hf(out: Path, model_class: str, config, seed: int) -> Path:
    """A transformers ``model_class`` (its name) of ``config`` (``TINY``'s shape, say), seeded, with
    its norm weights drawn around one (transformers starts them at one), saved to ``out``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.input_layernorm.weight.normal_(1.0, 0.3)
            layer.post_attention_layernorm.weight.normal_(1.0, 0.3)
    hf.save_pretrained(out)
    return out


# 2 layers, 4 heads of 16 over 2 KV heads, 211 tokens, an untied head
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=211, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)


def edited_config(model_dir: Path, out: Path, fields: dict, drop: tuple[str, ...] = ()):
    """The config of ``model_dir``'s config.json with ``fields`` changed and the keys ``drop``
    left out, written to ``out``."""
    import json

    from sandwich_tvm.model.config import load_config

    raw = json.loads((model_dir / "config.json").read_text()) | fields
    out.mkdir()
    (out / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in drop}))
    return load_config(out)


def hf_logits(hf, tokens: list[int]) -> np.ndarray:
    """A transformers model's logits at every position of ``tokens``."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    """A transformers model's ``steps`` greedy tokens after ``prompt``."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def greedy_matches_hf(engine, hf, vocab: int, steps: int, prompt_len: int = 30) -> list[int]:
    """The engine's greedy run of ``steps`` tokens after a seeded ``prompt_len``-token prompt,
    against HF's logits over the same tokens (1e-4) and its argmax; the engine's tokens."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, vocab, prompt_len)]
    logits: list[np.ndarray] = []
    gen = engine.generate(prompt, steps, logits_out=logits)
    ref = hf_logits(hf, prompt + gen.tokens[:-1])[len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(logits), ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    assert gen.tokens == [int(t) for t in ref.argmax(-1)]
    return gen.tokens


def torch_baseline_reads_gguf_as(hf, path: Path, cfg, prompt_len: int = 20) -> None:
    """The torch baseline on the GGUF at ``path`` (``cfg`` read from it; transformers dequantizes
    it) gives ``hf``'s logits over a seeded ``prompt_len``-token prompt."""
    from sandwich_tvm.bench.baselines.torch_hf import hf_model

    prompt = [int(t) for t in np.random.default_rng(4).integers(0, cfg.vocab_size, prompt_len)]
    np.testing.assert_allclose(hf_logits(hf_model(str(path), cfg, 0), prompt), hf_logits(hf, prompt),
                               rtol=1e-5, atol=1e-5)
