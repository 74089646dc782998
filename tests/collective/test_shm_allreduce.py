"""The shared-memory all-reduce between real processes: sums bit-identical to numpy's in rank
order for decode- and prefill-sized messages, a dead rank is an error, the segment goes away."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.collective.shm import ONE_SHOT_BYTES, CollectiveError, ShmGroup

# one token's hidden state of a small model and of Llama-3-8B; odd lengths; prefill-sized
SIZES = [1, 15, 768, 4096, 4099, ONE_SHOT_BYTES // 4 + 17, 300_001]


def message(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(1000 * (rank + 1) + n).standard_normal(n).astype(np.float32)


RESIDUAL = -1  # the residual stream's "rank": the same array on every rank


def reduce_all(group: ShmGroup, sizes: list[int], residual: bool) -> list[np.ndarray]:
    """Each size's all-reduce; with ``residual``, the residual is added in place (out=residual)."""
    if not residual:
        return [group.allreduce(message(group.rank, n)) for n in sizes]
    outs = []
    for n in sizes:
        stream = message(RESIDUAL, n)
        assert group.allreduce(message(group.rank, n), out=stream, residual=stream) is stream
        outs.append(stream)
    return outs


def _worker(name: str, rank: int, world: int, slot: int, sizes: list[int], residual: bool, results) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    with ShmGroup.attach(name, rank, world, slot, timeout_s=30) as group:
        outs = reduce_all(group, sizes, residual)
    results.put((rank, [o.tobytes() for o in outs]))


