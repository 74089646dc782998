"""`python -m sandwich_tvm.generate`: greedy generation with prefill/decode hot switching."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape

from ..host import require_own_cpu
from ..model.tokenizer import load_model_tokenizer
from ..runtime.engine import EngineError, check_length
from ..runtime.loader import open_engine
from ..runtime.sampling import Sampler, SamplingParams
from ..runtime.text import Detokenizer
from .args import non_negative_int, positive_int
from .options import LOAD_ERRORS, add_host_args, add_model_args, spec_from_args, synthetic_prompt


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sandwich_tvm.generate",
                                description="Generate greedily: prefill on the plan's prefill cores, "
                                            "decode on its decode cores.")
    add_model_args(p)
    add_host_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
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
    require_own_cpu("generate")  # it runs code here, not for the CPU SANDWICH_CPU describes
    err = Console(stderr=True)
    log = (lambda _m: None) if args.json else (lambda m: err.print(f"[dim]{m}[/]"))
    try:
        tok = load_model_tokenizer(args.model)
        if args.prompt is not None:
            if tok is None:
                raise EngineError(f"{args.model} has no tokenizer; pass --prompt-len N instead")
            prompt = tok.encode(args.prompt, add_special_tokens=True)
            if not prompt:
                raise EngineError("the prompt is empty after tokenization; pass some text")
        params = SamplingParams(max_tokens=None, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed)
        # The KV cache is allocated up front: size it to this run, and fail before compiling.
        needed = (len(prompt) if args.prompt is not None else args.prompt_len) + args.max_new_tokens
        spec = spec_from_args(args, log, context=args.context, needed_tokens=needed)
        if args.prompt is None:
            prompt = synthetic_prompt(args.prompt_len, spec.config.vocab_size)
        check_length(spec.config, len(prompt), args.max_new_tokens, spec.context)
        plan = spec.plan
        log(plan.describe())
        engine, _ = open_engine(spec, log=log)
        eos = set(tok.eos_ids) if tok is not None else set()

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
        out = gen.to_json() | {"weights_huge_page_share": engine.huge_page_share, "processes": plan.processes,
                                "hosts": list(spec.hosts)}
        print(json.dumps(out, allow_nan=False))  # strict JSON: no NaN
    else:
        print()
        err.print(_summary(gen))
    return 0
