"""`python -m sandwich_tvm.bench prefix-cache`: what prefix caching saves a request whose prompt
begins with a long prefix another request already ran (a shared system prompt, a chat's history).

Each round takes a fresh ``--prefix-tokens`` slice of ShareGPT text (tokenized with the model's
tokenizer, so no round finds another's prefix) and runs three one-token requests through the
serving engine (``BatchEngine``, as the server runs it), one after the other:

- *first*: prefix + question A, the prefix not cached yet;
- *cached*: prefix + question B, forked from the first's pages, prefilling only the rest;
- *uncached*: prefix + question B again with ``cache_prompt`` off (the cold baseline on the same
  prompt; its greedy token must equal *cached*'s).

TTFT is arrival to first token. Ratios are the medians of each round's own ratios.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.args import positive_int


def add_prefix_parser(sub) -> None:
    from ..model.config import DEFAULT_MODEL

    p = sub.add_parser("prefix-cache", help="TTFT of a request whose long prefix is cached, against cold")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", help="weight type (default auto: the model's own)")
    p.add_argument("--prefix-tokens", type=positive_int, default=1000, help="shared prefix (default 1000)")
    p.add_argument("--question-tokens", type=positive_int, default=24,
                   help="tokens after the prefix in each request (default 24)")
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds, each on a new prefix (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


def _ttft(batch, rid: str, prompt: list[int], cache: bool) -> tuple[float, int, int]:
    """(TTFT s, the greedy token, prompt tokens found cached) of one request run alone."""
    from ..runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, cache_prompt=cache)
    seq = batch.add(rid, prompt, params)
    token = None
    while batch.has_work():
        for e in batch.step():
            token = e.token if e.token is not None else token
    return seq.ttft_s(), token, seq.cached_tokens


def main_prefix(args: argparse.Namespace, console: Console) -> int:
    from ..cli.common import print_error
    from ..cli.options import LOAD_ERRORS
    from ..host import host_signature
    from ..model.tokenizer import load_model_tokenizer
    from ..runtime.batch import BatchEngine
    from ..runtime.loader import open_engine
    from ..runtime.scheduler import SchedulerPolicy
    from ..spec import SpecError, resolve_run_spec
    from .perplexity import sharegpt_text

    log = (lambda _m: None) if args.json else (lambda m: console.print(f"[dim]{m}[/]"))
    per_round = args.prefix_tokens + 2 * args.question_tokens
    try:
        spec = resolve_run_spec(args.model, dtype=args.dtype, kv_tokens=2 * per_round + 64, max_batch=1,
                                needed_tokens=args.prefix_tokens + args.question_tokens + 1, log=log)
        tok = load_model_tokenizer(args.model)
    except (SpecError, ValueError, *LOAD_ERRORS) as exc:
        print_error(console, exc)
        return 2
    ids = tok.encode(sharegpt_text(per_round * args.rounds * 8))
    if len(ids) < per_round * args.rounds:
        print_error(console, f"ShareGPT's first conversations give {len(ids)} tokens; ask fewer "
                             "--rounds or --prefix-tokens")
        return 2
    log(f"{spec.describe()}\ncompiling and loading ...")
    try:
        engine, _ = open_engine(spec, log=log)
    except LOAD_ERRORS as exc:
        print_error(console, exc)
        return 2
    policy = SchedulerPolicy(max_batch=1, prefill_budget=spec.prefill_chunk, chunk=spec.prefill_chunk)
    batch = BatchEngine(engine, policy)
    q = args.question_tokens
    _ttft(batch, "warm-up", ids[:64], False)
    rounds = []
    for r in range(args.rounds):
        base = r * per_round
        prefix = ids[base:base + args.prefix_tokens]
        a = prefix + ids[base + args.prefix_tokens:base + args.prefix_tokens + q]
        b = prefix + ids[base + args.prefix_tokens + q:base + per_round]
        first, _, _ = _ttft(batch, f"{r}a", a, True)
        cached, tok_cached, hit = _ttft(batch, f"{r}b", b, True)
        uncached, tok_cold, _ = _ttft(batch, f"{r}c", b, False)
        rounds.append({"first_s": first, "cached_s": cached, "uncached_s": uncached, "cached_tokens": hit,
                       "same_token": tok_cached == tok_cold})
        log(f"round {r + 1}/{args.rounds}: first {first * 1e3:.1f} ms, cached {cached * 1e3:.1f} ms "
            f"({hit} tokens shared), uncached {uncached * 1e3:.1f} ms")
    engine.close()

    def median(key: str) -> float:
        return float(np.median([x[key] for x in rounds]))

    cpu = host_signature()
    out = {"model": spec.config.name, "weights": spec.weight_dtype, "cpu": f"{cpu.model_name} ({cpu.slug})",
           "signature": cpu.to_json(), "threads": spec.plan.prefill_threads,
           "prefix_tokens": args.prefix_tokens, "question_tokens": q, "rounds": rounds,
           "median_ms": {k: median(f"{k}_s") * 1e3 for k in ("first", "cached", "uncached")},
           "cached_vs_first": float(np.median([x["cached_s"] / x["first_s"] for x in rounds])),
           "cached_vs_uncached": float(np.median([x["cached_s"] / x["uncached_s"] for x in rounds])),
           "same_tokens": all(x["same_token"] for x in rounds),
           "when": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python -m sandwich_tvm.bench " + " ".join(getattr(args, "argv", ["prefix-cache"]))}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    table = Table(title=f"TTFT with a {args.prefix_tokens}-token prefix, {out['model']} {out['weights']}, "
                        f"{out['threads']} threads ({out['cpu']})")
    for col in ("request", "median TTFT (ms)", "vs first"):
        table.add_column(col)
    for k in ("first", "cached", "uncached"):
        ms = out["median_ms"][k]
        table.add_row(k, f"{ms:.1f}", f"{ms / out['median_ms']['first']:.3f}")
    console.print(table)
    console.print(f"cached / first (median of rounds): {out['cached_vs_first']:.3f}; greedy tokens "
                  f"{'equal' if out['same_tokens'] else 'DIFFER'} with the cache off")
    return 0
