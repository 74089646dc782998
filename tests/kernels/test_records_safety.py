"""Records written by several processes, interrupted runs and unreadable files: a save merges
with what another process saved meanwhile, an interrupted guided run leaves no gap that the
m = 1 kernel would cover, a resumed full search replays the same window, files stay readable
by others, and set-aside or foreign files are skipped instead of crashing the cost model."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest

from sandwich_tvm.host import host_signature, save_atomic
from sandwich_tvm.kernels.costmodel import grouped_check, record_samples
from sandwich_tvm.kernels.database import (
    KernelRecord,
    ScheduleDbError,
    load_record,
    read_record,
    record_path,
    save_record,
)
from sandwich_tvm.kernels.defaults import default_schedule
from sandwich_tvm.kernels.guided import with_fill
from sandwich_tvm.kernels.microkernel import kernel_isa, microkernels
from sandwich_tvm.kernels.schedule import GemmShape, Polymerization
from sandwich_tvm.kernels.search import Problem, Tuned, seed
from sandwich_tvm.kernels.tuner import tune_gemm
from sandwich_tvm.tvm_compat import host_isa

SHAPE = GemmShape(96, 64)


def _tuned(m: int, searched: bool = True, gflops: float = 10.0) -> Tuned:
    isa = kernel_isa(host_isa(), "float32", set(host_signature().features or ()))
    return Tuned(m, default_schedule(SHAPE, m, 2, isa), gflops if searched else math.nan, searched)


def test_two_processes_saving_one_record_keep_both_their_m(tmp_path):
    a = KernelRecord(SHAPE, 2, host_signature(), [_tuned(1), _tuned(512)])
    b = KernelRecord(SHAPE, 2, host_signature(), [_tuned(1, gflops=11.0), _tuned(2, searched=False)])
    save_record(a, tmp_path)
    save_record(b, tmp_path)  # b never saw a's m = 512
    disk = load_record(record_path(SHAPE, 2, tmp_path))
    assert [(t.m, t.gflops) for t in disk.tuned if t.searched] == [(1, 11.0), (512, 10.0)]
    assert [t.m for t in disk.tuned] == [1, 2, 512]
    save_record(KernelRecord(SHAPE, 2, host_signature(), [_tuned(2)]), tmp_path)  # measured beats reused
    assert [(t.m, t.searched) for t in load_record(record_path(SHAPE, 2, tmp_path)).tuned] == [
        (1, True), (2, True), (512, True)]


def test_an_interrupted_guided_run_leaves_every_m_on_its_nearest_tuned_schedule():
    """What each save of a guided run holds (``with_fill``): the untuned m on the nearest tuned
    m's kernel, not m = 1's vector kernel up to the next tuned m (a record's buckets)."""
    isa = kernel_isa(host_isa(), "float32", set(host_signature().features or ()))
    mks = sorted(microkernels(isa, "float32"), key=lambda mk: mk.mr)
    short, tall = mks[0], next(mk for mk in reversed(mks) if mk.mr <= 16)
    assert short.mr < tall.mr

    def tuned(m, mk):
        return Tuned(m, seed(Problem(m, 96, 64, 2), mk, Polymerization(1, 2, 1)), 10.0, True)

    rec = KernelRecord(SHAPE, 2, host_signature(), [tuned(1, short), tuned(16, tall)])
    full = with_fill(rec, [1, 2, 4, 8, 16, 32], 96, 64, 2)
    assert [t.m for t in rec.tuned] == [1, 16]  # unchanged
    assert [(t.m, t.searched) for t in full.tuned] == [
        (1, True), (2, False), (4, False), (8, False), (16, True), (32, False)]
    mk = {t.m: t.schedule.mk for t in full.tuned}
    assert mk[2] == short and mk[8] == tall and mk[32] == tall  # nearest in octaves (4: a tie, the smaller m)


def test_a_resumed_full_search_offers_the_same_candidates_as_one_uninterrupted(tmp_path):
    calls: dict[str, dict[int, list[str]]] = {}

    def make(tag: str, stop_after: int | None = None):
        def search_one(p: Problem, mks, _top: int):
            seen = calls.setdefault(tag, {})
            if stop_after is not None and len(seen) == stop_after:
                raise KeyboardInterrupt
            seen[p.m] = sorted(mk.name for mk in mks)
            mk = min(mks, key=lambda mk: mk.mr)  # the same winner every time: a short history
            return seed(p, mk, Polymerization(1, p.threads, 1)), 10.0 + p.m  # rising: never stable
        return search_one

    tune_gemm(256, 256, threads=1, max_m=24, root=tmp_path / "a", search_one=make("whole"))
    with pytest.raises(KeyboardInterrupt):
        tune_gemm(256, 256, threads=1, max_m=24, root=tmp_path / "b", search_one=make("first", 10))
    tune_gemm(256, 256, threads=1, max_m=24, root=tmp_path / "b", search_one=make("resumed"))
    assert calls["resumed"] and all(calls["resumed"][m] == calls["whole"][m] for m in calls["resumed"])
    assert set(calls["first"]) | set(calls["resumed"]) == set(calls["whole"])


def test_unreadable_records_are_database_errors_and_files_follow_the_umask(tmp_path):
    folder = tmp_path / "linear_n1_k1_float32.json"
    folder.mkdir()  # a folder where a record should be
    with pytest.raises(ScheduleDbError, match="cannot be read"):
        read_record(folder)
    old = os.umask(0o022)
    try:
        save_atomic(tmp_path / "x.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.json").stat().st_mode) == 0o644


