"""llama.cpp as a baseline: the same weights written as a GGUF in the same dtype (F32, F16 or
BF16; ``gguf`` package) and timed through ``llama-cpp-python`` (built from source:
``pip install -e .[llamacpp]``, minutes).

The GGUF follows llama.cpp's own HF conversion: a Llama's q/k rows permuted back to the
interleaved RoPE layout (a Qwen2 or Qwen3 keeps HF's, with its q/k/v biases or q/k norms; a
Phi-3 too, fused as ``attn_qkv`` and an ``ffn_up`` holding gate|up, its LongRoPE as
``rope_factors_long/short``),
Llama-3 scaling as a ``rope_freqs`` tensor of per-frequency factors, tied embeddings as
``token_embd`` only. Every model gets a placeholder SentencePiece vocabulary (the
benchmarks feed token ids, never text) whose tokens all decode to ASCII: ``<0xNN>`` are plain
tokens, not byte tokens, so llama-server never holds a token back to complete a UTF-8 character
and streams exactly one chunk per generated token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ...model.config import LlamaConfig, yarn_mscale
from ...model.gguf import NOPE_EVERY, PERMUTED_ARCHITECTURES
from ...model.rope import inv_freq, linear_factor, uses_longrope, uses_yarn


def available() -> str | None:
    """None when usable, else why not."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as err:
        return f"llama.cpp baseline skipped: {err.name} is not installed (pip install -e '.[llamacpp]')"
    return None


