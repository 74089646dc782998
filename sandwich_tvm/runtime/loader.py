"""From a model name to a running engine: config, compile (cached), weights, plan."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..compiler.artifact import CompiledModel, compile_model
from ..kernels.attention import DEFAULT_KV_DTYPE
from ..model.config import load_config
from ..model.weights import load_params, load_tokenizer
from ..topology.plan import ExecPlan
from .engine import DEFAULT_CONTEXT, Engine, check_context


def open_engine(model: str | Path, plan: ExecPlan, *, stock: bool = False, schedules: Path | None = None,
                context: int | None = None, max_batch: int = 8, prefill_chunk: int = 2048,
                kv_tokens: int | None = None, kv_dtype: str = DEFAULT_KV_DTYPE, seed: int = 0,
                force: bool = False, dtype: str = "float32",
                log: Callable[[str], None] = lambda _m: None) -> tuple[Engine, object, CompiledModel]:
    """The engine, the tokenizer (None for presets) and the compiled model it runs.

    ``context``: the KV cache length in tokens, shared by all sequences (capped at the model's
    context; default ``DEFAULT_CONTEXT``); checked against memory before anything is compiled or
    loaded. ``kv_tokens``: the KV cache's size when it is larger (shared by the running
    sequences). ``max_batch``: sequences the cache holds at once and the decode kernels' largest m;
    ``prefill_chunk``: the most tokens one prefill call takes; ``dtype``: the weights' precision."""
    cfg = load_config(model)
    check_context(cfg, min(DEFAULT_CONTEXT if context is None else context, cfg.max_position_embeddings))
    compiled = compile_model(cfg, plan, stock=stock, max_batch=max_batch, root=schedules, force=force,
                             kv_dtype=kv_dtype, dtype=dtype, log=log)
    if plan.tp > 1:  # every rank loads its own shard
        from .tp import TPEngine

        engine = TPEngine(compiled, str(model), plan, context=context, prefill_chunk=prefill_chunk,
                          max_batch=max_batch, kv_tokens=kv_tokens, seed=seed, log=log)
        log(f"KV cache: {engine.kv_tokens} tokens ({engine.total_pages} pages) on each of {plan.tp} ranks")
        return engine, load_tokenizer(model), compiled
    isa, weight_dtype = compiled.weight_layout
    params = load_params(model, cfg, compiled.params, isa, seed=seed, log=log, dtype=weight_dtype,
                         layouts=compiled.layouts)
    engine = Engine(compiled, params, plan, context=context, max_batch=max_batch, prefill_chunk=prefill_chunk,
                    kv_tokens=kv_tokens)
    log(f"KV cache: {engine.kv_tokens} tokens ({engine.total_pages} pages), at most {engine.context} "
        "per sequence")
    if engine.huge_page_share is not None:
        gb = sum(a.nbytes for a in params) / 1e9
        log(f"weights: {gb:.2f} GB, {engine.huge_page_share:.0%} in 2 MiB pages")
    return engine, load_tokenizer(model), compiled
