"""`bench gemm`: correct kernels from every library, cold weights, MetaSchedule's default search."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sandwich_tvm.bench import cli as bench

pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def _no_spin_pauses(monkeypatch):
    """The pauses that let other libraries' workers stop spinning matter to timings, which these
    tests do not judge: what they check is what is timed, paired and reported."""
    monkeypatch.setattr(bench, "SPIN_PAUSE_S", 0.0)


@pytest.fixture
def quick_peaks(monkeypatch):
    """The host's FMA and sgemm peaks (seconds each), for the tests that never read them."""
    from sandwich_tvm.kernels import peak
    from sandwich_tvm.topology import microbench

    monkeypatch.setattr(peak, "fma_peak_gflops", lambda _threads: 1.0)
    monkeypatch.setattr(microbench, "sgemm_gflops", lambda _cpu: 1.0)


def _default_record(root, n: int, k: int, dtype: str, max_m: int) -> None:
    """A record of the default schedules in ``root``, as a tuning would leave it (in no time):
    for the tests that check what bench gemm times, not its tuning (the others tune on the spot)."""
    import os

    from sandwich_tvm.host import cpu_flags, host_isa
    from sandwich_tvm.kernels.defaults import default_schedule
    from sandwich_tvm.kernels.microkernel import kernel_isa
    from sandwich_tvm.kernels.schedule import GemmShape
    from sandwich_tvm.kernels.tuner import tune_gemm

    threads, isa = len(os.sched_getaffinity(0)), kernel_isa(host_isa(), dtype, cpu_flags())
    shape = GemmShape(n, k, dtype)
    tune_gemm(n, k, threads=threads, max_m=max_m, root=root, dtype=dtype,
              search_one=lambda p, _mks, _top: (default_schedule(shape, p.m, threads, isa), 1.0))


