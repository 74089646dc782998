"""`python -m sandwich_tvm.serve`: the OpenAI-compatible server (continuous batching, prefill
and decode hot-switched on their plans' cores).

Everything is loaded (and compiled, on the first run) before the port opens, so ``/health``
answering 200 means ready.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from ..host import require_own_cpu
from ..model.tokenizer import load_model_tokenizer
from ..runtime.engine import EngineError
from ..runtime.scheduler import SchedulerPolicy
from ..spec import DEFAULT_CONTEXT
from .args import non_negative_int, positive_float, positive_int
from .common import print_error
from .options import LOAD_ERRORS, add_host_args, add_model_args, spec_from_args

SWITCH_INTERVAL_S = 2e-4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sandwich_tvm.serve", description=__doc__)
    add_model_args(p)  # --model --plan --records --stock --max-batch --seed --kv-dtype --dtype
    add_host_args(p)  # --hosts --host-timeout
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=positive_int, default=8000, help="port (default 8000)")
    p.add_argument("--context", type=positive_int, default=None,
                   help=f"longest request, prompt + completion, in tokens (default {DEFAULT_CONTEXT}, at "
                        "most the model's context)")
    p.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                   help="paged KV cache size in tokens, shared by the running sequences (default: "
                        "--context x --max-batch / 2, at least --context); allocated at start")
    p.add_argument("--prefill-budget", type=positive_int, default=512,
                   help="tokens per prefill iteration, all sequences' chunks together (default 512)")
    p.add_argument("--chunk", type=positive_int, default=None,
                   help="tokens of one prompt per prefill iteration (default: the budget)")
    p.add_argument("--priority", choices=("prefill", "decode"), default="prefill",
                   help="which phase runs when both have work (default prefill: admit new requests first)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not share cached prompt prefixes between requests (on by default; a request "
                        "opts out with \"cache_prompt\": false)")
    p.add_argument("--num-speculative-tokens", type=non_negative_int, default=None,
                   help="speculative decoding: draft tokens per sequence and step, from prompt lookup or "
                        "--draft-model (default 0: off, or 4 with --draft-model; one-process plans)")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="draft with this model instead of prompt lookup: a smaller model sharing the "
                        "tokenizer (a .gguf, an HF directory, a named model)")
    p.add_argument("--draft-dtype", default="auto",
                   help="the draft model's weight type (default auto: as --dtype auto chooses)")
    p.add_argument("--prompt-lookup-max", type=positive_int, default=4,
                   help="longest n-gram matched for a draft (default 4)")
    p.add_argument("--prompt-lookup-min", type=positive_int, default=2,
                   help="shortest n-gram matched for a draft (default 2)")
    p.add_argument("--step-policy", choices=("split", "mixed"), default="split",
                   help="split (default): each step prefills or decodes, on its plan's cores; mixed: "
                        "decoding sequences and prompt chunks share steps (chunked prefill on decode)")
    p.add_argument("--max-queue", type=positive_int, default=64,
                   help="requests waiting for a KV slot before new ones get 429 (default 64)")
    p.add_argument("--tune-in-background", choices=("off", "idle", "always"), default="off",
                   help="tune the GEMMs that lack records while serving (the model-guided search, "
                        "within --tune-budget) and swap each rebuilt model in between two steps: idle: "
                        "only while no request is running; always: beside them (default off)")
    p.add_argument("--tune-budget", type=positive_float, default=8.0, metavar="MIN",
                   help="minutes of background tuning at most (default 8)")
    p.add_argument("--costmodel-data", choices=("all", "records"), default="all",
                   help="what background tuning's cost model and transfer learn from: all (default): the "
                        "records directory and the records shipped in the package; records: the records "
                        "directory alone (as tune kernels takes it)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"), help="uvicorn's log level")
    return p


def policy_of(args: argparse.Namespace) -> SchedulerPolicy:
    """The scheduler's policy from the options (``EngineError`` naming a bad combination)."""
    try:
        return SchedulerPolicy(max_batch=args.max_batch, prefill_budget=args.prefill_budget,
                               chunk=args.chunk or args.prefill_budget, priority=args.priority,
                               max_queue=args.max_queue, prefix_caching=args.prefix_caching,
                               num_speculative_tokens=speculative_tokens(args),
                               prompt_lookup_max=args.prompt_lookup_max,
                               prompt_lookup_min=args.prompt_lookup_min, steps=args.step_policy)
    except ValueError as err:
        raise EngineError(str(err).replace("SchedulerPolicy.", "--").replace("_", "-")) from err


def speculative_tokens(args: argparse.Namespace) -> int:
    """``--num-speculative-tokens``, by default 4 with a draft model and 0 (off) without."""
    if args.num_speculative_tokens is not None:
        if args.draft_model and not args.num_speculative_tokens:
            raise EngineError("--draft-model drafts --num-speculative-tokens tokens per step: give 1 or more "
                              "(default 4)")
        return args.num_speculative_tokens
    return 4 if args.draft_model else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_own_cpu("serve")  # it runs code here, not for the CPU SANDWICH_CPU describes

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        policy = policy_of(args)
        spec = spec_from_args(args, log, context=args.context, kv_tokens=args.kv_cache_tokens, shared_kv=True,
                              prefill_chunk=max(args.prefill_budget, policy.chunk))
        if args.tune_in_background != "off" and (spec.stock or spec.plan.processes > 1):
            raise EngineError("--tune-in-background swaps Sandwich kernels in one process: not with --stock "
                              "or a plan of several processes")
        tok = load_model_tokenizer(args.model)
        log(spec.plan.describe())
        from ..runtime.loader import open_draft_model, open_engine, resolve_draft_spec

        draft = resolve_draft_spec(spec, args.draft_model, dtype=args.draft_dtype, log=log) \
            if args.draft_model else None
        engine, _ = open_engine(spec, log=log)
        drafter = open_draft_model(draft, engine, log=log) if draft else None
    except LOAD_ERRORS as exc:
        print_error(Console(stderr=True), exc)
        return 2
    import uvicorn

    from ..runtime.async_engine import AsyncEngine
    from ..runtime.batch import BatchEngine
    from ..runtime.metrics import ServingMetrics
    from ..server.app import Server, create_app

    name = args.served_model_name or str(args.model)
    metrics = ServingMetrics(name)
    try:
        batch = BatchEngine(engine, policy, eos_ids=tok.eos_ids if tok else frozenset(), metrics=metrics,
                            drafter=drafter)
    except EngineError as exc:
        print_error(Console(stderr=True), exc)
        return 2
    batch.update_gauges()
    # The engine thread re-takes the GIL after every TVM call; with CPython's default 5 ms switch
    # interval it could wait that long behind the HTTP thread, once per call.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    async_engine = AsyncEngine(batch).start()
    tuner = None
    if args.tune_in_background != "off":
        from ..runtime.background_tuning import BackgroundTuner

        tuner = BackgroundTuner(spec, async_engine, args.tune_in_background, args.tune_budget, log,
                                metrics=metrics, shipped=args.costmodel_data == "all").start()
    app = create_app(Server(async_engine, tok, name, metrics))
    log(f"serving {name} on http://{args.host}:{args.port} (max batch {policy.max_batch}, KV cache "
        f"{engine.kv_tokens} tokens in {engine.total_pages} pages, {engine.context} per request, tokenizer: "
        f"{tok.source if tok else 'none, token-id prompts only'})")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        if tuner is not None:
            tuner.stop()
        async_engine.shutdown()
    return 0
