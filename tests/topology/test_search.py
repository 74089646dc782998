"""Configuration search and the latency simulator, on modelled machines."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sandwich_tvm.cli import topo as topo_cli
from sandwich_tvm.model.config import PRESETS
from sandwich_tvm.model.stages import split_layers
from sandwich_tvm.topology import load_tree, parse_config, search_plans
from sandwich_tvm.topology.hwobj import TopologyError
from sandwich_tvm.topology.profile import (
    MachineProfile,
    ProfileError,
    Resource,
    load_profile,
    match_profile,
)
from sandwich_tvm.topology.simulator import LatencySimulator
from tests.conftest import KUNPENG_192, topology

MILAN = str(topology("epyc-milan7763-2s-2n-128c-ccx8-nosmt"))

pytestmark = pytest.mark.hwloc


def test_shipped_profiles_load_and_match():
    tree, found = load_tree(xml=MILAN)
    assert match_profile(found.cpu_model, len(tree.pus)).name == "epyc-milan7763-2s"
    kp, found = load_tree(synthetic=KUNPENG_192)
    assert match_profile(found.cpu_model, len(kp.pus)).name == "kunpeng920-4s-192c"


def test_profile_errors(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)
    bad.write_text(json.dumps({"name": "x", "gflops_per_core": 10, "resources": [], "turbo": 1}))
    with pytest.raises(ProfileError, match="unknown fields"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="no machine profile"):
        load_profile("no-such-machine")


def test_tp_limits_reject_degrees_that_do_not_divide_heads(trace):
    tree, _ = load_tree(xml=MILAN)
    model = PRESETS["llama-160m"]  # 12 heads: TP 16 and 128 are impossible, 2 is fine
    assert model.tp_degrees_ok(2) and not model.tp_degrees_ok(16) and not model.tp_degrees_ok(8)
    result = search_plans(tree, model, load_profile("epyc-milan7763-2s"), trace)
    assert result.plans and all(model.tp_degrees_ok(p.plan.tp) for p in result.plans)
    assert result.stats.cuts_rejected_tp > 0
    assert any(p.plan.tp > 1 for p in result.plans)  # two sockets: multi-process plans rank
    bounded = search_plans(tree, model, load_profile("epyc-milan7763-2s"), trace, max_tp=1)
    assert bounded.plans and all(p.plan.tp == 1 for p in bounded.plans)  # tune plan --max-tp 1


@pytest.mark.parametrize(("source", "profile"), [
    ({"xml": MILAN}, "epyc-milan7763-2s"),
    ({"synthetic": KUNPENG_192}, "kunpeng920-4s-192c"),
])
def test_search_on_big_machines(source, profile, trace):
    tree, _ = load_tree(**source)
    model = PRESETS["llama-3-8b"]
    result = search_plans(tree, model, load_profile(profile), trace, top_k=10)
    # The search's cost is part of the product: the issue asks for < 60 s on this machine.
    assert result.stats.seconds < 60
    assert len(result.plans) == 10
    latencies = [p.prediction.latency_ms for p in result.plans]
    assert all(a <= b + 1e-6 for a, b in zip(latencies, latencies[1:], strict=False))
    for ranked in result.plans:
        plan = ranked.plan
        assert plan.decode.tp == plan.prefill.tp
        for pre, dec in zip(plan.prefill.processes, plan.decode.processes, strict=True):
            assert set(dec) <= set(pre)  # decode uses a subset of the same partition
        assert sorted(plan.prefill.cpus()) == sorted(tree.pus)  # prefill uses every core
    s = result.stats
    assert s.group_trees_unique < s.group_trees_generated
    assert s.remove_trees_pruned > 0 and s.configs_evaluated > 0


def test_early_stopping_skips_configurations(trace):
    tree, _ = load_tree(synthetic=KUNPENG_192)
    model, profile = PRESETS["llama-3-8b"], load_profile("kunpeng920-4s-192c")
    patient = search_plans(tree, model, profile, trace, patience=10_000)
    hasty = search_plans(tree, model, profile, trace, patience=2)
    assert patient.stats.configs_skipped_early_stop == 0
    assert hasty.stats.configs_skipped_early_stop > 0 and hasty.stats.groups_early_stopped > 0
    assert hasty.stats.configs_evaluated < patient.stats.configs_evaluated


def test_search_bound_stops_early_and_says_so(trace, capsys):
    tree, _ = load_tree(synthetic=KUNPENG_192)
    model, profile = PRESETS["llama-160m"], load_profile("kunpeng920-4s-192c")
    full = search_plans(tree, model, profile, trace)
    bounded = search_plans(tree, model, profile, trace, max_trees=60)
    assert not full.stats.bounded and bounded.stats.bounded
    generated = bounded.stats.group_trees_generated - 1 + bounded.stats.remove_trees_generated
    assert generated <= 60 and bounded.plans  # every grouped tree's own cuts are still ranked
    argv = ["--synthetic", KUNPENG_192, "--machine-profile", "kunpeng920-4s-192c", "--lengths", "128:32",
            "--max-trees", "60"]
    assert topo_cli.main(argv) == 0
    assert "search bounded: stopped at 60 generated TopoTrees (--max-trees)" in capsys.readouterr().out
    assert topo_cli.main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["stats"]["bounded"] and "search bounded" in captured.err


def _cluster_bound_profile() -> MachineProfile:
    """Plenty of DRAM bandwidth, but 4-core clusters that choke with all 4 cores streaming."""
    return MachineProfile("cluster-bound", 40.0, (
        Resource("NUMANode", "numa", (1000.0,)),
        Resource("L3Tag", "latent", (10.0, 20.0, 30.0, 16.0), size=4),
    ))


def test_decode_plan_removes_a_core_per_latent_cluster(trace):
    tree, _ = load_tree(synthetic="package:1 [numa] l3:1 core:16 pu:1")
    result = search_plans(tree, PRESETS["llama-160m"], _cluster_bound_profile(), trace)
    best = result.plans[0].plan
    assert best.prefill.threads == 16
    decode = best.decode.cpus()
    assert len(decode) == 12
    assert all(len([c for c in decode if c // 4 == k]) == 3 for k in range(4))
    assert any(t.startswith("group(4,1") for t in best.transforms)


def test_simulator_roofline_behaviour(trace):
    tree, _ = load_tree(xml=MILAN)
    sim = LatencySimulator(tree, load_profile("epyc-milan7763-2s"), PRESETS["llama-3-8b"], trace)
    one = parse_config(tree, "1x128")
    two = parse_config(tree, "2x64")
    ttft = sim.ttft_ms(two, np.array([128, 512, 1024]))
    assert np.all(np.diff(ttft) > 0)  # longer prompts take longer
    tpot = sim.tpot_ms(two, np.array([16, 1024, 4096]))
    assert np.all(np.diff(tpot) > 0)  # longer contexts read more KV cache
    assert two.domains == ((0,), (1,)) and one.domains == ((0, 1),)
    assert sim.tpot_ms(two, np.array([512]))[0] < sim.tpot_ms(one, np.array([512]))[0]  # NUMA-local
    few = parse_config(tree, "2x16")  # 16 cores of each socket: only 2 of its 8 CCD links
    assert sim.bandwidth_gbs(few) < sim.bandwidth_gbs(two)


def test_simulator_pipeline_stages(trace):
    """Two stages, one per socket: a batch-1 decode step runs them one after the other (each
    alone on its socket, so as slow as one socket reading every weight, plus the hand-offs),
    while a long prompt's pieces overlap on both sockets."""
    from sandwich_tvm.topology.configs import ServiceConfig

    tree, _ = load_tree(xml=MILAN)
    sim = LatencySimulator(tree, load_profile("epyc-milan7763-2s"), PRESETS["llama-3-8b"], trace)
    tp2 = parse_config(tree, "2x64")
    pp2 = ServiceConfig(tp2.processes, tp2.domains, pp=2)
    socket = ServiceConfig(tp2.processes[:1], tp2.domains[:1])
    assert pp2.tp == 1 and pp2.stage(1).processes == tp2.processes[1:] and "2 stages" in pp2.describe()
    ctx = np.array([512.0])
    pp_tpot, socket_tpot = sim.tpot_ms(pp2, ctx)[0], sim.tpot_ms(socket, ctx)[0]
    assert socket_tpot < pp_tpot < 1.05 * socket_tpot  # the same bytes at one socket's speed, plus hops
    assert sim.tpot_ms(tp2, ctx)[0] < pp_tpot  # TP reads both halves at once
    # two sequences go through as two micro-batches one tick apart: each stage reads its weights
    # twice, but the stages overlap, so the step is 1.5 batch-1 steps, not 2 (nor 1)
    two = sim.tpot_ms(pp2, ctx, batch=2)[0]
    assert 1.4 * pp_tpot < two < 1.6 * pp_tpot
    assert sim.tpot_ms(pp2, ctx, batch=3)[0] > two  # micro-batches of 2 and 1: the larger sets a tick
    prompt = np.array([1024.0])
    assert sim.ttft_ms(pp2, prompt)[0] < 0.75 * sim.ttft_ms(socket, prompt)[0]  # pieces overlap
    assert sim.ttft_ms(pp2, np.array([20.0]))[0] > sim.ttft_ms(socket, np.array([20.0]))[0]  # one piece
    # llama-160m in bf16 (~320 MB) outgrows a socket's 256 MB of L3, each stage's half does not:
    # a stage's steps read its own weights from its LLC, one socket reads them all from DRAM
    small = LatencySimulator(tree, load_profile("epyc-milan7763-2s"), PRESETS["llama-160m"], trace,
                             weight_bytes=2.0)
    assert small.bandwidth_gbs(socket) < small.bandwidth_gbs(socket, resident=small.stage_bytes(
        split_layers(12, 2)[0], 1))
    assert small.tpot_ms(pp2, ctx)[0] < 0.8 * small.tpot_ms(socket, ctx)[0]
    # a batch reads the weights once: two sequences cost little more than one on a memory-bound
    # socket; 32 cost their caches and arithmetic
    one, two, many = (sim.tpot_ms(socket, ctx, batch=b)[0] for b in (1, 2, 32))
    kv = cache_bytes(sim, 512) / (sim.bandwidth_gbs(socket, resident=float("inf")) * 1e6)
    assert two == pytest.approx(one + kv, rel=0.02) and many > one + 30 * kv


