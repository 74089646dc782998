"""`python -m sandwich_tvm.tune costmodel`: retrain the kernel cost model and save it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Console

from ..kernels.costmodel import CostModel, grouped_check, model_path, training_samples


def train_cost_model(root: Path | None, console: Console, shipped: bool = True) -> int:
    """Train on every record and measurement in the records directory (``root``, else the user's)
    and, with ``shipped``, the package's; report a check on shapes left out in turn; save to
    ``<records>/costmodel.json``."""
    samples = training_samples(root, shipped=shipped)
    try:
        model = CostModel.train(samples)
    except ValueError as err:
        console.print(f"[red]error:[/red] {err}")
        return 2
    shapes = {(s.cpu.slug, s.shape) for s in samples}
    console.print(f"trained on {len(samples)} schedules of {len(shapes)} (CPU, GEMM) pairs")
    rhos = grouped_check(samples)
    if rhos:
        console.print(f"left-out-shape check: median Spearman {np.median(rhos):.2f} over {len(rhos)} "
                      "(GEMM, m) tasks of measured candidates")
    path = model.save(model_path(root))
    console.print(f"saved {path}; load it with sandwich_tvm.kernels.costmodel.CostModel.load")
    return 0
