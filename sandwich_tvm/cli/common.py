"""Options and printing shared by the CLIs that plan on a machine."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from ..model.config import DEFAULT_PRESET, LlamaConfig, load_config
from ..topology import load_tree
from ..topology.microbench import measure_profile
from ..topology.profile import MachineProfile, load_profile, match_profile
from ..topology.search import SearchResult
from ..topology.simulator import Trace
from ..topology.sysfs import parse_cpulist
from ..topology.trace import parse_lengths, sample_sharegpt
from ..topology.tree import TopoTree, format_cpus


def add_machine_args(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--synthetic", metavar="STR",
                     help="an hwloc synthetic topology, e.g. 'package:2 [numa] l3:4 core:8 pu:1'")
    src.add_argument("--xml", metavar="FILE", help="an hwloc XML topology (lstopo --of xml)")
    parser.add_argument("--cpus", metavar="LIST",
                        help="restrict the machine to these OS CPU ids, e.g. 0-11 (hybrid CPUs)")
    parser.add_argument("--machine-profile", metavar="NAME|FILE",
                        help="roofs for the simulator: a shipped profile name or a JSON file "
                             "(default: microbenchmark this machine, or match a shipped one)")
    parser.add_argument("--refresh-profile", action="store_true",
                        help="re-run the microbenchmarks instead of using the cached profile")
    parser.add_argument("--model", default=DEFAULT_PRESET, metavar="PRESET|DIR",
                        help=f"model preset or HF model directory (default {DEFAULT_PRESET})")
    parser.add_argument("--lengths", metavar="P:O,...",
                        help="request lengths PROMPT:OUTPUT tokens (default: ShareGPT sample)")
    parser.add_argument("--requests", type=int, default=64,
                        help="ShareGPT requests to sample (default 64)")
    parser.add_argument("--top-k", type=int, default=10, help="plans to keep (default 10)")
    parser.add_argument("--patience", type=int, default=32,
                        help="early-stopping patience per process group (default 32)")
    parser.add_argument("--max-group-levels", type=int, default=2,
                        help="latent levels group() may insert (default 2)")


def resolve_machine(args: argparse.Namespace,
                    log: Callable[[str], None]) -> tuple[TopoTree, str, MachineProfile]:
    """The fundamental tree, where it came from, and the profile its predictions use."""
    cpus = set(parse_cpulist(args.cpus)) if args.cpus else None
    tree, found = load_tree(synthetic=args.synthetic, xml=args.xml, cpus=cpus)
    if args.machine_profile:
        profile = load_profile(args.machine_profile)
    elif args.synthetic is None and args.xml is None:
        profile = measure_profile(tree, found.cpu_model, refresh=args.refresh_profile, log=log)
    else:
        profile = match_profile(found.cpu_model, len(tree.pus))
        if profile is None:
            profile = load_profile("generic")
            log("warning: no shipped profile matches this modelled machine; using the generic "
                "one (pass --machine-profile for meaningful predictions)")
    return tree, found.source, profile


def resolve_model_and_trace(args: argparse.Namespace) -> tuple[LlamaConfig, Trace]:
    model = load_config(args.model)
    if args.lengths:
        return model, parse_lengths(args.lengths)
    return model, sample_sharegpt(args.requests, max_context=model.max_position_embeddings)


def plans_table(result: SearchResult, title: str) -> Table:
    table = Table(title=title)
    for col in ("#", "TP", "prefill", "decode", "decode CPUs (process 0)", "TTFT ms", "TPOT ms",
                "request ms", "transforms"):
        table.add_column(col, justify="right" if col.endswith(" ms") else "left",
                         overflow="ellipsis", no_wrap=True, max_width=28)
    for i, ranked in enumerate(result.plans, 1):
        plan, pred = ranked.plan, ranked.prediction
        table.add_row(str(i), str(plan.tp), plan.prefill.describe(), plan.decode.describe(),
                      format_cpus(plan.decode.processes[0]), f"{pred.ttft_ms:.1f}",
                      f"{pred.tpot_ms:.2f}", f"{pred.latency_ms:.0f}",
                      " ".join(plan.transforms) or "-")
    return table


def print_search(console: Console, result: SearchResult) -> None:
    s = result.stats
    console.print(f"group(): {s.group_trees_generated} trees generated, "
                  f"{s.group_trees_unique} unique after Merkle de-duplication")
    console.print(f"remove(): {s.remove_trees_generated} trees generated, "
                  f"{s.remove_trees_unique} explored, {s.remove_trees_pruned} pruned (no gain)")
    console.print(f"configurations: {s.configs_evaluated} simulated, "
                  f"{s.configs_skipped_early_stop} skipped by early stopping "
                  f"({s.groups_early_stopped} process groups stopped), "
                  f"{s.cuts_rejected_tp} cuts rejected by TP limits; {s.seconds:.2f} s")
