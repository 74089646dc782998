"""``bench gemm``'s cold weights: the rotation covers every CPU's cache, and grows while a
library's m = 1 GEMM reads its weights faster than the same run's streaming read."""

from __future__ import annotations

import os

import numpy as np

from sandwich_tvm.bench.cold import SLACK, cold_rotation, grow_rotation, llc_bytes_of, stream_read_gbs

MB = 1 << 20


def test_the_rotation_doubles_until_no_library_beats_the_read():
    copy = 100 * MB

    def measure(copies: int) -> tuple[float, dict[str, float]]:
        cached = copies * copy < 400 * MB  # the caches hold up to 400 MB of weights
        return 20.0, {"sandwich": 60.0 if cached else 18.0, "numpy": 10.0, "torch": 45.0 if cached else 15.0}

    out = grow_rotation(1, measure, lambda copies: True)
    assert [a["copies"] for a in out["attempts"]] == [1, 2, 4] and out["copies"] == 4 and out["cold"]
    assert out["attempts"][0]["faster_than_read"] == ["sandwich", "torch"]
    assert out["attempts"][-1]["faster_than_read"] == [] and out["outcome"].startswith("cold")


def test_the_rotation_stops_at_the_memory_bound_and_says_so():
    seen = []

    def measure(copies: int) -> tuple[float, dict[str, float]]:
        seen.append(copies)
        return 20.0, {"sandwich": 50.0, "numpy": 10.0}

    out = grow_rotation(3, measure, lambda copies: copies <= 12)
    assert seen == [3, 6, 12] and out["copies"] == 12 and not out["cold"]
    assert "sandwich" in out["outcome"] and "memory bound" in out["outcome"]


def test_within_the_slack_counts_as_reading_memory():
    out = grow_rotation(2, lambda c: (20.0, {"sandwich": 20.0 * SLACK * 0.99}), lambda c: True)
    assert out["copies"] == 2 and out["cold"] and len(out["attempts"]) == 1


def _cache(root, cpu: int, index: int, level: int, kind: str, size: str, shared: str) -> None:
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (d / name).write_text(f"{value}\n")


def test_llc_of_the_cpus_adds_each_shared_cache_once(tmp_path):
    for cpu in range(4):  # two complexes of two cores, each with its own 32 MiB L3
        _cache(tmp_path, cpu, 0, 1, "Data", "32K", str(cpu))
        _cache(tmp_path, cpu, 1, 1, "Instruction", "32K", str(cpu))
        _cache(tmp_path, cpu, 2, 2, "Unified", "1024K", str(cpu))
        _cache(tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3")
    assert llc_bytes_of(range(4), tmp_path) == 64 * MB  # CPU 0's L3 alone would say 32
    assert llc_bytes_of([0, 1], tmp_path) == 32 * MB
    assert llc_bytes_of([7], tmp_path) == 0  # sysfs says nothing


def test_stream_read_measures_the_buffer():
    cpus = sorted(os.sched_getaffinity(0))
    assert stream_read_gbs(np.ones(1 << 20, np.float32), cpus, repeats=2) > 0


def test_cold_rotation_on_calls_that_read_nothing():
    """No-op calls "read" their weights at an absurd speed: the rotation grows to the bound."""
    made, lines = [], []
    calls = {"sandwich": lambda: None, "numpy": lambda: None}
    one = {"sandwich": 2 * MB, "numpy": 4 * MB}
    cpus = [min(os.sched_getaffinity(0))]
    out = cold_rotation(2, made.append, lambda: calls, one, host_bytes=1 << 50, cpus=cpus, log=lines.append,
                        pause_s=0.0, min_read_bytes=8 * MB)
    assert made == [2] and out["copies"] == 2 and not out["cold"]  # 4 copies would not fit
    assert out["rotation_bytes"] == {"sandwich": 4 * MB, "numpy": 8 * MB}
    assert out["read_bytes"] >= 2 * 8 * MB and out["attempts"][0]["read_gbs"] > 0
    assert "cold check, 2 copies" in lines[0]
    assert out["attempts"][0]["faster_than_read"] == ["numpy", "sandwich"]