def test_bench_gemm_reports_every_library_and_metaschedule(tmp_path, capsys):
    plot = tmp_path / "gemm.png"
    _default_record(tmp_path, 40, 72, "float32", 3)
    assert bench.main(["gemm", "--n", "40", "--k", "72", "--m", "1,3", "--schedules", str(tmp_path),
                       "--metaschedule-trials", "4", "--rounds", "2", "--metaschedule-m", "3", "--json",
                       "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights"] == "cold" and plot.is_file() and out["weight_copies"] > 1
    cold = out["cold_check"]  # checked in the run against a streaming read of at least 1 GiB
    assert cold["copies"] == out["weight_copies"] and cold["attempts"] and cold["read_bytes"] >= 1 << 30
    assert cold["rotation_bytes"]["sandwich"] == cold["copies"] * cold["weight_bytes"]["sandwich"]
    assert [a["copies"] for a in cold["attempts"]][-1] == cold["copies"]
    assert out["fma_peak_gflops"] > 0 and all(0 < r["fma_peak_fraction"] < 2 for r in out["rows"])
    assert [r["m"] for r in out["rows"]] == [1, 3]
    for r in out["rows"]:
        assert r["max_rel_err"] < 1e-5
        assert min(r["sandwich_gflops"], r["numpy_gflops"], r["torch_gflops"]) > 0
        # ratios pair each round's timings (the libraries take turns at each m)
        secs = r["seconds"]
        assert {lib: len(v) for lib, v in secs.items()} == {"sandwich": 2, "numpy": 2, "torch": 2}
        vs_torch = [t / s for s, t in zip(secs["sandwich"], secs["torch"], strict=True)]
        rounds = zip(secs["sandwich"], secs["numpy"], secs["torch"], strict=True)
        vs_best = [min(a, b) / s for s, a, b in rounds]
        assert r["ratio_vs_torch"] == pytest.approx(float(np.median(vs_torch)))
        assert r["ratio_vs_best"] == pytest.approx(float(np.median(vs_best)))
    ms = out["metaschedule"]  # a real search: its kernel computes the same product
    assert (ms["m"], ms["trials"]) == (3, 4) and ms["max_rel_err"] < 1e-5 and ms["tuning_seconds"] > 0
    assert ms["sandwich_ratio"] == pytest.approx(out["rows"][1]["sandwich_gflops"] / ms["gflops"])


def test_bench_gemm_times_a_quantized_weight_against_its_dequantized_values(tmp_path, capsys, quick_peaks):
    """q8_0 blocks (llama.cpp's) on the int8 kernels where the CPU has them: numpy and torch
    multiply the same blocks' values, torch in the dtype `generate` would run it in."""
    from sandwich_tvm.bench.baselines.torch_hf import torch_dtype
    from sandwich_tvm.host import cpu_flags
    from sandwich_tvm.kernels.microkernel import ISAS, kernel_isa
    from sandwich_tvm.tvm_compat import host_isa

    _default_record(tmp_path, 40, 96, "q8_0", 3)
    assert bench.main(["gemm", "--n", "40", "--k", "96", "--m", "1,3", "--dtype", "q8_0", "--schedules",
                       str(tmp_path), "--rounds", "1", "--hot-weights", "--json",
                       "--plot", str(tmp_path / "q.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    isa = kernel_isa(host_isa(), "q8_0", cpu_flags())
    assert out["kernel_isa"] == isa and out["torch_dtype"] == torch_dtype("auto")[0]
    # int8 activations (quantized per row and block, as llama.cpp's) cost up to ~1% of the largest value
    bound = 0.02 if ISAS[isa].int8_dot else 1e-5
    assert all(r["max_rel_err"] < bound and r["sandwich_gflops"] > 0 for r in out["rows"])


def test_paired_ratio_cancels_the_hosts_drift():
    from sandwich_tvm.bench.timing import paired_median_ratio

    # the host slows 3x between rounds; ours is 2x faster within every round
    assert paired_median_ratio([1.0, 3.0, 1.5], [2.0, 6.0, 3.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_median_ratio([1.0], [1.0, 2.0])


@pytest.mark.parametrize("epilogue", ["residual", "silu_mul"])
def test_bench_gemm_with_the_models_epilogue(tmp_path, capsys, epilogue, quick_peaks):
    """Sandwich's fused kernel (its record tuned with the epilogue) against numpy and torch
    running the product and then the epilogue; every library's result is checked."""
    assert bench.main(["gemm", "--n", "64", "--k", "72", "--m", "1,3", "--schedules", str(tmp_path),
                       "--epilogue", epilogue, "--rounds", "1", "--hot-weights", "--json",
                       "--plot", str(tmp_path / "gemm.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["epilogue"] == epilogue and all(r["max_rel_err"] < 1e-5 for r in out["rows"])
    assert next(tmp_path.glob(f"*/t*/linear_n64_k72_float32_{epilogue}.json"))  # tuned with it
    assert bench.main(["gemm", "--n", "64", "--k", "72", "--epilogue", epilogue,
                       "--metaschedule-trials", "2", "--schedules", str(tmp_path)]) == 2
    assert "without --epilogue" in capsys.readouterr().out


def test_bench_gemm_against_another_tuning_takes_turns_and_pairs_the_ratio(tmp_path, capsys, quick_peaks):
    """``--against DIR``: the kernel of another record of the same GEMM (e.g. the full search's
    against the guided one's) runs in the same rounds; a GEMM DIR has no record of is refused."""
    import shutil

    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    args = ["gemm", "--n", "40", "--k", "72", "--m", "1,2", "--rounds", "2", "--hot-weights", "--json",
            "--plot", str(tmp_path / "gemm.png")]
    assert bench.main([*args, "--schedules", str(mine), "--against", str(theirs)]) == 2
    said = capsys.readouterr()
    assert "no record of n40_k72_float32" in said.out + said.err
    assert not mine.exists()  # refused before tuning anything
    assert bench.main([*args, "--schedules", str(mine)]) == 0  # tunes mine on the spot
    capsys.readouterr()
    shutil.copytree(mine, theirs)
    assert bench.main([*args, "--schedules", str(mine), "--against", str(theirs)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["against"]["search"] == "full" and out["against"]["records"] == str(theirs)
    for r in out["rows"]:
        secs = r["seconds"]
        assert set(secs) == {"sandwich", "against", "numpy", "torch"} and len(secs["against"]) == 2
        pairs = [b / a for a, b in zip(secs["sandwich"], secs["against"], strict=True)]
        assert r["ratio_vs_against"] == pytest.approx(float(np.median(pairs)))
        assert r["against_gflops"] > 0 and r["against_schedule"] == r["schedule"]
    ratios = [r["ratio_vs_against"] for r in out["rows"]]
    assert out["against"]["geomean_ratio"] == pytest.approx(float(np.exp(np.mean(np.log(ratios)))))
