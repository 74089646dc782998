"""``bench e2e``'s rounds: torch and both llama.cpp rows take their turn in every round with
Sandwich, so every ratio is a median of paired per-round ratios; llama.cpp's locked row."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from rich.console import Console

from sandwich_tvm.bench.baselines.llamacpp import llama_kwargs
from sandwich_tvm.bench.rounds import interleaved, merge_rounds, paired_ratio, round_order


def fake(name: str, calls: list[str], ms: float, drift: list[float]):
    """A runner whose request takes ``ms`` times the host's current slowness (``drift``)."""

    def run(p: int) -> dict:
        calls.append(name)
        slow = drift[len(calls) - 1]
        return {"system": name, "prompt": p, "ttft_ms": ms * slow * p, "tpot_ms": ms * slow}

    return run


def test_round_order_alternates_by_round_and_length():
    assert round_order(3, 0, 0) == [0, 1, 2] and round_order(3, 0, 1) == [2, 1, 0]
    assert round_order(3, 1, 0) == [2, 1, 0]


def test_every_runner_takes_its_turn_in_every_round():
    calls: list[str] = []
    drift = [1.0] * 3 + [3.0] * 3 + [1.5] * 3  # the host slows down 3x in the second round
    runners = [(n, fake(n, calls, ms, drift)) for n, ms in (("sandwich", 1.0), ("llama.cpp", 2.0),
                                                             ("torch", 4.0))]
    order: list[dict] = []
    rows = interleaved(runners, 8, 0, 3, order)
    assert calls == ["sandwich", "llama.cpp", "torch", "torch", "llama.cpp", "sandwich",
                     "sandwich", "llama.cpp", "torch"]
    assert [(o["round"], o["system"]) for o in order] == list(zip([0] * 3 + [1] * 3 + [2] * 3, calls,
                                                                  strict=True))
    sw, _, th = rows
    assert th["tpot_runs_ms"] == [4.0, 12.0, 6.0] and th["tpot_ms"] == 6.0
    assert paired_ratio(sw, th, "tpot") == pytest.approx(0.25)  # the drift cancels round by round
    assert paired_ratio(sw, th, "ttft") == pytest.approx(0.25)


def test_a_runner_that_skips_a_length_has_no_row():
    rows = interleaved([("a", lambda p: {"system": "a", "ttft_ms": 1.0, "tpot_ms": 1.0}),
                        ("stock", lambda p: None)], 8, 0, 2)
    assert [r["system"] for r in rows] == ["a"]
    assert merge_rounds([{"ttft_ms": 1.0, "tpot_ms": 2.0}])["tpot_runs_ms"] == [2.0]


def test_llama_cpp_python_keeps_its_defaults_unless_locked():
    plain, locked = llama_kwargs(4, 256), llama_kwargs(4, 256, locked=True)
    assert "use_mlock" not in plain and "use_mmap" not in plain  # llama-cpp-python's defaults: mmap
    assert locked == plain | {"use_mlock": True, "use_mmap": False}
    assert plain["n_threads"] == plain["n_threads_batch"] == 4 and plain["n_ctx"] == 256


def test_torch_runner_runs_one_request_per_call(tmp_path):
    pytest.importorskip("transformers")
    from sandwich_tvm.bench.baselines.torch_hf import torch_runner

    from ..model.hf_models import write_hf_model

    hf = write_hf_model("mha-untied", tmp_path / "hf")
    calls: list[int] = []

    def model(ids, **kw):
        calls.append(ids.shape[1])
        return hf(ids, **kw)

    cpus = frozenset(os.sched_getaffinity(0))
    run = torch_runner(model, "float32", 1, 5, lambda p: [(3 + i) % 301 for i in range(p)], cpus=cpus)
    assert calls == [8, 1, 1]  # the warm-up
    os.sched_setaffinity(0, {min(cpus)})  # as a TVM plan leaves the thread
    try:
        row = run(12)
        assert os.sched_getaffinity(0) == cpus  # put back before torch runs
    finally:
        os.sched_setaffinity(0, cpus)
    assert calls[3:] == [12, 1, 1, 1, 1]
    assert row["system"] == "torch" and row["prompt"] == 12 and row["output_tokens"] == 5
    assert row["ttft_ms"] > 0 and row["tpot_ms"] > 0


