"""`python -m sandwich_tvm.bench speculative`: single-request decode speed with prompt-lookup
speculative decoding against plain decoding, on outputs that copy from the prompt.

Each round asks the model (through its chat template) to repeat a new ShareGPT passage, and
runs the request alone through the serving engine twice, greedy: drafts off and drafts on (the
order alternates by round). Decode speed is output tokens after the first over the time from
the first token to the last. Greedy speculative decoding must give the same tokens; the run
records whether it did, the acceptance rate and the tokens emitted per verify step.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.args import positive_int

INSTRUCTION = "Repeat the following text exactly, word for word:\n\n"


def add_speculative_parser(sub) -> None:
    from ..model.config import DEFAULT_MODEL

    p = sub.add_parser("speculative", help="decode speed with prompt-lookup drafts against without")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", help="weight type (default auto: the model's own)")
    p.add_argument("--passage-chars", type=positive_int, default=900,
                   help="characters to repeat (default 900)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="output tokens (default 128)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4,
                   help="draft length (default 4)")
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds, each a new passage (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


def _run(engine, policy, prompt: list[int], max_tokens: int) -> dict:
    from ..runtime.batch import BatchEngine
    from ..runtime.sampling import SamplingParams

    batch = BatchEngine(engine, policy)
    seq = batch.add("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    steps = 0
    while batch.has_work():
        batch.step()
        steps += 1
    out = seq.tokens[len(seq.prompt):]
    decode_s = seq.finished_at - seq.first_token_at
    return {"tokens": out, "decode_tok_s": (len(out) - 1) / decode_s if len(out) > 1 else float("nan"),
            "steps": steps, "drafted": batch.drafted, "accepted": batch.accepted}


def main_speculative(args: argparse.Namespace, console: Console) -> int:
    from ..cli.common import print_error
    from ..cli.options import LOAD_ERRORS
    from ..host import host_signature
    from ..model.tokenizer import load_model_tokenizer
    from ..runtime.loader import open_engine
    from ..runtime.scheduler import SchedulerPolicy
    from ..spec import SpecError, resolve_run_spec
    from .perplexity import sharegpt_text

    log = (lambda _m: None) if args.json else (lambda m: console.print(f"[dim]{m}[/]"))
    try:
        tok = load_model_tokenizer(args.model)
        text = sharegpt_text(args.passage_chars * (args.rounds + 1))
        prompts = []
        for r in range(args.rounds):
            passage = text[r * args.passage_chars:(r + 1) * args.passage_chars]
            chat = tok.render_chat([{"role": "user", "content": INSTRUCTION + passage}])
            prompts.append(tok.encode(chat))
        spec = resolve_run_spec(args.model, dtype=args.dtype, max_batch=1, log=log,
                                needed_tokens=max(len(p) for p in prompts) + args.max_tokens)
    except (SpecError, ValueError, *LOAD_ERRORS) as exc:
        print_error(console, exc)
        return 2
    log(f"{spec.describe()}\ncompiling and loading ...")
    try:
        engine, _ = open_engine(spec, log=log)
    except LOAD_ERRORS as exc:
        print_error(console, exc)
        return 2
    chunk = spec.prefill_chunk
    plain = SchedulerPolicy(max_batch=1, prefill_budget=chunk, chunk=chunk, prefix_caching=False)
    drafts = SchedulerPolicy(max_batch=1, prefill_budget=chunk, chunk=chunk, prefix_caching=False,
                             num_speculative_tokens=args.num_speculative_tokens)
    _run(engine, plain, prompts[0][:32], 4)  # warm-up
    rounds = []
    for r, prompt in enumerate(prompts):
        order = [("plain", plain), ("speculative", drafts)]
        if r % 2:  # take turns going first
            order.reverse()
        runs = {name: _run(engine, pol, prompt, args.max_tokens) for name, pol in order}
        a, b = runs["plain"], runs["speculative"]
        rounds.append({"prompt_tokens": len(prompt), "output_tokens": len(a["tokens"]),
                       "plain_tok_s": a["decode_tok_s"], "speculative_tok_s": b["decode_tok_s"],
                       "speedup": b["decode_tok_s"] / a["decode_tok_s"],
                       "same_tokens": a["tokens"] == b["tokens"],
                       "drafted": b["drafted"], "accepted": b["accepted"],
                       "tokens_per_step": len(b["tokens"]) / max(b["steps"] - 1, 1)})
        log(f"round {r + 1}/{args.rounds}: plain {a['decode_tok_s']:.1f} tok/s, speculative "
            f"{b['decode_tok_s']:.1f} tok/s, {b['accepted']}/{b['drafted']} draft tokens accepted")
    engine.close()
    cpu = host_signature()
    drafted = sum(x["drafted"] for x in rounds)
    out = {"model": spec.config.name, "weights": spec.weight_dtype, "cpu": f"{cpu.model_name} ({cpu.slug})",
           "signature": cpu.to_json(), "threads": spec.plan.decode_threads,
           "num_speculative_tokens": args.num_speculative_tokens, "max_tokens": args.max_tokens,
           "workload": f"repeat a {args.passage_chars}-character ShareGPT passage (chat template), greedy",
           "rounds": rounds, "median_speedup": float(np.median([x["speedup"] for x in rounds])),
           "median_plain_tok_s": float(np.median([x["plain_tok_s"] for x in rounds])),
           "median_speculative_tok_s": float(np.median([x["speculative_tok_s"] for x in rounds])),
           "acceptance_rate": sum(x["accepted"] for x in rounds) / drafted if drafted else 0.0,
           "same_tokens": all(x["same_tokens"] for x in rounds),
           "when": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python -m sandwich_tvm.bench " + " ".join(getattr(args, "argv", ["speculative"]))}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    table = Table(title=f"Decode with prompt-lookup drafts, {out['model']} {out['weights']}, "
                        f"{out['threads']} threads ({out['cpu']})")
    for col in ("round", "plain tok/s", "speculative tok/s", "speedup", "accepted", "same tokens"):
        table.add_column(col)
    for i, x in enumerate(rounds):
        table.add_row(str(i + 1), f"{x['plain_tok_s']:.1f}", f"{x['speculative_tok_s']:.1f}",
                      f"{x['speedup']:.2f}x", f"{x['accepted']}/{x['drafted']}", str(x["same_tokens"]))
    console.print(table)
    console.print(f"median speedup {out['median_speedup']:.2f}x; acceptance {out['acceptance_rate']:.0%}")
    return 0
