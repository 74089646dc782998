"""Tuning in minutes, end to end: the guided search on a model whose shapes it never saw, against
the full search's records in one `bench gemm` run per GEMM.

1. A records directory (the "world") is built from the shipped records: ``--holdout heldout``
   drops every record of the held-out model's (n, k) shapes, of every CPU and dtype, and adds
   ``--extra DIR`` (e.g. measurements collected on other shapes); ``--holdout cpu`` drops every
   record and measurement this CPU would read instead (its own folder and any older folder whose
   partial signature agrees with it): a CPU signature with no records.
2. `bench costmodel` ranks random schedules of the held-out GEMMs (Spearman), trained on the
   world alone (heldout mode only).
3. `tune kernels --search model` tunes the model into the world (timed, the default budget).
4. `bench gemm --against <the shipped records, or --against DIR>` times the guided kernels against
   the full search's, the two taking turns, for every GEMM at m = 1..512 (the lm_head at m = 1).

The summary JSON (``--out``) holds every step's result, the wall time of the tuning and the
geomean of the paired GFLOPS ratios over every (GEMM, m). It is written after every step;
``--resume`` goes on from it (the world and its tuning kept, the GEMMs not yet timed).

    python scripts/tuning_in_minutes.py --model llama-3.2-1b --dtype bfloat16 \\
        --extra /tmp/collect --out docs/tuning/zen4/summary_bf16.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

M_LIST = "1,2,4,8,16,32,64,128,256,512"


def build_world(world: Path, model: str, mode: str, extra: Path | None) -> dict:
    from sandwich_tvm.host import CpuSignature, host_signature
    from sandwich_tvm.kernels.database import SHIPPED_DIR
    from sandwich_tvm.model.config import load_config
    from sandwich_tvm.model.shapes import linear_shapes

    here = host_signature()
    held = {(s.n, s.k) for dt in ("float32", "bfloat16", "float16", "q8_0", "q4_0")
            for s in linear_shapes(load_config(model), dt).values()}
    shutil.rmtree(world, ignore_errors=True)
    copied = 0
    for f in sorted(SHIPPED_DIR.glob("*/t*/**/linear_*.json*")):
        rel = f.relative_to(SHIPPED_DIR)
        with open(f) as fh:  # a record, or a measurement file's header line
            d = json.loads(fh.readline() if f.suffix == ".jsonl" else fh.read())
        if mode == "cpu" and not here.differences(CpuSignature.from_json(d["cpu"])):
            continue
        if mode == "heldout" and (d["n"], d["k"]) in held:
            continue
        dst = world / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dst)
        copied += 1
    if extra is not None and mode == "heldout":
        for f in sorted(Path(extra).rglob("linear_*.json*")):
            dst = world / f.relative_to(extra)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dst)
            copied += 1
    return {"mode": mode, "files": copied, "held_out_shapes": sorted(held) if mode == "heldout" else [],
            "without_cpu": here.slug if mode == "cpu" else None}


def run(cmd: list[str], log: Path) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    with open(log, "w") as err:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--holdout", choices=("heldout", "cpu"), default="heldout")
    p.add_argument("--extra", type=Path, default=None, help="records directory added to the world")
    p.add_argument("--world", type=Path, default=Path("out/tuning-world"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", type=Path, default=None,
                   help="the full search's records (default: the package's shipped records)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--resume", action="store_true", help="go on from --out's steps (same world)")
    args = p.parse_args()
    from sandwich_tvm.host import save_atomic
    from sandwich_tvm.kernels.database import SHIPPED_DIR
    from sandwich_tvm.model.config import load_config
    from sandwich_tvm.model.shapes import linear_shapes

    py, w, full = sys.executable, str(args.world), str(args.against or SHIPPED_DIR)
    logs = args.out.with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out: dict = json.loads(args.out.read_text()) if args.resume and args.out.is_file() else {}
    asked = {k: str(v) for k, v in vars(args).items() if k != "resume"}
    if args.resume and "tune_seconds" not in out:
        raise SystemExit(f"--resume: {args.out} holds no finished tuning; run without --resume")
    if args.resume and out.get("args") != asked:
        raise SystemExit(f"--resume: {args.out} was made with other options ({out.get('args')}); "
                         "run without --resume")
    if "tune_seconds" not in out:
        out = {"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": asked,
               "world": build_world(args.world, args.model, args.holdout, args.extra)}
        if args.holdout == "heldout":
            res = run([py, "-m", "sandwich_tvm.bench", "costmodel", "--records", w, "--costmodel-data",
                       "records", "--holdout", args.model, "--dtype", args.dtype, "--json"],
                      logs / "costmodel.err")
            out["costmodel"] = json.loads(res.stdout)
        t0 = time.perf_counter()
        res = run([py, "-m", "sandwich_tvm.tune", "kernels", "--model", args.model, "--dtype", args.dtype,
                   "--threads", str(args.threads), "--max-m", "512", "--records", w, "--costmodel-data",
                   "records"], logs / "tune.err")
        out["tune_seconds"] = round(time.perf_counter() - t0, 1)
        (logs / "tune.log").write_text(res.stdout)
        save_atomic(args.out, json.dumps(out, indent=1))
    out.setdefault("gemm", {})
    for name, shape in linear_shapes(load_config(args.model), args.dtype).items():
        if name in out["gemm"]:
            continue
        ms = "1" if name == "lm_head" else M_LIST
        res = run([py, "-m", "sandwich_tvm.bench", "gemm", "--n", str(shape.n), "--k", str(shape.k),
                   "--epilogue", shape.epilogue, "--dtype", shape.dtype, "--m", ms,
                   "--threads", str(args.threads), "--schedules", w, "--against", full,
                   "--rounds", str(args.rounds), "--json",
                   "--plot", str(logs / f"gemm_{name}.png")], logs / f"gemm_{name}.err")
        out["gemm"][name] = json.loads(res.stdout)
        save_atomic(args.out, json.dumps(out, indent=1))
        print(f"{name}: geomean {out['gemm'][name]['against']['geomean_ratio']:.3f}x the full search's",
              flush=True)
    ratios = [r["ratio_vs_against"] for g in out["gemm"].values() for r in g["rows"]]
    out["geomean_vs_full_search"] = round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
    out["min_vs_full_search"] = round(min(ratios), 3)
    save_atomic(args.out, json.dumps(out, indent=1))
    print(f"tuning {out['tune_seconds']:.0f} s; geomean {out['geomean_vs_full_search']}x the full search's "
          f"over {len(ratios)} (GEMM, m)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
