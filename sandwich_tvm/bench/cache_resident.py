"""`python -m sandwich_tvm.bench cache-resident`: the cache-resident mode on a modelled cluster.

The cache-resident paper's machines (``../shared/papers/cache-resident-inference.txt``:
dual-socket EPYC 9684X servers, 1,152 MB of 3D V-Cache L3 a socket, joined by InfiniBand) are
modelled, not measured: a topology with a package per socket (a hwloc synthetic string or XML)
and a machine profile whose values say they are modelled (``epyc-9684x-2s``). For each model,
the planner (``topology.stage_plans``) ranks pipelines of one-socket stages by predicted TPOT
at batch 1 and picks the best; the report gives, for each batch, its predicted TPOT against
the single-socket plan's (every layer on one socket, weights from DRAM: llama.cpp's plan on
such a machine) and whether each stage's weights fit its last-level cache.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.args import positive_int, positive_ints

# 8 dual-socket servers modelled as one tree, a package (and a NUMA node) per socket: 12 CCDs
# of 8 cores a socket, 96 MB of L3 each (1,152 MB a socket)
CLUSTER = ("package:16 [numa] l3:12(size=96MiB) l2:8(size=1MiB) l1d:1(size=32KiB) "
           "l1i:1(size=32KiB) core:1 pu:1")
PROFILE = "epyc-9684x-2s"
BYTES = {"q8_0": 34 / 32, "q4_0": 18 / 32}  # int8 weight types: the profile's compute is int8 VNNI's


def add_cache_resident_parser(sub) -> None:
    p = sub.add_parser("cache-resident",
                       help="modelled: pipelines of cache-resident sockets against one socket, per batch")
    p.add_argument("--models", default="llama-3.2-3b,llama-2-7b", help="comma-separated presets or models")
    p.add_argument("--dtype", choices=sorted(BYTES), default="q8_0",
                   help="weights (default q8_0: int8 blocks, the paper's int8; its KV cache is int8 too)")
    p.add_argument("--synthetic", default=CLUSTER, help="hwloc synthetic topology, a package per socket "
                                                        "(default: 8 dual-socket EPYC 9684X servers)")
    p.add_argument("--xml", default=None, help="hwloc XML instead of --synthetic")
    p.add_argument("--profile", default=PROFILE, help=f"machine profile (default {PROFILE}, modelled)")
    p.add_argument("--context", type=positive_int, default=1024, help="tokens in each sequence's cache")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="decode batch sizes (default 1,2,4,8,16,32)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


def evaluate(model_spec: str, tree, profile, dtype: str, context: int, batches: list[int]) -> dict:
    """The planner's choice for one model and its TPOT against one socket's, per batch."""
    from ..model.config import load_config
    from ..topology.simulator import LatencySimulator, Trace
    from ..topology.stage_plans import rank, socket_plans, tpot

    cfg = load_config(model_spec)
    kv = 1 + 4 / cfg.head_dim  # an int8 KV cache: rows with their fp32 scale
    head = BYTES["q8_0"] if dtype == "q4_0" else BYTES[dtype]
    sim = LatencySimulator(tree, profile, cfg, Trace(np.array([float(context)]), np.array([1.0])),
                           weight_bytes=BYTES[dtype], kv_bytes=kv, head_bytes=head)
    plans = socket_plans(tree, sim)
    ranked = rank(plans, sim, context)
    best, single = ranked[0][0], next(p for p in plans if p.pp == 1)
    rows = []
    for b in batches:
        ours, one = tpot(best, sim, context, b), tpot(single, sim, context, b)
        rows.append({"batch": b, "tpot_ms": ours, "single_socket_tpot_ms": one, "speedup": one / ours})
    return {"model": cfg.name, "weights_gb": cfg.num_params() * BYTES[dtype] / 1e9,
            "chosen": best.describe(), "pp": best.pp, "cache_resident": best.resident,
            "stages_resident": best.stages_resident, "stage_weights_mb": [w / 1e6 for w in best.weights],
            "llc_mb_per_socket": best.llc_bytes / 1e6,
            "ranking_batch1": [{"pp": p.pp, "resident": p.resident, "tpot_ms": t} for p, t in ranked],
            "rows": rows}


def main_cache_resident(args: argparse.Namespace, console: Console) -> int:
    from ..cli.common import print_error
    from ..model.config import ModelConfigError
    from ..topology import load_tree
    from ..topology.hwobj import TopologyError
    from ..topology.profile import ProfileError, load_profile

    try:
        tree, _ = load_tree(xml=args.xml) if args.xml else load_tree(synthetic=args.synthetic)
        profile = load_profile(args.profile)
        batches = positive_ints(args.batches, "--batches")
        out = [evaluate(m, tree, profile, args.dtype, args.context, batches) for m in args.models.split(",")]
    except (TopologyError, ProfileError, ModelConfigError, ValueError) as exc:
        print_error(console, exc)
        return 2
    sockets = len(tree.nodes(tree.depth_of("Package") or 0))
    doc = {"modelled": True, "topology": args.xml or args.synthetic, "sockets": sockets,
           "profile": profile.name, "profile_notes": profile.notes, "dtype": args.dtype,
           "context": args.context, "models": out,
           "command": "python -m sandwich_tvm.bench " + " ".join(getattr(args, "argv", ["cache-resident"]))}
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    for r in out:
        title = (f"{r['model']} {args.dtype} ({r['weights_gb']:.2f} GB), modelled on {profile.name}: "
                 f"{r['chosen']}, {r['stages_resident']} of {r['pp']} stages in LLC")
        table = Table(title=title)
        for col in ("batch", "TPOT ms", "one socket TPOT ms", "speedup"):
            table.add_column(col)
        for row in r["rows"]:
            table.add_row(str(row["batch"]), f"{row['tpot_ms']:.2f}", f"{row['single_socket_tpot_ms']:.2f}",
                          f"{row['speedup']:.2f}x" if math.isfinite(row["speedup"]) else "-")
        console.print(table)
    return 0
