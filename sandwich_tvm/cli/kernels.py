"""`python -m sandwich_tvm.tune kernels`: tune every Linear GEMM of a model for every m."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..kernels.database import record_path
from ..kernels.search import SequenceTuner
from ..kernels.tuner import tune_gemm
from ..model.config import load_config
from ..model.linear import DEFAULT_DTYPE, WEIGHT_DTYPES, resolve_dtype
from ..model.parallel import check_tp
from ..model.shapes import linear_shapes
from .args import positive_int


def add_kernel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="kernel threads (default: all CPUs this process may use)")
    parser.add_argument("--max-m", type=positive_int, default=None,
                        help="largest sequence length (default 2048; 4 in the 'all' chain)")
    parser.add_argument("--decode-max-m", type=positive_int, default=1,
                        help="chain: largest m tuned for the decode thread count (default 1, batch 1)")
    parser.add_argument("--window", type=positive_int, default=16,
                        help="micro-kernel sliding window σ (default 16)")
    parser.add_argument("--schedules", type=Path, default=None,
                        help="database root (default: the repository's schedules/)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="P",
                        help="tune one rank's shard shapes of a model split over P processes (default 1)")
    parser.add_argument("--dtype", choices=("auto", *WEIGHT_DTYPES), default=DEFAULT_DTYPE,
                        help=f"the weights' precision the kernels read (default {DEFAULT_DTYPE}; auto: "
                             "bfloat16); each dtype has its own records")


def tune_model_kernels(args: argparse.Namespace, console: Console, threads: int, max_m: int,
                       tp: int | None = None) -> int:
    """Tune the model's GEMMs for ``threads`` (one rank's shards when split over ``tp`` processes;
    default ``--tp``)."""
    cfg = load_config(args.model)
    tp = getattr(args, "tp", 1) if tp is None else tp
    check_tp(cfg, tp)
    dtype, why = resolve_dtype(args.dtype)
    if args.dtype == "auto":
        console.print(f"weights: {dtype} ({why})")
    shapes = linear_shapes(cfg, dtype, tp)
    shards = f", one of {tp} ranks' shards" if tp > 1 else ""
    table = Table(title=f"Sandwich kernels for {cfg.name}, {dtype} weights, {threads} threads{shards}")
    for col in ("gemm", "n", "k", "tuned m", "searched", "best GFLOPS", "seconds", "file"):
        table.add_column(col)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        for name, shape in shapes.items():
            top = min(max_m, args.decode_max_m) if name == "lm_head" else max_m  # decode-sized m only
            ladder = SequenceTuner(shape.n, shape.k, threads, (), max_m=top).ladder()
            task = bar.add_task(f"{name} n={shape.n} k={shape.k}", total=len(ladder))
            rec = tune_gemm(shape.n, shape.k, threads=threads, max_m=top, window=args.window,
                            root=args.schedules, dtype=dtype, epilogue=shape.epilogue,
                            progress=lambda _t, task=task: bar.advance(task),
                            log=lambda msg: console.print(msg, markup=False, highlight=False))
            best = max((t.gflops for t in rec.tuned if t.searched), default=float("nan"))
            table.add_row(name, str(shape.n), str(shape.k), str(len(rec.tuned)),
                          str(sum(t.searched for t in rec.tuned)), f"{best:.1f}", f"{rec.seconds:.0f}",
                          str(record_path(shape, threads, args.schedules)))
    console.print(table)
    return 0
