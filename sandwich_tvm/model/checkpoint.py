"""Reading HF checkpoints: safetensors files (sharded or not) mapped without copying, checked
against the config; and seeded random weights for a preset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..kernels.packing import numpy_dtype
from .config import LlamaConfig, model_path


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
    """Every tensor of the checkpoint (HF names), memory-mapped in its stored dtype (float32,
    float16, or bfloat16 through ml_dtypes): nothing is read or widened until a tensor is used,
    so conversion holds one tensor at a time, and bf16/f16 weights reach a 16-bit model without
    an fp32 round trip. ``model_dir`` may also be a named model or a ``.gguf`` file, whose
    quantized tensors are ``gguf.LazyTensor``s, dequantized when numpy reads them."""
    model_dir = model_path(model_dir)
    if model_dir.suffix == ".gguf":
        from .gguf import read_gguf

        return read_gguf(model_dir)
    out: dict[str, np.ndarray] = {}
    for path in checkpoint_files(model_dir):
        out.update(_map_safetensors(path))
    return out


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of one safetensors file as read-only views of its memory map."""

    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(f"{path} is not a readable safetensors file ({why}); it may be truncated: "
                              "re-download it")

    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            if size < 8 or header_len > size - 8:
                raise bad(f"a header of {header_len} bytes in a file of {size}")
            header = json.loads(fh.read(header_len))
        data = np.memmap(path, dtype=np.uint8, mode="r") if size > 8 + header_len else np.zeros(0, np.uint8)
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise bad(str(err)) from err
    base, out = 8 + header_len, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            stored, shape, (lo, hi) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise bad(f"tensor {name!r} has a malformed entry: {err}") from err
        if stored not in _SAFETENSORS_DTYPES:
            raise ModelLoadError(f"{path}: tensor {name!r} is stored as {stored}; the loader reads "
                                 f"{', '.join(_SAFETENSORS_DTYPES)}: convert the checkpoint (e.g. "
                                 "save_pretrained after model.to(torch.bfloat16))")
        dtype = numpy_dtype(_SAFETENSORS_DTYPES[stored])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not 0 <= lo <= hi <= size - base or hi - lo != nbytes:
            raise bad(f"tensor {name!r} lies outside the file or has the wrong size")
        out[name] = data[base + lo:base + hi].view(dtype).reshape(shape)
    return out


def hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor ``cfg`` implies, in HF names: its exact shape and the config fields it
    follows (for error messages). No ``lm_head.weight`` when the embeddings are tied."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    qs, kvs = "num_attention_heads * head_dim", "num_key_value_heads * head_dim"
    out = {"model.embed_tokens.weight": ((cfg.vocab_size, h), "vocab_size, hidden_size")}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        # in this order (random_checkpoint draws the weights in it); Phi-3's q|k|v and gate|up fused
        if cfg.fused_checkpoint:
            out[p + "self_attn.qkv_proj.weight"] = ((q + 2 * kv, h), f"({qs}) + 2 ({kvs}), hidden_size")
        else:
            out |= {p + "self_attn.q_proj.weight": ((q, h), f"{qs}, hidden_size"),
                    p + "self_attn.k_proj.weight": ((kv, h), f"{kvs}, hidden_size"),
                    p + "self_attn.v_proj.weight": ((kv, h), f"{kvs}, hidden_size")}
        out[p + "self_attn.o_proj.weight"] = ((h, q), f"hidden_size, {qs}")
        if cfg.fused_checkpoint:
            out[p + "mlp.gate_up_proj.weight"] = ((2 * inter, h), "2 intermediate_size, hidden_size")
        else:
            out |= {p + "mlp.gate_proj.weight": ((inter, h), "intermediate_size, hidden_size"),
                    p + "mlp.up_proj.weight": ((inter, h), "intermediate_size, hidden_size")}
        out |= {p + "mlp.down_proj.weight": ((h, inter), "hidden_size, intermediate_size"),
                p + "input_layernorm.weight": ((h,), "hidden_size"),
                p + "post_attention_layernorm.weight": ((h,), "hidden_size")}
        if cfg.qk_norm:
            out |= {p + f"self_attn.{x}_norm.weight": ((d,), "head_dim") for x in ("q", "k")}
        if cfg.qkv_bias:
            out |= {p + "self_attn.q_proj.bias": ((q,), qs), p + "self_attn.k_proj.bias": ((kv,), kvs),
                    p + "self_attn.v_proj.bias": ((kv,), kvs)}
    out["model.norm.weight"] = ((h,), "hidden_size")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((cfg.vocab_size, h), "vocab_size, hidden_size")
    return out


def _first(names: list[str], n: int = 4) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(repr(x) for x in names[:n]) + more


def check_checkpoint(cfg: LlamaConfig, state: dict[str, np.ndarray], where: str) -> None:
    """Every tensor ``cfg`` implies is present with its exact shape, and nothing else is there
    (a wrong shape or extra layers would otherwise run and generate wrong tokens)."""
    expected = hf_shapes(cfg)
    missing = []
    for name, (shape, fields) in expected.items():
        if name not in state:
            missing.append(name)
        elif tuple(state[name].shape) != shape:
            raise ModelLoadError(f"{where}: {name} has shape {list(state[name].shape)}, but config.json "
                                 f"implies {list(shape)} ({fields}); the checkpoint does not match its "
                                 "config.json: fix one of them")
    if missing:
        what = f"tensor {missing[0]!r} is" if len(missing) == 1 else f"tensors {_first(missing)} are"
        raise ModelLoadError(f"{where}: {what} missing; is this a Llama checkpoint matching its config.json?")
    extra = sorted((n for n in state if n not in expected and not n.endswith("rotary_emb.inv_freq")),
                   key=_natural)
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        # Some tied checkpoints store the head anyway; a copy of the embedding is harmless.
        if np.array_equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            extra.remove("lm_head.weight")
        else:
            raise ModelLoadError(f"{where}: config.json sets tie_word_embeddings, but lm_head.weight differs "
                                 "from model.embed_tokens.weight; set tie_word_embeddings to false")
    if extra:
        layers = [n for n in extra if n.startswith("model.layers.")]
        hint = (f"config.json says num_hidden_layers {cfg.num_hidden_layers}: fix it to match the checkpoint"
                if layers else "this is not a plain LlamaForCausalLM checkpoint: remove them or use one")
        what = "1 tensor is" if len(extra) == 1 else f"{len(extra)} tensors are"
        raise ModelLoadError(f"{where}: {what} not part of the model config.json describes: "
                             f"{_first(extra)}; {hint}")


def _natural(name: str) -> list:
    """Sort key putting layer 10 after layer 9."""
    return [int(t) if t.isdigit() else t for t in name.split(".")]


def random_checkpoint(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random weights in HF names (std 0.02 like HF's initializer, biases too, norms at 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, _) in hf_shapes(cfg).items():
        if name.endswith(".bias"):
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        elif len(shape) == 1:
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    return out
