"""tune_gemm through MetaSchedule on a small GEMM; the database is resumable and CPU-checked."""

from __future__ import annotations

import pytest

from sandwich_tvm.kernels.database import load_record, record_path
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

