"""Tuned dynamic-shape kernels on disk: ``<records>/<cpu>/t<threads>/linear_<n>_<k>_<dtype>.json``.

``<records>`` is the user's records directory (``SANDWICH_RECORDS_DIR``, else
``<cache>/records``), where ``tune`` writes, then the records shipped in the package
(``sandwich_tvm/records/``); an explicit ``root`` replaces both.

A file records the CPU signature (``host.CpuSignature``: vendor, family/model/stepping, ISA
features, cache sizes; not the model name, which clouds mask), the thread count, every tuned
m and the buckets (``m <= m_max`` -> schedule) the runtime kernel dispatches on. ``<cpu>`` is
the signature's slug. A record is used on a host whose signature agrees on every field both
know; one from another CPU is refused with what differs. Files are rewritten atomically
after every tuned m, so an interrupted tuning resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..host import CpuSignature, cache_dir, file_lock, host_signature, save_atomic, units_of
from .codegen import Bucket, KernelError, check_schedule
from .microkernel import kernel_isa, microkernels
from .schedule import GemmSchedule, GemmShape
from .search import Tuned

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "records"  # package data
RECORDS_ENV = "SANDWICH_RECORDS_DIR"
FORMAT = 2


def user_records_dir() -> Path:
    """Where this user's tuning is written and read first: ``$SANDWICH_RECORDS_DIR``, else
    ``<cache>/records`` (``host.cache_dir``)."""
    env = os.environ.get(RECORDS_ENV)
    return Path(env) if env else cache_dir() / "records"


def search_roots(root: Path | None = None) -> tuple[Path, ...]:
    """The directories records are read from, first match wins: ``root`` alone when given, else
    the user's directory and then the shipped records."""
    return (Path(root),) if root is not None else (user_records_dir(), SHIPPED_DIR)


class ScheduleDbError(ValueError):
    """A tuning database that does not belong to this machine or cannot be read."""


class StaleRecordError(ScheduleDbError):
    """A record of this CPU from an earlier version, which tuned its weight type on a unit this
    version no longer uses for it here (the base ISA's tiles before AVX-VNNI's, AMX-INT8's before
    amxdq's): used as missing. ``record``: it, unchecked."""

    record: KernelRecord


class _StaleSchedule(ValueError):
    pass


def retune_hint(threads: int) -> str:
    return f"re-tune with `python -m sandwich_tvm.tune kernels --threads {threads}`"


@dataclass
class KernelRecord:
    """The tuning of one (n, k, dtype, threads) GEMM on one CPU."""

    shape: GemmShape
    threads: int
    cpu: CpuSignature
    tuned: list[Tuned] = field(default_factory=list)
    seconds: float = 0.0
    search: str = "full"  # "full": every candidate measured; "model": the cost model's top few
    transferred_from: list[str] = field(default_factory=list)  # records whose schedules seeded it

    @property
    def isa(self) -> str:
        return self.cpu.isa

    @property
    def kernel_isa(self) -> str:
        """The micro-kernels' ISA: the CPU's, or its bf16 dot-product unit for bf16 weights."""
        return kernel_isa(self.cpu.isa, self.shape.dtype, set(self.cpu.features or ()))

    def add(self, tuned: Tuned, seconds: float = 0.0) -> None:
        """Keep a newly tuned m (in m order) and the seconds it took."""
        self.tuned = sorted([*self.tuned, tuned], key=lambda t: t.m)
        self.seconds += seconds

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
            "cpu": self.cpu.to_json(),
            "isa": self.isa,
            "threads": self.threads,
            "n": self.shape.n,
            "k": self.shape.k,
            "dtype": self.shape.dtype,
            "epilogue": self.shape.epilogue,
            "seconds": round(self.seconds, 2),
            "search": self.search,
            "transferred_from": list(self.transferred_from),
            "tuned": [
                {"m": t.m, "schedule": t.schedule.to_json(), "searched": t.searched,
                 "gflops": None if math.isnan(t.gflops) else round(t.gflops, 2)}
                for t in self.tuned
            ],
            "buckets": [{"m_max": b.m_max, "schedule": b.schedule.to_json()} for b in self.buckets()],
        }

    @classmethod
    def from_json(cls, d: dict, check: bool = True) -> KernelRecord:
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')!r}, this version reads {FORMAT}")
        tuned = [
            Tuned(int(t["m"]), GemmSchedule.from_json(t["schedule"]),
                  float("nan") if t["gflops"] is None else float(t["gflops"]), bool(t["searched"]))
            for t in d["tuned"]
        ]
        shape = GemmShape(int(d["n"]), int(d["k"]), d.get("dtype", "float32"), d.get("epilogue", "none"))
        rec = cls(shape, int(d["threads"]), CpuSignature.from_json(d["cpu"]), tuned,
                  float(d.get("seconds", 0.0)), str(d.get("search", "full")),
                  [str(x) for x in d.get("transferred_from", [])])
        if check:
            rec.validate()
        return rec

    def validate(self) -> None:
        """Every schedule must be one the generator can build for this record's ISA and threads."""
        if self.shape.n < 1 or self.shape.k < 1 or self.threads < 1:
            raise ValueError(f"shape {self.shape} or threads {self.threads} out of range")
        if not self.tuned:
            raise ValueError("no tuned sequence lengths")
        stale = ""
        for t in self.tuned:
            sch = t.schedule
            if t.m < 1:
                raise ValueError(f"tuned m={t.m} is not positive")
            if sch.mk not in microkernels(self.kernel_isa, self.shape.dtype):
                if sch.mk.isa not in self._earlier_units():
                    raise ValueError(f"m={t.m}: micro-kernel {sch.mk.name} is not a {self.kernel_isa} "
                                     f"{self.shape.dtype} register tile")
                stale = stale or (f"m={t.m} was tuned on {sch.mk.name}, a {sch.mk.isa} tile; this version "
                                  f"runs {self.shape.dtype} on {self.kernel_isa} tiles here")
            if min(sch.poly.pm, sch.poly.pn, sch.poly.pk) < 1 or sch.poly.threads != self.threads:
                raise ValueError(f"m={t.m}: polymerization {sch.poly} does not use {self.threads} threads")
            try:
                check_schedule(self.shape, sch)
            except KernelError as err:
                raise ValueError(f"m={t.m}: {err}") from None
        if stale:  # a whole record of an earlier version's choice: not damaged, out of date
            raise _StaleSchedule(stale)

    def _earlier_units(self) -> set[str]:
        """The units an earlier version may have tuned this CPU's weight type on: its base ISA's
        tiles and every unit it has the flags for."""
        return units_of(self.cpu.isa, set(self.cpu.features or ()))


