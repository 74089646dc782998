"""Llama-family model shapes: built-in presets and HF `config.json` directories."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_DTYPES = ("float32",)


class ModelConfigError(ValueError):
    """A model description we cannot use; the message says what to do."""


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama 2/3/3.2 or TinyLlama model (HF field names where they exist)."""

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
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    def layer_params(self) -> int:
        """Weights of one decoder layer's Linear layers (qkv, o, gate_up, down)."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d
        return qkv + self.num_attention_heads * d * h + 3 * h * self.intermediate_size

    def num_params(self) -> int:
        """All parameters (embeddings counted once when tied)."""
        embed = self.vocab_size * self.hidden_size
        heads = 0 if self.tie_word_embeddings else embed
        return self.num_hidden_layers * self.layer_params() + embed + heads

    def tp_degrees_ok(self, tp: int) -> bool:
        """Operator limits: TP must divide the query heads, the KV heads and the FFN width."""
        return (tp >= 1 and self.num_attention_heads % tp == 0
                and self.num_key_value_heads % tp == 0 and self.intermediate_size % tp == 0)

    def to_dict(self) -> dict:
        return asdict(self)


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
}
DEFAULT_PRESET = "llama-160m"


def load_config(spec: str | Path) -> LlamaConfig:
    """A preset name or an HF model directory holding `config.json`."""
    if str(spec) in PRESETS:
        return PRESETS[str(spec)]
    path = Path(spec)
    if not path.exists():
        raise ModelConfigError(
            f"{str(spec)!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory"
        )
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise ModelConfigError(f"{path} has no config.json; point --model at an HF model directory")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{cfg_file} is not valid JSON ({err}); re-download it") from err
    return from_hf_dict(raw, name=path.name if path.is_dir() else path.parent.name, where=cfg_file)


def from_hf_dict(raw: dict, name: str, where: Path | str = "config.json") -> LlamaConfig:
    """Validate an HF Llama config dict and convert it."""
    archs = raw.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and raw.get("model_type") != "llama":
        raise ModelConfigError(
            f"{where}: architecture {archs or raw.get('model_type')} is not supported; "
            f"sandwich-tvm serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "vocab_size") if k not in raw]
    if missing:
        raise ModelConfigError(f"{where}: missing fields {missing}")
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ModelConfigError(f"{where}: dtype {dtype!r} is not supported")
    heads = raw["num_attention_heads"]
    if raw["hidden_size"] % heads:
        raise ModelConfigError(f"{where}: hidden_size is not a multiple of num_attention_heads")
    if raw.get("head_dim", raw["hidden_size"] // heads) != raw["hidden_size"] // heads:
        raise ModelConfigError(f"{where}: head_dim {raw['head_dim']} != hidden_size / heads is not supported")
    unsupported = [k for k in ("attention_bias", "mlp_bias") if raw.get(k)]
    if unsupported or raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{where}: {unsupported or raw.get('hidden_act')} is not supported "
                               "(Llama uses no biases and SiLU)")
    # transformers >= 5 writes "rope_parameters" (theta inside); older files "rope_theta"/"rope_scaling".
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("llama3", "default"):
        raise ModelConfigError(f"{where}: RoPE scaling {kind!r} is not supported (llama3 or none)")
    scaling = rope if kind == "llama3" else None
    return LlamaConfig(
        name=name,
        hidden_size=raw["hidden_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", heads),
        intermediate_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Weights are served in fp32 on CPU for now; fp16/bf16 checkpoints are upcast.
        dtype="float32",
    )