def test_the_cost_model_skips_set_aside_and_foreign_files_and_a_tiny_check_does_not_crash(tmp_path):
    path = save_record(KernelRecord(SHAPE, 2, host_signature(), [_tuned(1), _tuned(2)]), tmp_path)
    Path(str(path).replace(".json", ".unusable-20260101-000000.json")).write_text(path.read_text())
    (path.parent / "linear_n8_k8_float32.json").write_text("[]")
    samples = record_samples([tmp_path])
    assert len(samples) == 2  # the set-aside copy and the list are not records
    assert grouped_check(samples) == []  # one shape: nothing to hold out, no crash


def test_a_torn_measurements_file_loses_nothing_appended_after_it(tmp_path):
    from sandwich_tvm.kernels.measurements import MeasurementLog, read_measurements

    log = MeasurementLog(SHAPE, 2, host_signature(), tmp_path)
    sch = _tuned(1).schedule
    log.append([(1, sch, 5.0)])
    with open(log.path, "a") as fh:
        fh.write('{"m": 2, "s": {')  # killed mid-line
    log.append([(3, sch, 6.0)])
    assert [x.m for x in read_measurements(log.path)] == [1, 3]  # the next append is on its own line
    log.path.write_text('{"cpu": {"isa"')  # a torn header
    log.append([(4, sch, 7.0), (5, sch, 8.0)])
    assert [x.m for x in read_measurements(log.path)] == [4, 5]
    assert len(list(log.path.parent.glob("*.unusable-*"))) == 1  # the torn file kept aside


def test_a_save_keeps_what_another_process_changed_since_this_one_read(tmp_path):
    """A three-way merge against what this process last read or wrote: another process's refined
    m = 1 survives a save of this process's older copy; where both changed an m, the faster."""
    path = save_record(KernelRecord(SHAPE, 2, host_signature(), [_tuned(1, gflops=10.0)]), tmp_path)
    other = KernelRecord(SHAPE, 2, host_signature(), [_tuned(1, gflops=35.0)])
    save_atomic(path, json.dumps(other.to_json()))  # another process refined m = 1 meanwhile
    save_record(KernelRecord(SHAPE, 2, host_signature(), [_tuned(1, gflops=10.0), _tuned(2, gflops=5.0)]),
                tmp_path)
    assert [(t.m, t.gflops) for t in load_record(path).tuned] == [(1, 35.0), (2, 5.0)]
    again = KernelRecord(SHAPE, 2, host_signature(), [_tuned(1, gflops=40.0), _tuned(2, gflops=5.0)])
    save_atomic(path, json.dumps(again.to_json()))  # refined again, while this one re-measured it too
    save_record(KernelRecord(SHAPE, 2, host_signature(), [_tuned(1, gflops=20.0), _tuned(2, gflops=5.0)]),
                tmp_path)
    assert [(t.m, t.gflops) for t in load_record(path).tuned] == [(1, 40.0), (2, 5.0)]


def test_a_full_search_after_an_interrupted_guided_run_keeps_what_it_measures(tmp_path):
    fills = [_tuned(m, searched=False) for m in (2, 3, 4)]
    filled = KernelRecord(SHAPE, 2, host_signature(), [_tuned(1), *fills], search="model")
    path = save_record(filled, tmp_path)
    isa = kernel_isa(host_isa(), "float32", set(host_signature().features or ()))
    searched = []

    def search_one(p, _mks, _top):
        searched.append(p.m)
        return default_schedule(SHAPE, p.m, 2, isa), 20.0 + p.m

    tune_gemm(SHAPE.n, SHAPE.k, threads=2, max_m=4, root=tmp_path, search_one=search_one)
    assert searched == [2, 3, 4]  # m = 1 was measured: replayed
    assert [(t.m, t.searched, t.gflops) for t in load_record(path).tuned] == [
        (1, True, 10.0), (2, True, 22.0), (3, True, 23.0), (4, True, 24.0)]


def test_only_an_interrupt_in_other_clothes_exits_130():
    from sandwich_tvm.cli.entry import _is_interrupt

    assert _is_interrupt(RuntimeError("Traceback ... KeyboardInterrupt"))
    assert _is_interrupt(RuntimeError('File "entry.py", line 21, in _on_sigint\n RuntimeError'))  # CI's
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as inner:
            raise RuntimeError("while building") from inner
    except RuntimeError as err:
        assert _is_interrupt(err)
    assert not _is_interrupt(RuntimeError("a real error")) and not _is_interrupt(OSError("disk full"))
