"""`python -m sandwich_tvm.topo`: the TopoTree of a machine and its ranked Sandwich plans."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.text import Text

from ..topology.hwobj import TopologyError
from ..topology.profile import MachineProfile
from ..topology.search import parse_config
from .common import (
    PLAN_ERRORS,
    add_machine_args,
    bound_note,
    plans_table,
    print_error,
    print_search,
    resolve_machine,
    resolve_model_and_trace,
    run_search,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sandwich_tvm.topo",
        description="Read a CPU topology (this machine, --synthetic or --xml), explore it "
                    "with group/remove, and rank Sandwich plans with the latency simulator.")
    add_machine_args(parser)
    parser.add_argument("--evaluate", metavar="CONFIG",
                        help="predict one configuration: PxC (P processes of C cores) or CPU "
                             "lists '0-15;16-31'; 'PREFILL/DECODE' for a pair, e.g. 8x16/8x12")
    parser.add_argument("--profile", action="store_true",
                        help="print the machine's roofs (GFLOPS per core, GB/s with 1..n cores)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return parser


def profile_lines(profile: MachineProfile) -> list[str]:
    lines = [f"profile {profile.name} ({profile.source}) {profile.cpu_model}".rstrip(),
             f"  compute: {profile.gflops_per_core:.1f} GFLOPS/core (fp32)"]
    for r in profile.resources:
        curve = ", ".join(f"{k}:{bw:.1f}" for k, bw in enumerate(r.bw_gbs, 1))
        lines.append(f"  {r.name} ({r.scope}) GB/s by active cores: {curve}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    out = Console(width=max(Console().width, 150))

    def log(message: str) -> None:
        err.print(Text(message, style="dim"), soft_wrap=True)

    try:
        tree, source, profile = resolve_machine(args, log=log)
        if args.profile:
            if args.json:
                print(profile.to_json())
            else:
                out.print("\n".join(profile_lines(profile)), markup=False, emoji=False)
            return 0
        model, trace = resolve_model_and_trace(args)
        with err.status(f"exploring TopoTrees (at most {args.max_trees}) ..."):
            result = run_search(args, tree, model, profile, trace)
        evaluated = None
        if args.evaluate:
            pre, _, dec = args.evaluate.partition("/")
            prefill, decode = parse_config(tree, pre), parse_config(tree, dec or pre)
            if prefill.tp != decode.tp:
                raise TopologyError("--evaluate: prefill and decode need the same process count")
            pred = result.simulator.predict(prefill, decode)
            evaluated = {"prefill": prefill.to_dict(), "decode": decode.to_dict(),
                         "tp_allowed": model.tp_degrees_ok(prefill.tp),
                         "predicted_ttft_ms": round(pred.ttft_ms, 3),
                         "predicted_tpot_ms": round(pred.tpot_ms, 3),
                         "predicted_latency_ms": round(pred.latency_ms, 3)}
    except PLAN_ERRORS as exc:
        print_error(err, exc)
        return 2
    if args.json:
        note = bound_note(result.stats)
        if note:
            err.print(Text(note, style="yellow"), soft_wrap=True)
        print(json.dumps({
            "machine": source, "tree": tree.summary(), "profile": profile.name,
            "model": model.name, "requests": len(trace.prompt),
            "stats": vars(result.stats), "plans": [p.to_dict() for p in result.plans],
            "evaluated": evaluated}, indent=2))
        return 0
    out.print(Text.assemble((source, "bold"), f": {len(tree.pus)} PUs, "
                                              f"{tree.count_kind('NUMANode')} NUMA nodes"))
    out.print(tree.render(), markup=False, emoji=False)
    print_search(out, result)
    out.print(plans_table(result, f"Sandwich plans for {model.name} on {profile.name} "
                                  f"({len(trace.prompt)} requests)"))
    if evaluated:
        out.print(Text(f"evaluated {args.evaluate}: TTFT {evaluated['predicted_ttft_ms']:.1f} ms, "
                       f"TPOT {evaluated['predicted_tpot_ms']:.2f} ms"
                       + ("" if evaluated["tp_allowed"] else " (TP degree not allowed by the model)")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
