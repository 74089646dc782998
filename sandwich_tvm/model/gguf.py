"""GGUF files (llama.cpp's format) in: the config from the metadata, and the tensors under HF's
names as ``checkpoint.read_checkpoint`` returns them (the tokenizer is ``gguf_tokenizer``).

F32/F16/BF16 tensors are views of the file's memory map; Q8_0/Q4_0/Q4_1 tensors are their own
blocks (``QuantBlocks``), and Q4_K's and Q5_0's are regrouped as q4_1 and q8_0 blocks
(``kernels.kquant``) when read; the other types (with a printed note: Q5_1, the other K-quants,
the i-quants) are dequantized to float32 with ``gguf.quants`` when a tensor is used, one at a
time. llama.cpp stores a Llama's q/k rows interleaved for its RoPE (``attn_q``/``attn_k`` are
permuted by its HF conversion, see ``bench.baselines.llamacpp``); they are put back in HF's
rotate-half order here. A Qwen2's, Qwen3's or Phi-3's rows are HF's as they are (llama.cpp ropes
them as NeoX does); Qwen2's q, k and v biases and Qwen3's q/k norms are read beside the weights,
and Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate|up) are HF's ``qkv_proj`` and ``gate_up_proj``.
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..kernels.kquant import REGROUPED
from ..kernels.packing import numpy_dtype
from ..kernels.quant import QTYPES, QuantBlocks
from .checkpoint import ModelLoadError, hf_shapes
from .config import (
    MULTIPLIERS,
    LlamaConfig,
    ModelConfigError,
    linear_scaling,
    longrope_scaling,
    shape_problems,
    yarn_context,
    yarn_mscale,
    yarn_scaling,
)

# llama: Llama 2/3, TinyLlama, SmolLM2, Mistral; qwen2: Llama with q, k and v biases; qwen3: Llama
# with an RMSNorm over each q and k head; phi3: Llama with q|k|v and gate|up fused. Their q/k rows
# are as HF holds them (llama.cpp ropes them in NeoX's rotate-half order). granite: Llama (its q/k
# rows permuted as a Llama's) with four scalars, llama.cpp's embedding, residual, attention and
# logit scales; smollm3: Llama (rows permuted) whose every fourth layer takes no RoPE, as llama.cpp
# fixes it (``NOPE_EVERY``; no key says so)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "granite", "smollm3")
PERMUTED_ARCHITECTURES = ("llama", "granite", "smollm3")  # q/k rows in llama.cpp's interleaved RoPE order
NOPE_EVERY = 4
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # a phi3's LongRoPE sets
FAMILIES = "Llama 2/3, TinyLlama, SmolLM2, SmolLM3, Mistral, Qwen2, Qwen3, Phi-3, dense Granite 3"
# the quantized types the kernels read as they are: GGML type -> the weight dtype holding its blocks
KERNEL_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", **{k: d for k, (d, _) in REGROUPED.items()}}
NATIVE_TYPES = ("F32", "F16", "BF16", *KERNEL_TYPES)  # loaded without going through floats
# dequantized (by gguf.quants), with a note: Q5_1, the other K-quants, and the i-quants llama.cpp
# also falls back to for rows K-quants cannot hold (IQ4_NL under Q2_K/Q3_K for widths not of 256)
NOTED_TYPES = ("Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS",
               "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4")

# GGUF tensor names (after ``blk.N.``) -> HF's (after ``model.layers.N.``)
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # a Phi-3's: ffn_up gate|up
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_BIASED = ("attn_q", "attn_k", "attn_v")  # the biases a model has (Qwen2's)


# --------------------------------------------------------------------------- the file

def open_gguf(path: Path):
    """The file's ``gguf.GGUFReader`` (parsed once per file version: a 49k-token vocabulary
    takes seconds); a truncated or foreign file is a one-line ``ModelLoadError``."""
    try:
        st = path.stat()
    except OSError as err:
        raise ModelLoadError(f"{path} cannot be read ({err.strerror})") from err
    return _reader(str(path), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=2)
def _reader(path: str, size: int, _mtime: int):
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except ValueError as err:
        if "GGMLQuantizationType" in str(err):
            raise ModelLoadError(f"{path}: a tensor has an unknown type ({err}); sandwich-tvm loads "
                                 f"{', '.join(NATIVE_TYPES + NOTED_TYPES)}") from err
        raise _unreadable(path, err) from err
    except (OSError, IndexError, KeyError, UnicodeDecodeError, OverflowError, TypeError) as err:
        raise _unreadable(path, err) from err
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size:
            raise _unreadable(path, f"tensor {t.name} ends past the end of the file")
    return reader


def _unreadable(path: str | Path, why: object) -> ModelLoadError:
    why = str(why).splitlines()[0][:160] if str(why) else type(why).__name__
    return ModelLoadError(f"{path} is not a readable GGUF file ({why}); it may be truncated: re-download it")


def metadata(reader, key: str, default: Any = None) -> Any:
    """One metadata value as Python (str, int, float, bool, or a list of them)."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return default
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]][0].item()