GGUF_VERSION = 3  # of what write_gguf writes; part of the cache name (2: no BYTE tokens; 3: keyed by config)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half row order -> llama.cpp's interleaved pairs (inverse of HF's conversion); a
    1-D bias moves as its rows."""
    w = np.asarray(w)  # a GGUF checkpoint's tensors may be lazy (model.gguf.LazyTensor)
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


GGUF_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0",
              "q4_1": "q4_1"}


def write_gguf(cfg: LlamaConfig, state: dict[str, np.ndarray], path: Path, dtype: str = "float32") -> Path:
    """The weights as a GGUF; with a 16-bit ``dtype`` its matrices are F16/BF16 and the 1-D
    tensors stay F32, as llama.cpp's ``convert_hf_to_gguf.py --outtype f16|bf16`` writes them;
    a quantized ``dtype`` (q8_0, q4_0, q4_1) quantizes them with gguf's reference code, the
    output (or tied embedding) in the head type our engine runs (q8_0 under 4-bit weights), so
    both engines read the same values."""
    import gguf

    from ...kernels.quant import QTYPES, head_dtype

    if dtype not in GGUF_TYPES:
        raise ValueError(f"no GGUF type for {dtype!r}; one of {', '.join(GGUF_TYPES)}")

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    # as llama.cpp's conversion names a Qwen2, a Qwen3, a Phi-3, a Granite and a SmolLM3
    arch = ("qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "phi3" if cfg.fused_checkpoint
            else "granite" if cfg.granite else "smollm3" if cfg.nope_layers else "llama")
    if cfg.qk_norm + cfg.qkv_bias + cfg.fused_checkpoint + cfg.granite + bool(cfg.nope_layers) > 1:
        raise ValueError(f"{cfg.name}: this writer names no llama.cpp architecture for more than one of q/k "
                         "norms, q/k/v biases, fused matrices, Granite's multipliers and layers without RoPE")
    every = tuple(i for i in range(cfg.num_hidden_layers) if (i + 1) % NOPE_EVERY == 0)
    if cfg.nope_layers and (cfg.rope_scaling or {}).get("rope_type") == "llama3":
        raise ValueError(f"{cfg.name}: llama.cpp's smollm3 reads no per-frequency factors (rope_freqs), "
                         "which Llama-3's RoPE scaling is written as")
    if cfg.nope_layers and cfg.nope_layers != every:
        raise ValueError(f"{cfg.name}: llama.cpp's smollm3 takes RoPE out of every {NOPE_EVERY}th layer "
                         f"only, not layers {list(cfg.nope_layers)}")
    if arch == "phi3" and cfg.explicit_head_dim:
        raise ValueError(f"{cfg.name}: llama.cpp's phi3 takes heads x head_dim == hidden_size only")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(cfg.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.rope_dims)
    if cfg.explicit_head_dim:  # explicit (heads x head_dim != hidden_size)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "granite":  # as llama.cpp's conversion writes Granite's multipliers
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_scale)
        w.add_logit_scale(cfg.logits_scaling)
    w.add_file_type({"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                     "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[dtype])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(len(tokens), cfg.vocab_size)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.NORMAL] * (cfg.vocab_size - 3)  # no BYTE tokens: see the module docstring
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[: cfg.vocab_size])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types(types[: cfg.vocab_size])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def put(name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        own = head_dtype(dtype) if name in ("token_embd.weight", "output.weight") else dtype
        if arr.ndim == 2 and own in QTYPES:
            qtype = gguf.GGMLQuantizationType[QTYPES[own].gguf]
            w.add_tensor(name, QTYPES[own].quantize(arr), raw_dtype=qtype)
        elif arr.ndim == 1 or dtype == "float32":
            w.add_tensor(name, arr)
        elif dtype == "float16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType.BF16
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", state["lm_head.weight"])
    if cfg.rope_scaling and linear_factor(cfg) != 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_factor(cfg))
    elif uses_yarn(cfg):
        sc = cfg.rope_scaling
        if (sc["beta_fast"], sc["beta_slow"], sc["truncate"]) != (32.0, 1.0, True):
            raise ValueError(f"{cfg.name}: llama.cpp's Llama runs YaRN with beta_fast 32, beta_slow 1 and "
                             f"rounded ramp ends only, not {sc}")
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(sc["factor"])
        w.add_rope_scaling_orig_ctx_len(sc["original_max_position_embeddings"])
        w.add_float32(f"{arch}.rope.scaling.attn_factor", sc["attention_factor"] / yarn_mscale(sc["factor"]))
    elif uses_longrope(cfg):  # as llama.cpp's conversion writes a Phi-3's
        sc = cfg.rope_scaling
        w.add_rope_scaling_orig_ctx_len(sc["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(sc["attention_factor"])
        put("rope_factors_long.weight", np.asarray(sc["long_factor"]))
        put("rope_factors_short.weight", np.asarray(sc["short_factor"]))
    elif cfg.rope_scaling:
        base = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
        put("rope_freqs.weight", (base / inv_freq(cfg).astype(np.float64)).astype(np.float32))
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", state[p + "input_layernorm.weight"])
        qkv = (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads), ("v", 0))
        if cfg.fused_checkpoint:  # a Phi-3's q|k|v as HF holds them (NeoX RoPE)
            put(b + "attn_qkv.weight", state[p + "self_attn.qkv_proj.weight"])
            qkv = ()
        for x, heads in qkv:
            rows = state[p + f"self_attn.{x}_proj.weight"]  # a Qwen's q/k stay HF's: NeoX RoPE
            put(b + f"attn_{x}.weight", _permute(rows, heads) if heads and arch in PERMUTED_ARCHITECTURES
                else rows)
            if cfg.qkv_bias:
                put(b + f"attn_{x}.bias", state[p + f"self_attn.{x}_proj.bias"])
            if cfg.qk_norm and x != "v":
                put(b + f"attn_{x}_norm.weight", state[p + f"self_attn.{x}_norm.weight"])
        put(b + "attn_output.weight", state[p + "self_attn.o_proj.weight"])
        put(b + "ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        if cfg.fused_checkpoint:  # a Phi-3's ffn_up holds gate|up
            put(b + "ffn_up.weight", state[p + "mlp.gate_up_proj.weight"])
        else:
            put(b + "ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
            put(b + "ffn_up.weight", state[p + "mlp.up_proj.weight"])
        put(b + "ffn_down.weight", state[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def gguf_for(model_spec: str, cfg: LlamaConfig, seed: int,
             log: Callable[[str], None] | None = None, dtype: str = "float32") -> Path:
    """The GGUF (F32, F16/BF16 or quantized matrices for ``dtype``) of the weights our engine runs
    for ``model_spec`` (a preset's random weights drawn with ``seed``, or a checkpoint
    directory), written once under ``cache_dir()/gguf/``; a GGUF model of that type is used as
    it is."""
    from ...host import cache_dir
    from ...model.checkpoint import random_checkpoint, read_checkpoint
    from ...model.config import PRESETS
    from ...model.weights import checkpoint_key

    preset = model_spec in PRESETS
    if not preset:
        from ...model.config import model_path
        from ...model.gguf import linear_type

        own = model_path(model_spec)
        if own.suffix == ".gguf" and linear_type(own) == dtype:  # the file as its users hold it
            return own
    key = f"seed{seed}" if preset else checkpoint_key(Path(model_spec), "gguf-f32", cfg)
    tag = "" if dtype == "float32" else f"-{GGUF_TYPES.get(dtype, dtype)}"
    path = cache_dir() / "gguf" / f"{cfg.name}-{key}{tag}-v{GGUF_VERSION}.gguf"
    if not path.is_file():
        if log is not None:
            log(f"writing the same weights as a {GGUF_TYPES.get(dtype, dtype).upper()} GGUF: {path}")
        state = random_checkpoint(cfg, seed) if preset else read_checkpoint(Path(model_spec))
        write_gguf(cfg, state, path, dtype)
        del state
    return path


def llama_kwargs(threads: int, context: int, locked: bool = False) -> dict:
    """``llama_cpp.Llama``'s arguments: its defaults but the threads and the context, and with
    ``locked`` the weights read into locked memory (``use_mlock``, ``use_mmap=False``) instead
    of mapped from the GGUF (the page cache's 4 KiB pages)."""
    kw = {"n_ctx": context, "n_threads": threads, "n_threads_batch": threads, "n_batch": min(context, 2048),
          "n_ubatch": min(context, 512), "logits_all": False, "verbose": False}
    return kw | ({"use_mlock": True, "use_mmap": False} if locked else {})


def raise_memlock_limit() -> int | None:
    """Raise this process's soft ``RLIMIT_MEMLOCK`` to its hard limit (an unprivileged default,
    often 8 MiB, makes ``mlock`` of the weights fail with only a warning); the limit in bytes,
    None when unlimited."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
    return None if hard == resource.RLIM_INFINITY else hard


class LlamaCpp:
    """Greedy prefill/decode timing through llama-cpp-python on ``threads`` threads; ``locked``:
    the weights in locked memory (``llama_kwargs``)."""

    def __init__(self, gguf_path: Path, threads: int, context: int, locked: bool = False):
        import llama_cpp

        self.memlock_limit = raise_memlock_limit() if locked else None
        self.llm = llama_cpp.Llama(str(gguf_path), **llama_kwargs(threads, context, locked))
        self.n_vocab = self.llm.n_vocab()

    def logits(self) -> np.ndarray:
        """The last evaluated position's logits, read in place through llama.cpp's C API
        (llama-cpp-python copies them only with ``logits_all``, which would slow prefill)."""
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def generate(self, prompt: list[int], new_tokens: int,
                 on_token: Callable[[int], None] | None = None) -> tuple[float, list[float], list[int]]:
        """(TTFT ms, per-step decode ms, tokens)."""
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        token = int(np.argmax(self.logits()))
        ttft = (time.perf_counter() - t0) * 1e3
        steps, tokens = [], [token]
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            self.llm.eval([token])
            token = int(np.argmax(self.logits()))
            steps.append((time.perf_counter() - t0) * 1e3)
            tokens.append(token)
        return ttft, steps, tokens
