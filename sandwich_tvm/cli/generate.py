"""`python -m sandwich_tvm.generate`: greedy generation with prefill/decode hot switching."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from ..compiler.artifact import CompileError
from ..model.config import DEFAULT_PRESET, ModelConfigError, load_config
from ..model.weights import ModelLoadError
from ..runtime.engine import EngineError
from ..runtime.loader import open_engine
from ..runtime.plan import PlanError, resolve_plan


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_PRESET, metavar="PRESET|DIR",
                        help=f"preset (random weights) or HF model directory (default {DEFAULT_PRESET})")
    parser.add_argument("--plan", type=Path, default=None,
                        help="plans.json from `tune plan` (default out/plans.json if present, else all CPUs)")
    parser.add_argument("--schedules", type=Path, default=None,
                        help="tuned kernel database root (default: the repository's schedules/)")
    parser.add_argument("--stock", action="store_true", help="use TVM's stock build (the baseline)")
    parser.add_argument("--max-batch", type=int, default=8, help="decode kernels cover m <= this (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")


LOAD_ERRORS = (ModelConfigError, ModelLoadError, PlanError, CompileError, EngineError)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sandwich_tvm.generate",
                                description="Generate greedily: prefill on the plan's prefill cores, "
                                            "decode on its decode cores.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
    src.add_argument("--prompt-len", type=int, help="a synthetic prompt of N token ids")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=None, help="KV cache length (default: the model's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    return [(7 + 31 * i) % vocab for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    log = (lambda _m: None) if args.json else (lambda m: err.print(f"[dim]{m}[/]"))
    try:
        plan = resolve_plan(args.plan)
        log(plan.describe())
        engine, tok, _ = open_engine(args.model, plan, stock=args.stock, schedules=args.schedules,
                                     context=args.context, max_batch=args.max_batch, seed=args.seed, log=log)
        if args.prompt is not None:
            if tok is None:
                raise EngineError(f"{args.model} has no tokenizer.json; pass --prompt-len N instead")
            prompt = tok.encode(args.prompt).ids
        else:
            prompt = synthetic_prompt(args.prompt_len, load_config(args.model).vocab_size)
        eos = set()
        if tok is not None:
            ids = (tok.token_to_id(t) for t in ("</s>", "<|end_of_text|>", "<|eot_id|>"))
            eos = {i for i in ids if i is not None}
        seen: list[int] = []
        shown = [""]

        def stream(token: int) -> None:
            """Print the new text (tokens decode in context, so diff the whole decoded string)."""
            seen.append(token)
            if args.json:
                return
            if tok is not None:
                text = tok.decode(seen)
                sys.stdout.write(text[len(shown[0]):])
                shown[0] = text
            else:
                sys.stdout.write(f"{token} ")
            sys.stdout.flush()

        gen = engine.generate(prompt, args.max_new_tokens, stop=eos, on_token=stream)
    except LOAD_ERRORS as exc:
        err.print(f"[red]error:[/] {exc}")
        return 2
    if args.json:
        print(json.dumps(gen.to_json() | {"weights_huge_page_share": engine.huge_page_share}))
    else:
        print()
        err.print(f"prompt {gen.prompt_tokens} tokens, {len(gen.tokens)} generated; "
                  f"TTFT {gen.ttft_ms:.1f} ms, TPOT {gen.tpot_ms:.2f} ms (median), "
                  f"plan switch {gen.switch_ms * 1e3:.0f} µs")
    return 0