def record_path(shape: GemmShape, threads: int, root: Path | None = None,
                cpu: CpuSignature | None = None) -> Path:
    """Where the record is written: under ``root``, else the user's records directory."""
    root = user_records_dir() if root is None else root
    return root / (cpu or host_signature()).slug / f"t{threads}" / f"linear_{shape.name}.json"


SET_ASIDE = ".unusable-"  # in the name of a file set aside (kept, never read as a record)
LOCK_NAME = ".records.lock"  # one per records folder: saves there take turns


def set_aside(path: Path) -> Path:
    """Rename an unusable records or measurements file out of the way (kept for a look, no longer
    read); another process that set it aside first is no error. Returns the new name."""
    aside = path.with_name(f"{path.stem}{SET_ASIDE}{time.strftime('%Y%m%d-%H%M%S')}{path.suffix}")
    with contextlib.suppress(FileNotFoundError):
        path.replace(aside)
    return aside


# what this process last read from or wrote to each record file: the base of a three-way merge
_BASE: dict[Path, dict[int, tuple]] = {}


def _entry(t: Tuned) -> tuple:
    return (t.schedule, t.searched, None if math.isnan(t.gflops) else round(t.gflops, 2))


def remember(path: Path, rec: KernelRecord) -> None:
    """Note ``rec`` as what this process knows of ``path`` (a later save merges against it)."""
    _BASE[Path(path).resolve()] = {t.m: _entry(t) for t in rec.tuned}


def save_record(rec: KernelRecord, root: Path | None = None) -> Path:
    """Save ``rec`` atomically, merged under a lock with what another process (``serve``'s
    background tuning beside a ``tune kernels`` run) saved there since this one read it: an m
    only one side changed keeps that side's entry (a refined m stays refined); one both
    changed keeps a measured entry over a reused one, then the faster; every m either holds is
    kept. A folder that cannot be written is a ``ScheduleDbError``."""
    path = record_path(rec.shape, rec.threads, root, rec.cpu)
    try:
        with file_lock(path.parent / LOCK_NAME):
            merged = _merged(rec, path)
            save_atomic(path, json.dumps(merged.to_json(), indent=1))
    except OSError as err:
        raise ScheduleDbError(f"cannot write the record {path}: {err.strerror or err}; make its folder "
                              "writable or pass --records DIR") from err
    remember(path, merged)
    return path


