"""`python -m sandwich_tvm.tune`: the main job.

Stage ``plan`` reads this machine's topology, microbenchmarks its roofs (cached per CPU),
explores TopoTrees and writes the ranked Sandwich plans to ``<out>/plans.json``. Stage
``kernels`` tunes every Linear GEMM of the model for every sequence length and writes the
dynamic-shape kernel records to the user's records directory. ``all`` runs both and hands the
best plan on in-process to compile and a short generation.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from ..host import HostError, cache_dir, ensure_writable, require_own_cpu
from ..kernels.attention import DEFAULT_KV_DTYPE
from ..kernels.quant import head_dtype
from ..model.config import ModelConfigError
from ..spec import DTYPE_BYTES, RunSpec, SpecError, kv_value_bytes, layer_weight_bytes, resolve_run_spec
from ..topology.hwobj import TopologyError
from ..topology.plan import ExecPlan, PlanError, save_plans
from ..topology.profile import ProfileError
from ..topology.simulator import measured_decode_kernels
from .args import positive_int, threads_beyond_cpus
from .chain import DEFAULT_QUESTION
from .common import (
    add_machine_args,
    bound_note,
    plans_table,
    print_error,
    print_search,
    resolve_machine,
    resolve_model_and_trace,
    run_search,
)
from .kernels import add_kernel_args, tune_model_kernels
from .topo import profile_lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sandwich_tvm.tune",
        description="Tune Sandwich for a model on this machine (default: smollm2-135m, "
                    "SmolLM2-135M-Instruct). Stage 'plan': topology -> ranked prefill/decode plans.")
    parser.add_argument("stage", nargs="?", default="all", choices=["all", "plan", "kernels", "costmodel"],
                        help="'all' (default): plan -> kernels -> compile -> a short generation "
                             "against TVM's stock build; or one stage; 'costmodel' retrains the kernel "
                             "cost model on every record and measurement and saves it")
    add_machine_args(parser)
    add_kernel_args(parser)
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="directory for plans.json (default ./out)")
    parser.add_argument("--prompt", default=DEFAULT_QUESTION,
                        help=f"chain: the user message, for a model with a tokenizer (default "
                             f"{DEFAULT_QUESTION!r})")
    parser.add_argument("--prompt-len", type=positive_int, default=32,
                        help="chain: prompt tokens of a random-weight preset (default 32)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32,
                        help="chain: new tokens at most (default 32)")
    parser.add_argument("--no-stock", action="store_true", help="chain: skip TVM's stock build")
    parser.add_argument("--plan", type=Path, default=None, metavar="FILE",
                        help="'all': skip the plan stage and run the chain on this plans.json (e.g. a "
                             "tensor-parallel plan of your own)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_own_cpu("tune")  # it runs code here, not for the CPU SANDWICH_CPU describes
    console = Console(width=max(Console().width, 150))
    if args.threads is not None and (too_many := threads_beyond_cpus(args.threads)):
        print_error(console, too_many)
        return 2
    if args.stage == "costmodel":
        from .costmodel import train_cost_model

        return train_cost_model(args.records, console, shipped=args.costmodel_data == "all")
    try:  # the run spec, once: the plan stage ranks plans for the weights the kernels are tuned for
        spec = resolve_run_spec(args.model, dtype=args.dtype, kv_dtype=DEFAULT_KV_DTYPE, records=args.records,
                                plan=args.plan, log=console.print)
    except (ModelConfigError, SpecError, PlanError) as exc:
        print_error(console, exc)
        return 2
    if args.stage == "kernels":
        from ..kernels.database import ScheduleDbError, user_records_dir

        try:  # the records folder is written after every m: checked before the first
            ensure_writable(spec.records or user_records_dir(), "records directory")
            return tune_model_kernels(args, spec, console, args.threads or len(os.sched_getaffinity(0)),
                                      2048 if args.max_m is None else args.max_m)
        except (ModelConfigError, ScheduleDbError, ValueError, HostError) as exc:
            print_error(console, exc)
            return 2
    if args.plan is not None and args.stage != "all":
        print_error(console, f"--plan is for the 'all' chain, not the {args.stage} stage")
        return 2
    if args.plan is None:
        best = plan_stage(args, spec, console)
        if best is None or args.stage == "plan":
            return 0 if best is not None else 2
        spec = spec.with_plan(best)
    return run_chain(args, spec, console)


def plan_stage(args: argparse.Namespace, spec: RunSpec, console: Console) -> ExecPlan | None:
    """Search this machine's plans for ``spec``'s model and dtypes, write them to
    ``<out>/plans.json`` and return the best (None after an error, which is printed)."""
    try:
        ensure_writable(args.out, "--out directory")  # before minutes of work, not after
        ensure_writable(cache_dir(), "cache directory")
        console.rule("[bold]sandwich-tvm tune: plan stage")
        tree, source, profile = resolve_machine(args, log=lambda msg: console.print(Text(msg)))
        console.print(Text(f"machine: {source}, {tree.summary()}"))
        console.print(Text("\n".join(profile_lines(profile))))
        model, trace = resolve_model_and_trace(args)
        console.print(f"model: {model.name} ({model.num_params() / 1e6:.0f}M parameters), "
                      f"{len(trace.prompt)} requests")
        kernels = None
        if args.synthetic is None and args.xml is None:  # this host: its records' decode times
            kernels = measured_decode_kernels(spec.config, spec.weight_dtype,
                                              set(range(1, len(tree.pus) + 1)), spec.records)
            if kernels:
                console.print(f"decode kernels: this host's m = 1 records for {sorted(kernels)} threads "
                              "(a floor under the roofline)")
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task("exploring grouped TopoTrees", total=None)
            result = run_search(
                args, tree, model, profile, trace,
                progress=lambda _stage, done, total: bar.update(task, completed=done, total=total),
                weight_bytes=layer_weight_bytes(spec.config, spec.weight_dtype, spec.wider_linears),
                head_bytes=DTYPE_BYTES[head_dtype(spec.weight_dtype)], decode_kernels=kernels,
                kv_bytes=kv_value_bytes(spec.kv_dtype, spec.config.head_dim))
    except (TopologyError, ModelConfigError, ProfileError, HostError, ValueError) as exc:
        print_error(console, exc)
        return None
    print_search(console, result)
    if note := bound_note(result.stats):
        console.print(Text(note, style="yellow"))
    console.print(plans_table(result, f"Sandwich plans for {model.name}"))
    out = args.out / "plans.json"
    if not result.plans:
        print_error(console, "the search found no plan for this model on this machine")
        return None
    ranked = [p.exec_plan(str(out)) for p in result.plans]
    save_plans(out, ranked, details=[p.to_dict() for p in result.plans], machine=source, tree=tree.summary(),
               profile=json.loads(profile.to_json()), model=model.to_dict(), weight_dtype=spec.weight_dtype,
               kv_dtype=spec.kv_dtype)
    best = result.plans[0]
    console.print(f"best plan: {ranked[0].describe()}; predicted TTFT {best.prediction.ttft_ms:.1f} ms, "
                  f"TPOT {best.prediction.tpot_ms:.2f} ms ({spec.weight_dtype} weights)")
    console.print(f"wrote {out} (run it with --plan {out})")
    return ranked[0]


def run_chain(args: argparse.Namespace, spec: RunSpec, console: Console) -> int:
    """kernels (prefill and decode thread counts) -> compile -> generation vs the stock build."""
    from ..kernels.database import ScheduleDbError
    from .chain import chain_prompt, compare_with_stock
    from .options import LOAD_ERRORS

    try:
        plan = spec.plan
        max_m = 4 if args.max_m is None else args.max_m
        console.rule(f"[bold]kernels stage: m <= {max_m}, {plan.describe()}")
        for threads in sorted({plan.prefill_threads, plan.decode_threads}, reverse=True):
            limit = max_m if threads == plan.prefill_threads else min(max_m, args.decode_max_m)
            tune_model_kernels(args, spec, console, threads, limit, tp=plan.tp)
        console.rule("[bold]compile and generate")
        prompt, tok = chain_prompt(args, spec)
        ctx = len(prompt) + args.max_new_tokens + 8
        return compare_with_stock(args, replace(spec, context=ctx, kv_tokens=ctx, prefill_chunk=ctx), console,
                                  prompt, tok)
    except (*LOAD_ERRORS, ScheduleDbError) as exc:
        print_error(console, exc)
        return 2
