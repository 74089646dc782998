"""`bench tuning-curve`: the background-tuning metrics read from /metrics, and the summary of a
curve (untuned first request against the requests on the last build)."""

from __future__ import annotations

import pytest

from sandwich_tvm.bench.tuning_curve import scrape, summarize
from sandwich_tvm.runtime.metrics import ServingMetrics


def test_scrape_reads_what_the_server_exports():
    from prometheus_client import generate_latest

    m = ServingMetrics("x")
    assert scrape(generate_latest(m.registry).decode()) == {"swaps": 0.0, "landed": 0.0, "running": 0.0}
    m.tuning_running.set(1)
    m.tuned_gemms.inc(3)
    m.kernel_swaps.inc(2)
    assert scrape(generate_latest(m.registry).decode()) == {"swaps": 2.0, "landed": 3.0, "running": 1.0}


def _point(tps: float, swaps: int, after: bool, text: str = "a") -> dict:
    return {"tokens_per_s": tps, "tpot_ms": 1e3 / tps, "prefill_tokens_per_s": 10 * tps,
            "swaps": swaps, "landed": swaps, "after_tuning": after,
            "text": text}


def test_summary_compares_the_untuned_requests_with_the_ones_on_the_last_build():
    points = [_point(90, 0, False), _point(110, 0, False), _point(100, 0, False), _point(150, 2, False),
              _point(190, 5, True), _point(210, 5, True), _point(200, 5, True)]
    s = summarize(points)
    assert (s["untuned_tokens_per_s"], s["tuned_tokens_per_s"], s["swaps"]) == (100, 200, 5)
    assert (s["untuned_requests"], s["tuned_requests"]) == (3, 3)
    assert s["prefill_speedup"] == pytest.approx(2.0) and s["tuned_prefill_tokens_per_s"] == 2000
    assert s["speedup"] == pytest.approx(2.0) and s["distinct_texts"] == 1
    mixed = summarize([*points, _point(1000, 5, True) | {"swapped_during": True}])
    assert mixed["tuned_tokens_per_s"] == 200  # a request over a swap counts for neither side
    assert summarize(points[3:])["speedup"] is None  # nothing ran untuned
    changed = summarize([*points, _point(200, 5, True, "b")])
    assert changed["distinct_texts"] == 2 and changed["texts_by_swaps"] == {"0": 1, "2": 1, "5": 2}


def test_copy_records_must_be_a_directory(tmp_path, capsys):
    from sandwich_tvm.bench.cli import main

    rc = main(["tuning-curve", "--model", "llama-34m", "--records", str(tmp_path / "r"),
               "--copy-records", str(tmp_path / "missing"), "--json"])
    assert rc == 2 and "is not a directory" in capsys.readouterr().err
