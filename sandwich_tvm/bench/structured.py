"""`python -m sandwich_tvm.bench structured`: what a constrained request costs the requests it is
batched with.

Each round runs one batch twice through the serving engine (``BatchEngine``, as the server runs
it), greedy, every request ``--max-tokens`` long: half the batch *plain* chat requests, the other
half *companions* that are plain in the ``plain`` run and follow a JSON schema in the ``json``
run (a string field too long to close within the tokens, so both runs decode the same number of
steps). The order of the two runs alternates by round. A decode step of the whole batch is timed
from its start to its tokens; the ``json`` run also times its grammars (masks and advancing the
matchers). The check: the ``json`` run's steps are slower than the ``plain`` run's by no more than
the grammar time they contain (``excess_ms`` = step-time difference minus grammar time per step,
medians of each round's own values), so no step waits for another request's grammar beyond it.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.args import positive_int

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                           "summary": {"type": "string", "minLength": 4000}},
          "required": ["title", "summary"]}
QUESTION = "Summarize this conversation as JSON with a title and a summary:\n\n"


def add_structured_parser(sub) -> None:
    from ..model.config import DEFAULT_MODEL

    p = sub.add_parser("structured", help="step time of a batch with JSON-schema requests against without")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", help="weight type (default auto: the model's own)")
    p.add_argument("--batch", type=positive_int, default=8,
                   help="requests in the batch, half of them companions (default 8)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="output tokens a request (default 64)")
    p.add_argument("--prompt-chars", type=positive_int, default=400,
                   help="ShareGPT characters in each prompt (default 400)")
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


def _run(engine, policy, prompts: list[list[int]], max_tokens: int, constraint=None) -> dict:
    """The batch once; ``constraint()`` makes each companion's grammar (None: all plain)."""
    from ..runtime.batch import BatchEngine
    from ..runtime.sampling import SamplingParams

    batch = BatchEngine(engine, policy)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, cache_prompt=False)
    half = len(prompts) // 2
    seqs = [batch.add(f"r{i}", p, params, constraint=constraint() if constraint and i >= half else None)
            for i, p in enumerate(prompts)]
    steps: list[float] = []
    grammar: list[float] = []
    while batch.has_work():
        full = all(s.first_token_at is not None and s.finished_at is None for s in seqs)
        g0, t0 = batch.grammar_s, time.perf_counter()
        batch.step()
        if full and all(s.finished_at is None for s in seqs):  # a decode step of the whole batch
            steps.append(time.perf_counter() - t0)
            grammar.append(batch.grammar_s - g0)
    if not steps:
        raise RuntimeError("the batch never decoded as a whole: the KV cache holds too few tokens")
    return {"step_ms": float(np.median(steps)) * 1e3, "grammar_ms": float(np.mean(grammar)) * 1e3,
            "steps": len(steps), "outputs": [s.tokens[len(s.prompt):] for s in seqs]}


