"""A learned cost model for GEMM schedules: XGBoost over schedule features (TVM's XGBModel idea,
over our schedule value instead of loop features).

``features`` turns (CPU, threads, shape, m, schedule) into one row of ``FEATURES``: the shape
(log m, n, k, the weight's bytes per element, the epilogue), the micro-kernel (rows, vectors,
k-partials, register share, tile or int8-dot ISA), the slice and polymerization, what one thread
gets (rows, columns, reduction, blocks of each), how full the edge blocks are, the blocks'
footprints against the CPU's L1d / L2 / L3 and the analytic prior (``search.model_score``).
The target is log2 GFLOPS; only the order of candidates of one (shape, m) is used.

It is trained on every measured candidate kept beside the records (``measurements``) and every
tuned m of every record (the winners), from the user's records directory and the shipped one:
``python -m sandwich_tvm.tune costmodel`` retrains and saves it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ..host import CpuSignature, save_atomic
from .database import FORMAT, SET_ASIDE, SHIPPED_DIR, KernelRecord, user_records_dir
from .measurements import Measurement, all_measurements
from .microkernel import ISAS
from .quant import BLOCK, QTYPES
from .schedule import EPILOGUES, GemmSchedule, GemmShape, cdiv
from .search import model_score

FEATURES = (
    "log_m", "log_n", "log_k", "weight_bytes", *(f"epi_{e}" for e in EPILOGUES[1:]),
    "tile_isa", "int8_dot", "k_pack", "lanes", "mr", "vectors", "k_partials", "register_share",
    "log_mc", "log_nc", "log_kc", "pm", "pn", "pk", "threads",
    "log_m_thread", "log_n_thread", "log_k_thread", "m_blocks", "n_blocks", "k_blocks",
    "row_use", "m_fill", "n_fill", "k_fill", "balance",
    "a_block_l1", "a_block_l2", "b_block_l1", "b_block_l2", "b_panel_l1", "c_block_l2",
    "weight_l3", "log_l1", "log_l2", "log_l3", "prior",
)
PARAMS = {"n_estimators": 400, "max_depth": 7, "learning_rate": 0.08, "subsample": 0.9,
          "colsample_bytree": 0.9, "min_child_weight": 2.0}
MODEL_FILE = "costmodel.json"


def weight_bytes(dtype: str) -> float:
    """Bytes per weight element as stored (a quantized block's scale included)."""
    if dtype in QTYPES:
        return QTYPES[dtype].block_bytes / BLOCK
    return {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}.get(dtype, 4.0)


def _lg(x: float) -> float:
    return math.log2(max(x, 1e-9))


def features(cpu: CpuSignature, threads: int, shape: GemmShape, m: int, s: GemmSchedule) -> list[float]:
    """One row of ``FEATURES`` (see the module docstring)."""
    mk, sl, p = s.mk, s.slice, s.poly
    spec = ISAS[mk.isa]
    wb = weight_bytes(shape.dtype)
    l1 = (cpu.l1d_kib or 32) * 1024
    l2 = (cpu.l2_kib or 1024) * 1024
    l3 = (cpu.l3_kib or 32768) * 1024
    mt, nt, kt = cdiv(m, p.pm), cdiv(shape.n, p.pn), cdiv(shape.k, p.pk)
    mc, nc, kc = min(sl.mc, max(mt, mk.mr)), min(sl.nc, max(nt, mk.nr)), min(sl.kc, kt)
    mb, nb, kb = cdiv(mt, mc), cdiv(nt, nc), cdiv(kt, kc)
    rows = cdiv(mt, mk.mr) * mk.mr
    vectors = mk.nr // mk.lanes
    return [
        _lg(m), _lg(shape.n), _lg(shape.k), wb, *(float(shape.epilogue == e) for e in EPILOGUES[1:]),
        float(bool(spec.tile_rows)), float(spec.int8_dot), float(spec.k_pack), float(mk.lanes),
        float(mk.mr), float(vectors), float(mk.k_partials), mk.registers_used / spec.registers,
        _lg(sl.mc), _lg(sl.nc), _lg(sl.kc), float(p.pm), float(p.pn), float(p.pk), float(threads),
        _lg(mt), _lg(nt), _lg(kt), float(mb), float(nb), float(kb),
        mt / rows, mt / (mb * mc), nt / (nb * nc), kt / (kb * kc),
        shape.n / (p.pn * nb * nc) if p.pn > 1 else 1.0,
        mc * kc * 4 / l1, mc * kc * 4 / l2, nc * kc * wb / l1, nc * kc * wb / l2,
        mk.nr * kc * wb / l1, mc * nc * 4 / l2,
        shape.n * shape.k * wb / l3, _lg(l1), _lg(l2), _lg(l3), model_score(mk, mt),
    ]


Sample = Measurement  # one timed schedule: a measured candidate or a record's winner


def record_samples(roots: Sequence[Path]) -> list[Sample]:
    """The tuned (searched) m of every readable record under ``roots``: winners, with GFLOPS."""
    out = []
    for base in roots:
        for path in sorted(Path(base).glob("*/t*/linear_*.json")):
            if SET_ASIDE in path.name:
                continue
            try:
                d = json.loads(path.read_text())
                if d.get("format") != FORMAT:
                    continue
                rec = KernelRecord.from_json(d)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not a record
                continue
            out += [Sample(rec.cpu, rec.threads, rec.shape, t.m, t.schedule, t.gflops)
                    for t in rec.tuned if t.searched and t.gflops > 0 and not math.isnan(t.gflops)]
    return out


def training_roots(root: Path | None = None, shipped: bool = True) -> tuple[Path, ...]:
    """Where the model learns from: the records directory (``root``, else the user's) and, with
    ``shipped``, the records and measurements shipped in the package."""
    mine = user_records_dir() if root is None else Path(root)
    return (mine, SHIPPED_DIR) if shipped and mine.resolve() != SHIPPED_DIR.resolve() else (mine,)


def training_samples(root: Path | None = None, exclude: Iterable[tuple[int, int]] = (),
                     shipped: bool = True) -> list[Sample]:
    """Every measurement and every record winner under ``training_roots``, less the (n, k)
    shapes in ``exclude`` (a held-out family)."""
    skip = set(exclude)
    roots = training_roots(root, shipped)
    out = [x for base in roots for x in all_measurements(base)]
    out += record_samples(roots)
    return [s for s in out if (s.shape.n, s.shape.k) not in skip]


def matrix(samples: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([features(s.cpu, s.threads, s.shape, s.m, s.schedule) for s in samples], dtype=np.float32)
    y = np.array([_lg(max(s.gflops, 0.1)) for s in samples], dtype=np.float32)
    return x.reshape(len(samples), len(FEATURES)), y


class CostModel:
    """Predicted log2 GFLOPS of schedules (higher is better)."""

    def __init__(self, booster) -> None:
        self.booster = booster

    @classmethod
    def train(cls, samples: Sequence[Sample], seed: int = 0) -> CostModel:
        import xgboost as xgb

        if len(samples) < 16:
            raise ValueError(f"{len(samples)} samples are too few to train a cost model; tune a few "
                             "shapes with the full search first (`tune kernels --search full`)")
        x, y = matrix(samples)
        params = {k: v for k, v in PARAMS.items() if k not in ("n_estimators", "learning_rate")}
        params.update(eta=PARAMS["learning_rate"], seed=seed, nthread=1, objective="reg:squarederror")
        dtrain = xgb.DMatrix(x, label=y, feature_names=list(FEATURES))
        return cls(xgb.train(params, dtrain, num_boost_round=PARAMS["n_estimators"]))

    def predict(self, cpu: CpuSignature, threads: int, shape: GemmShape, m: int,
                schedules: Sequence[GemmSchedule]) -> np.ndarray:
        import xgboost as xgb

        if not schedules:
            return np.zeros(0)
        x = np.array([features(cpu, threads, shape, m, s) for s in schedules], dtype=np.float32)
        return self.booster.predict(xgb.DMatrix(x, feature_names=list(FEATURES)))

    def save(self, path: Path) -> Path:
        raw = self.booster.save_raw(raw_format="json")
        save_atomic(Path(path), bytes(raw))
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> CostModel:
        import xgboost as xgb

        booster = xgb.Booster()
        try:
            booster.load_model(str(path))
        except xgb.core.XGBoostError as err:
            raise ValueError(f"{path}: not a usable cost model ({err}); retrain it with "
                             "`python -m sandwich_tvm.tune costmodel`") from None
        return cls(booster)


def model_path(root: Path | None = None) -> Path:
    return (user_records_dir() if root is None else Path(root)) / MODEL_FILE


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties share their mean rank); NaN when one side is constant."""
    def ranks(x: np.ndarray) -> np.ndarray:
        r = np.empty(len(x))
        r[np.argsort(x, kind="stable")] = np.arange(len(x), dtype=float)
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r
    ra, rb = ranks(np.asarray(a, float)), ranks(np.asarray(b, float))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def grouped_check(samples: Sequence[Sample], folds: int = 4, min_task: int = 8) -> list[float]:
    """Leave shapes out in ``folds`` groups: train on the rest, and return the Spearman of predicted
    against measured GFLOPS for every (CPU, shape, m) task of at least ``min_task`` candidates."""
    keys = sorted({(s.shape.n, s.shape.k) for s in samples})
    if len(keys) < 2:
        return []
    out = []
    for f in range(min(folds, len(keys))):
        held = set(keys[f::folds])
        train = [s for s in samples if (s.shape.n, s.shape.k) not in held]
        tasks: dict[tuple, list[Sample]] = {}
        for s in samples:
            if (s.shape.n, s.shape.k) in held:
                tasks.setdefault((s.cpu.slug, s.threads, s.shape, s.m), []).append(s)
        if not train or not tasks:
            continue
        try:
            model = CostModel.train(train)
        except ValueError:  # too few samples left to learn from in this fold
            continue
        for (_, threads, shape, m), group in tasks.items():
            if len(group) >= min_task:
                pred = model.predict(group[0].cpu, threads, shape, m, [s.schedule for s in group])
                rho = spearman(pred, [s.gflops for s in group])
                if rho == rho:
                    out.append(rho)
    return out