# --------------------------------------------------------------------------- the config

def gguf_config(path: Path, name: str | None = None) -> LlamaConfig:
    """The ``LlamaConfig`` a GGUF's metadata describes (named ``name``, else ``general.name`` or
    the file stem); an architecture not in ``SUPPORTED_ARCHITECTURES``, or a Llama variant
    the model does not run (experts, per-layer head counts, RoPE scaling other than Llama-3's,
    linear or YaRN), is a ``ModelConfigError``."""
    reader = open_gguf(path)
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(f"{path}: architecture {arch!r} is not supported; sandwich-tvm runs "
                               f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUFs ({FAMILIES})")

    def get(key: str, default: Any = None) -> Any:
        v = metadata(reader, f"{arch}.{key}", default)
        if v is None:
            raise ModelConfigError(f"{path}: metadata {arch}.{key} is missing; re-convert the model")
        if isinstance(v, list):
            raise ModelConfigError(f"{path}: {arch}.{key} varies per layer ({v[:4]}...); not supported")
        return v

    if get("expert_count", 0):
        raise ModelConfigError(f"{path}: a mixture of experts ({arch}.expert_count {get('expert_count')}) is "
                               "not supported; sandwich-tvm runs dense Llama models")
    names = {t.name for t in reader.tensors}
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = metadata(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None) or (
        int(embd.shape[-1]) if embd is not None else None)
    kwargs = dict(hidden_size=hidden, num_hidden_layers=get("block_count"), num_attention_heads=heads,
                  num_key_value_heads=get("attention.head_count_kv", heads),
                  intermediate_size=get("feed_forward_length"), vocab_size=vocab,
                  max_position_embeddings=get("context_length", 2048),
                  rope_theta=_f32(get("rope.freq_base", 10000.0)),
                  rope_scaling=None, rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
                  tie_word_embeddings="output.weight" not in names,
                  qkv_bias=any(n.endswith(".attn_q.bias") for n in names),  # the layers without: missing
                  qk_norm=arch == "qwen3",  # which llama.cpp requires: a file without them is incomplete
                  fused_checkpoint=arch == "phi3")
    if arch == "smollm3":
        kwargs["nope_layers"] = tuple(i for i in range(get("block_count")) if (i + 1) % NOPE_EVERY == 0)
    if (arch == "phi3") != any(n.endswith(".attn_qkv.weight") for n in names):  # --fuse-qkv, or a split phi3
        held = "separate attn_q/k/v" if arch == "phi3" else "a fused attn_qkv"
        raise ModelConfigError(f"{path}: a {arch} GGUF with {held} is not supported; convert it as "
                               "llama.cpp's convert_hf_to_gguf.py does by default (phi3 fused, others not)")
    longrope = {n for n in names if n.startswith("rope_factors_")}  # Phi-3's 128k models, Phi-3.5, Phi-4-mini
    if longrope and arch != "phi3":
        raise ModelConfigError(f"{path}: LongRoPE factors ({', '.join(sorted(longrope))}) in a {arch} GGUF "
                               "are not supported; LongRoPE is supported in phi3 GGUFs only")
    if longrope and longrope != set(ROPE_FACTORS):
        raise ModelConfigError(f"{path}: a phi3 GGUF's LongRoPE needs both {' and '.join(ROPE_FACTORS)}, not "
                               f"{', '.join(sorted(longrope))} only; re-convert the model")
    if arch != "qwen3" and any(n.endswith(".attn_q_norm.weight") for n in names):
        raise ModelConfigError(f"{path}: a {arch} GGUF with q/k norms (attn_q_norm) is not supported; "
                               "convert the model as the architecture it is (qwen3)")
    # an attention head's width: key_length where the converter wrote it (Mistral-Nemo, Mistral
    # Small 3: heads x head_dim != embedding_length), else embedding_length / head_count
    head_dim = get("attention.key_length", 0) or None
    kwargs["head_dim"] = head_dim
    problems = shape_problems(kwargs)
    if problems:
        raise ModelConfigError(f"{path}: " + "; ".join(problems))
    head_dim = head_dim or hidden // heads
    # defaults as llama.cpp's: value_length embedding_length / head_count, the RoPE width head_dim;
    # a phi3 may turn fewer (Phi-4-mini: 96 of 128)
    for key, default in (("rope.dimension_count", head_dim), ("attention.value_length", hidden // heads)):
        if get(key, default) != head_dim and not (arch == "phi3" and key == "rope.dimension_count"):
            raise ModelConfigError(f"{path}: {arch}.{key} {get(key)} != head_dim {head_dim} (attention."
                                   "key_length, else embedding_length / head_count) is not supported")
    if get("rope.dimension_count", head_dim) != head_dim:
        kwargs["rotary_dim"] = get("rope.dimension_count")
        if problems := shape_problems(kwargs):
            raise ModelConfigError(f"{path}: {arch}.rope.dimension_count: " + "; ".join(problems))
    # as llama.cpp reads them: the type defaults to linear, its factor to the older scale_linear
    # key, and a factor of 0 (or 1), like the type none, scales nothing
    scaling = get("rope.scaling.type", "linear")
    if scaling == "longrope" and longrope:  # llama.cpp's type for it; its factors are the tensors'
        scaling = "none"
    factor = float(get("rope.scaling.factor", get("rope.scale_linear", 0.0)))
    if scaling == "linear" and factor not in (0.0, 1.0):
        if "rope_freqs.weight" in names:
            raise ModelConfigError(f"{path}: both linear RoPE scaling and per-frequency factors (rope_freqs) "
                                   "are given; not supported")
        kwargs["rope_scaling"] = linear_scaling(factor, path)
    elif scaling == "yarn":  # llama.cpp's Llama: betas 32 and 1, attn_factor x 0.1 ln(factor) + 1
        if "rope_freqs.weight" in names:
            raise ModelConfigError(f"{path}: both YaRN and per-frequency factors (rope_freqs) are given; "
                                   "not supported")
        factor = factor or 1.0
        kwargs["rope_scaling"] = yarn_scaling(
            factor, int(get("rope.scaling.original_context_length", 0) or kwargs["max_position_embeddings"]),
            32.0, 1.0, float(get("rope.scaling.attn_factor", 1.0)) * yarn_mscale(factor), True, path)
        kwargs["max_position_embeddings"] = yarn_context(get("context_length", 2048), kwargs["rope_scaling"])
    elif scaling not in ("linear", "none"):
        raise ModelConfigError(f"{path}: RoPE scaling {scaling!r} is not supported (llama3, linear, yarn or "
                               "none)")
    if longrope:  # llama.cpp's phi3: the factors' set by the context, cos and sin x attn_factor
        if kwargs["rope_scaling"] is not None or "rope_freqs.weight" in names:
            raise ModelConfigError(f"{path}: both LongRoPE factors and other RoPE scaling are given; "
                                   "not supported")
        original = get("rope.scaling.original_context_length", 0)
        if not original:
            raise ModelConfigError(f"{path}: LongRoPE needs {arch}.rope.scaling.original_context_length; "
                                   "re-convert the model")
        sets = [_rope_factors(reader, name, (kwargs.get("rotary_dim") or head_dim) // 2, path)
                for name in ROPE_FACTORS]
        attention = float(get("rope.scaling.attn_factor", 1.0))
        kwargs["rope_scaling"] = longrope_scaling(*sets, original, attention)
    elif scaling != "yarn" and float(get("rope.scaling.attn_factor", 1.0)) != 1.0:  # llama.cpp: cos, sin x it
        raise ModelConfigError(f"{path}: {arch}.rope.scaling.attn_factor {get('rope.scaling.attn_factor')} "
                               "scales RoPE's cos and sin outside YaRN and LongRoPE; not supported")
    if "rope_freqs.weight" in names and arch == "smollm3":
        raise ModelConfigError(f"{path}: per-frequency RoPE factors (rope_freqs) in a smollm3 GGUF are not "
                               "supported (llama.cpp's smollm3 does not read them)")
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        kwargs["rope_scaling"] = llama3_scaling(np.asarray(t.data, np.float64).ravel(), kwargs["rope_theta"],
                                                head_dim, path)
    if arch == "granite":
        kwargs |= _granite_scales(reader, get, path)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", str(metadata(reader, "general.name", "") or "")).strip("-")
    cfg = LlamaConfig(name=name or stem or path.stem, **kwargs)
    _check_tensors(reader, cfg, path)
    return cfg


def _granite_scales(reader, get: Callable[[str, Any], Any], path: Path) -> dict[str, float | None]:
    """A granite GGUF's multipliers as llama.cpp reads them: ``logit_scale`` required, a missing
    (or zero) residual or embedding scale scales nothing, a missing attention scale is
    1 / sqrt(head_dim); a negative scale, or RoPE turned off (``rope.scaling.finetuned`` false),
    is refused."""
    if not get("rope.scaling.finetuned", True):
        raise ModelConfigError(f"{path}: a granite GGUF without RoPE (rope.scaling.finetuned false) is not "
                               "supported")
    if metadata(reader, "granite.logit_scale") is None:
        raise ModelConfigError(f"{path}: metadata granite.logit_scale is missing; re-convert the model")
    scales = {}
    for key, field in (("logit_scale", "logits_scaling"), ("residual_scale", "residual_multiplier"),
                       ("embedding_scale", "embedding_multiplier"),
                       ("attention.scale", "attention_multiplier")):
        v = _f32(get(key, 0.0))
        if not math.isfinite(v) or v < 0 or (v == 0 and key == "logit_scale"):
            raise ModelConfigError(f"{path}: granite.{key} {v} must be a positive number; re-convert the "
                                   "model")
        scales[field] = v or MULTIPLIERS[field]  # 0: scales nothing (llama.cpp's), or 1 / sqrt(head_dim)
    return scales


def _rope_factors(reader, name: str, pairs: int, path: Path) -> list[float]:
    """A LongRoPE factor set (``rope_factors_short/long.weight``): ``pairs`` positive floats."""
    t = next(t for t in reader.tensors if t.name == name)
    v = np.asarray(t.data, np.float64).ravel() if t.tensor_type.name in ("F32", "F16") else None
    if v is None or v.size != pairs or not np.all(np.isfinite(v) & (v > 0)):
        raise ModelConfigError(f"{path}: {name} must hold {pairs} positive factors in F32 or F16 (one per "
                               "pair RoPE turns); re-convert the model")
    return [float(x) for x in v]


def _f32(v: float) -> float:
    """A float32 metadata value as written (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(v)))


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, where: Path | str) -> dict | None:
    """Llama-3 RoPE scaling recovered from llama.cpp's ``rope_freqs`` (base / scaled frequency per
    pair). Between its two cut-offs the interpolation weight is linear in 1 / wavelength,
    ``s = a / wavelen + b``: with two or more pairs there, the fitted ``(a, b)`` fix it up to the
    choice ``low_freq_factor = 1``; with fewer, Meta's ``low/high_freq_factor`` 1 and 4 are assumed
    and the original context solved for. Either way the result must reproduce ``rope_freqs``."""
    from .rope import inv_freq

    freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if factors.shape != freq.shape:
        raise ModelConfigError(f"{where}: rope_freqs has {factors.size} values, head_dim {head_dim} "
                               f"needs {freq.size}; re-convert the model")
    if np.allclose(factors, 1.0):
        return None
    factor, wavelen = float(factors.max()), 2 * math.pi / freq
    mid = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    weight = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
    candidates = []  # (high_freq_factor, original context) with low_freq_factor 1
    if mid.sum() >= 2:
        a, b = np.polyfit(1 / wavelen[mid], weight, 1)
        if b < 0:
            candidates.append((round(float(1 - 1 / b), 3), float(-a / b)))
    elif mid.sum() == 1:  # s = (old / wavelen - 1) / 3
        candidates.append((4.0, float(wavelen[mid][0] * (1 + 3 * weight[0]))))
    else:  # any context between the last unscaled wavelength x 4 and the first scaled one
        candidates.append((4.0, 4 * float(wavelen[factors <= 1 + 1e-4].max(initial=0.0)) + 1))
    for high, old in candidates:
        fitted = {"rope_type": "llama3", "factor": round(factor, 4), "low_freq_factor": 1.0,
                  "high_freq_factor": high, "original_max_position_embeddings": int(round(old))}
        probe = LlamaConfig("probe", head_dim, 1, 1, 1, 1, 1, rope_theta=theta, rope_scaling=fitted)
        if np.allclose(inv_freq(probe), freq / factors, rtol=1e-3):
            return fitted
    raise ModelConfigError(f"{where}: rope_freqs is not Llama-3 RoPE scaling; only that (or none) is "
                           "supported")


# --------------------------------------------------------------------------- the tensors

class LazyTensor:
    """A tensor computed when numpy reads it (``np.asarray``): a quantized GGUF tensor
    dequantized to float32, or q/k rows put back in HF's order. It holds no data itself."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, load: Callable[[], np.ndarray]):
        self.shape, self.dtype, self._load = shape, np.dtype(dtype), load
        self.ndim = len(shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self._load()
        return out if dtype is None else out.astype(dtype, copy=False)

    def __getitem__(self, index) -> np.ndarray:
        return self._load()[index]

    def astype(self, dtype, copy: bool = True) -> np.ndarray:
        return self._load().astype(dtype, copy=copy)

    def __repr__(self) -> str:
        return f"LazyTensor({list(self.shape)}, {self.dtype})"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaved RoPE row pairs -> HF's rotate-half order (``llamacpp._permute``
    inverted); a 1-D bias moves as the rows it belongs to."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, fused: bool = False) -> str | None:
    """The HF name of a GGUF tensor name (in a model whose checkpoint is ``fused``: a Phi-3's);
    None for a tensor no Llama-family checkpoint we run has."""
    if m := _LAYER.fullmatch(gguf_name):
        ours = (fused and _FUSED_NAMES.get(m.group(2))) or _LAYER_NAMES.get(m.group(2))
        if m.group(3) == "bias" and m.group(2) not in _BIASED:
            return None
        return f"model.layers.{m.group(1)}.{ours}.{m.group(3)}" if ours else None
    top = gguf_name.removesuffix(".weight")
    return f"{_TOP_NAMES[top]}.weight" if gguf_name.endswith(".weight") and top in _TOP_NAMES else None


def _tensor(t) -> np.ndarray | LazyTensor:
    """A GGUF tensor in its numpy shape: a view of the memory map, or dequantized on use."""
    import gguf

    kind = t.tensor_type.name
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if kind in ("F32", "F16"):
        return t.data.reshape(shape)
    if kind == "BF16":
        return t.data.view(numpy_dtype("bfloat16")).reshape(shape)
    if kind in KERNEL_TYPES and len(shape) == 2:  # the blocks as they are (kernels.quant)
        raw = t.data.reshape(shape[0], -1)
        qtype = QTYPES[KERNEL_TYPES[kind]]
        if kind == qtype.gguf:
            return QuantBlocks(raw, qtype, shape[1])
        # Q4_K, Q5_0: regrouped when first read; the file's exact values wherever floats are asked for
        regroup = REGROUPED[kind][1]
        return QuantBlocks.later(lambda: regroup(raw, t.name), shape[0], qtype, shape[1],
                                 lambda: gguf.quants.dequantize(raw, t.tensor_type).reshape(shape))

    def load() -> np.ndarray:
        try:
            return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        except NotImplementedError:  # an older gguf package
            raise ModelLoadError(f"tensor {t.name} is {kind}, which the installed gguf package cannot "
                                 "dequantize; upgrade it (pip install -U gguf)") from None

    return LazyTensor(shape, np.float32, load)


def _check_tensors(reader, cfg: LlamaConfig, path: Path) -> None:
    """Every tensor is one a Llama has, in a type we load, with the shape the metadata implies,
    and none is missing: checked when the config is read, before anything is compiled."""
    expected = hf_shapes(cfg)
    seen = set()
    for t in reader.tensors:
        if t.name == "rope_freqs.weight" or t.name in ROPE_FACTORS:  # in the config (llama3, LongRoPE)
            continue
        name = hf_name(t.name, cfg.fused_checkpoint)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {t.name!r} is not part of a {FAMILIES} model (biases but "
                                 "q, k and v's, experts, other architectures are not supported)")
        kind = t.tensor_type.name
        if kind not in NATIVE_TYPES + NOTED_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name} is stored as {kind}; sandwich-tvm loads "
                                 f"{', '.join(NATIVE_TYPES)} (and {', '.join(NOTED_TYPES)} dequantized)")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if name not in expected or shape != expected[name][0]:
            want = (f"implies {list(expected[name][0])} ({expected[name][1]})" if name in expected
                    else f"describes {cfg.num_hidden_layers} layers")
            raise ModelLoadError(f"{path}: tensor {t.name} has shape {list(shape)}, but the metadata "
                                 f"{want}; the file is inconsistent: re-convert it")
        seen.add(name)
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" and {len(missing) - 1} more are" if len(missing) > 1 else " is"
        raise ModelLoadError(f"{path}: tensor {missing[0]!r}{more} missing for the {cfg.num_hidden_layers} "
                             "layers the metadata describes; the file is incomplete: re-convert it")


def layer_kinds(path: Path) -> Counter:
    """How many of a GGUF's layer matrices each GGML type holds (``Q4_K``, ``Q6_K``, ``F16``...)."""
    return Counter(t.tensor_type.name for t in open_gguf(path).tensors
                   if t.name.startswith("blk.") and len(t.shape) == 2)


def layer_kind(path: Path) -> str | None:
    """The GGML type a GGUF's layers hold in most of their matrices (``Q4_K``, ``F16``, ...)."""
    kinds = layer_kinds(path)
    return kinds.most_common(1)[0][0] if kinds else None


def linear_type(path: Path) -> str | None:
    """The weight type a GGUF's layers hold in most of their matrices, as ``--dtype`` names it
    (``q4_1``, ``bfloat16``, ...), or None for a type the kernels do not read natively."""
    kind = layer_kind(path)
    if kind is None:
        return None
    floats = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    return floats.get(kind, KERNEL_TYPES.get(kind))


# 5 bits and more: types a 4-bit model holds in q8_0 rather than round to 4 bits
WIDE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")
# GGUF layer tensors -> the Linear that holds them (fused as the model stores them)
_LINEARS = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "attn_qkv": "qkv", "attn_output": "o",
            "ffn_gate": "gate_up", "ffn_up": "gate_up", "ffn_down": "down"}


