"""`python -m sandwich_tvm.bench speculative`: single-request decode speed with speculative
decoding against plain decoding: drafts from prompt lookup, or from a draft model
(``--draft-model``, sharing the tokenizer).

Each round sends the model (through its chat template) a new request: ``--workload repeat``
asks it to repeat a ShareGPT passage (outputs that copy from the prompt, where prompt lookup
drafts well); ``chat`` sends a ShareGPT conversation's first user message as it is. Each
request runs alone through the serving engine twice, greedy: drafts off and drafts on (the
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

    p = sub.add_parser("speculative", help="decode speed with speculative drafts against without")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", help="weight type (default auto: the model's own)")
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="draft with this model (sharing the tokenizer) instead of prompt lookup")
    p.add_argument("--draft-dtype", default="auto", help="the draft model's weight type (default auto)")
    p.add_argument("--workload", choices=("repeat", "chat"), default="repeat",
                   help="repeat: repeat a ShareGPT passage (default); chat: ShareGPT first user messages")
    p.add_argument("--passage-chars", type=positive_int, default=900,
                   help="characters to repeat; chat: the longest message taken (default 900)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="output tokens (default 128)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4,
                   help="draft length (default 4)")
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds, each a new passage (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


def _run(engine, policy, prompt: list[int], max_tokens: int, drafter=None) -> dict:
    from ..runtime.batch import BatchEngine
    from ..runtime.sampling import SamplingParams

    batch = BatchEngine(engine, policy, drafter=drafter)
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
    from ..runtime.loader import open_draft_model, open_engine, resolve_draft_spec
    from ..runtime.scheduler import SchedulerPolicy
    from ..spec import SpecError, resolve_run_spec

    log = (lambda _m: None) if args.json else (lambda m: console.print(f"[dim]{m}[/]"))
    try:
        tok = load_model_tokenizer(args.model)
        prompts = [tok.encode(tok.render_chat([{"role": "user", "content": m}]))
                   for m in _messages(args.workload, args.passage_chars, args.rounds)]
        spec = resolve_run_spec(args.model, dtype=args.dtype, max_batch=1, log=log,
                                needed_tokens=max(len(p) for p in prompts) + args.max_tokens)
        draft = (resolve_draft_spec(spec, args.draft_model, dtype=args.draft_dtype, log=log)
                 if args.draft_model else None)
    except (SpecError, ValueError, *LOAD_ERRORS) as exc:
        print_error(console, exc)
        return 2
    log(f"{spec.describe()}\ncompiling and loading ...")
    try:
        engine, _ = open_engine(spec, log=log)
        drafter = open_draft_model(draft, engine, log=log) if draft else None
    except LOAD_ERRORS as exc:
        print_error(console, exc)
        return 2
    chunk = spec.prefill_chunk
    plain = SchedulerPolicy(max_batch=1, prefill_budget=chunk, chunk=chunk, prefix_caching=False)
    drafts = SchedulerPolicy(max_batch=1, prefill_budget=chunk, chunk=chunk, prefix_caching=False,
                             num_speculative_tokens=args.num_speculative_tokens)
    _run(engine, plain, prompts[0][:32], 4)  # warm-up
    _run(engine, drafts, prompts[0][:32], 4, drafter)
    warm_draft_s = drafter.seconds if drafter else 0.0
    rounds = []
    for r, prompt in enumerate(prompts):
        order = [("plain", plain), ("speculative", drafts)]
        if r % 2:  # take turns going first
            order.reverse()
        runs = {name: _run(engine, pol, prompt, args.max_tokens, drafter if name == "speculative" else None)
                for name, pol in order}
        a, b = runs["plain"], runs["speculative"]
        parted = None if a["tokens"] == b["tokens"] else _parting(engine, prompt, a["tokens"], b["tokens"])
        rounds.append({"parted": parted, "prompt_tokens": len(prompt), "output_tokens": len(a["tokens"]),
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
    workload = (f"repeat a {args.passage_chars}-character ShareGPT passage (chat template), greedy"
                if args.workload == "repeat" else
                f"ShareGPT first user messages of at most {args.passage_chars} characters (chat template), "
                "greedy")
    drafts_from = (f"draft model {draft.config.name} ({draft.weight_dtype} weights)" if draft
                   else "prompt lookup")
    out = {"model": spec.config.name, "weights": spec.weight_dtype, "cpu": f"{cpu.model_name} ({cpu.slug})",
           "signature": cpu.to_json(), "threads": spec.plan.decode_threads, "drafts": drafts_from,
           "num_speculative_tokens": args.num_speculative_tokens, "max_tokens": args.max_tokens,
           "workload": workload,
           "rounds": rounds, "median_speedup": float(np.median([x["speedup"] for x in rounds])),
           "median_plain_tok_s": float(np.median([x["plain_tok_s"] for x in rounds])),
           "median_speculative_tok_s": float(np.median([x["speculative_tok_s"] for x in rounds])),
           "acceptance_rate": sum(x["accepted"] for x in rounds) / drafted if drafted else 0.0,
           "same_tokens": all(x["same_tokens"] for x in rounds),
           "median_tokens_per_step": float(np.median([x["tokens_per_step"] for x in rounds])),
           "draft_seconds": drafter.seconds - warm_draft_s if drafter else None,
           "draft_error": drafter.error if drafter else None,
           "when": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python -m sandwich_tvm.bench " + " ".join(getattr(args, "argv", ["speculative"]))}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    table = Table(title=f"Decode with drafts from {drafts_from}, {out['model']} {out['weights']}, "
                        f"{out['threads']} threads ({out['cpu']})")
    for col in ("round", "plain tok/s", "speculative tok/s", "speedup", "accepted", "same tokens"):
        table.add_column(col)
    for i, x in enumerate(rounds):
        table.add_row(str(i + 1), f"{x['plain_tok_s']:.1f}", f"{x['speculative_tok_s']:.1f}",
                      f"{x['speedup']:.2f}x", f"{x['accepted']}/{x['drafted']}", str(x["same_tokens"]))
    console.print(table)
    console.print(f"median speedup {out['median_speedup']:.2f}x; acceptance {out['acceptance_rate']:.0%}")
    return 0


def _messages(workload: str, chars: int, n: int) -> list[str]:
    """``n`` user messages: an instruction to repeat a ShareGPT passage of ``chars`` characters
    (``repeat``), or ShareGPT first user messages of 40 to ``chars`` characters in a seeded order
    (``chat``)."""
    if workload == "repeat":
        from .perplexity import sharegpt_text

        text = sharegpt_text(chars * (n + 1))
        return [INSTRUCTION + text[r * chars:(r + 1) * chars] for r in range(n)]
    from .serving.workload import first_turns

    turns = first_turns()
    picked = []
    for i in np.random.default_rng(0).permutation(len(turns)).tolist():
        if turns[i] is not None and 40 <= len(turns[i][0].strip()) <= chars:
            picked.append(turns[i][0].strip())
            if len(picked) == n:
                break
    return picked


def _parting(engine, prompt: list[int], plain: list[int], spec: list[int]) -> dict:
    """Where the speculative tokens part from the plain ones: the position, both tokens, and the
    plain run's logits there (the gap between its top two, and the speculative token's), from
    one more plain greedy run that keeps its logits. A gap of a few hundredths is a near-tie the
    verify chunk's and the one-token decode's summation orders settle differently."""
    j = next((i for i, (x, y) in enumerate(zip(plain, spec, strict=False)) if x != y),
             min(len(plain), len(spec)))
    if j >= min(len(plain), len(spec)):  # one ended sooner (a stop token), same up to there
        return {"position": j, "ended_sooner": "plain" if len(plain) < len(spec) else "speculative"}
    logits: list = []
    again = engine.generate(prompt, j + 1, logits_out=logits).tokens
    row = np.asarray(logits[j], dtype=np.float64)
    top = np.sort(row)[-2:]
    return {"position": j, "plain_token": plain[j], "speculative_token": spec[j],
            "plain_top2_gap": float(top[1] - top[0]),
            "speculative_token_below_max": float(top[1] - row[spec[j]]),
            "plain_again": again == plain[:j + 1]}
