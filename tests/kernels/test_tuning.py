"""tune_gemm through MetaSchedule on a small GEMM; the database is resumable and CPU-checked."""

from __future__ import annotations

import json

import pytest

from sandwich_tvm.kernels.database import ScheduleDbError, load_record, record_path
from sandwich_tvm.kernels.schedule import GemmShape
from sandwich_tvm.kernels.tuner import tune_gemm


@pytest.mark.compile
def test_tune_small_gemm_then_resume(tmp_path):
    seen = []
    rec = tune_gemm(96, 64, threads=2, max_m=3, root=tmp_path, work_dir=tmp_path / "ms",
                    progress=lambda t: seen.append(t.m))
    assert [t.m for t in rec.tuned] == [1, 2, 3] and all(t.gflops > 0 for t in rec.tuned)
    path = record_path(GemmShape(96, 64), 2, tmp_path)
    assert load_record(path).buckets()[-1].m_max > 1 << 40
    records = (tmp_path / "ms" / "database_tuning_record.json").read_text().splitlines()
    assert len(records) >= 3  # every measurement committed to MetaSchedule's database
    calls = []
    tune_gemm(96, 64, threads=2, max_m=3, root=tmp_path, search_one=lambda p, mks, top: calls.append(p))
    assert calls == []  # resumed: nothing searched twice


def test_database_from_another_cpu_is_refused(tmp_path):
    path = tmp_path / "linear.json"
    path.write_text(json.dumps({"cpu": "Imaginary CPU 9000", "isa": "sve2", "threads": 2, "n": 8,
                                "k": 8, "tuned": [], "buckets": []}))
    with pytest.raises(ScheduleDbError, match="tuned on 'Imaginary CPU 9000'"):
        load_record(path)
    path.write_text("{not json")
    with pytest.raises(ScheduleDbError, match="not a Sandwich kernel database"):
        load_record(path)
