"""``bench compile``: how long a model takes to compile in a new process, with the kernels an
earlier build parsed kept on disk (``tvm_compat.parse_tvmscript``) and without.

Each build is ``python -m sandwich_tvm.compile --force`` in a process of its own, as a user runs
it. "kept" builds share one cache directory whose ``kernels/`` a warm-up build filled; "parse
all" builds each get an empty one. Both read the same tuned records (the user's, named through
``SANDWICH_RECORDS_DIR``, then the shipped ones), so they compile the same kernels. The two take
turns, the order reversed every other round; medians over rounds, and the ratio is the median
of the rounds' paired ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from ..cli.args import positive_int
from ..cli.common import print_error
from ..host import host_signature, save_atomic
from ..model.config import DEFAULT_MODEL
from .rounds import round_order

SYSTEMS = ("parse all", "kept")


def add_compile_parser(sub) -> None:
    a = sub.add_parser("compile", help="a model's compile time in a new process, with and without the "
                                       "kernels an earlier build parsed kept on disk")
    a.add_argument("--model", default=DEFAULT_MODEL, help=f"the model to build (default {DEFAULT_MODEL})")
    a.add_argument("--dtype", default="auto", help="its Linear weights (compile --dtype; default auto)")
    a.add_argument("--rounds", type=positive_int, default=3,
                   help="rounds in which the two builds take turns (default 3)")
    a.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results here")


def build_once(model: str, dtype: str, cache: Path, out: Path, records: Path) -> dict:
    """One ``compile --force`` in a new process with ``SANDWICH_CACHE=cache``: its wall time and the
    seconds the build itself reports (``meta.json``: exporting, parsing, lowering, LLVM)."""
    env = {**os.environ, "SANDWICH_CACHE": str(cache), "SANDWICH_RECORDS_DIR": str(records)}
    cmd = [sys.executable, "-m", "sandwich_tvm.compile", "--model", model, "--dtype", dtype, "--force",
           "--out", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
                           f"{done.stdout.strip()[-2000:]}")
    meta = json.loads((out / "meta.json").read_text())
    return {"wall_s": wall, "build_s": float(meta["seconds"])}


def measure(model: str, dtype: str, rounds: int, log=lambda _m: None) -> dict:
    """The two kinds of build taking turns for ``rounds`` rounds, after one warm-up build that
    fills the kept kernels."""
    from ..kernels.database import user_records_dir

    records = user_records_dir()
    with tempfile.TemporaryDirectory(prefix="sandwich-bench-compile-") as tmp:
        root = Path(tmp)
        kept = root / "kept"
        log(f"warm-up: building {model} ({dtype}) once to keep its parsed kernels")
        build_once(model, dtype, kept, root / "out", records)
        kept_files = len(list((kept / "kernels").rglob("*.json.gz")))
        runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
        for r in range(rounds):
            for j in round_order(len(SYSTEMS), 0, r):
                system = SYSTEMS[j]
                cache = kept if system == "kept" else root / f"empty-{r}"
                row = build_once(model, dtype, cache, root / "out", records)
                runs[system].append(row)
                log(f"round {r + 1}/{rounds} {system}: {row['build_s']:.1f} s build, "
                    f"{row['wall_s']:.1f} s wall")
    out: dict = {"kept_kernel_files": kept_files, "systems": {}}
    for system, rows in runs.items():
        out["systems"][system] = {f"{k}_runs": [x[k] for x in rows] for k in ("wall_s", "build_s")} | {
            f"{k}_median": float(np.median([x[k] for x in rows])) for k in ("wall_s", "build_s")}
    for k in ("wall_s", "build_s"):
        pairs = zip(runs["kept"], runs["parse all"], strict=True)
        ratios = [a[k] / b[k] for a, b in pairs]
        out[f"{k.removesuffix('_s')}_ratio_kept_vs_parse_all"] = float(np.median(ratios))
    return out


def main_compile_time(args: argparse.Namespace, console: Console) -> int:
    try:
        result = measure(args.model, args.dtype, args.rounds, log=console.print)
    except RuntimeError as exc:
        print_error(console, exc)
        return 2
    cpu = host_signature()
    result = {"model": args.model, "dtype": args.dtype, "rounds": args.rounds,
              "cpu": f"{cpu.model_name} ({cpu.slug})", "command": "python -m sandwich_tvm.bench "
              + " ".join(args.argv)} | result
    for system, row in result["systems"].items():
        console.print(f"{system:>9}: build {row['build_s_median']:.1f} s, wall {row['wall_s_median']:.1f} s "
                      "(medians)")
    console.print(f"kept / parse all: build {result['build_ratio_kept_vs_parse_all']:.2f}x, wall "
                  f"{result['wall_ratio_kept_vs_parse_all']:.2f}x (median of paired rounds)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        save_atomic(args.json, json.dumps(result, indent=1))
    return 0
