"""The end of the main job: compile with the tuned kernels, generate, compare with TVM's stock build."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from ..host import save_atomic
from ..model.config import load_config
from ..model.linear import resolve_dtype
from ..runtime.loader import open_engine
from ..topology.plan import ExecPlan
from .generate import synthetic_prompt


def compare_with_stock(args: argparse.Namespace, plan: ExecPlan, console: Console) -> int:
    cfg = load_config(args.model)
    prompt = synthetic_prompt(args.prompt_len, cfg.vocab_size)
    results = {}
    for stock in ([False] if args.no_stock else [False, True]):
        name = "tvm-stock" if stock else "sandwich"
        engine, _, compiled = open_engine(args.model, plan.one_process() if stock else plan, stock=stock,
                                          schedules=args.schedules,
                                          context=args.prompt_len + args.max_new_tokens + 8,
                                          dtype="float32" if stock else resolve_dtype(args.dtype)[0],
                                          log=lambda m: console.print(f"[dim]{m}[/]"))
        engine.generate(prompt[:4], 2)  # warm-up
        gen = engine.generate(prompt, args.max_new_tokens)
        engine.close()
        results[name] = gen.to_json() | {"kernels": compiled.meta["kernels"]}
        tpot = "n/a" if results[name]["tpot_ms"] is None else f"{gen.tpot_ms:.2f} ms"
        console.print(f"{name}: TTFT {gen.ttft_ms:.1f} ms, TPOT {tpot}, tokens {gen.tokens[:8]}...")
    table = Table(title=f"{cfg.name}: prompt {args.prompt_len} tokens, {args.max_new_tokens} new "
                        f"({plan.describe()})")
    for col in ("build", "TTFT ms", "TPOT ms", "TTFT speed-up", "TPOT speed-up"):
        table.add_column(col, justify="right")
    base = results.get("tvm-stock")
    for name, r in results.items():
        tpot_up = (f"{base['tpot_ms'] / r['tpot_ms']:.1f}x"
                   if base and base["tpot_ms"] and r["tpot_ms"] else "n/a")
        up = (f"{base['ttft_ms'] / r['ttft_ms']:.1f}x", tpot_up) if base else ("-", "-")
        tpot = "n/a" if r["tpot_ms"] is None else f"{r['tpot_ms']:.2f}"
        table.add_row(name, f"{r['ttft_ms']:.1f}", tpot, *up)
    console.print(table)
    if base and base["tokens"] != results["sandwich"]["tokens"]:
        console.print("[yellow]warning:[/] the stock build generated different tokens")
    out = args.out / "chain.json"
    save_atomic(out, json.dumps({"model": cfg.name, "plan": plan.describe(), "results": results}, indent=1,
                               allow_nan=False))
    console.print(f"wrote {out}")
    return 0
