"""``bench compile``: the two kinds of build take turns, "kept" ones share one cache whose kernels a
warm-up filled, "parse all" ones each get an empty cache, and the ratio pairs the rounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandwich_tvm.bench import compile_time


def test_builds_take_turns_and_pair_by_round(monkeypatch):
    calls: list[tuple[str, Path]] = []
    times = iter([99.0, 10.0, 20.0, 40.0, 10.0, 6.0, 12.0])  # warm-up, then kept/parse-all per round

    def fake_build(model, dtype, cache, out, records):
        calls.append((cache.name, records))
        if len(calls) == 1:  # the warm-up keeps one parsed kernel
            (cache / "kernels" / "tvm-x").mkdir(parents=True)
            (cache / "kernels" / "tvm-x" / "a.json.gz").write_bytes(b"")
        s = next(times)
        return {"wall_s": s + 2.0, "build_s": s}

    monkeypatch.setattr(compile_time, "build_once", fake_build)
    monkeypatch.setenv("SANDWICH_RECORDS_DIR", "/somewhere/records")
    result = compile_time.measure("llama-160m", "bfloat16", 3)
    # the order reverses every other round: parse all first, then kept first, then parse all first
    assert [c for c, _ in calls] == ["kept", "empty-0", "kept", "kept", "empty-1", "empty-2", "kept"]
    assert {r for _, r in calls} == {Path("/somewhere/records")}
    assert result["kept_kernel_files"] == 1
    assert result["systems"]["parse all"]["build_s_runs"] == [10.0, 10.0, 6.0]
    assert result["systems"]["kept"]["build_s_runs"] == [20.0, 40.0, 12.0]
    assert result["build_ratio_kept_vs_parse_all"] == pytest.approx(2.0)  # rounds: 2, 4, 2
    assert result["systems"]["kept"]["wall_s_median"] == pytest.approx(22.0)


def test_a_failed_build_says_what_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_time.sys, "executable", "false")  # a build that fails at once
    with pytest.raises(RuntimeError, match="compile --model no-such-model .* failed \\(1\\)"):
        compile_time.build_once("no-such-model", "auto", tmp_path / "c", tmp_path / "o", tmp_path / "r")