def _merged(rec: KernelRecord, path: Path) -> KernelRecord:
    try:
        disk = read_record(path)
    except ScheduleDbError:  # none, damaged or stale: this one replaces it
        return rec
    if (disk.shape, disk.threads) != (rec.shape, rec.threads) or disk.cpu.differences(rec.cpu):
        return rec
    base = _BASE.get(path.resolve(), {})
    mine, theirs = {t.m: t for t in rec.tuned}, {t.m: t for t in disk.tuned}
    out = {}
    for m in mine.keys() | theirs.keys():
        a, b = mine.get(m), theirs.get(m)
        if a is None or b is None or _entry(a) == _entry(b):
            out[m] = a or b
        elif _entry(a) == base.get(m):  # only the other process changed it
            out[m] = b
        elif _entry(b) == base.get(m):  # only this one did
            out[m] = a
        else:  # both: measured over reused, then the faster (a reuse has no GFLOPS)
            out[m] = max((a, b), key=lambda t: (t.searched, -math.inf if math.isnan(t.gflops) else t.gflops))
    sources = sorted(set(rec.transferred_from) | set(disk.transferred_from))
    search = "full" if "full" in (rec.search, disk.search) else rec.search  # a full search reuses on purpose
    return KernelRecord(rec.shape, rec.threads, rec.cpu, sorted(out.values(), key=lambda t: t.m),
                        rec.seconds, search, sources)


def read_record(path: Path) -> KernelRecord:
    """Read and validate a record, whatever CPU it was tuned on."""
    try:
        return KernelRecord.from_json(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise ScheduleDbError(
            f"{path}: no such tuning database; run `python -m sandwich_tvm.tune kernels`") from None
    except OSError as err:  # another user's 0600 file, a folder in its place
        raise ScheduleDbError(f"{path}: cannot be read ({err.strerror or err}); fix its permissions "
                              "or remove it") from err
    except _StaleSchedule as err:
        stale = StaleRecordError(f"{path} is from an earlier version ({err}): it is not used; "
                                 "`python -m sandwich_tvm.tune kernels` re-tunes it")
        stale.record = KernelRecord.from_json(json.loads(Path(path).read_text()), check=False)
        raise stale from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise ScheduleDbError(
            f"{path}: not a usable Sandwich kernel database ({type(err).__name__}: {err}); "
            "delete it, or re-tune: `python -m sandwich_tvm.tune kernels` sets it aside and starts "
            "afresh") from err


_NOTED: set[str] = set()


def _note_once(message: str) -> None:
    """Say it on stderr, once per process."""
    if message not in _NOTED:
        _NOTED.add(message)
        print(f"note: {message}", file=sys.stderr)


def check_signature(rec: KernelRecord, path: Path, here: CpuSignature | None = None) -> None:
    """Refuse a record tuned on another CPU: its kernels would be slow or use missing instructions."""
    here = here or host_signature()
    diff = here.differences(rec.cpu)
    if diff:
        raise ScheduleDbError(
            f"{path} was tuned on {rec.cpu.describe()}, but this machine is {here.describe()}; "
            f"they differ in {'; '.join(diff)}. Its schedules do not apply here: "
            f"{retune_hint(rec.threads)} (the record for this CPU goes to <records>/{here.slug}/)")


def load_record(path: Path, *, check_host: bool = True) -> KernelRecord:
    """Read a record; with ``check_host``, refuse one tuned on another CPU signature."""
    rec = read_record(path)
    if check_host:
        check_signature(rec, path)
    return rec


def find_record(shape: GemmShape, threads: int, root: Path | None = None,
                cpu: CpuSignature | None = None) -> KernelRecord | None:
    """The record of ``cpu`` (default this host): its own signature's file, else one whose
    (partial) signature agrees with it on every field both know. A shape with an epilogue
    falls back to the record of the plain GEMM when none was tuned with the epilogue."""
    here = cpu or host_signature()
    rec = _find(shape, threads, root, here)
    if rec is None and shape.epilogue != "none":
        return _find(shape.plain, threads, root, here)
    return rec


def _find(shape: GemmShape, threads: int, root: Path | None, here: CpuSignature) -> KernelRecord | None:
    for base in search_roots(root):
        rec = _find_in(shape, threads, base, here)
        if rec is not None:
            return rec
    return None


def _find_in(shape: GemmShape, threads: int, base: Path, here: CpuSignature) -> KernelRecord | None:
    path = record_path(shape, threads, base, here)
    if path.exists():
        try:
            rec = read_record(path)
            check_signature(rec, path, here)
            return rec
        except StaleRecordError as err:
            check_signature(err.record, path, here)  # another CPU's record says so first
            _note_once(str(err))  # then look on, as if it were not there
    for other in sorted(base.glob(f"*/t{threads}/{path.name}")):
        try:
            rec = read_record(other)
        except ScheduleDbError:
            continue  # another CPU's damaged file is not ours to judge
        if not here.differences(rec.cpu):
            return rec
    return None
