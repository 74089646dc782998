"""`python -m sandwich_tvm.tune kernels`: tune every Linear GEMM of a model for every m."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..kernels.database import RECORDS_ENV, record_path
from ..kernels.search import SequenceTuner
from ..kernels.tuner import tune_gemm
from ..model.parallel import check_tp
from ..model.shapes import linear_shapes
from ..spec import RunSpec
from .args import positive_int
from .options import add_dtype_arg


def add_kernel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="kernel threads (default: all CPUs this process may use)")
    parser.add_argument("--max-m", type=positive_int, default=None,
                        help="largest sequence length (default 2048; 4 in the 'all' chain)")
    parser.add_argument("--decode-max-m", type=positive_int, default=1,
                        help="chain: largest m tuned for the decode thread count (default 1, batch 1)")
    parser.add_argument("--window", type=positive_int, default=16,
                        help="micro-kernel sliding window σ (default 16)")
    parser.add_argument("--records", "--schedules", dest="records", type=Path, default=None, metavar="DIR",
                        help=f"where records are written and read (default: ${RECORDS_ENV} or the user's "
                             "cache; the package's shipped records are read after it)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="P",
                        help="tune one rank's shard shapes of a model split over P processes (default 1)")
    add_dtype_arg(parser)


def tune_model_kernels(args: argparse.Namespace, spec: RunSpec, console: Console, threads: int, max_m: int,
                       tp: int | None = None) -> int:
    """Tune the GEMMs of ``spec``'s model and weight dtype for ``threads`` (one rank's shards when
    split over ``tp`` processes; default ``--tp``), writing to ``spec.records``."""
    cfg, dtype, root = spec.config, spec.weight_dtype, spec.records
    tp = getattr(args, "tp", 1) if tp is None else tp
    check_tp(cfg, tp)
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
                            root=root, dtype=shape.dtype, epilogue=shape.epilogue,
                            progress=lambda _t, task=task: bar.advance(task),
                            log=lambda msg: console.print(msg, markup=False, highlight=False))
            best = max((t.gflops for t in rec.tuned if t.searched), default=float("nan"))
            table.add_row(name, str(shape.n), str(shape.k), str(len(rec.tuned)),
                          str(sum(t.searched for t in rec.tuned)), f"{best:.1f}", f"{rec.seconds:.0f}",
                          str(record_path(shape, threads, root)))
    console.print(table)
    return 0
