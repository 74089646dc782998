"""`python -m sandwich_tvm.bench agreement`: how often a 16-bit model picks its fp32 model's greedy
token (teacher-forced, on the same weights), and how close the steps where it does not were."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.args import positive_int


def add_agreement_parser(sub) -> None:
    from ..kernels.attention import DEFAULT_KV_DTYPE, KV_DTYPES
    from ..model.config import DEFAULT_PRESET

    a = sub.add_parser("agreement", help="greedy tokens of a 16-bit model against its fp32 model")
    a.add_argument("--model", default=DEFAULT_PRESET, metavar="PRESET|DIR",
                   help=f"preset (random weights) or HF model directory (default {DEFAULT_PRESET})")
    a.add_argument("--dtype", choices=("auto", "bfloat16", "float16"), default="auto",
                   help="the candidate's weights (default auto: bfloat16); the reference is fp32 "
                        "weights with an fp32 KV cache")
    a.add_argument("--kv-dtype", choices=KV_DTYPES, default=DEFAULT_KV_DTYPE,
                   help=f"the candidate's KV cache (default {DEFAULT_KV_DTYPE}, as served)")
    a.add_argument("--steps", type=positive_int, default=64, help="greedy steps (default 64)")
    a.add_argument("--prompt-len", type=positive_int, default=32, help="random prompt tokens (default 32)")
    a.add_argument("--prompts", type=positive_int, default=4,
                   help="random prompts, each followed for --steps steps (default 4)")
    a.add_argument("--torch", action="store_true",
                   help="also score HF transformers in bf16 (as `generate` runs it) on the same tokens")
    a.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights (default 0)")
    a.add_argument("--prompt-seed", type=int, default=3, help="seed of the random prompts (default 3)")
    a.add_argument("--schedules", default=None, help="tuned kernel database root (default schedules/)")
    a.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


def _fits(cfg, dtype_bytes: int) -> str | None:
    """Why the reference's weights cannot be held here, or None."""
    import psutil

    need = cfg.num_params() * dtype_bytes
    have = psutil.virtual_memory().available
    if need > 0.9 * have:
        return (f"{cfg.name}'s fp32 weights need {need / 2**30:.1f} GiB and this machine has "
                f"{have / 2**30:.1f} GiB available; compare it on a machine with more memory")
    return None


def torch_agreement(spec: str, cfg, seed: int, prompts: list[list[int]], tokens: list[list[int]],
                    threads: int) -> list:
    """HF ``transformers`` in bf16 on the reference's tokens, scored against HF in fp32 (which
    the fp32 model matches within 1e-4): what a torch user's bf16 model gives up."""
    import os

    import torch

    from ..tvm_compat import PROCESS_CPUS
    from .agreement import score
    from .e2e import hf_model

    os.sched_setaffinity(0, PROCESS_CPUS)  # the engine's decode plan pinned this thread to its cores
    torch.set_num_threads(threads)
    model = hf_model(spec, cfg, seed)
    out = []
    with torch.inference_mode():
        fp32 = [model(torch.tensor([p + t[:-1]])).logits[0, len(p) - 1:].numpy()
                for p, t in zip(prompts, tokens, strict=True)]
        model = model.to(torch.bfloat16)
        for p, t, ref in zip(prompts, tokens, fp32, strict=True):
            ids = torch.tensor([p + t[:-1]])
            forced = model(ids).logits[0, len(p) - 1:].float().numpy()
            own = model.generate(ids[:, :len(p)], max_new_tokens=len(t), min_new_tokens=len(t),
                                 do_sample=False)[0, len(p):].tolist()
            out.append(score(t, ref, forced, own))
    return out


def main_agreement(args: argparse.Namespace, console: Console) -> int:
    from ..cli.common import print_error
    from ..compiler.artifact import CompileError
    from ..model.checkpoint import ModelLoadError
    from ..model.config import ModelConfigError, load_config
    from ..runtime.engine import EngineError
    from ..runtime.loader import open_engine
    from ..spec import SpecError, resolve_run_spec
    from .agreement import greedy_agreement, pooled

    log = (lambda _m: None) if args.json else (lambda m: console.print(f"[dim]{m}[/]"))
    try:
        cfg = load_config(args.model)
    except (ModelConfigError, ModelLoadError) as exc:
        print_error(console, exc)
        return 2
    if why := _fits(cfg, 4):
        print_error(console, why)
        return 2
    try:
        spec = resolve_run_spec(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, records=args.schedules,
                                needed_tokens=args.prompt_len + args.steps, max_batch=1, seed=args.seed)
    except SpecError as exc:
        print_error(console, exc)
        return 2
    dtype = spec.weight_dtype
    log(f"candidate: {dtype} weights ({spec.dtype_note}), {args.kv_dtype} KV cache; "
        "reference: float32, float32")
    rng = np.random.default_rng(args.prompt_seed)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, args.prompt_len)]
               for _ in range(args.prompts)]

    def opener(weights: str, kv: str):
        def open_it():
            log(f"opening the {weights} model ({kv} KV cache) ...")
            wider = spec.wider_linears if weights == spec.weight_dtype else ()  # the reference: all fp32
            engine, _ = open_engine(replace(spec, weight_dtype=weights, kv_dtype=kv, wider_linears=wider),
                                    log=log)
            return engine
        return open_it

    t0 = time.perf_counter()
    try:
        results = greedy_agreement(opener("float32", "float32"), opener(dtype, args.kv_dtype), prompts,
                                   args.steps)
    except (ModelLoadError, CompileError, EngineError, SpecError) as exc:
        print_error(console, exc)
        return 2
    systems = {f"sandwich {dtype}": results}
    if args.torch:
        log("HF transformers in bfloat16 on the same tokens ...")
        systems["torch bfloat16"] = torch_agreement(args.model, cfg, args.seed, prompts,
                                                    [r.tokens for r in results], len(spec.plan.prefill_cpus))
    out = {"model": cfg.name, "dtype": dtype, "kv_dtype": args.kv_dtype, "prompt_len": args.prompt_len,
           "steps": args.steps, "seconds": time.perf_counter() - t0,
           "systems": {name: {"agree": pooled(rs), "prompts": [r.to_json() for r in rs]}
                       for name, rs in systems.items()}}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    table = Table(title=f"{cfg.name}: teacher-forced agreement with the fp32 model's greedy tokens "
                        f"({args.prompts} prompts x {args.steps} steps)")
    for col in ("system", "agree (all steps)", "per prompt", "own greedy prefix", "logit RMS error",
                "flips' fp32 margin rank (worst)"):
        table.add_column(col, justify="right")
    for name, rs in systems.items():
        ranks = [d.margin_rank for r in rs for d in r.disagreements]
        table.add_row(name, f"{pooled(rs):.1%}", " ".join(f"{r.agree:.0%}" for r in rs),
                      " ".join(str(r.free_run_prefix) for r in rs),
                      f"{np.mean([r.logit_rms_error for r in rs]):.4f}",
                      f"{max(ranks):.0%}" if ranks else "-")
    console.print(table)
    console.print(f"logits' RMS {np.mean([r.logit_scale for r in results]):.3f}; fp32's median top-1 margin "
                  f"{np.median([r.median_margin for r in results]):.4f}. A flip's margin rank: the share "
                  "of steps whose fp32 top-1 margin is smaller (near-ties rank low).")
    return 0