def cache_bytes(sim, context: int) -> float:
    """One sequence's K and V over every layer."""
    m = sim.model
    return context * m.num_hidden_layers * 2 * m.num_key_value_heads * m.head_dim * sim.kv_bytes


def test_simulator_weight_attention_separation(trace):
    """Weights on one socket, the KV cache and attention on the other: a decode step reads the
    weights at one socket's speed, then the cache at the other's, with two hand-offs a layer; a
    longer context costs only the attention side more, and a slower hand-off costs 2 per layer."""
    import dataclasses

    from sandwich_tvm.topology.configs import ServiceConfig

    tree, _ = load_tree(xml=MILAN)
    model, profile = PRESETS["llama-3-8b"], load_profile("epyc-milan7763-2s")
    sim = LatencySimulator(tree, profile, model, trace)
    tp2 = parse_config(tree, "2x64")
    wa = ServiceConfig(tp2.processes, tp2.domains, wa=True)
    socket = ServiceConfig(tp2.processes[:1], tp2.domains[:1])
    assert wa.tp == 1 and wa.side(1).processes == tp2.processes[1:] and "attention rank" in wa.describe()
    # caches past the LLC: 4,096 more tokens cost their bytes at the attention socket's DRAM speed
    short, long = sim.tpot_ms(wa, np.array([4096.0]))[0], sim.tpot_ms(wa, np.array([8192.0]))[0]
    attention = ServiceConfig(tp2.processes[1:], tp2.domains[1:])
    kv = model.num_hidden_layers * 2 * 4096 * model.num_key_value_heads * model.head_dim * 4
    assert long - short == pytest.approx(kv / (sim.bandwidth_gbs(attention, resident=kv) * 1e6), rel=1e-6)
    assert sim.tpot_ms(socket, np.array([4096.0]))[0] < short  # the same weight bytes, plus the hand-offs
    # the sides are on two sockets: each hand-off pays the cross-NUMA latency
    slower = LatencySimulator(tree, dataclasses.replace(profile, allreduce_cross_numa_us=115.0), model, trace)
    added = slower.tpot_ms(wa, np.array([4096.0]))[0] - short
    per_handoff_ms = (115.0 - profile.allreduce_cross_numa_us) / 1e3
    assert added == pytest.approx(2 * model.num_hidden_layers * per_handoff_ms)
    assert sim.ttft_ms(wa, np.array([1024.0]))[0] > 0
    # each context length decides alone whether its cache fits the attention side's LLC
    both = sim.tpot_ms(wa, np.array([256.0, 8192.0]))
    alone = [sim.tpot_ms(wa, np.array([c]))[0] for c in (256.0, 8192.0)]
    dram = LatencySimulator(tree, dataclasses.replace(profile, llc_gbs_per_core=0.0), model, trace)
    assert both == pytest.approx(alone)
    assert alone[0] < dram.tpot_ms(wa, np.array([256.0]))[0]  # 256 tokens of cache fit: read from the LLC
    assert alone[1] == pytest.approx(dram.tpot_ms(wa, np.array([8192.0]))[0])  # 8,192 do not