def main_structured(args: argparse.Namespace, console: Console) -> int:
    from ..cli.common import print_error
    from ..cli.options import LOAD_ERRORS
    from ..host import host_signature
    from ..model.tokenizer import load_model_tokenizer
    from ..runtime.grammar import Grammars, grammar_from_json_schema
    from ..runtime.loader import open_engine
    from ..runtime.scheduler import SchedulerPolicy
    from ..spec import SpecError, resolve_run_spec
    from .perplexity import sharegpt_text

    log = (lambda _m: None) if args.json else (lambda m: console.print(f"[dim]{m}[/]"))
    if args.batch < 2:
        print_error(console, "--batch must be at least 2 (half of it companions)")
        return 2
    try:
        tok = load_model_tokenizer(args.model)
        text = sharegpt_text(args.prompt_chars * (args.batch + 1))
        prompts = [tok.encode(tok.render_chat([{"role": "user", "content": QUESTION + text[
            i * args.prompt_chars:(i + 1) * args.prompt_chars]}])) for i in range(args.batch)]
        need = max(len(p) for p in prompts) + args.max_tokens
        spec = resolve_run_spec(args.model, dtype=args.dtype, max_batch=args.batch, log=log,
                                needed_tokens=need, kv_tokens=args.batch * (need + 16))
        if need > spec.config.max_position_embeddings:
            raise SpecError(f"a prompt of {need - args.max_tokens} tokens + --max-tokens {args.max_tokens} "
                            f"exceeds the model's context of {spec.config.max_position_embeddings}; lower "
                            "--prompt-chars or --max-tokens")
    except (SpecError, ValueError, *LOAD_ERRORS) as exc:
        print_error(console, exc)
        return 2
    log(f"{spec.describe()}\ncompiling and loading ...")
    try:
        engine, _ = open_engine(spec, log=log)
    except LOAD_ERRORS as exc:
        print_error(console, exc)
        return 2
    grammars = Grammars(tok.tok, spec.config.vocab_size, tok.eos_ids)
    grammar = grammar_from_json_schema(SCHEMA)
    chunk = spec.prefill_chunk
    policy = SchedulerPolicy(max_batch=args.batch, prefill_budget=chunk, chunk=chunk, prefix_caching=False)
    _run(engine, policy, [p[:16] for p in prompts[:2]], 4)  # warm-up
    rounds = []
    for r in range(args.rounds):
        order = [("plain", None), ("json", lambda: grammars.constraint(grammar))]
        if r % 2:  # take turns going first
            order.reverse()
        runs = {name: _run(engine, policy, prompts, args.max_tokens, make) for name, make in order}
        a, b = runs["plain"], runs["json"]
        half = args.batch // 2
        extra = b["step_ms"] - a["step_ms"]
        rounds.append({"plain_step_ms": a["step_ms"], "json_step_ms": b["step_ms"],
                       "grammar_ms_per_step": b["grammar_ms"], "extra_ms": extra,
                       "excess_ms": extra - b["grammar_ms"], "steps": min(a["steps"], b["steps"]),
                       "plain_requests_same_tokens": a["outputs"][:half] == b["outputs"][:half],
                       "companion_sample": tok.decode(b["outputs"][half])[:80]})
        log(f"round {r + 1}/{args.rounds}: step {a['step_ms']:.2f} ms plain, {b['step_ms']:.2f} ms with "
            f"{args.batch - half} JSON requests, of which grammars {b['grammar_ms']:.2f} ms")
    engine.close()

    def median(key: str) -> float:
        return float(np.median([x[key] for x in rounds]))

    cpu = host_signature()
    out = {"model": spec.config.name, "weights": spec.weight_dtype, "cpu": f"{cpu.model_name} ({cpu.slug})",
           "signature": cpu.to_json(), "threads": spec.plan.decode_threads, "batch": args.batch,
           "companions": args.batch - args.batch // 2, "max_tokens": args.max_tokens, "schema": SCHEMA,
           "rounds": rounds, **{f"median_{k}": median(k) for k in
                                ("plain_step_ms", "json_step_ms", "grammar_ms_per_step", "extra_ms",
                                 "excess_ms")},
           "plain_requests_same_tokens": all(x["plain_requests_same_tokens"] for x in rounds),
           "when": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python -m sandwich_tvm.bench " + " ".join(getattr(args, "argv", ["structured"]))}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    table = Table(title=f"Decode steps of {args.batch} requests, {out['companions']} of them JSON-"
                        "constrained "
                        f"or not, {out['model']} {out['weights']}, {out['threads']} threads ({out['cpu']})")
    for col in ("round", "plain step ms", "json step ms", "grammar ms/step", "excess ms"):
        table.add_column(col)
    for i, x in enumerate(rounds):
        table.add_row(str(i + 1), f"{x['plain_step_ms']:.2f}", f"{x['json_step_ms']:.2f}",
                      f"{x['grammar_ms_per_step']:.2f}", f"{x['excess_ms']:+.2f}")
    console.print(table)
    console.print(f"median: steps {out['median_extra_ms']:+.2f} ms with the JSON requests, grammars "
                  f"{out['median_grammar_ms_per_step']:.2f} ms of it; beyond the grammars "
                  f"{out['median_excess_ms']:+.2f} ms; the plain requests' tokens "
                  f"{'unchanged' if out['plain_requests_same_tokens'] else 'CHANGED'}")
    return 0