def test_bench_e2e_interleaves_torch_and_both_llama_cpp_rows(monkeypatch):
    """The whole command with fake systems: torch is in every round, each ratio paired."""
    from sandwich_tvm.bench import cli, e2e

    calls: list[str] = []
    drift = itertools.cycle([1.0] * 4 + [2.0] * 4)  # the host flips speed every round of 4 requests
    speeds = {"sandwich": 1.0, "llama.cpp": 2.0, "llama.cpp mlock": 1.5, "torch": 4.0}

    def runner(name: str):
        def run(p: int) -> dict:
            calls.append(name)
            slow = next(drift)
            return {"system": name, "prompt": p, "ttft_ms": speeds[name] * slow * p,
                    "tpot_ms": speeds[name] * slow, "tokens": [1, 2]}
        return run

    class Probe:
        def __init__(self, cpus):
            self.samples: list[float] = []

    monkeypatch.setattr(e2e, "tvm_runner", lambda *a, name="sandwich", **k: runner(name))
    monkeypatch.setattr(e2e, "llamacpp_runner", lambda *a, locked=False, **k: runner(
        "llama.cpp mlock" if locked else "llama.cpp"))
    monkeypatch.setattr(e2e, "torch_baseline", lambda *a, **k: runner("torch"))
    monkeypatch.setattr(e2e, "predicted", lambda cfg, plan, prompts, *a, **k: [
        {"prompt": p, "ttft_ms": 1.0, "tpot_ms": 1.0, "decode_gbs": None} for p in prompts])
    monkeypatch.setattr("sandwich_tvm.topology.microbench.BandwidthProbe", Probe)
    args = cli.build_parser().parse_args([
        "e2e", "--model", "llama-160m", "--prompts", "8,16", "--repeat", "2", "--new-tokens", "4", "--json",
        "--dtype", "float32", "--systems", "sandwich,llamacpp,llamacpp-mlock,torch"])
    result = e2e.bench_e2e(args, Console(quiet=True))
    rounds = [calls[i:i + 4] for i in range(0, len(calls), 4)]
    assert len(rounds) == 4 and all(sorted(r) == sorted(speeds) for r in rounds)  # torch in each
    assert rounds[0] == ["sandwich", "llama.cpp", "llama.cpp mlock", "torch"] and rounds[1] == rounds[0][::-1]
    assert [(o["prompt"], o["round"], o["system"]) for o in result["order"]][:4] == [
        (8, 0, "sandwich"), (8, 0, "llama.cpp"), (8, 0, "llama.cpp mlock"), (8, 0, "torch")]
    sw = [r for r in result["rows"] if r["system"] == "sandwich"]
    assert len(sw) == 2
    for r in sw:  # paired: the host's 2x flips cancel out of every ratio
        assert r["tpot_ratio_vs_torch"] == pytest.approx(0.25)
        assert r["tpot_ratio_vs_llamacpp"] == pytest.approx(0.5)
        assert r["tpot_ratio_vs_llamacpp_mlock"] == pytest.approx(1 / 1.5)
        assert r["same_tokens_as_llamacpp_mlock"] is True
    torch_rows = [r for r in result["rows"] if r["system"] == "torch"]
    assert all(len(r["tpot_runs_ms"]) == 2 and np.isfinite(r["tpot_ms"]) for r in torch_rows)


def test_decode_weight_reads_say_which_level_served_them(monkeypatch):
    from sandwich_tvm.bench import e2e
    from sandwich_tvm.model.config import PRESETS

    cfg = PRESETS["llama-34m"]
    nbytes = e2e.decode_weight_bytes(cfg, "q4_0")  # 4-bit layers, a q8_0 head
    layers = cfg.num_hidden_layers * cfg.layer_params()
    assert nbytes == layers * 18 / 32 + cfg.vocab_size * cfg.hidden_size * 34 / 32
    monkeypatch.setattr(e2e, "last_level_cache_bytes", lambda: 32 << 20)
    rows = [{"system": "sandwich", "weights": "q4_0", "tpot_ms": 0.25, "decode_bandwidth_gbs": 30.0},
            {"system": "sandwich", "weights": "q4_0", "tpot_ms": 1.0, "decode_bandwidth_gbs": 30.0},
            {"system": "sandwich", "weights": "float32", "tpot_ms": 1.0, "decode_bandwidth_gbs": 30.0},
            {"system": "llama.cpp", "weights": "q4_0", "tpot_ms": 0.5}]
    e2e.add_weight_reads(rows, cfg, "q4_0")
    assert rows[0]["weight_read_gbs"] == pytest.approx(nbytes / 0.25e6)
    assert rows[0]["weights_served_from"] == "last-level cache"  # 76 GB/s of 19 MB: above DRAM's 30
    assert rows[1]["weights_served_from"].startswith("undetermined")  # they fit, but 19 GB/s < 30
    assert rows[2]["weights_served_from"] == "DRAM"  # 120 MB of fp32 weights do not fit 32 MiB
    assert "weights_served_from" not in rows[3] and rows[3]["weight_read_gbs"] > 0  # no probe there