def test_simulator_takes_the_decode_kernels_measured_time_as_a_floor(trace):
    """A small quantized model's decode GEMMs compute slower than its weights stream: with their
    tuning's m = 1 times the step is those times per layer (plus the cache) and the head's."""
    from sandwich_tvm.topology.configs import ServiceConfig
    from sandwich_tvm.topology.simulator import DecodeKernels

    tree, _ = load_tree(xml=MILAN)
    model, profile = PRESETS["llama-3-8b"], load_profile("epyc-milan7763-2s")
    socket = ServiceConfig(parse_config(tree, "2x64").processes[:1], parse_config(tree, "2x64").domains[:1])
    ctx = np.array([512.0])
    roof = LatencySimulator(tree, profile, model, trace).tpot_ms(socket, ctx)[0]
    slow = DecodeKernels(layer_ms=10.0, head_ms=30.0)
    sim = LatencySimulator(tree, profile, model, trace, decode_kernels={socket.threads: slow})
    kv = 2 * 512 * model.num_key_value_heads * model.head_dim * 4 / (sim.bandwidth_gbs(socket) * 1e6)
    expected = model.num_hidden_layers * (10.0 + kv + profile.layer_overhead_us / 1e3) + 30.0
    assert sim.tpot_ms(socket, ctx)[0] == pytest.approx(expected) and expected > roof
    fast = LatencySimulator(tree, profile, model, trace, decode_kernels={socket.threads: DecodeKernels(0, 0)})
    assert fast.tpot_ms(socket, ctx)[0] == pytest.approx(roof)  # kernels faster than the roofline: no change
    other = LatencySimulator(tree, profile, model, trace,  # only another thread count measured: scaled
                             decode_kernels={2 * socket.threads: DecodeKernels(5.0, 15.0)})
    assert other.tpot_ms(socket, ctx)[0] == pytest.approx(expected)


