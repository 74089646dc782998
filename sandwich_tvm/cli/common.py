"""Options and printing shared by the CLIs that plan on a machine."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..model.config import DEFAULT_MODEL, LlamaConfig, ModelConfigError, load_config
from ..topology import load_tree
from ..topology.hwobj import TopologyError
from ..topology.microbench import measure_profile
from ..topology.profile import MachineProfile, ProfileError, load_profile, match_profile
from ..topology.search import MAX_TREES, SearchResult, SearchStats, search_plans
from ..topology.simulator import Trace
from ..topology.sysfs import parse_cpulist
from ..topology.trace import parse_lengths, sample_sharegpt
from ..topology.tree import TopoTree, format_cpus
from .args import non_negative_int, positive_int

# What planning on a machine raises for bad input; each message says what to do.
PLAN_ERRORS = (TopologyError, ModelConfigError, ProfileError, ValueError)


def print_error(console: Console, exc: BaseException | str) -> None:
    """One red line, the message printed literally: no rich markup or emoji codes, since paths,
    shapes and topology strings hold '[...]' and ':package:'."""
    console.print(Text.assemble(("error: ", "red"), str(exc)), soft_wrap=True)


def cpu_list(text: str) -> tuple[int, ...]:
    """argparse type of --cpus: '0-11,16' -> those OS CPU ids."""
    try:
        cpus = parse_cpulist(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not cpus:
        raise argparse.ArgumentTypeError(f"{text!r} lists no CPUs; write e.g. 0-11,16")
    return cpus


def add_machine_args(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--synthetic", metavar="STR",
                     help="an hwloc synthetic topology, e.g. 'package:2 [numa] l3:4 core:8 pu:1'")
    src.add_argument("--xml", metavar="FILE", help="an hwloc XML topology (lstopo --of xml)")
    parser.add_argument("--cpus", metavar="LIST", type=cpu_list,
                        help="restrict the machine to these OS CPU ids, e.g. 0-11,16 (hybrid CPUs)")
    parser.add_argument("--machine-profile", metavar="NAME|FILE",
                        help="roofs for the simulator: a shipped profile name or a JSON file "
                             "(default: microbenchmark this machine, or match a shipped one)")
    parser.add_argument("--refresh-profile", action="store_true",
                        help="re-run the microbenchmarks instead of using the cached profile")
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="MODEL",
                        help=f"a packaged model (default {DEFAULT_MODEL}), a preset of random weights, an HF "
                             "model directory or a .gguf file")
    parser.add_argument("--lengths", metavar="P:O,...",
                        help="request lengths PROMPT:OUTPUT tokens (default: ShareGPT sample)")
    parser.add_argument("--requests", type=positive_int, default=64,
                        help="ShareGPT requests to sample (default 64)")
    parser.add_argument("--top-k", type=positive_int, default=10, help="plans to keep (default 10)")
    parser.add_argument("--patience", type=positive_int, default=32,
                        help="early-stopping patience per process group (default 32)")
    parser.add_argument("--max-group-levels", type=non_negative_int, default=2,
                        help="latent levels group() may insert (default 2)")
    parser.add_argument("--max-tp", type=positive_int, default=None, metavar="N",
                        help="plans of at most N processes (tensor-parallel ranks or pipeline stages); "
                             "default: any the model's heads divide or its layers split into")
    parser.add_argument("--max-trees", type=positive_int, default=MAX_TREES,
                        help=f"bound on the TopoTrees the search generates (default {MAX_TREES}); "
                             "a bounded search says so and ranks the plans it found")


def resolve_machine(args: argparse.Namespace,
                    log: Callable[[str], None]) -> tuple[TopoTree, str, MachineProfile]:
    """The fundamental tree, where it came from, and the profile its predictions use."""
    cpus = set(args.cpus) if args.cpus is not None else None
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
        try:
            return model, parse_lengths(args.lengths)
        except ValueError as err:
            raise ValueError(f"--lengths: {err}") from None
    return model, sample_sharegpt(args.requests, max_context=model.max_position_embeddings)


def run_search(args: argparse.Namespace, tree: TopoTree, model: LlamaConfig, profile: MachineProfile,
               trace: Trace, progress: Callable[[str, int, int], None] | None = None,
               weight_bytes: float = 4, kv_bytes: float = 4, head_bytes: float | None = None,
               decode_kernels: dict | None = None) -> SearchResult:
    """`search_plans` with the options of add_machine_args, for weights and a KV cache of
    ``weight_bytes`` / ``kv_bytes`` per element (the run spec's dtypes; the lm_head's
    ``head_bytes``)."""
    return search_plans(tree, model, profile, trace, top_k=args.top_k, patience=args.patience,
                        max_group_levels=args.max_group_levels, max_trees=args.max_trees,
                        progress=progress, max_tp=getattr(args, "max_tp", None), weight_bytes=weight_bytes,
                        kv_bytes=kv_bytes, head_bytes=head_bytes, decode_kernels=decode_kernels)


def bound_note(stats: SearchStats) -> str | None:
    """What to tell the user when --max-trees cut the search short."""
    if not stats.bounded:
        return None
    return (f"search bounded: stopped at {stats.max_trees} generated TopoTrees (--max-trees); the "
            "ranked plans are the best found so far. Raise --max-trees to search further.")


def plans_table(result: SearchResult, title: str) -> Table:
    table = Table(title=Text(title, style="table.title"))
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
    note = bound_note(s)
    if note:
        console.print(Text(note, style="yellow"), soft_wrap=True)
