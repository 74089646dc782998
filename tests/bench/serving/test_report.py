"""Percentiles, SLO attainment, goodput and the SLO-scale sweep on hand-made records."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from rich.console import Console

from sandwich_tvm.bench.serving.client import RequestRecord, RunResult
from sandwich_tvm.bench.serving.report import (
    Slo,
    SystemRuns,
    attainment,
    build_report,
    default_slo,
    goodput,
    meets,
    percentiles,
    plot_report,
    render,
    scale_key,
    scale_sweep,
    without_requests,
)
from sandwich_tvm.model.config import PRESETS

SLO = Slo(ttft_ms=200, tpot_ms=100)


def rec(ttft_ms: float, tpot_ms: float, out: int = 11, ok: bool = True, sent: bool = True) -> RequestRecord:
    """A request with this TTFT and TPOT (E2E = TTFT + (out - 1) * TPOT)."""
    if not sent:
        return RequestRecord(8, out, sent=False)
    if not ok:
        return RequestRecord(8, out, ok=False, error="HTTP 500: boom", e2e_s=0.01)
    return RequestRecord(8, out, ok=True, ttft_s=ttft_ms / 1e3, e2e_s=(ttft_ms + (out - 1) * tpot_ms) / 1e3,
                         output_tokens=out)


def run(rate: float | None, records: list[RequestRecord], wall_s: float = 10.0) -> RunResult:
    return RunResult("poisson" if rate else "single", rate, records, wall_s)


def test_percentiles():
    p = percentiles(range(1, 101))
    assert p == {"p50": pytest.approx(50.5), "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_tpot_from_e2e_and_ttft():
    r = rec(150, 40, out=11)
    assert r.tpot_s == pytest.approx(0.040)
    assert rec(150, 40, out=1).tpot_s is None  # one token: no TPOT, and no TPOT to miss
    assert meets(rec(150, 400, out=1), SLO)


def test_meets_needs_both_slos():
    assert meets(rec(200, 100), SLO)  # equal is within
    assert not meets(rec(201, 50), SLO)
    assert not meets(rec(50, 101), SLO)
    assert not meets(rec(0, 0, ok=False), SLO)


def test_attainment_exactly_ninety_percent_counts_and_failures_miss():
    records = [rec(100, 50)] * 9 + [rec(0, 0, ok=False)]
    assert attainment(records, SLO) == pytest.approx(0.9)
    assert goodput([(2.0, attainment(records, SLO))]) == 2.0
    records = [rec(100, 50)] * 26 + [rec(0, 0, ok=False)] * 3  # 26/29 < 0.9
    assert goodput([(2.0, attainment(records, SLO))]) is None


def test_unsent_requests_are_not_counted():
    records = [rec(100, 50)] * 9 + [rec(0, 0, sent=False)] * 5
    assert attainment(records, SLO) == 1.0
    assert attainment([rec(0, 0, sent=False)], SLO) is None


def test_goodput_is_the_highest_rate_reaching_the_goal():
    assert goodput([(1.0, 1.0), (2.0, 0.95), (4.0, 0.5)]) == 2.0
    assert goodput([(1.0, 0.95), (2.0, 0.5), (4.0, 0.92)]) == 4.0  # the highest tested, as defined
    assert goodput([(1.0, 0.5), (2.0, 0.1)]) is None
    assert goodput([(None, 1.0)]) is None  # single-sequence runs have no rate
    assert goodput([]) is None


def _random_runs(seed: int = 0) -> list[RunResult]:
    rng = np.random.default_rng(seed)
    runs = []
    for i, rate in enumerate((0.5, 1.0, 2.0, 4.0)):
        ttft = rng.lognormal(np.log(80 * 2 ** i), 0.6, 40)
        tpot = rng.lognormal(np.log(40 * 1.5 ** i), 0.4, 40)
        records = [rec(a, b) for a, b in zip(ttft, tpot, strict=True)] + [rec(0, 0, ok=False)]
        runs.append(run(rate, records))
    return runs


def test_scale_sweep_is_monotone():
    scales = (0.25, 0.5, 1, 2, 4, 8, 16, 64)
    sweep = scale_sweep(_random_runs(), SLO, scales)
    table = np.array([sweep["attainment_by_scale"][scale_key(s)] for s in scales])  # (scales, rates)
    assert (np.diff(table, axis=0) >= 0).all()  # looser SLOs never lose attainment
    goods = [sweep["goodput_by_scale"][scale_key(s)] or 0.0 for s in scales]
    assert goods == sorted(goods) and goods[0] == 0.0 and goods[-1] == 4.0
    first = sweep["min_slo_scale"]
    assert first in scales
    assert sweep["goodput_by_scale"][scale_key(first)] is not None
    assert all(sweep["goodput_by_scale"][scale_key(s)] is None for s in scales if s < first)


def test_min_scale_none_when_never_reached():
    runs = [run(1.0, [rec(0, 0, ok=False)] * 3)]
    assert scale_sweep(runs, SLO, (1, 16))["min_slo_scale"] is None


def test_default_slos_follow_the_paper():
    assert default_slo(PRESETS["llama-160m"].num_params(), "poisson")[0] == Slo(200, 100)
    assert default_slo(PRESETS["tinyllama-1.1b"].num_params(), "poisson")[0] == Slo(2000, 280)
    assert default_slo(PRESETS["llama-3.2-1b"].num_params(), "poisson")[0] == Slo(2000, 280)
    assert default_slo(PRESETS["llama-3.2-1b"].num_params(), "single")[0] == Slo(2200, 70)
    assert default_slo(PRESETS["llama-3-8b"].num_params(), "single")[0] == Slo(8000, 240)


def _doc(mode: str = "poisson") -> dict:
    runs = _random_runs() if mode == "poisson" else [run(None, _random_runs()[0].records)]
    other = [RunResult(r.mode, r.rate, r.records[::2], r.wall_s) for r in runs]
    systems = [SystemRuns("sandwich", "ok", runs=runs), SystemRuns("llamacpp", "ok", runs=other),
               SystemRuns("vllm", "skipped", reason="not installed")]
    return build_report({"model": "llama-160m", "mode": mode}, systems, SLO, "test", (0.5, 1, 2, 4, 8, 16))


def test_json_has_goodput_per_system_and_scale():
    doc = json.loads(json.dumps(_doc()))
    assert set(doc["goodput"]) == {"sandwich", "llamacpp", "vllm"}
    for per_scale in doc["goodput"].values():
        assert set(per_scale) == {"0.5", "1", "2", "4", "8", "16"}
    s = doc["systems"]["sandwich"]
    assert s["goodput"] == s["goodput_by_scale"]["1"]
    r = s["runs"][0]
    assert r["sent"] == 41 and r["failed"] == 1 and r["ok"] == 40
    assert set(r["ttft_ms"]) == {"p50", "p90", "p99", "mean"} and r["output_tokens_per_s"] > 0
    assert len(r["requests"]) == 41
    assert "requests" not in without_requests(doc)["systems"]["sandwich"]["runs"][0]
    assert doc["systems"]["vllm"]["status"] == "skipped" and doc["systems"]["vllm"]["runs"] == []


@pytest.mark.parametrize("mode", ["poisson", "single"])
def test_plot_and_tables(tmp_path, mode):
    doc = _doc(mode)
    path = plot_report(doc, tmp_path / "plots" / "serve.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000
    out = io.StringIO()
    render(doc, Console(file=out, width=200))
    text = out.getvalue()
    assert "sandwich" in text and "SLO-scale sweep" in text and "not installed" in text