def test_simulator_stages_on_other_hosts_pay_the_measured_hops(trace):
    """Stages across hosts: the shared-memory hand-offs become relayed hops (``bench hop``'s
    latency per call and bandwidth per byte); without a measured hop cost it is an error."""
    from sandwich_tvm.topology.configs import ServiceConfig
    from sandwich_tvm.topology.simulator import HopCost

    tree, _ = load_tree(xml=MILAN)
    model = PRESETS["llama-3-8b"]
    tp2 = parse_config(tree, "2x64")
    local = ServiceConfig(tp2.processes, tp2.domains, pp=2)
    remote = ServiceConfig(tp2.processes, tp2.domains, pp=2, hosts=True)
    assert "2 stages on hosts" in remote.describe()
    hop = HopCost.from_json({"latency_us": 250.0, "gbs": 0.03})
    sim = LatencySimulator(tree, load_profile("epyc-milan7763-2s"), model, trace, hop=hop)
    ctx = np.array([512.0])
    shm_hops = 2 * sim._hop_ms(model.hidden_size * 4)
    # decode at batch 1: 3 calls; stage 0's hidden state down to stage 1, stage 1's up to the head
    net = 3 * 0.25 + 2 * model.hidden_size * 4 / 0.03e6
    assert sim.tpot_ms(remote, ctx)[0] == pytest.approx(sim.tpot_ms(local, ctx)[0] - shm_hops + net)
    with pytest.raises(ValueError, match="run `bench hop`"):
        LatencySimulator(tree, load_profile("epyc-milan7763-2s"), model, trace).tpot_ms(remote, ctx)
    with pytest.raises(ValueError, match="rerun `bench hop`"):
        HopCost.from_json({"latency_us": 250.0, "gbs": None})


