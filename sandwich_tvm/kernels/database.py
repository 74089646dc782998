"""Tuned dynamic-shape kernels on disk: ``schedules/<cpu>/t<threads>/linear_<n>_<k>_<dtype>.json``.

A file records the CPU model, ISA and thread count it was tuned for, every tuned m and the
buckets (``m <= m_max`` -> schedule) the runtime kernel dispatches on. Files are rewritten
atomically after every tuned m, so an interrupted tuning resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..topology.profile import save_atomic
from ..tvm_compat import cpu_flags, host_isa
from .codegen import Bucket
from .schedule import GemmSchedule, GemmShape
from .search import Tuned

SCHEDULES_DIR = Path(__file__).resolve().parents[2] / "schedules"
FORMAT = 1


class ScheduleDbError(ValueError):
    """A tuning database that does not belong to this machine or cannot be read."""


def host_cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


@dataclass
class KernelRecord:
    """The tuning of one (n, k, dtype, threads) GEMM on one CPU."""

    shape: GemmShape
    threads: int
    cpu: str
    isa: str
    tuned: list[Tuned] = field(default_factory=list)
    seconds: float = 0.0

    def buckets(self) -> list[Bucket]:
        """Consecutive tuned m with one schedule merged; each covers up to the next tuned m."""
        out: list[Bucket] = []
        ordered = sorted(self.tuned, key=lambda t: t.m)
        for i, t in enumerate(ordered):
            m_max = ordered[i + 1].m - 1 if i + 1 < len(ordered) else 1 << 62
            if out and out[-1].schedule == t.schedule:
                out[-1] = Bucket(m_max, t.schedule)
            else:
                out.append(Bucket(m_max, t.schedule))
        if out:
            out[-1] = Bucket(1 << 62, out[-1].schedule)
        return out

    def schedule_for(self, m: int) -> GemmSchedule:
        for b in self.buckets():
            if m <= b.m_max:
                return b.schedule
        raise ScheduleDbError("empty kernel record")

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "cpu": self.cpu,
            "isa": self.isa,
            "threads": self.threads,
            "n": self.shape.n,
            "k": self.shape.k,
            "dtype": self.shape.dtype,
            "seconds": round(self.seconds, 2),
            "tuned": [
                {"m": t.m, "schedule": t.schedule.to_json(), "searched": t.searched,
                 "gflops": None if math.isnan(t.gflops) else round(t.gflops, 2)}
                for t in self.tuned
            ],
            "buckets": [{"m_max": b.m_max, "schedule": b.schedule.to_json()} for b in self.buckets()],
        }

    @classmethod
    def from_json(cls, d: dict) -> KernelRecord:
        tuned = [
            Tuned(int(t["m"]), GemmSchedule.from_json(t["schedule"]),
                  float("nan") if t["gflops"] is None else float(t["gflops"]), bool(t["searched"]))
            for t in d["tuned"]
        ]
        shape = GemmShape(int(d["n"]), int(d["k"]), d.get("dtype", "float32"))
        return cls(shape, int(d["threads"]), d["cpu"], d["isa"], tuned, float(d.get("seconds", 0.0)))


def record_path(shape: GemmShape, threads: int, root: Path | None = None, cpu: str | None = None) -> Path:
    root = SCHEDULES_DIR if root is None else root
    return root / _slug(cpu or host_cpu_model()) / f"t{threads}" / f"linear_{shape.name}.json"


def save_record(rec: KernelRecord, root: Path | None = None) -> Path:
    path = record_path(rec.shape, rec.threads, root, rec.cpu)
    save_atomic(path, json.dumps(rec.to_json(), indent=1))
    return path


def load_record(path: Path, *, check_host: bool = True) -> KernelRecord:
    """Read a record; refuse one tuned on another CPU or ISA (its kernels would be wrong or slow)."""
    try:
        rec = KernelRecord.from_json(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise ScheduleDbError(
            f"{path}: no such tuning database; run `python -m sandwich_tvm.tune kernels`") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ScheduleDbError(
            f"{path}: not a Sandwich kernel database ({err}); delete it and re-tune") from err
    if check_host:
        here, isa = host_cpu_model(), host_isa()
        if rec.isa != isa or (rec.isa not in cpu_flags() and _slug(rec.cpu) != _slug(here)):
            raise ScheduleDbError(
                f"{path} was tuned on {rec.cpu!r} ({rec.isa}) but this machine is {here!r} ({isa}); "
                "its schedules do not apply here. Re-tune with `python -m sandwich_tvm.tune kernels`."
            )
    return rec


def find_record(shape: GemmShape, threads: int, root: Path | None = None) -> KernelRecord | None:
    path = record_path(shape, threads, root)
    return load_record(path) if path.exists() else None