def run_group(world: int, sizes: list[int], residual: bool = False) -> list[list[np.ndarray]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with ShmGroup.create(world, max(sizes) * 4, timeout_s=30) as group:
        procs = [ctx.Process(target=_worker,
                             args=(group.name, r, world, group.slot, sizes, residual, results))
                 for r in range(1, world)]
        for p in procs:
            p.start()
        mine = reduce_all(group, sizes, residual)
        got = dict(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        name = group.name
    assert not Path("/dev/shm", name).exists()  # the owner removed the segment
    out = [mine]
    for r in range(1, world):
        out.append([np.frombuffer(b, np.float32) for b in got[r]])
    return out


@pytest.mark.parametrize(("world", "residual"), [(2, False), (3, False), (2, True)])
def test_every_rank_gets_the_rank_order_sum(world, residual):
    per_rank = run_group(world, SIZES, residual)
    for i, n in enumerate(SIZES):
        want = message(0, n)
        for r in range(1, world):
            want = want + message(r, n)  # float32 adds in rank order, as the kernel does
        if residual:
            want = want + message(RESIDUAL, n)  # then the residual, fused into the same pass
        for r in range(world):
            np.testing.assert_array_equal(per_rank[r][i], want, err_msg=f"rank {r}, n={n}")


# (rows, w, full): one token's logits of a vocabulary split in two or three (full < world * w
# where the vocabulary does not divide), and a few rows
GATHERS = [(1, 5, 9), (1, 16_000, 32_000), (3, 7, 7), (2, 1001, 2002)]


def _gatherer(name: str, rank: int, world: int, slot: int, results) -> None:
    with ShmGroup.attach(name, rank, world, slot, timeout_s=30) as group:
        outs = [group.allgather(message(rank, rows * w).reshape(rows, w), full=min(full, world * w))
                for rows, w, full in GATHERS]
    results.put((rank, [o.tobytes() for o in outs]))


@pytest.mark.parametrize("world", [2, 3])
def test_allgather_puts_every_ranks_part_side_by_side(world):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with ShmGroup.create(world, 4 * max(r * w for r, w, _ in GATHERS), timeout_s=30) as group:
        procs = [ctx.Process(target=_gatherer, args=(group.name, r, world, group.slot, results))
                 for r in range(1, world)]
        for p in procs:
            p.start()
        mine = [group.allgather(message(0, rows * w).reshape(rows, w), full=min(full, world * w))
                for rows, w, full in GATHERS]
        got = dict(results.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=30)
    for i, (rows, w, full) in enumerate(GATHERS):
        full = min(full, world * w)
        parts = [message(r, rows * w).reshape(rows, w) for r in range(world)]
        want = np.concatenate(parts, axis=-1)[:, :full]
        np.testing.assert_array_equal(mine[i], want)
        for r in range(1, world):
            np.testing.assert_array_equal(np.frombuffer(got[r][i], np.float32).reshape(rows, full), want)


def _quitter(name: str, slot: int) -> None:
    ShmGroup.attach(name, 1, 2, slot).close()  # joins, then leaves without a collective


def test_a_rank_that_exits_fails_the_wait_at_once():
    ctx = mp.get_context("spawn")
    with ShmGroup.create(2, 4096, timeout_s=60.0) as group:
        p = ctx.Process(target=_quitter, args=(group.name, group.slot))
        p.start()
        p.join(timeout=60)
        start = time.monotonic()
        with pytest.raises(Exception, match=f"rank 1 \\(pid {p.pid}\\) exited"):
            group.allreduce(np.ones(16, np.float32))
        assert time.monotonic() - start < 5  # not the 60 s deadline


def test_a_rank_that_never_arrives_is_an_error_not_a_hang():
    with (ShmGroup.create(2, 4096, timeout_s=1.0) as group,  # rank 1 never attaches
          pytest.raises(Exception, match="rank 1 did not arrive within 1")):
        group.allreduce(np.ones(16, np.float32))


def test_a_rank_that_aborts_fails_its_peers():
    with ShmGroup.create(2, 4096, timeout_s=60.0) as group:
        peer = ShmGroup.attach(group.name, 1, 2, group.slot)
        assert group.pids == [os.getpid(), os.getpid()]
        peer.abort()
        with pytest.raises(Exception, match="rank 1 failed"):
            group.allreduce(np.ones(16, np.float32))
        peer.close()


def test_bad_groups_are_refused():
    with pytest.raises(CollectiveError, match="does not exist"):
        ShmGroup.attach("sandwich-no-such-segment", 1, 2, 4096)
    with ShmGroup.create(2, 4096) as group:
        with pytest.raises(CollectiveError, match=f"exceeds the group's {group.slot}-byte slots"):
            group.allreduce(np.ones(group.slot // 4 + 1, np.float32))
        with pytest.raises(CollectiveError, match="exceeds the group's"):
            group.allgather(np.ones((2, group.slot // 8 + 1), np.float32))
        with pytest.raises(CollectiveError, match="outside a group of 2"):
            ShmGroup.attach(group.name, 2, 2, group.slot)


def test_the_owner_removes_the_segment_even_while_a_view_of_it_lives():
    group = ShmGroup.create(1, 4096)
    view = group._seg[:64]  # e.g. a tensor someone kept
    path = Path("/dev/shm", group.name)
    assert path.exists()
    group.close()
    assert not path.exists()
    assert view.shape == (64,)  # still mapped, goes with the view


def test_bench_allreduce_times_two_real_processes_and_reports_both_bandwidths():
    from sandwich_tvm.bench.allreduce import bench_allreduce

    sizes = [768, 70_000]
    result = bench_allreduce(2, sizes, rounds=1, systems=["shm"], log=lambda _m: None)
    assert result["read_gbs"] > 0
    assert [(r["procs"], r["floats"]) for r in result["rows"]] == [(2, n) for n in sizes]
    for r in result["rows"]:
        seconds = r["shm_us"] / 1e6
        assert 0 < seconds < 1
        # bus bandwidth: what one rank's link carries; memory: every rank reads and writes the message
        assert np.isclose(r["shm_bus_gbs"], r["bytes"] / seconds / 1e9)
        assert np.isclose(r["shm_mem_gbs"], 4 * r["bytes"] / seconds / 1e9)
        assert np.isclose(r["shm_mem_of_read"], r["shm_mem_gbs"] / result["read_gbs"])


def test_bench_e2e_times_the_allreduce_for_the_simulator():
    from sandwich_tvm.bench.e2e import allreduce_profile

    terms = allreduce_profile(2, 768, log=lambda _m: None)
    assert 0 < terms["allreduce_latency_us"] < 1e5 and terms["allreduce_gbs"] > 0


def test_the_simulator_sizes_allreduces_as_fp32_activations():
    """The residual stream stays fp32 whatever the weights' dtype: slowing the all-reduce adds the
    same time to a bf16 model's TP-2 prefill and decode as to an fp32 model's."""
    from sandwich_tvm.model.config import PRESETS
    from sandwich_tvm.topology import load_tree
    from sandwich_tvm.topology.configs import ServiceConfig
    from sandwich_tvm.topology.microbench import measure_profile
    from sandwich_tvm.topology.simulator import LatencySimulator, Trace

    tree, found = load_tree()
    profile = measure_profile(tree, found.cpu_model, refresh=False, log=lambda _m: None)
    config = ServiceConfig(((tree.pus[0],), (tree.pus[-1],)), ((tree.domains[0],), (tree.domains[-1],)))
    trace = Trace(prompt=np.array([64.0]), output=np.array([8.0]))
    added = {}
    cfg = PRESETS["llama-160m"]
    for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):  # the weights' bytes
        times = []
        for gbs in (10.0, 0.1):
            sim = LatencySimulator(tree, dataclasses.replace(profile, allreduce_gbs=gbs), cfg, trace,
                                   weight_bytes=nbytes, kv_bytes=nbytes)
            p = trace.prompt
            times.append(np.array([sim.ttft_ms(config, p)[0], sim.tpot_ms(config, p)[0]]))
        added[dtype] = times[1] - times[0]
    assert (added["float32"] > 0).all()
    np.testing.assert_allclose(added["bfloat16"], added["float32"], rtol=1e-9)


def test_disco_sessions_reduce_through_the_shared_memory():
    """The same all-reduce is Disco's collective for CPU workers: ``Session.allreduce`` (sum and
    average) on a two-worker ``ProcessSession`` whose workers run sandwich's entrypoint."""
    from sandwich_tvm.runtime import tp_worker
    from sandwich_tvm.runtime.disco_group import DiscoGroup

    with ShmGroup.create(2, 4096, timeout_s=30) as group:
        disco = DiscoGroup(2, tp_worker.ENTRYPOINT)
        try:
            rank0 = disco.start(tp_worker.ATTACH, group.name, 2, group.slot, 30.0)
            assert isinstance(rank0, tp_worker.Rank) and rank0.group.name == group.name
            sess = disco.session
            parts = [message(r, 1000) for r in range(2)]
            for op, want in (("sum", parts[0] + parts[1]), ("avg", (parts[0] + parts[1]) / 2)):
                src, dst = sess.empty((1000,), "float32"), sess.empty((1000,), "float32")
                for r in range(2):
                    src.debug_copy_from(r, parts[r])
                sess.allreduce(src, dst, op=op)
                for r in range(2):
                    np.testing.assert_allclose(dst.debug_get_from_remote(r).numpy(), want, rtol=1e-6)
        finally:
            disco.close()


def test_a_segment_that_fails_to_open_is_removed(monkeypatch):
    """``create`` made the file but could not map it: nothing holds the group to close it, so
    the file goes at once."""
    from sandwich_tvm.collective import shm

    def fail(*_args, **_kwargs):
        raise OSError("no memory to map the segment")

    before = set(shm.SHM_DIR.glob(f"sandwich-{os.getpid()}-*"))
    monkeypatch.setattr(ShmGroup, "_open", classmethod(fail))
    with pytest.raises(OSError, match="no memory"):
        ShmGroup.create(2, 1024)
    assert set(shm.SHM_DIR.glob(f"sandwich-{os.getpid()}-*")) == before
