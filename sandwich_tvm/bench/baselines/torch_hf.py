"""HF ``transformers`` on torch as ``bench e2e``'s baseline: the same weights, run as its users
run ``generate`` (logits of the last position only, KV cache on), one request per call so it
takes its turn in every round like the other systems."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from ...model.config import MULTIPLIERS, LlamaConfig


def rope_parameters(cfg: LlamaConfig) -> dict:
    """``cfg``'s RoPE as transformers' ``rope_parameters`` (LongRoPE with both sets: transformers
    picks one by the running length; a partial rotary as the fraction of the head it turns)."""
    rope = {k: v for k, v in (cfg.rope_scaling or {}).items() if k != "long"} | {"rope_theta": cfg.rope_theta}
    rope.setdefault("rope_type", "default")
    if cfg.rotary_dim:  # transformers turns int(head_dim x factor) dimensions: no rounding down
        rope["partial_rotary_factor"] = (cfg.rotary_dim + 0.5) / cfg.head_dim
    return rope


def with_rope_scaling(model, cfg: LlamaConfig):
    """``model`` with ``cfg``'s RoPE scaling: transformers' GGUF reader reads neither llama.cpp's
    ``rope.scaling.*`` keys nor its ``rope_freqs`` for Llama, nor a phi3's ``rope_factors``, so a
    scaled GGUF loads unscaled."""
    if cfg.rope_scaling or cfg.rotary_dim:
        model.config.rope_parameters = rope = rope_parameters(cfg)
        if "original_max_position_embeddings" in rope:  # a Phi-3's own field wins over the dict's
            model.config.original_max_position_embeddings = rope["original_max_position_embeddings"]
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model


def hf_model(spec: str, cfg: LlamaConfig, seed: int):
    """The same weights in transformers' ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` for q/k/v
    biases, ``Qwen3ForCausalLM`` for q/k norms, ``Phi3ForCausalLM`` for fused matrices,
    ``SmolLM3ForCausalLM`` for layers without RoPE,
    ``GraniteForCausalLM`` for Granite's multipliers; a checkpoint's own class), fp32."""
    import torch
    import transformers

    from ...model.checkpoint import random_checkpoint, read_checkpoint
    from ...model.config import PRESETS, model_path

    if spec not in PRESETS:
        path = model_path(spec)
        if path.suffix == ".gguf" and _architecture(path) in ("granite", "smollm3"):  # transformers' has none
            return _holding(cfg, read_checkpoint(path))  # the file's own values, dequantized
        if path.suffix == ".gguf":  # transformers dequantizes it to fp32, as our loader does
            config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            config.head_dim = cfg.head_dim  # transformers' GGUF reader skips attention.key_length
            if (getattr(config, "pad_token_id", None) or 0) >= cfg.vocab_size:  # Phi-3's default 32000
                config.pad_token_id = None  # names no token of this vocabulary: no padding row
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, config=config, dtype=torch.float32).eval()
            return with_rope_scaling(model, cfg)
        # Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite or SmolLM3, as its config.json says
        return transformers.AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32).eval()
    return _holding(cfg, random_checkpoint(cfg, seed))


def _architecture(path) -> str:
    from ...model.gguf import metadata, open_gguf

    return str(metadata(open_gguf(path), "general.architecture"))


def _holding(cfg: LlamaConfig, state: dict[str, np.ndarray]):
    """transformers' class for ``cfg`` holding ``state`` (HF names; a GGUF's blocks as the file's
    values, ``QuantBlocks.__array__``, not the regrouped blocks our kernels read), fp32."""
    import torch
    import transformers

    rope = rope_parameters(cfg)
    fields = dict(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters=rope, head_dim=cfg.head_dim)
    if cfg.qk_norm:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields, use_sliding_window=False))
    elif cfg.qkv_bias:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields, use_sliding_window=False))
    elif cfg.granite:
        multipliers = {k: getattr(cfg, k) for k in MULTIPLIERS}
        multipliers["attention_multiplier"] = cfg.attention_scale  # transformers' default is 1
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**fields, **multipliers))
    elif cfg.nope_layers:
        flags = [int(i not in cfg.nope_layers) for i in range(cfg.num_hidden_layers)]
        model = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(
            **fields, no_rope_layers=flags, pad_token_id=None))  # its default: a 128k-vocabulary id
    elif cfg.fused_checkpoint:
        head_dim = fields.pop("head_dim")  # not a Phi3Config argument, but its attention reads it
        original = rope.get("original_max_position_embeddings", cfg.max_position_embeddings)
        config = transformers.Phi3Config(**fields, pad_token_id=None,
                                         original_max_position_embeddings=original)
        config.head_dim = head_dim
        model = transformers.Phi3ForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    tensors = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in state.items()}
    loaded = model.load_state_dict(tensors, strict=False)  # a tied head is the embedding, tied below
    astray = [k for k in loaded.missing_keys if k != "lm_head.weight"] + list(loaded.unexpected_keys)
    if astray:
        raise ValueError(f"{cfg.name}: the torch baseline's {type(model).__name__} and our weights disagree "
                         f"on {astray[:4]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def torch_dtype(choice: str) -> tuple[str, str]:
    """The torch baseline's dtype and why: bf16 where the CPU has bf16 units (oneDNN uses them)."""
    from ...host import half_precision_units

    if choice != "auto":
        return choice, "requested with --torch-dtype"
    units = half_precision_units()
    if units:
        return "bfloat16", f"this CPU has {', '.join(units)}"
    return "float32", "this CPU has no AMX or AVX512-BF16"


def torch_runner(model, dtype: str, threads: int, new_tokens: int, prompt_of: Callable[[int], list[int]],
                 cpus: frozenset[int] | None = None) -> Callable[[int], dict]:
    """One greedy request per call on ``model`` (already in ``dtype``) with ``threads`` threads:
    TTFT of the prompt, TPOT the median of the ``new_tokens - 1`` decode steps. Each call first
    puts this thread back on ``cpus`` (default: the CPUs this process may use), which another
    system's plan may have narrowed; torch's workers inherit it. Warmed up before it returns."""
    import torch

    from ...host import PROCESS_CPUS

    cpus = PROCESS_CPUS if cpus is None else cpus
    torch.set_num_threads(threads)

    def request(p: int, new: int) -> tuple[float, list[float]]:
        os.sched_setaffinity(0, cpus)
        with torch.inference_mode():
            ids = torch.tensor([prompt_of(p)])
            t0 = time.perf_counter()
            out = model(ids, use_cache=True, logits_to_keep=1)
            token = out.logits[0, -1].argmax()
            ttft = (time.perf_counter() - t0) * 1e3
            past, steps = out.past_key_values, []
            for _ in range(new - 1):
                t0 = time.perf_counter()
                out = model(token.view(1, 1), past_key_values=past, use_cache=True, logits_to_keep=1)
                past, token = out.past_key_values, out.logits[0, -1].argmax()
                steps.append((time.perf_counter() - t0) * 1e3)
        return ttft, steps

    request(8, 3)  # warm-up: oneDNN primitives, the thread pool

    def run(p: int) -> dict:
        ttft, steps = request(p, new_tokens)
        tpot = float(np.median(steps)) if steps else float("nan")
        return {"system": "torch", "dtype": dtype, "weights": dtype, "prompt": p, "ttft_ms": ttft,
                "tpot_ms": tpot, "output_tokens": len(steps) + 1}

    return run
