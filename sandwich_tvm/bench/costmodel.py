"""`python -m sandwich_tvm.bench costmodel`: how well the cost model ranks schedules of shapes it
never saw.

The model is trained on every record and measurement under the records roots *less* the GEMM
shapes of the held-out model (``--holdout``, all its (n, k) in any dtype or epilogue). For each
held-out GEMM and each ``--m``, ``--candidates`` schedules drawn at random from the space the
guided search ranks (``search.space`` over the micro-kernels that fit m) are built and timed
here; the report gives, per (GEMM, m), the Spearman correlation of predicted against measured
GFLOPS and how the model's top pick does against the best of the sample. Nothing measured here
is written to the records (it would leak the held-out shapes into later training).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from ..cli.args import positive_int, positive_ints


def add_costmodel_parser(sub) -> None:
    p = sub.add_parser("costmodel", help="the cost model's ranking on held-out shapes (Spearman)")
    p.add_argument("--holdout", default="llama-3.2-1b",
                   help="model whose GEMM shapes are left out of training and ranked "
                        "(default llama-3.2-1b)")
    p.add_argument("--dtype", default="bfloat16",
                   help="weight dtype of the ranked schedules (default bfloat16)")
    p.add_argument("--m", default="1,4,16,64,256", help="sequence lengths (default 1,4,16,64,256)")
    p.add_argument("--candidates", type=positive_int, default=24,
                   help="random schedules timed per (GEMM, m) (default 24)")
    p.add_argument("--threads", type=positive_int, default=None, help="kernel threads (default: all CPUs)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--records", type=Path, default=None, metavar="DIR",
                   help="records directory to learn from (default: $SANDWICH_RECORDS_DIR or the user's)")
    p.add_argument("--costmodel-data", choices=("all", "records"), default="all",
                   help="all (default): that directory and the shipped records and measurements; "
                        "records: that directory alone")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")


def run_costmodel(args: argparse.Namespace, log) -> dict:
    import os

    from ..host import cpu_flags, host_signature
    from ..kernels.costmodel import CostModel, spearman, training_samples
    from ..kernels.guided import fitting
    from ..kernels.microkernel import kernel_isa, microkernels
    from ..kernels.search import Problem, space
    from ..kernels.tuner import MetaScheduleSearch
    from ..model.config import load_config
    from ..model.shapes import linear_shapes
    from ..tvm_compat import host_isa, host_target

    threads = args.threads or len(os.sched_getaffinity(0))
    ms_list = positive_ints(args.m, "--m")
    cfg = load_config(args.holdout)
    shapes = {k: v for k, v in linear_shapes(cfg, args.dtype).items() if k != "lm_head"}
    held = {(s.n, s.k) for s in linear_shapes(cfg, args.dtype).values()}
    t0 = time.perf_counter()
    samples = training_samples(args.records, exclude=held, shipped=args.costmodel_data == "all")
    model = CostModel.train(samples)
    log(f"cost model trained on {len(samples)} schedules (held out: {args.holdout}'s {len(held)} shapes) "
        f"in {time.perf_counter() - t0:.1f} s")
    isa = kernel_isa(host_isa(), args.dtype, cpu_flags())
    mks = microkernels(isa, args.dtype)
    here = host_signature()
    rng = random.Random(args.seed)
    rows = []
    for name, shape in shapes.items():
        search = MetaScheduleSearch(host_target(threads), isa, None, dtype=args.dtype,
                                    epilogue=shape.epilogue)
        for m in ms_list:
            p = Problem(m, shape.n, shape.k, threads)
            pool = space(p, fitting(mks, m))
            cands = rng.sample(pool, min(args.candidates, len(pool)))
            measured = np.array(search.measure(p, cands))
            pred = model.predict(here, threads, shape, m, cands)
            ok = measured > 0
            rho = spearman(pred[ok], measured[ok])
            pick = float(measured[int(np.argmax(np.where(ok, pred, -np.inf)))])
            rows.append({"gemm": name, "n": shape.n, "k": shape.k, "epilogue": shape.epilogue, "m": m,
                         "candidates": int(ok.sum()), "spearman": round(rho, 3),
                         "top_pick_gflops": round(pick, 1), "best_gflops": round(float(measured.max()), 1),
                         "top_pick_vs_best": round(pick / float(measured.max()), 3),
                         "samples": [{"schedule": c.to_json(), "gflops": round(float(g), 2),
                                      "predicted": round(float(q), 4)}
                                     for c, g, q in zip(cands, measured, pred, strict=True)]})
            log(f"  {name} m={m}: Spearman {rho:.2f}, top pick {pick:.0f} "
                f"of best {measured.max():.0f} GFLOPS")
    rhos = [r["spearman"] for r in rows if r["spearman"] == r["spearman"]]
    return {"cpu": here.describe(), "threads": threads, "holdout": args.holdout, "dtype": args.dtype,
            "training_samples": len(samples), "candidates": args.candidates, "seed": args.seed,
            "median_spearman": round(float(np.median(rhos)), 3) if rhos else None,
            "median_top_pick_vs_best": round(float(np.median([r["top_pick_vs_best"] for r in rows])), 3),
            "rows": rows, "command": "python -m sandwich_tvm.bench costmodel " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in (("holdout", args.holdout), ("dtype", args.dtype),
                                                           ("m", args.m), ("candidates", args.candidates),
                                                           ("records", args.records),
                                                           ("costmodel-data", args.costmodel_data))
                if v is not None),
            "when": time.strftime("%Y-%m-%dT%H:%M:%S")}


def main_costmodel(args: argparse.Namespace, console: Console) -> int:
    result = run_costmodel(args, (lambda _m: None) if args.json else console.print)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    table = Table(title=f"cost model on held-out {args.holdout} GEMMs ({args.dtype}, {result['cpu']})")
    for col in ("gemm", "m", "candidates", "Spearman", "top pick / best"):
        table.add_column(col)
    for r in result["rows"]:
        table.add_row(r["gemm"], str(r["m"]), str(r["candidates"]), f"{r['spearman']:.2f}",
                      f"{r['top_pick_vs_best']:.2f}")
    console.print(table)
    console.print(f"median Spearman {result['median_spearman']}, median top pick / best "
                  f"{result['median_top_pick_vs_best']}")
    return 0
