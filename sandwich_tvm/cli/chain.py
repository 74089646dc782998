"""The end of the main job: compile with the tuned kernels, generate, compare with TVM's stock build."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from ..host import save_atomic
from ..model.config import PRESETS
from ..model.rope import stock_problem
from ..model.tokenizer import ModelTokenizer, load_model_tokenizer
from ..runtime.loader import open_engine
from ..spec import RunSpec
from .options import synthetic_prompt

DEFAULT_QUESTION = "What is the capital of France? Answer in one sentence."


def chain_prompt(args: argparse.Namespace, spec: RunSpec) -> tuple[list[int], ModelTokenizer | None]:
    """The main job's prompt: ``--prompt`` as one chat turn for a model with a real tokenizer,
    else ``--prompt-len`` synthetic ids (a random-weight preset has nothing to say)."""
    tok = None if spec.model in PRESETS else load_model_tokenizer(spec.model)
    if tok is None:
        return synthetic_prompt(args.prompt_len, spec.config.vocab_size), None
    text = tok.render_chat([{"role": "user", "content": args.prompt}])
    return tok.encode(text), tok


def build_dtypes(run: RunSpec, meta: dict) -> dict[str, object]:
    """The dtypes a build runs: its weights and KV cache as compiled (``meta``), its activations,
    and the Linears a GGUF held wider (``RunSpec.wider_linears``: layer, Linear, dtype)."""
    out = {"weight_dtype": meta.get("dtype", run.weight_dtype),
           "kv_dtype": meta.get("kv_dtype", run.kv_dtype), "act_dtype": run.act_dtype}
    if run.built_wider:
        out["wider_linears"] = [list(w) for w in run.built_wider]
    return out


def compare_with_stock(args: argparse.Namespace, spec: RunSpec, console: Console,
                       prompt: list[int] | None = None, tok: ModelTokenizer | None = None) -> int:
    """Generate from ``prompt`` (default ``--prompt-len`` synthetic ids) with ``spec`` and with
    TVM's stock build of the same model on the same CPUs; with ``tok``, print the answers."""
    cfg, plan = spec.config, spec.plan
    prompt = synthetic_prompt(args.prompt_len, cfg.vocab_size) if prompt is None else prompt
    stop = set(tok.eos_ids) if tok is not None else set()
    results = {}
    no_stock = args.no_stock
    if not no_stock and (kind := stock_problem(cfg)):
        console.print(f"[yellow]note:[/] TVM's stock build cannot run this model as transformers does "
                      f"({kind}); skipping it")
        no_stock = True
    for stock in ([False] if no_stock else [False, True]):
        name = "tvm-stock" if stock else "sandwich"
        run = (replace(spec, stock=True, weight_dtype="float32", kv_dtype="float32", plan=plan.one_process())
               if stock else spec)
        engine, compiled = open_engine(run, log=lambda m: console.print(f"[dim]{m}[/]"))
        engine.generate(prompt[:4], 2)  # warm-up
        gen = engine.generate(prompt, args.max_new_tokens, stop=stop)
        engine.close()
        results[name] = (gen.to_json() | build_dtypes(run, compiled.meta)
                         | {"kernels": compiled.meta["kernels"]})
        if tok is not None:
            results[name]["text"] = tok.decode(gen.tokens)
            console.print(f"{name} answers: {results[name]['text']!r}", markup=False, highlight=False)
        tpot = "n/a" if results[name]["tpot_ms"] is None else f"{gen.tpot_ms:.2f} ms"
        r = results[name]
        console.print(f"{name} ({r['weight_dtype']} weights, {r['kv_dtype']} KV cache): TTFT "
                      f"{gen.ttft_ms:.1f} ms, TPOT {tpot}, tokens {gen.tokens[:8]}...")
    table = Table(title=f"{cfg.name}: prompt {len(prompt)} tokens, up to {args.max_new_tokens} new "
                        f"({plan.describe()})")
    for col in ("build", "weights", "KV cache", "TTFT ms", "TPOT ms", "TTFT speed-up", "TPOT speed-up"):
        table.add_column(col, justify="right")
    base = results.get("tvm-stock")
    for name, r in results.items():
        tpot_up = (f"{base['tpot_ms'] / r['tpot_ms']:.1f}x"
                   if base and base["tpot_ms"] and r["tpot_ms"] else "n/a")
        up = (f"{base['ttft_ms'] / r['ttft_ms']:.1f}x", tpot_up) if base else ("-", "-")
        tpot = "n/a" if r["tpot_ms"] is None else f"{r['tpot_ms']:.2f}"
        table.add_row(name, r["weight_dtype"], r["kv_dtype"], f"{r['ttft_ms']:.1f}", tpot, *up)
    console.print(table)
    if base and base["tokens"] != results["sandwich"]["tokens"]:
        console.print("[yellow]warning:[/] the stock build generated different tokens")
    out = args.out / "chain.json"
    save_atomic(out, json.dumps({"model": cfg.name, "plan": plan.describe(), "results": results}, indent=1,
                               allow_nan=False))
    console.print(f"wrote {out}")
    return 0
