"""RoPE's inverse frequencies as HF computes them (the default, linear and Llama-3 scaling); the
kernel that applies them to q and k is ``kernels.rope``."""

from __future__ import annotations

import math

import numpy as np

from .config import LlamaConfig


def inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """HF's inverse frequencies (``rope_type`` default, linear or llama3), float32."""
    d = cfg.head_dim
    freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = cfg.rope_scaling
    if sc and sc.get("rope_type", sc.get("type")) == "linear":  # positions / factor
        freq = freq / sc["factor"]
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freq
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = np.where(wavelen > old / lo, freq / factor, freq)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        freq = np.where(mid, (1 - smooth) * freq / factor + smooth * freq, scaled)
    return freq.astype(np.float32)


def linear_factor(cfg: LlamaConfig) -> float:
    """The factor positions are divided by under linear RoPE scaling, else 1 (TVM's
    ``rope_scale`` multiplies positions by its inverse: its own RoPE, the stock build's, then
    scales as ``inv_freq`` does)."""
    sc = cfg.rope_scaling
    return float(sc["factor"]) if sc and sc.get("rope_type", sc.get("type")) == "linear" else 1.0