def wider_linears(path: Path) -> tuple[tuple[int, str, str], ...]:
    """(layer, Linear, ``"q8_0"``) of every Linear holding a matrix of 5 bits or more (a
    Q4_K_M's Q6_K ``attn_v`` and ``ffn_down``): what a model in 4-bit weights runs in q8_0 to
    keep the precision the file chose (a fused qkv or gate_up takes its widest part's)."""
    out = set()
    for t in open_gguf(path).tensors:
        m = _LAYER.fullmatch(t.name)
        if m and m.group(3) == "weight" and m.group(2) in _LINEARS and t.tensor_type.name in WIDE_TYPES:
            out.add((int(m.group(1)), _LINEARS[m.group(2)], "q8_0"))
    return tuple(sorted(out))


def read_gguf(path: Path) -> dict[str, np.ndarray | LazyTensor]:
    """Every tensor of a GGUF under HF's names (checked against the file's metadata by
    ``gguf_config``). Without ``output.weight`` the embeddings are tied (no ``lm_head.weight``)."""
    reader, cfg = open_gguf(path), gguf_config(path)
    permuted = metadata(reader, "general.architecture") in PERMUTED_ARCHITECTURES  # a Qwen's are HF's
    state: dict[str, np.ndarray | LazyTensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name, cfg.fused_checkpoint)
        if name is None:  # rope_freqs, rope_factors_*: in the config
            continue
        arr = _tensor(t)
        # a Llama's q/k rows, and their biases where it has them (llama.cpp's converter permutes both)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            if isinstance(arr, QuantBlocks):  # whole rows of blocks move
                state[name] = QuantBlocks.later(lambda a=arr, h=heads: _unpermute(a.raw, h), arr.shape[0],
                                                arr.qtype, arr.k,
                                                (lambda a=arr, h=heads: _unpermute(np.asarray(a), h))
                                                if arr.exact else None)
                continue
            arr = LazyTensor(arr.shape, arr.dtype, lambda a=arr, h=heads: _unpermute(np.asarray(a), h))
        state[name] = arr
    noted = sorted({t.tensor_type.name for t in reader.tensors} & set(NOTED_TYPES))
    if noted:
        print(f"note: {path.name} holds {', '.join(noted)} tensors; they are dequantized at load "
              f"(native types: {', '.join(NATIVE_TYPES)})", file=sys.stderr)
    return state


# --------------------------------------------------------------------------- the conversion cache key

def hash_gguf(path: Path, h, full_bytes: int, sample_bytes: int) -> None:
    """Feed ``h`` the file's size, its header (metadata and tensor table), then its data: whole
    up to ``full_bytes``, else ``sample_bytes`` from the start, middle and end of every tensor."""
    reader, size = open_gguf(path), path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as fh:
        h.update(fh.read(reader.data_offset))
        if size <= full_bytes:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
            return
        for t in sorted(reader.tensors, key=lambda t: t.name):
            lo, hi = t.data_offset, t.data_offset + int(t.n_bytes)
            for start in sorted({lo, max(lo, (lo + hi - sample_bytes) // 2), max(lo, hi - sample_bytes)}):
                fh.seek(start)
                h.update(fh.read(min(sample_bytes, hi - start)))
