"""``bench allreduce`` places each system's ranks as its users do and says how: gloo's ranks are
not pinned (their I/O threads float over the same CPUs), the shared-memory ranks one per CPU."""

from __future__ import annotations

import os

import pytest

from sandwich_tvm.bench import allreduce
from sandwich_tvm.bench.allreduce import PLACEMENTS, bench_allreduce, rank_cpus, run_gloo

CPUS = sorted(os.sched_getaffinity(0))


def test_rank_cpus_per_system():
    cpus = [4, 5, 6, 7]
    assert [rank_cpus("shm", r, 2, cpus) for r in range(2)] == [[4], [5]]
    assert [rank_cpus("gloo-pinned", r, 3, cpus) for r in range(3)] == [[4], [5], [6]]
    assert [rank_cpus("gloo", r, 3, cpus) for r in range(3)] == [[4, 5, 6]] * 3  # the same P CPUs
    assert rank_cpus("gloo", 0, 6, cpus) == cpus  # more ranks than CPUs: all of them
    assert "torchrun" in PLACEMENTS["gloo"] and "not pinned" in PLACEMENTS["gloo"]


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("system", ["gloo", "gloo-pinned"])
def test_gloo_threads_run_where_the_placement_says(system):
    pytest.importorskip("torch.distributed")
    seen: dict[int, list[list[int]]] = {}
    times = run_gloo(2, [768], rounds=1, cpus=CPUS, system=system, threads=seen)
    assert 0 < times[768] < 1 and sorted(seen) == [0, 1]
    for rank, sets in seen.items():
        # every thread of the rank, gloo's I/O threads included, on the rank's CPUs
        assert sets == [rank_cpus(system, rank, 2, CPUS)], (rank, sets)


def test_report_says_how_each_systems_ranks_were_placed(monkeypatch):
    class Probe:
        def __init__(self, cpus):
            pass

        def sample(self) -> float:
            return 10.0

    def fake_gloo(world, sizes, rounds, cpus, system, threads):
        threads.update({r: [rank_cpus(system, r, world, cpus)] for r in range(world)})
        return {n: 1e-5 * (2 if system == "gloo-pinned" else 1) for n in sizes}

    monkeypatch.setattr("sandwich_tvm.topology.microbench.BandwidthProbe", Probe)
    monkeypatch.setattr(allreduce, "run_shm", lambda world, sizes, rounds, cpus: {n: 5e-6 for n in sizes})
    monkeypatch.setattr(allreduce, "run_gloo", fake_gloo)
    result = bench_allreduce(2, [768], 1, ["shm", "gloo", "gloo-pinned"], log=lambda _m: None)
    where = result["placement"]
    assert set(where) == {"shm", "gloo", "gloo-pinned"}
    assert where["gloo"]["how"] == PLACEMENTS["gloo"]
    ranks = where["gloo"]["ranks"]["2"]
    assert [r["cpus"] for r in ranks] == [rank_cpus("gloo", r, 2, CPUS) for r in range(2)]
    assert ranks[0]["thread_cpus"] == [rank_cpus("gloo", 0, 2, CPUS)]
    assert [r["cpus"] for r in where["shm"]["ranks"]["2"]] == [[CPUS[0]], [CPUS[1 % len(CPUS)]]]
    row = result["rows"][0]
    assert row["gloo_pinned_us"] == pytest.approx(20.0) and row["latency_ratio"] == pytest.approx(0.5)
