"""The Linear GEMMs of a Llama model (weights fused as the model stores them)."""

from __future__ import annotations

from ..kernels.schedule import GemmShape
from .config import LlamaConfig


def linear_shapes(cfg: LlamaConfig, dtype: str = "float32", tp: int = 1) -> dict[str, GemmShape]:
    """qkv, o, gate_up, down and lm_head as ``Y = X @ W.T`` shapes (n = output, k = input features),
    of one rank's shard when the model is split over ``tp`` processes (the paper's payload
    generator: shapes from the config and the TP degree).

    The lm_head only ever sees decode-sized m (prefill computes the last token's logits)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d // tp, cfg.num_key_value_heads * d // tp
    inter = cfg.intermediate_size // tp
    return {
        "qkv": GemmShape(q + 2 * kv, h, dtype),
        "o": GemmShape(h, q, dtype),
        "gate_up": GemmShape(2 * inter, h, dtype),
        "down": GemmShape(h, inter, dtype),
        "lm_head": GemmShape(-(-cfg.vocab_size // tp), h, dtype),
    }
