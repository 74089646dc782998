"""Weights: an HF checkpoint (safetensors, sharded or not) or seeded random weights for a preset,
converted once to the layout the compiled model reads and placed in 2 MiB pages.

HF names map to ours as MLC-LLM does: ``qkv_proj = cat(q, k, v)``, ``gate_up_proj =
cat(gate, up)``. A Linear weight whose parameter is 3-D is packed into kernel panels
(``kernels.codegen.pack_weight``). Decode at batch 1 streams every weight once per token,
so weights live in anonymous memory advised ``MADV_HUGEPAGE`` (notes §8).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..kernels.codegen import fuses_silu_mul, interleave_gate_up, pack_weight
from ..kernels.microkernel import ISAS
from ..memory import aligned_empty
from ..topology.profile import cache_dir
from .config import LlamaConfig

FORMAT = 2  # 2: gate_up interleaved for the silu_mul epilogue


class ModelLoadError(ValueError):
    """A checkpoint we cannot load; the message names the file and what to do."""


# --------------------------------------------------------------------------- reading checkpoints

def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF model directory (sharded through its index or single)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({err}); re-download it") from err
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {missing}; download them")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        hint = (f" (found {bins}: convert them to safetensors, e.g. save_pretrained(safe_serialization=True))"
                if bins else "")
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights{hint}")
    return files


def read_checkpoint(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float32 numpy arrays (HF names)."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, np.ndarray] = {}
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="numpy") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open is not iterable)
                    out[name] = np.asarray(fh.get_tensor(name), dtype=np.float32)
        except SafetensorError as err:
            if "bf16" in str(err).lower() or "bfloat16" in str(err).lower():
                out.update(_read_bf16(path))
                continue
            raise ModelLoadError(f"{path} is not a readable safetensors file ({err}); it may be "
                                 "truncated: re-download it") from err
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"{path} cannot be read ({err}); re-download it") from err
    return out


def _read_bf16(path: Path) -> dict[str, np.ndarray]:
    """bfloat16 tensors (numpy has no bf16): widen the raw 16-bit words to float32."""
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        dt = info["dtype"]
        data = np.frombuffer(raw[base + lo:base + hi], dtype={"BF16": np.uint16, "F16": np.float16,
                                                              "F32": np.float32}[dt])
        if dt == "BF16":
            data = (data.astype(np.uint32) << 16).view(np.float32)
        out[name] = data.astype(np.float32).reshape(info["shape"])
    return out


def random_checkpoint(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random weights in HF names (std 0.02 like HF's initializer, norms at 1)."""
    rng = np.random.default_rng(seed)
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size

    def w(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.02))

    out = {"model.embed_tokens.weight": w(cfg.vocab_size, h), "model.norm.weight": np.ones(h, np.float32)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                p + "mlp.down_proj.weight": w(h, inter),
                p + "input_layernorm.weight": np.ones(h, np.float32),
                p + "post_attention_layernorm.weight": np.ones(h, np.float32)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = w(cfg.vocab_size, h)
    return out


# --------------------------------------------------------------------------- conversion

_FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
          "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def _hf_tensor(state: dict[str, np.ndarray], name: str, cfg: LlamaConfig, where: str) -> np.ndarray:
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    for ours, parts in _FUSED.items():
        if name.endswith(ours):
            prefix = name[: -len(ours)]
            return np.concatenate([_get(state, prefix + p, where) for p in parts], axis=0)
    return _get(state, name, where)


def _get(state: dict[str, np.ndarray], name: str, where: str) -> np.ndarray:
    if name not in state:
        raise ModelLoadError(f"{where}: tensor {name!r} is missing; is this a Llama checkpoint "
                             "matching its config.json?")
    return state[name]


def convert(cfg: LlamaConfig, state: dict[str, np.ndarray], params: list[tuple[str, tuple[int, ...]]],
            isa: str, where: str = "checkpoint",
            progress: Callable[[int, int], None] | None = None) -> list[np.ndarray]:
    """Arrays in ``params`` order (name, expected shape), packed where the shape is 3-D."""
    out = []
    for i, (name, shape) in enumerate(params):
        hf = _hf_tensor(state, name, cfg, where)
        if len(shape) == 3:  # packed panels of W[n, k]
            if hf.ndim != 2 or hf.shape[1] != shape[1] or hf.shape[0] > shape[0] * shape[2]:
                raise ModelLoadError(f"{where}: {name} has shape {list(hf.shape)}, but config.json "
                                     f"implies [n <= {shape[0] * shape[2]}, {shape[1]}]")
            if name.endswith("mlp.gate_up_proj.weight") and fuses_silu_mul(cfg.intermediate_size, isa):
                hf = interleave_gate_up(hf, ISAS[isa].lanes)  # for the silu_mul epilogue
            arr = pack_weight(hf, isa, out=aligned_empty(shape))
        else:
            if tuple(hf.shape) != tuple(shape):
                raise ModelLoadError(f"{where}: {name} has shape {list(hf.shape)}, but config.json "
                                     f"implies {list(shape)}")
            arr = aligned_empty(shape)
            arr[...] = hf
        out.append(arr)
        if progress:
            progress(i + 1, len(params))
    return out


# --------------------------------------------------------------------------- the conversion cache

def checkpoint_key(model_dir: Path, layout: str) -> str:
    """Names, sizes and mtimes of the checkpoint files plus the parameter layout."""
    h = hashlib.sha256(f"{FORMAT}|{layout}".encode())
    for f in checkpoint_files(model_dir):
        st = f.stat()
        h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def converted_cache_path(model_dir: Path, layout: str) -> Path:
    return cache_dir() / "weights" / f"{model_dir.name}-{checkpoint_key(model_dir, layout)}.safetensors"


def save_converted(path: Path, params: list[tuple[str, tuple[int, ...]]], arrays: list[np.ndarray]) -> None:
    """Written to a temporary name, then renamed: an interrupted save leaves no corrupt cache."""
    from safetensors.numpy import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({name: np.ascontiguousarray(a) for (name, _), a in zip(params, arrays, strict=True)}, str(tmp))
    tmp.replace(path)


def load_converted(path: Path, params: list[tuple[str, tuple[int, ...]]]) -> list[np.ndarray] | None:
    """The cached conversion, copied into 2 MiB pages; None when absent or unreadable."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return None
    try:
        out = []
        with safe_open(str(path), framework="numpy") as fh:
            for name, shape in params:
                src = fh.get_tensor(name)
                if tuple(src.shape) != tuple(shape):
                    return None
                arr = aligned_empty(shape)
                arr[...] = src
                out.append(arr)
        return out
    except (SafetensorError, OSError, KeyError, ValueError):
        path.unlink(missing_ok=True)  # a corrupt cache is rebuilt from the checkpoint
        return None


# --------------------------------------------------------------------------- entry point

def load_params(spec: str | Path, cfg: LlamaConfig, params: list[tuple[str, tuple[int, ...]]], isa: str,
                *, seed: int = 0, log: Callable[[str], None] = lambda _m: None) -> list[np.ndarray]:
    """Weights for ``params``: a preset's seeded random weights, or the checkpoint in ``spec``
    (converted once, then read from the conversion cache)."""
    from .config import PRESETS

    if str(spec) in PRESETS:
        log(f"random weights for preset {spec} (seed {seed})")
        return convert(cfg, random_checkpoint(cfg, seed), params, isa, where=f"preset {spec}")
    model_dir = Path(spec)
    layout = json.dumps([params, isa])
    cached = converted_cache_path(model_dir, layout)
    arrays = load_converted(cached, params)
    if arrays is not None:
        log(f"weights from the conversion cache {cached}")
        return arrays
    log(f"converting {model_dir} (once; cached in {cached})")
    arrays = convert(cfg, read_checkpoint(model_dir), params, isa, where=str(model_dir))
    save_converted(cached, params, arrays)
    return arrays


def load_tokenizer(spec: str | Path):
    """``tokenizer.json`` of a model directory through ``tokenizers``; None for presets."""
    path = Path(spec) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception
        raise ModelLoadError(f"{path} is not a valid tokenizer ({err}); re-download it") from err