def test_parse_config_forms():
    tree, _ = load_tree(xml=MILAN)
    assert parse_config(tree, "8x16").describe() == "8x16"  # needs a latent group of 2 L3s
    explicit = parse_config(tree, "0-15;64-79")
    assert explicit.processes[1][0] == 64 and explicit.domains == ((0,), (1,))
    with pytest.raises(TopologyError, match="no cut"):
        parse_config(tree, "3x8")
    with pytest.raises(TopologyError, match="not in this machine"):
        parse_config(tree, "0-3;500-503")
    with pytest.raises(TopologyError, match="PxC"):
        parse_config(tree, "axb")


def test_topo_cli_json(capsys):
    code = topo_cli.main(["--xml", MILAN, "--model", "tinyllama-1.1b", "--lengths", "512:128",
                          "--top-k", "3", "--evaluate", "2x64/2x32", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["plans"]) == 3
    for plan in out["plans"]:
        for key in ("processes", "tp", "prefill_cpus", "decode_cpus", "predicted_ttft_ms",
                    "predicted_tpot_ms"):
            assert key in plan
        assert len(plan["prefill_cpus"]) == plan["processes"]
    assert out["evaluated"]["decode"]["threads"] == 32


def test_topo_cli_clear_errors(capsys):
    assert topo_cli.main(["--synthetic", "package:2 core:oops"]) == 2
    assert "synthetic" in capsys.readouterr().err
    assert topo_cli.main(["--xml", MILAN, "--model", "/nonexistent/model"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert topo_cli.main(["--xml", MILAN, "--lengths", "12"]) == 2
    assert "PROMPT:OUTPUT" in capsys.readouterr().err


def test_a_searched_plan_is_the_plan_the_runtime_follows(trace):
    """The search's plan value and plans.json say the same thing: on this machine the runtime's
    ExecPlan read back from the file equals the one the search hands over; on a big modelled
    machine every rank keeps its CPUs and NUMA nodes."""
    from sandwich_tvm.topology.plan import ExecPlan

    tree, _ = load_tree()
    here = search_plans(tree, PRESETS["llama-160m"], load_profile("generic"), trace, top_k=3)
    for ranked in here.plans:
        assert ExecPlan.from_dict(json.loads(json.dumps(ranked.to_dict())), "plans.json") == \
            ranked.exec_plan("plans.json")
    tree, _ = load_tree(xml=MILAN)
    big = search_plans(tree, PRESETS["llama-160m"], load_profile("epyc-milan7763-2s"), trace)
    for ranked in big.plans:
        plan, p = ranked.exec_plan(), ranked.plan
        assert plan.tp == p.tp and plan.numa == p.prefill.domains
        assert plan.ranks == tuple(zip(p.prefill.processes, p.decode.processes, strict=True))
        assert plan.predicted_tpot_ms == round(ranked.prediction.tpot_ms, 3)


def test_the_simulator_reads_the_head_in_its_own_type(trace):
    """Under 4-bit weights the lm_head is q8_0: its bytes, not the layers', cost its stream."""
    from sandwich_tvm.spec import DTYPE_BYTES
    from sandwich_tvm.topology.configs import ServiceConfig

    tree, _ = load_tree(xml=MILAN)
    model, profile = PRESETS["llama-3-8b"], load_profile("epyc-milan7763-2s")
    socket = ServiceConfig(parse_config(tree, "2x64").processes[:1], parse_config(tree, "2x64").domains[:1])
    ctx = np.array([512.0])
    q4 = LatencySimulator(tree, profile, model, trace, weight_bytes=DTYPE_BYTES["q4_0"])
    mixed = LatencySimulator(tree, profile, model, trace, weight_bytes=DTYPE_BYTES["q4_0"],
                             head_bytes=DTYPE_BYTES["q8_0"])
    extra = model.hidden_size * model.vocab_size * (DTYPE_BYTES["q8_0"] - DTYPE_BYTES["q4_0"])
    gap = mixed.tpot_ms(socket, ctx)[0] - q4.tpot_ms(socket, ctx)[0]
    assert gap == pytest.approx(extra / (q4.bandwidth_gbs(socket) * 1e6)) and gap > 0


def test_the_search_ranks_pipeline_and_separated_arrangements_beside_tensor_parallel(trace):
    """Every plan of several processes is also ranked as pipeline stages (each stage's ranks a
    valid TP degree) and with weight-attention separation; the arrangement reaches the plan the
    runtime follows and its plans.json entry."""
    import dataclasses

    from sandwich_tvm.topology.configs import SandwichPlan
    from sandwich_tvm.topology.search import arrangements, runnable

    tree, _ = load_tree(xml=MILAN)
    model = PRESETS["llama-3.2-1b"]  # 32 heads, 8 KV heads, 16 layers
    four = parse_config(tree, "4x32")
    kinds = {(p.prefill.pp, p.prefill.wa, p.tp) for p in arrangements(SandwichPlan(four, four), model)}
    assert kinds == {(1, False, 4), (2, False, 2), (4, False, 1)}  # 3 ranks beside attention: no TP-3
    two = parse_config(tree, "2x64")
    kinds = {(p.prefill.pp, p.prefill.wa, p.tp) for p in arrangements(SandwichPlan(two, two), model)}
    assert kinds == {(1, False, 2), (2, False, 1), (1, True, 1)}

    small = PRESETS["llama-160m"]  # 12 heads and 12 layers: 8 processes only as stages
    assert runnable(small, 8) and runnable(small, 12) and not runnable(small, 13)
    deep = dataclasses.replace(PRESETS["llama-3-8b"], num_hidden_layers=80)  # stages up to one group's 64
    assert runnable(deep, 64) and not runnable(deep, 65)
    eight = parse_config(tree, "8x16")
    kinds = {(p.prefill.pp, p.prefill.wa, p.tp) for p in arrangements(SandwichPlan(eight, eight), small)}
    assert kinds == {(2, False, 4), (4, False, 2), (8, False, 1)}
    staged = search_plans(tree, small, load_profile("epyc-milan7763-2s"), trace, top_k=100_000)
    assert any(r.plan.prefill.pp == 8 for r in staged.plans)  # a cut no TP degree allows
    assert all(small.tp_degrees_ok(r.plan.tp) and r.plan.prefill.pp <= 12 for r in staged.plans)

    result = search_plans(tree, model, load_profile("epyc-milan7763-2s"), trace, top_k=100_000)
    found = {(r.plan.prefill.pp, r.plan.prefill.wa) for r in result.plans}
    assert {(1, False), (2, False), (4, False), (1, True)} <= found
    tp2 = next(r for r in result.plans if r.plan.prefill.pp == 1 and not r.plan.prefill.wa
               and r.plan.tp == 2)
    for ranked in result.plans:  # each arrangement is predicted as itself
        plan = ranked.plan
        assert ranked.prediction == result.simulator.predict(plan.prefill, plan.decode)
    same = [r for r in result.plans if r.plan.prefill.key == tp2.plan.prefill.key
            and r.plan.decode.key == tp2.plan.decode.key]
    assert len({(r.plan.prefill.pp, r.plan.prefill.wa) for r in same}) == 3  # TP-2, PP-2, WA
    assert len({round(r.prediction.tpot_ms, 6) for r in same}) == 3
    staged = next(r for r in result.plans if r.plan.prefill.pp == 2 and r.plan.tp == 1)
    sep = next(r for r in result.plans if r.plan.prefill.wa)
    for ranked, pp, wa in ((staged, 2, False), (sep, 1, True)):
        entry = ranked.to_dict()
        assert (entry["processes"], entry["pp"], entry["wa"]) == (2, pp, wa)
        runs = ranked.exec_plan()
        assert (runs.processes, runs.pp, runs.wa) == (2, pp, wa)
        written = runs.to_dict()  # the plans.json entry `generate --plan` reads (this host's CPUs aside)
        assert (written["processes"], written["pp"], written.get("wa", False)) == (2, pp, wa)
