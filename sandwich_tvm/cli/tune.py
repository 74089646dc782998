"""`python -m sandwich_tvm.tune`: the main job.

Stage ``plan`` reads this machine's topology, microbenchmarks its roofs (cached per CPU),
explores TopoTrees and writes the ranked Sandwich plans to ``<out>/plans.json``. Stage
``kernels`` tunes every Linear GEMM of the model for every sequence length and writes the
dynamic-shape kernel databases under ``schedules/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from ..host import HostError, cache_dir, ensure_writable, save_atomic
from ..model.config import ModelConfigError
from ..topology.hwobj import TopologyError
from ..topology.profile import ProfileError
from .args import positive_int, threads_beyond_cpus
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
        description="Tune Sandwich for a model on this machine (default: the llama-160m preset). "
                    "Stage 'plan': topology -> ranked prefill/decode plans.")
    parser.add_argument("stage", nargs="?", default="all", choices=["all", "plan", "kernels"],
                        help="'all' (default): plan -> kernels -> compile -> a short generation "
                             "against TVM's stock build; or one stage")
    add_machine_args(parser)
    add_kernel_args(parser)
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="directory for plans.json (default ./out)")
    parser.add_argument("--prompt-len", type=positive_int, default=32,
                        help="chain: prompt tokens (default 32)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16,
                        help="chain: new tokens (default 16)")
    parser.add_argument("--no-stock", action="store_true", help="chain: skip TVM's stock build")
    parser.add_argument("--plan", type=Path, default=None, metavar="FILE",
                        help="'all': skip the plan stage and run the chain on this plans.json (e.g. a "
                             "tensor-parallel plan of your own)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(width=max(Console().width, 150))
    if args.threads is not None and (too_many := threads_beyond_cpus(args.threads)):
        print_error(console, too_many)
        return 2
    if args.stage == "kernels":
        from ..kernels.database import ScheduleDbError

        try:
            return tune_model_kernels(args, console, args.threads or len(os.sched_getaffinity(0)),
                                      2048 if args.max_m is None else args.max_m)
        except (ModelConfigError, ScheduleDbError, ValueError) as exc:
            print_error(console, exc)
            return 2
    if args.plan is not None and args.stage != "all":
        print_error(console, f"--plan is for the 'all' chain, not the {args.stage} stage")
        return 2
    code = 0 if args.plan is not None else plan_stage(args, console)
    if code or args.stage == "plan":
        return code
    return run_chain(args, console)


def plan_stage(args: argparse.Namespace, console: Console) -> int:
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
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task("exploring grouped TopoTrees", total=None)
            result = run_search(
                args, tree, model, profile, trace,
                progress=lambda _stage, done, total: bar.update(task, completed=done, total=total))
    except (TopologyError, ModelConfigError, ProfileError, HostError, ValueError) as exc:
        print_error(console, exc)
        return 2
    print_search(console, result)
    if note := bound_note(result.stats):
        console.print(Text(note, style="yellow"))
    console.print(plans_table(result, f"Sandwich plans for {model.name}"))
    out = args.out / "plans.json"
    save_atomic(out, json.dumps({
        "machine": source, "tree": tree.summary(), "profile": json.loads(profile.to_json()),
        "model": model.to_dict(), "plans": [p.to_dict() for p in result.plans]}, indent=2))
    best = result.plans[0] if result.plans else None
    if best:
        console.print(f"best plan: {best.exec_plan(str(out)).describe()}; "
                      f"predicted TTFT {best.prediction.ttft_ms:.1f} ms, "
                      f"TPOT {best.prediction.tpot_ms:.2f} ms")
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def run_chain(args: argparse.Namespace, console: Console) -> int:
    """kernels (prefill and decode thread counts) -> compile -> generation vs the stock build."""
    from ..kernels.database import ScheduleDbError
    from ..topology.plan import ExecPlan
    from .chain import compare_with_stock
    from .generate import LOAD_ERRORS

    try:
        plan = ExecPlan.from_file(args.plan or args.out / "plans.json")
        max_m = 4 if args.max_m is None else args.max_m
        console.rule(f"[bold]kernels stage: m <= {max_m}, {plan.describe()}")
        for threads in sorted({plan.prefill_threads, plan.decode_threads}, reverse=True):
            limit = max_m if threads == plan.prefill_threads else min(max_m, args.decode_max_m)
            tune_model_kernels(args, console, threads, limit, tp=plan.tp)
        console.rule("[bold]compile and generate")
        return compare_with_stock(args, plan, console)
    except (*LOAD_ERRORS, ScheduleDbError) as exc:
        print_error(console, exc)
        return 2
