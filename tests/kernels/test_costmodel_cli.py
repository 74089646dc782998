"""`tune kernels --search model --budget`, `tune costmodel`: the budget is spread over the GEMMs,
the model comes from the records and measurements there are (no TVM run here)."""

from __future__ import annotations

import random

import pytest

from sandwich_tvm.cli import kernels as kernels_cli
from sandwich_tvm.cli import tune
from sandwich_tvm.kernels.database import KernelRecord
from sandwich_tvm.kernels.measurements import MeasurementLog
from sandwich_tvm.kernels.schedule import GemmShape
from sandwich_tvm.kernels.search import Problem, Tuned, space
from tests.kernels.test_costmodel import CPU, MKS, synthetic_gflops


def _measure_some(root, shapes=((576, 576), (960, 576), (1536, 768)), per=24) -> None:
    rng = random.Random(0)
    for n, k in shapes:
        log = MeasurementLog(GemmShape(n, k), 2, CPU, root)
        for m in (1, 8, 64):
            p = Problem(m, n, k, 2)
            cands = rng.sample(space(p, MKS), per)
            log.record(m, cands, [synthetic_gflops(p, s) for s in cands])


def test_tune_costmodel_trains_checks_and_saves(tmp_path, capsys):
    _measure_some(tmp_path)
    assert tune.main(["costmodel", "--records", str(tmp_path), "--costmodel-data", "records"]) == 0
    out = capsys.readouterr().out
    assert "trained on 216 schedules" in out and "median Spearman" in out
    assert (tmp_path / "costmodel.json").is_file()


def test_tune_costmodel_with_nothing_to_learn_from_says_so(tmp_path, capsys):
    assert tune.main(["costmodel", "--records", str(tmp_path), "--costmodel-data", "records"]) == 2
    assert "too few to train" in capsys.readouterr().out


@pytest.mark.parametrize("search", ["model", "full"])
def test_tune_kernels_spreads_the_budget_over_the_gemms(tmp_path, monkeypatch, capsys, search):
    _measure_some(tmp_path)
    calls = []

    def fake(kind):
        def run(n, k, *, threads, max_m, root, dtype, epilogue, log, progress=None, **kw):
            calls.append((kind, n, k, max_m, kw.get("deadline"), kw.get("refine", False)))
            rec = KernelRecord(GemmShape(n, k, dtype, epilogue), threads, CPU)
            rec.add(Tuned(1, space(Problem(1, n, k, threads), MKS)[0], 1.0, searched=True))  # one m searched
            return rec
        return run

    monkeypatch.setattr(kernels_cli, "tune_gemm_guided", fake("model"))
    monkeypatch.setattr(kernels_cli, "tune_gemm", fake("full"))
    clock = iter(range(0, 10_000, 7))
    monkeypatch.setattr(kernels_cli.time, "monotonic", lambda: float(next(clock)))
    assert tune.main(["kernels", "--model", "llama-160m", "--records", str(tmp_path), "--threads", "2",
                      "--max-m", "16", "--search", search, "--budget", "2",
                      "--costmodel-data", "records"]) == 0
    first, again = [c for c in calls if not c[5]], [c for c in calls if c[5]]
    assert [c[0] for c in first] == [search] * 5
    assert [c[3] for c in first] == [16, 16, 16, 16, 1]  # the lm_head: decode-sized m only
    if search == "model":  # the budget the first pass left goes to a second, GEMM by GEMM
        assert again and [c[1:4] for c in again] == [c[1:4] for c in first][:len(again)]
        for calls_ in (first, again):  # each GEMM's deadline after the one before, within the budget
            deadlines = [c[4] for c in calls_]
            assert all(a < b for a, b in zip(deadlines, deadlines[1:], strict=False))
            assert deadlines[-1] <= 120 + 7 * 2  # the fake clock ticks 7 s a call
        assert "cost model: XGBoost on 216" in capsys.readouterr().out
    else:
        assert not again


def test_a_rerun_over_complete_records_searches_nothing_again(tmp_path, monkeypatch):
    """The second pass follows a first pass that searched something: a re-run over records that
    were complete leaves them (and the builds keyed on them) as they were."""
    _measure_some(tmp_path)
    calls = []

    def done(n, k, *, threads, max_m, root, dtype, epilogue, log, progress=None, **kw):
        calls.append(kw.get("refine", False))
        return KernelRecord(GemmShape(n, k, dtype, epilogue), threads, CPU)  # nothing new searched

    monkeypatch.setattr(kernels_cli, "tune_gemm_guided", done)
    assert tune.main(["kernels", "--model", "llama-160m", "--records", str(tmp_path), "--threads", "2",
                      "--max-m", "16", "--budget", "2", "--costmodel-data", "records"]) == 0
    assert calls == [False] * 5
