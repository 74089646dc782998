"""The Linear GEMMs of a Llama model (weights fused as the model stores them)."""

from __future__ import annotations

from ..model.config import LlamaConfig
from .schedule import GemmShape


def linear_shapes(cfg: LlamaConfig, dtype: str = "float32") -> dict[str, GemmShape]:
    """qkv, o, gate_up, down and lm_head as ``Y = X @ W.T`` shapes (n = output, k = input features).

    The lm_head only ever sees decode-sized m (prefill computes the last token's logits)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {
        "qkv": GemmShape(q + 2 * kv, h, dtype),
        "o": GemmShape(h, q, dtype),
        "gate_up": GemmShape(2 * cfg.intermediate_size, h, dtype),
        "down": GemmShape(h, cfg.intermediate_size, dtype),
        "lm_head": GemmShape(cfg.vocab_size, h, dtype),
    }
