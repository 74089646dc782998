"""`python -m sandwich_tvm.generate`: greedy generation with prefill/decode hot switching."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ..compiler.artifact import CompileError
from ..kernels.attention import DEFAULT_KV_DTYPE, KV_DTYPES
from ..model.config import DEFAULT_PRESET, ModelConfigError, load_config
from ..model.linear import DEFAULT_DTYPE, WEIGHT_DTYPES, resolve_dtype
from ..model.parallel import ShardError
from ..model.weights import ModelLoadError, load_tokenizer
from ..runtime.engine import EngineError, check_context, check_length, run_context
from ..runtime.loader import open_engine
from ..runtime.sampling import Sampler, SamplingError, SamplingParams
from ..runtime.text import Detokenizer
from ..topology.plan import PlanError, resolve_plan
from .args import non_negative_int, positive_int


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_PRESET, metavar="PRESET|DIR",
                        help=f"preset (random weights) or HF model directory (default {DEFAULT_PRESET})")
    parser.add_argument("--plan", type=Path, default=None,
                        help="plans.json from `tune plan` (default out/plans.json if present, else all CPUs)")
    parser.add_argument("--schedules", type=Path, default=None,
                        help="tuned kernel database root (default: the repository's schedules/)")
    parser.add_argument("--stock", action="store_true", help="use TVM's stock build (the baseline)")
    parser.add_argument("--max-batch", type=positive_int, default=8,
                        help="decode kernels cover m <= this (default 8)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of a preset's random weights")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=DEFAULT_KV_DTYPE,
                        help=f"what the KV cache stores (default {DEFAULT_KV_DTYPE}, as llama.cpp's; "
                             "attention sums in fp32; a bf16 model on AMX feeds its prompt "
                             "attention bf16 operands, as it does its Linears)")
    parser.add_argument("--dtype", choices=("auto", *WEIGHT_DTYPES), default=DEFAULT_DTYPE,
                        help=f"the Linear weights' precision (default {DEFAULT_DTYPE}; auto: bfloat16, on "
                             "the CPU's bf16 dot-product unit where it has one, else widened to fp32 as "
                             "loaded). Activations, norms, RoPE, softmax and accumulation stay fp32")


def weight_dtype(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    """The resolved ``--dtype`` (TVM's stock build: float32), said when ``auto`` chose it."""
    if args.stock:
        return "float32"
    dtype, why = resolve_dtype(args.dtype)
    if args.dtype == "auto":
        log(f"weights: {dtype} ({why})")
    return dtype


LOAD_ERRORS = (ModelConfigError, ModelLoadError, PlanError, CompileError, EngineError, SamplingError,
               ShardError)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sandwich_tvm.generate",
                                description="Generate greedily: prefill on the plan's prefill cores, "
                                            "decode on its decode cores.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer.json)")
    src.add_argument("--prompt-len", type=positive_int, help="a synthetic prompt of N token ids")
    p.add_argument("--max-new-tokens", type=non_negative_int, default=32,
                   help="tokens to generate (default 32; 0 runs the prefill only)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="KV cache length in tokens (default: prompt + new tokens rounded up to 256, "
                        "at most the model's max_position_embeddings)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely (default -1: off)")
    p.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of the sampler (default: fresh entropy); --seed is the preset weights'")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    return [(7 + 31 * i) % vocab for i in range(n)]


class TextStream:
    """Writes a :class:`~sandwich_tvm.runtime.text.Detokenizer`'s deltas as tokens arrive;
    ``finish`` writes whatever is left."""

    def __init__(self, tok, write: Callable[[str], object]):
        self.detok, self.write = Detokenizer(tok), write

    def push(self, token: int) -> None:
        self._emit(self.detok.push(token))

    def finish(self) -> None:
        self._emit(self.detok.finish())

    def _emit(self, text: str) -> None:
        if text:
            self.write(text)


def _summary(gen) -> str:
    tpot = f"{gen.tpot_ms:.2f} ms (median)" if gen.decode_ms else "n/a (no decode step)"
    return (f"prompt {gen.prompt_tokens} tokens, {len(gen.tokens)} generated; TTFT {gen.ttft_ms:.1f} ms, "
            f"TPOT {tpot}, plan switch {gen.switch_ms * 1e3:.0f} µs")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    log = (lambda _m: None) if args.json else (lambda m: err.print(f"[dim]{m}[/]"))
    try:
        cfg = load_config(args.model)
        tok = load_tokenizer(args.model)
        if args.prompt is not None:
            if tok is None:
                raise EngineError(f"{args.model} has no tokenizer.json; pass --prompt-len N instead")
            prompt = tok.encode(args.prompt).ids
            if not prompt:
                raise EngineError("the prompt is empty after tokenization; pass some text")
        else:
            prompt = synthetic_prompt(args.prompt_len, cfg.vocab_size)
        params = SamplingParams(max_tokens=None, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed)
        # The KV cache is allocated up front: size it to this run, and fail before compiling.
        if args.context is not None:
            check_context(cfg, args.context)
        context = args.context or run_context(cfg, len(prompt) + args.max_new_tokens)
        check_length(cfg, len(prompt), args.max_new_tokens, context)
        plan = resolve_plan(args.plan)
        log(plan.describe())
        engine, _, _ = open_engine(args.model, plan, stock=args.stock, schedules=args.schedules,
                                   context=context, max_batch=args.max_batch, seed=args.seed,
                                   kv_dtype=args.kv_dtype, dtype=weight_dtype(args, log), log=log)
        eos = set()
        if tok is not None:
            ids = (tok.token_to_id(t) for t in ("</s>", "<|end_of_text|>", "<|eot_id|>"))
            eos = {i for i in ids if i is not None}

        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        stream = TextStream(tok, write) if tok is not None and not args.json else None
        on_token = stream.push if stream else None if args.json else (lambda t: write(f"{t} "))
        sampler = Sampler(params, prompt)
        sample = None if params.greedy else (lambda logits: sampler(logits).token)
        gen = engine.generate(prompt, args.max_new_tokens, stop=eos, on_token=on_token, sample=sample)
        if stream is not None:
            stream.finish()
    except LOAD_ERRORS as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)  # one line, brackets kept
        return 2
    if args.json:
        out = gen.to_json() | {"weights_huge_page_share": engine.huge_page_share, "processes": plan.tp}
        print(json.dumps(out, allow_nan=False))  # strict JSON: no NaN
    else:
        print()
        err.print(_summary(gen))
    return 0
