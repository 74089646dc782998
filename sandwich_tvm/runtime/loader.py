"""From a run spec to a running engine: compile (cached), load the weights, open the engine (and
a draft model's beside it)."""

from __future__ import annotations

from collections.abc import Callable

from ..compiler.artifact import CompiledModel, compile_model
from ..model.weights import load_params
from ..spec import RunSpec, check_weights_fit, resolve_run_spec
from .draft_model import DraftModel, check_draft_model
from .engine import Engine, EngineError


def open_engine(spec: RunSpec, *, force: bool = False, log: Callable[[str], None] = lambda _m: None
                ) -> tuple[Engine, CompiledModel]:
    """The engine for ``spec`` (one process, or ``spec.plan.processes`` ranks: tensor-parallel,
    pipeline stages, or the two sides of weight-attention separation) and the compiled model it
    runs (a pipeline's first stage, a separated model's weight side). ``spec`` was
    checked against the model and the memory when it was resolved (``spec.resolve_run_spec``);
    nothing here re-resolves it. The weights (with the KV cache) must fit in the memory available
    now, checked before compiling (``spec.check_weights_fit``)."""
    check_weights_fit(spec)
    stages = [compile_model(spec, force=force, log=log, stage=i) for i in range(spec.plan.parts)]
    compiled = stages[0] if stages else compile_model(spec, force=force, log=log)
    if spec.plan.processes > 1:  # every rank loads its own shard, stage or side
        from .tp import TPEngine

        engine = TPEngine(compiled, spec, log=log, stages=stages)
        where = "on the attention rank" if spec.plan.wa else f"on each of {spec.plan.processes} ranks"
        log(f"KV cache: {engine.kv_tokens} tokens ({engine.total_pages} pages) {where}")
        return engine, compiled
    isa, weight_dtype = compiled.weight_layout
    params = load_params(spec.model, spec.config, compiled.params, isa, seed=spec.seed, log=log,
                         dtype=weight_dtype, layouts=compiled.layouts, imatrix=spec.imatrix)
    engine = Engine(compiled, params, spec.plan, context=spec.context, max_batch=spec.max_batch,
                    prefill_chunk=spec.prefill_chunk, kv_tokens=spec.kv_tokens)
    log(f"KV cache: {engine.kv_tokens} tokens ({engine.total_pages} pages), at most {engine.context} "
        "per sequence")
    if engine.huge_page_share is not None:
        gb = sum(a.nbytes for a in params) / 1e9
        log(f"weights: {gb:.2f} GB, {engine.huge_page_share:.0%} in 2 MiB pages")
    return engine, compiled


def resolve_draft_spec(spec: RunSpec, model: str, *, dtype: str = "auto",
                       log: Callable[[str], None] = lambda _m: None) -> RunSpec:
    """The run spec of a draft model for speculative decoding beside ``spec``'s model: the same
    plan, context, batch and KV cache type, its own weights (``dtype``: their type, auto as for
    ``--dtype``). Checked before anything is compiled: one process, and the target's tokenizer."""
    from ..model.config import load_config
    from ..model.tokenizer import load_model_tokenizer

    if spec.plan.processes > 1:
        raise EngineError("a draft model runs beside a one-process plan; this plan has "
                          f"{spec.plan.processes} processes")
    cfg = load_config(model)
    check_draft_model(spec.config, cfg, load_model_tokenizer(spec.model), load_model_tokenizer(model))
    if (most := cfg.max_position_embeddings) < spec.context:
        raise EngineError(f"the draft model {cfg.name} holds {most} tokens of context, this run "
                          f"{spec.context}; lower --context to {most}")
    return resolve_run_spec(model, dtype=dtype, kv_dtype=spec.kv_dtype, plan=spec.plan, context=spec.context,
                            kv_tokens=spec.kv_tokens, max_batch=spec.max_batch,
                            prefill_chunk=spec.prefill_chunk, records=spec.records, seed=spec.seed, log=log)


def open_draft_model(draft: RunSpec, target: Engine, *,
                     log: Callable[[str], None] = lambda _m: None) -> DraftModel:
    """The draft model of ``draft`` (``resolve_draft_spec``) beside the ``target`` engine: its
    own weights and KV cache, on the target's cores."""
    log(f"draft model: {draft.describe()}")
    engine, _ = open_engine(draft, log=log)
    return DraftModel(engine, target.use, target.cfg.vocab_size, log=log)
