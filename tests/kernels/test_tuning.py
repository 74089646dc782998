"""tune_gemm through MetaSchedule on a small GEMM; the database is resumable and CPU-checked."""

from __future__ import annotations

import pytest

from sandwich_tvm.kernels.database import load_record, record_path
from sandwich_tvm.kernels.schedule import GemmShape
from sandwich_tvm.kernels.tuner import tune_gemm

pytestmark = pytest.mark.usefixtures("small_rotation")


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



def test_runner_makes_cold_weight_copies_once_per_weight():
    """Every m of one GEMM shares its weight's cold copies (twice the LLC: ~1 GB each on a
    480 MiB L3; made per m, tuning one GEMM grew past 24 GB)."""
    from types import SimpleNamespace

    from sandwich_tvm.kernels.metaschedule import InProcessRunner

    runner = InProcessRunner(cache=None, cold_bytes=3 * 64 * 48 * 4)

    def info(m):
        return [SimpleNamespace(shape=s, dtype="float32") for s in ((m, 48), (4, 48, 16), (m, 64))]

    runner._tensors(info(1))
    first = runner._weights
    assert len(first) == 3
    runner._tensors(info(2))
    assert runner._weights is first  # another m, the same copies
    runner._tensors([SimpleNamespace(shape=s, dtype="float32") for s in ((1, 32), (4, 32, 16), (1, 64))])
    assert runner._weights is not first and len(runner._weights) == 5  # another weight, 4.5 per 36 KB
