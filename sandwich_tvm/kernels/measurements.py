"""Every timed candidate, kept beside the records: what the cost model learns from.

``<records>/<cpu slug>/t<threads>/measured/linear_<shape>.jsonl``: a header line (the CPU
signature, the shape and the thread count), then one line per measured candidate: its m,
schedule and GFLOPS. Lines are appended (and flushed) as candidates are timed, so an
interrupted tuning keeps what it measured; a torn last line is skipped when read (the next append
starts on a line of its own), and a file whose header is torn is set aside and begun again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..host import CpuSignature
from .database import search_roots, set_aside, user_records_dir
from .schedule import GemmSchedule, GemmShape

MEASURED_DIR = "measured"


@dataclass(frozen=True)
class Measurement:
    """One candidate timed on one CPU."""

    cpu: CpuSignature
    threads: int
    shape: GemmShape
    m: int
    schedule: GemmSchedule
    gflops: float


def measurements_path(shape: GemmShape, threads: int, cpu: CpuSignature, root: Path | None = None) -> Path:
    root = user_records_dir() if root is None else Path(root)
    return root / cpu.slug / f"t{threads}" / MEASURED_DIR / f"linear_{shape.name}.jsonl"


class MeasurementLog:
    """Appends one shape's measurements to its file (header written once)."""

    def __init__(self, shape: GemmShape, threads: int, cpu: CpuSignature, root: Path | None = None) -> None:
        self.path = measurements_path(shape, threads, cpu, root)
        self.header = {"cpu": cpu.to_json(), "threads": threads, "n": shape.n, "k": shape.k,
                       "dtype": shape.dtype, "epilogue": shape.epilogue}

    def append(self, rows: Iterable[tuple[int, GemmSchedule, float]]) -> None:
        lines = [json.dumps({"m": m, "s": s.to_json(), "g": round(g, 2)}) for m, s, g in rows]
        if not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh, torn = self._state()
        with open(self.path, "a") as fh:
            if fresh:
                fh.write(json.dumps(self.header) + "\n")
            fh.write(("\n" if torn else "") + "\n".join(lines) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _state(self) -> tuple[bool, bool]:
        """(whether the file needs its header, whether its last line was cut off). A file whose
        header cannot be read (a write killed mid-line) would hide every line after it: it is
        set aside (kept, renamed, no longer read) and a new one begun."""
        try:
            with open(self.path, "rb") as fh:
                head = fh.readline()
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                if size:
                    fh.seek(size - 1)
                    last = fh.read(1)
        except FileNotFoundError:
            return True, False
        if not size:
            return True, False
        try:
            CpuSignature.from_json(json.loads(head)["cpu"])
        except (ValueError, KeyError, TypeError, AttributeError):
            set_aside(self.path)
            return True, False
        return False, last != b"\n"

    def record(self, m: int, schedules: Sequence[GemmSchedule], gflops: Sequence[float]) -> None:
        """``MetaScheduleSearch.on_measured``: one timed batch at ``m``."""
        self.append(zip([m] * len(schedules), schedules, gflops, strict=False))


def read_measurements(path: Path) -> Iterator[Measurement]:
    """The measurements of one file; a file without a usable header yields nothing, a torn or
    foreign line is skipped."""
    try:
        with open(path) as fh:
            head = json.loads(fh.readline())
            cpu = CpuSignature.from_json(head["cpu"])
            shape = GemmShape(int(head["n"]), int(head["k"]), head["dtype"], head["epilogue"])
            threads = int(head["threads"])
            for line in fh:
                try:
                    d = json.loads(line)
                    yield Measurement(cpu, threads, shape, int(d["m"]), GemmSchedule.from_json(d["s"]),
                                      float(d["g"]))
                except (ValueError, KeyError, TypeError):
                    continue
    except (OSError, ValueError, KeyError, TypeError):
        return


def all_measurements(root: Path | None = None) -> list[Measurement]:
    """Every measurement under the records roots (the user's, then the shipped ones)."""
    out: list[Measurement] = []
    for base in search_roots(root):
        for path in sorted(Path(base).glob(f"*/t*/{MEASURED_DIR}/linear_*.jsonl")):
            out.extend(read_measurements(path))
    return out
