"""`bench costmodel`: the held-out model's GEMMs are left out of training, random schedules of
them are timed here and ranked by the model (Spearman per GEMM and m)."""

from __future__ import annotations

import json

import pytest

from sandwich_tvm.bench import cli as bench
from tests.kernels.test_costmodel_cli import _measure_some

from ..model.hf_models import hf_checkpoint

pytestmark = pytest.mark.compile


def test_bench_costmodel_ranks_timed_schedules_of_held_out_shapes(tmp_path, capsys):
    held = hf_checkpoint(tmp_path, "mha-untied")
    records = tmp_path / "records"
    _measure_some(records)
    assert bench.main(["costmodel", "--holdout", str(held), "--dtype", "float32", "--m", "2",
                       "--candidates", "3", "--records", str(records), "--costmodel-data", "records",
                       "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["training_samples"] == 216 and out["holdout"] == str(held)
    assert [r["gemm"] for r in out["rows"]] == ["qkv", "o", "gate_up", "down"]
    for r in out["rows"]:
        assert r["m"] == 2 and r["candidates"] == 3 and len(r["samples"]) == 3
        assert all(s["gflops"] > 0 for s in r["samples"])
        assert max(s["gflops"] for s in r["samples"]) == pytest.approx(r["best_gflops"], abs=0.06)
        assert r["spearman"] != r["spearman"] or -1 <= r["spearman"] <= 1  # NaN: tied predictions
        assert 0 < r["top_pick_vs_best"] <= 1
    assert bench.main(["costmodel", "--holdout", str(held), "--records", str(tmp_path / "none"),
                       "--costmodel-data", "records"]) == 2
    assert "too few" in capsys.readouterr().out
