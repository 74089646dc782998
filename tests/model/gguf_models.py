"""Tiny random Llamas written as GGUF files the way llama.cpp's HF conversion writes them (q/k
rows permuted for its RoPE, tied embeddings as ``token_embd`` only), with any tensor types and
a trained byte-level BPE (``gpt2``) vocabulary in the metadata; and importance matrices as
llama-imatrix writes them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sandwich_tvm.bench.baselines.llamacpp import _permute
from sandwich_tvm.model.checkpoint import random_checkpoint
from sandwich_tvm.model.config import LlamaConfig
from sandwich_tvm.model.gguf import PERMUTED_ARCHITECTURES

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b  # adds two numbers\n",
    "Numbers like 12345 and 2024 appear in text; so do émigrés, naïve cafés and 東京.",
    "Please explain how a transformer language model generates text, one token at a time.",
]


def tiny_tokenizer(vocab_size: int = 360):
    """A byte-level BPE (GPT-2's split, ByteLevel decoder) trained on ``CORPUS``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def tiny_config(vocab_size: int, tied: bool = True, name: str = "tiny") -> LlamaConfig:
    return LlamaConfig(name, 64, 2, 4, 2, 96, vocab_size, max_position_embeddings=256, rope_theta=50000.0,
                       tie_word_embeddings=tied)


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
              "mlp.gate_up_proj": "ffn_up"}  # a Phi-3's ffn_up holds gate|up


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_NAMES[part]}.{kind}"


def write_gguf(path: Path, cfg: LlamaConfig, state: dict[str, np.ndarray], *, qtype: str = "F32",
               tokenizer=None, arch: str = "llama", meta: dict | None = None, drop: tuple[str, ...] = (),
               extra: dict[str, np.ndarray] | None = None, kinds: dict[str, str] | None = None) -> Path:
    """``state`` (HF names) as a GGUF: matrices stored as ``qtype`` (the embedding as Q8_0 when
    ``qtype`` is a 4-bit type, as llama.cpp's Q4 files do), 1-D tensors as F32. ``meta``
    overrides metadata values (``None`` leaves a key out); ``drop`` leaves GGUF tensors out;
    ``kinds`` stores the GGUF tensors it names in other types."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    fields = {"general.name": cfg.name, f"{arch}.context_length": cfg.max_position_embeddings,
              f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.block_count": cfg.num_hidden_layers,
              f"{arch}.feed_forward_length": cfg.intermediate_size,
              f"{arch}.attention.head_count": cfg.num_attention_heads,
              f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
              f"{arch}.rope.dimension_count": cfg.head_dim, f"{arch}.rope.freq_base": cfg.rope_theta,
              f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
              f"{arch}.vocab_size": cfg.vocab_size}
    if cfg.explicit_head_dim:  # as llama.cpp's converter writes an explicit head_dim
        fields |= {f"{arch}.attention.{k}_length": cfg.head_dim for k in ("key", "value")}
    fields |= meta or {}
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    if tokenizer is not None:
        add_gpt2_tokenizer(w, tokenizer)
    for hf, arr in state.items():
        name = gguf_name(hf)
        if name in drop:
            continue
        # llama.cpp permutes a Llama's (and a Granite's) q/k rows and their biases; a Qwen2's stay HF's
        permuted = arch in PERMUTED_ARCHITECTURES and name.startswith("blk.")
        if permuted and name.split(".")[2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            arr = _permute(arr, heads)
        kind = qtype if arr.ndim == 2 else "F32"
        if name == "token_embd.weight" and kind.startswith("Q4"):
            kind = "Q8_0"
        kind = (kinds or {}).get(name, kind)
        add_tensor(w, name, arr, kind)
    for name, arr in (extra or {}).items():
        add_tensor(w, name, arr, "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_tensor(w, name: str, arr: np.ndarray, kind: str) -> None:
    import gguf

    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if kind == "F32":
        w.add_tensor(name, arr)
    elif kind == "F16":
        w.add_tensor(name, arr.astype(np.float16))
    elif kind == "Q4_K":  # gguf's quantizer has no K-quants
        w.add_tensor(name, q4_k_quantize(arr), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    else:
        qtype = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)


def q4_k_quantize(w: np.ndarray) -> np.ndarray:
    """``W[n, k]`` as rows of Q4_K super-blocks (llama.cpp's ``block_q4_K``), rounded plainly:
    each sub-block of 32 spans its min..max in 15 steps, its step and minimum in 6-bit multiples
    of the super-block's d and dmin. Not llama.cpp's search, but its format bit for bit."""
    n, k = w.shape
    x = np.asarray(w, np.float32).reshape(n, k // 256, 8, 32)
    lo = np.minimum(x.min(axis=3), 0)
    step, low = (x.max(axis=3) - lo) / 15, -lo  # [n, blocks, 8]
    d = (step.max(axis=2) / 63).astype(np.float16)
    dmin = (low.max(axis=2) / 63).astype(np.float16)

    def six(v, scale):
        s = scale.astype(np.float32)[..., None]
        return np.clip(np.rint(np.divide(v, s, out=np.zeros_like(v), where=s > 0)), 0, 63).astype(np.uint8)

    sc, mn = six(step, d), six(low, dmin)
    eff_d = d.astype(np.float32)[..., None] * sc
    eff_m = dmin.astype(np.float32)[..., None] * mn
    q = np.clip(np.rint(np.divide(x + eff_m[..., None], eff_d[..., None], out=np.zeros_like(x),
                                  where=eff_d[..., None] > 0)), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)], axis=-1)
    pairs = q.reshape(n, k // 256, 4, 2, 32)
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
    head = np.stack([d, dmin], axis=-1).view(np.uint8)  # [n, blocks, 4]
    return np.concatenate([head, scales, qs], axis=-1).reshape(n, -1)


def add_gpt2_tokenizer(w, tok, pre: str = "default") -> None:
    """llama.cpp's ``gpt2`` vocabulary keys for a ``tokenizers`` byte-level BPE."""
    import gguf

    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def quantized(arr: np.ndarray, kind: str) -> np.ndarray:
    """``arr`` after a round trip through GGUF type ``kind`` (what the loader must return)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    arr = np.ascontiguousarray(arr, np.float32)
    raw = q4_k_quantize(arr) if kind == "Q4_K" else gguf.quants.quantize(arr, qtype)
    return gguf.quants.dequantize(raw, qtype)


def write_imatrix(path: Path, cfg, *, counts: float = 64.0, k_of=None, skip: tuple[str, ...] = (),
                  seed: int = 0) -> Path:
    """An importance matrix as llama-imatrix writes it: per weight ``NAME.in_sum2`` and ``NAME.counts``."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "imatrix")
    for hf, arr in random_checkpoint(cfg, 0).items():
        name = gguf_name(hf)
        if arr.ndim != 2 or name in skip:
            continue
        k = (k_of or (lambda _n, k: k))(name, arr.shape[1])
        w.add_tensor(f"{name}.in_sum2", (rng.gamma(0.5, 2.0, k) * counts).astype(np.float32))
        w.add_tensor(f"{name}.counts", np.array([counts], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llamacpp_gguf(model_dir: Path, path: Path) -> Path:
    """``model_dir``'s checkpoint as the GGUF (F32) the benchmarks write for llama.cpp, at
    ``path``, written once a session."""
    from sandwich_tvm.bench.baselines import llamacpp
    from sandwich_tvm.model.checkpoint import read_checkpoint
    from sandwich_tvm.model.config import load_config

    if not path.is_file():
        llamacpp.write_gguf(load_config(model_dir), read_checkpoint(model_dir), path)
    return path
