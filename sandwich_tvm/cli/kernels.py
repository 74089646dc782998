"""`python -m sandwich_tvm.tune kernels`: tune every Linear GEMM of a model for every m."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..kernels.costmodel import training_roots
from ..kernels.database import RECORDS_ENV, record_path
from ..kernels.guided import tune_gemm_guided
from ..kernels.search import SequenceTuner
from ..kernels.tuner import tune_gemm
from ..model.parallel import check_tp
from ..model.shapes import linear_shapes
from ..spec import RunSpec
from .args import positive_float, positive_int
from .options import add_dtype_arg

DEFAULT_BUDGET_MIN = 8.0
REFINE_MIN_S = 20.0  # budget left after the first pass below this is not worth a second


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
                        help=f"where records are written and read, alone (default: ${RECORDS_ENV} or the "
                             "user's cache, and the package's shipped records after it)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="P",
                        help="tune one rank's shard shapes of a model split over P processes (default 1)")
    parser.add_argument("--search", choices=("model", "full"), default="model",
                        help="model (default): the XGBoost cost model ranks each m's schedules and only "
                             "its top few are measured, starting from the nearest tuned shapes' records; "
                             "full: the paper's search, every step measured")
    parser.add_argument("--budget", type=positive_float, default=DEFAULT_BUDGET_MIN, metavar="MIN",
                        help="model search: minutes for the whole model, spread over its GEMMs and m "
                             f"best first (default {DEFAULT_BUDGET_MIN:g}); m left untuned reuse their "
                             "nearest tuned m, and a re-run resumes them")
    parser.add_argument("--costmodel-data", choices=("all", "records"), default="all",
                        help="what the cost model learns from: all (default): the records directory and "
                             "the records and measurements shipped in the package; records: the records "
                             "directory alone (e.g. to hold shapes or CPUs out)")
    add_dtype_arg(parser, activations=False)


def tune_model_kernels(args: argparse.Namespace, spec: RunSpec, console: Console, threads: int, max_m: int,
                       tp: int | None = None) -> int:
    """Tune the GEMMs of ``spec``'s model and weight dtype for ``threads`` (one rank's shards when
    split over ``tp`` processes; default ``--tp``), writing to ``spec.records``."""
    from ..kernels.database import ScheduleDbError
    from .args import threads_beyond_cpus

    if too_many := threads_beyond_cpus(threads, f"tuning for {threads} threads"):  # defaults and plans too
        raise ScheduleDbError(too_many)
    cfg, dtype, root = spec.config, spec.weight_dtype, spec.records
    tp = getattr(args, "tp", 1) if tp is None else tp
    check_tp(cfg, tp)
    shapes = linear_shapes(cfg, dtype, tp, wider=spec.wider_linears)
    shards = f", one of {tp} ranks' shards" if tp > 1 else ""
    table = Table(title=f"Sandwich kernels for {cfg.name}, {dtype} weights, {threads} threads{shards}")
    for col in ("gemm", "n", "k", "tuned m", "searched", "best GFLOPS", "seconds", "file"):
        table.add_column(col)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    tops = {name: min(max_m, args.decode_max_m) if name == "lm_head" else max_m  # decode-sized m only
            for name in shapes}
    ladders = {name: SequenceTuner(sh.n, sh.k, threads, (), max_m=tops[name]).ladder()
               for name, sh in shapes.items()}
    model = _cost_model(args, root, console)
    start, budget = time.monotonic(), 60.0 * getattr(args, "budget", DEFAULT_BUDGET_MIN)
    names = list(shapes)
    searched = 0  # m the first pass searched in this run (none: the records were complete)
    with Progress(*columns, console=console) as bar:
        for i, (name, shape) in enumerate(shapes.items()):
            ladder = ladders[name]
            before = record_of(shape, threads, root)
            task = bar.add_task(f"{name} n={shape.n} k={shape.k}", total=len(ladder))
            log = lambda msg: console.print(msg, markup=False, highlight=False)  # noqa: E731
            if model is not None:
                rec = tune_gemm_guided(shape.n, shape.k, threads=threads, model=model, max_m=tops[name],
                                       root=root, dtype=shape.dtype, epilogue=shape.epilogue,
                                       transfer_roots=training_roots(root, _shipped(args)),
                                       deadline=_deadline(start + budget, ladders, names, i),
                                       progress=lambda _t, task=task: bar.advance(task), log=log)
            else:
                rec = tune_gemm(shape.n, shape.k, threads=threads, max_m=tops[name], window=args.window,
                                root=root, dtype=shape.dtype, epilogue=shape.epilogue,
                                progress=lambda _t, task=task: bar.advance(task), log=log)
            searched += sum(t.searched and before.get(t.m) != t.schedule for t in rec.tuned)
            best = max((t.gflops for t in rec.tuned if t.searched), default=float("nan"))
            table.add_row(name, str(shape.n), str(shape.k), str(len(rec.tuned)),
                          str(sum(t.searched for t in rec.tuned)), f"{best:.1f}", f"{rec.seconds:.0f}",
                          str(record_path(shape, threads, root)))
    console.print(table)
    if model is not None:
        if searched:  # a re-run over complete records leaves them (and the builds keyed on them) be
            _refine(args, spec, shapes, ladders, tops, threads, model, start + budget, console)
        spent = time.monotonic() - start
        console.print(f"model-guided search: {spent:.0f} s of a {budget / 60:g} min budget")
    return 0


def _refine(args: argparse.Namespace, spec: RunSpec, shapes: dict, ladders: dict, tops: dict, threads: int,
            model, end: float, console: Console) -> None:
    """The budget the first pass left (``end``: when it runs out), spent searching every GEMM's
    tuned m again with the model's next candidates (``tune_gemm_guided(refine=True)``), each GEMM
    its share by ladder points."""
    if end - time.monotonic() < REFINE_MIN_S:
        return
    console.print(f"{end - time.monotonic():.0f} s of the budget left: searching the tuned m again")
    log = lambda msg: console.print(msg, markup=False, highlight=False)  # noqa: E731
    names = list(shapes)
    for i, name in enumerate(names):
        if end <= time.monotonic():
            break
        shape = shapes[name]
        before = record_of(shape, threads, spec.records)
        rec = tune_gemm_guided(shape.n, shape.k, threads=threads, model=model, max_m=tops[name],
                               root=spec.records, dtype=shape.dtype, epilogue=shape.epilogue,
                               transfer_roots=training_roots(spec.records, _shipped(args)),
                               deadline=_deadline(end, ladders, names, i), log=log, refine=True)
        changed = [t.m for t in rec.tuned if before.get(t.m) not in (None, t.schedule)]
        log(f"{name}: searched again; new schedules at m = {changed or 'none'}")


def _deadline(end: float, ladders: dict, names: list, i: int) -> float:
    """GEMM ``names[i]``'s deadline: its share, by ladder points, of the budget left until ``end``."""
    rest = sum(len(ladders[n]) for n in names[i:])
    return time.monotonic() + max(0.0, end - time.monotonic()) * len(ladders[names[i]]) / rest


def record_of(shape, threads: int, root) -> dict:
    """m -> schedule of ``shape``'s record under ``root`` ({} without one)."""
    from ..kernels.database import ScheduleDbError, load_record

    try:
        rec = load_record(record_path(shape, threads, root))
    except (OSError, ScheduleDbError):
        return {}
    return {t.m: t.schedule for t in rec.tuned}


def _shipped(args: argparse.Namespace) -> bool:
    """Whether the cost model and transfer read the shipped records besides the records directory."""
    return getattr(args, "costmodel_data", "all") == "all"


def _cost_model(args: argparse.Namespace, root: Path | None, console: Console):
    """The cost model for ``--search model``, trained on every record and measurement there is
    (seconds); None for ``--search full`` or when there is too little to learn from."""
    if getattr(args, "search", "model") != "model":
        return None
    from ..kernels.costmodel import CostModel, training_samples

    samples = training_samples(root, shipped=_shipped(args))
    try:
        model = CostModel.train(samples)
    except ValueError as err:
        console.print(f"{err}; using the full search", markup=False)
        return None
    console.print(f"cost model: XGBoost on {len(samples)} measured schedules (records and measurements)")
    return model
