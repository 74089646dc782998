"""RoPE's inverse frequencies as HF computes them (the default, linear, Llama-3, YaRN and LongRoPE
scaling), and the factor YaRN and LongRoPE scale cos and sin by; the kernel that applies them to
q and k is ``kernels.rope``.

LongRoPE (Phi-3.5, the 128k Phi-3s, Phi-4-mini) divides each frequency by one of two sets of
factors: the short set for sequences within the original context, the long set beyond it.
transformers switches sets on the running length (recomputing the whole sequence when it crosses),
llama.cpp by the context it is run with. A paged KV cache cannot recompute, so the set is chosen
as llama.cpp chooses it: by the run's context (``at_context``), once, in the run spec. Within
the original context that is what transformers computes; a run whose context is longer turns
every position by the long set, as transformers does for a sequence that long."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .config import LlamaConfig


def inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """HF's inverse frequencies (``rope_type`` default, linear, llama3, yarn or longrope), one per
    pair of the ``cfg.rope_dims`` turned dimensions, float32."""
    d = cfg.rope_dims
    freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = cfg.rope_scaling
    if uses_longrope(cfg):
        freq = freq / np.asarray(sc["long_factor" if sc.get("long") else "short_factor"], np.float64)
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
    if uses_yarn(cfg):
        freq = _yarn(freq, d, cfg.rope_theta, sc)
    return freq.astype(np.float32)


def _yarn(freq: np.ndarray, d: int, theta: float, sc: dict) -> np.ndarray:
    """YaRN: frequencies that turn more than ``beta_fast`` times over the original context kept,
    fewer than ``beta_slow`` times divided by the factor, a linear ramp over the pairs between."""

    context = sc["original_max_position_embeddings"]

    def pair_of(turns: float) -> float:  # the pair whose wavelength fits the context ``turns`` times
        return d * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(sc["beta_fast"]), pair_of(sc["beta_slow"])
    if sc["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    keep = 1 - np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return freq / sc["factor"] * (1 - keep) + freq * keep


def uses_yarn(cfg: LlamaConfig) -> bool:
    """Whether ``cfg`` scales RoPE by YaRN (which TVM's stock build does not do as HF does)."""
    return bool(cfg.rope_scaling) and cfg.rope_scaling.get("rope_type") == "yarn"


def uses_longrope(cfg: LlamaConfig) -> bool:
    """Whether ``cfg`` scales RoPE by LongRoPE's per-frequency factors."""
    return bool(cfg.rope_scaling) and cfg.rope_scaling.get("rope_type") == "longrope"


def stock_problem(cfg: LlamaConfig) -> str | None:
    """Why TVM's stock build cannot run the model as transformers does, or None."""
    if uses_yarn(cfg):
        return "its RoPE has no YaRN attention factor"
    if uses_longrope(cfg):
        return "its RoPE has no LongRoPE attention factor and picks its own factor set"
    if cfg.nope_layers:
        return "its cache turns every layer by RoPE (layers without it need Sandwich's RoPE in the graph)"
    if cfg.sliding_window:
        return "its attention kernels have no sliding window"
    return None


def at_context(cfg: LlamaConfig, context: int) -> LlamaConfig:
    """``cfg`` for runs whose sequences reach ``context`` positions: LongRoPE's long factors where
    that exceeds the original context (llama.cpp's choice), its short ones within it; any other
    model as it is."""
    if not uses_longrope(cfg):
        return cfg
    long = context > cfg.rope_scaling["original_max_position_embeddings"]
    if long == cfg.rope_scaling.get("long", False):
        return cfg
    return replace(cfg, rope_scaling=dict(cfg.rope_scaling, long=long))


def attention_factor(cfg: LlamaConfig) -> float:
    """What RoPE's cos and sin are multiplied by: YaRN's or LongRoPE's attention factor, else 1."""
    return float(cfg.rope_scaling["attention_factor"]) if uses_yarn(cfg) or uses_longrope(cfg) else 1.0


def linear_factor(cfg: LlamaConfig) -> float:
    """The factor positions are divided by under linear RoPE scaling, else 1 (TVM's
    ``rope_scale`` multiplies positions by its inverse: its own RoPE, the stock build's, then
    scales as ``inv_freq`` does)."""
    sc = cfg.rope_scaling
    return float(sc["factor"]) if sc and sc.get("rope_type", sc.get("type")) == "linear" else 1.0
