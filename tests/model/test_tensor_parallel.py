"""Tensor parallelism: the Megatron split of each weight, and a two-process plan (one core per
rank, TVM Disco, the shared-memory all-reduce) against HF transformers and one process on the
same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.cli.options import synthetic_prompt
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.parallel import Shard, ShardError, check_tp
from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.engine import EngineError
from sandwich_tvm.runtime.loader import open_engine
from sandwich_tvm.runtime.sampling import SamplingParams
from sandwich_tvm.runtime.scheduler import SchedulerPolicy
from sandwich_tvm.spec import RunSpec, resolve_run_spec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS

from ..precompile import generate_spec, selected, warm_up
from .hf_models import CONFIGS, hf_checkpoint
from .test_pipeline_parallel import KillAfter

torch = pytest.importorskip("torch")

CPUS = sorted(PROCESS_CPUS)
DECODE_STEPS = 24


def test_a_shard_is_each_ranks_part_of_every_segment():
    w = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    qkv = Shard(0, (6, 2, 2))  # q | k | v rows
    parts = [qkv.take(w, r, 2) for r in range(2)]
    assert [p.shape for p in parts] == [(5, 3), (5, 3)] and qkv.local(2) == 5
    np.testing.assert_array_equal(parts[1], np.concatenate([w[3:6], w[7:8], w[9:10]]))
    cols = Shard(1, (3,))  # a row-parallel weight: input columns, the last rank padded with zeros
    assert cols.take(w, 1, 2).shape == (10, 2)
    np.testing.assert_array_equal(cols.take(w, 1, 2), np.pad(w[:, 2:], ((0, 0), (0, 1))))
    assert Shard.from_json(qkv.to_json()) == qkv
    with pytest.raises(ShardError, match="does not split into segments"):
        Shard(0, (4, 4)).take(w, 0, 2)


def test_a_model_that_cannot_be_split_evenly_is_refused():
    cfg = load_config("llama-160m")  # 12 heads
    check_tp(cfg, 4)
    with pytest.raises(ShardError, match="12 attention heads, which 5 processes cannot share"):
        check_tp(cfg, 5)


def _write_tp2_plan(path: Path) -> Path:
    path.write_text(json.dumps({"plans": [{"tp": 2, "prefill_cpus": [[CPUS[0]], [CPUS[1]]],
                                           "decode_cpus": [[CPUS[0]], [CPUS[1]]]}]}))
    return path


def _plan_file_argv(model_dir: Path, plan: Path) -> list[str]:
    return ["--model", str(model_dir), "--plan", str(plan), "--prompt-len", "20", "--max-new-tokens", "6",
            "--dtype", "float32", "--kv-dtype", "float32", "--json"]


def _tp2() -> ExecPlan:
    return ExecPlan.of_ranks([((CPUS[0],), (CPUS[0],)), ((CPUS[1],), (CPUS[1],))], "test: TP-2")


def _tp1() -> ExecPlan:
    return ExecPlan.of_ranks([(tuple(CPUS), tuple(CPUS))], "test: TP-1")


def _engine_spec(model_dir: Path, plan: ExecPlan) -> RunSpec:
    return resolve_run_spec(model_dir, plan=plan, context=256, max_batch=1, kv_dtype="float32",
                            dtype="float32")


if len(CPUS) >= 2:
    warm_up(__name__, "test_two_processes_match_hf_and_a_killed_rank_ends_cleanly",
            lambda base: [_engine_spec(hf_checkpoint(base, case), plan) for case in sorted(CONFIGS)
                          for plan in (_tp2(), _tp1())])
    warm_up(__name__, "test_generate_runs_a_two_process_plan_file",
            lambda base: [generate_spec(_plan_file_argv(hf_checkpoint(base, "gqa-tied-llama3"),
                                                        _write_tp2_plan(base / "tp2-plans.json")))])


@pytest.fixture(scope="module")
def plan_file_build(hf_case, precompiler, request, tmp_path_factory):
    """The plan-file test's TP-2 build (generate's batch of 8) starts on the other core with the
    first test of its checkpoint that asks for this."""
    if len(CPUS) >= 2 and any(hf_case[0].name.startswith(p["hf_case"])
                              for p in selected(request, "test_generate_runs_a_two_process_plan_file")):
        plan = _write_tp2_plan(tmp_path_factory.mktemp("tp2") / "plans.json")
        precompiler.submit(generate_spec(_plan_file_argv(hf_case[0], plan)))


def _reference(hf, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.compile
@pytest.mark.skipif(len(CPUS) < 2, reason="a two-process plan needs two CPUs")
def test_two_processes_match_hf_and_a_killed_rank_ends_cleanly(hf_case, precompiler, plan_file_build):
    model_dir, hf = hf_case
    cfg = load_config(model_dir)
    plan, one = _tp2(), _tp1()

    def spec(plan: ExecPlan) -> RunSpec:
        return _engine_spec(model_dir, plan)

    precompiler.submit(spec(one))  # built on the other core while TP-2 is built here
    compiled = precompiler.build(spec(plan))  # the artifact the engine below opens
    assert compiled.tp == 2
    assert compiled.shards["model.layers.0.mlp.down_proj.weight"] == Shard(1, (cfg.intermediate_size,))
    engine, _ = open_engine(spec(plan))
    try:
        prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 45)]
        logits: list[np.ndarray] = []
        gen = engine.generate(prompt, DECODE_STEPS + 1, logits_out=logits)
        ref = _reference(hf, prompt + gen.tokens[:-1])[len(prompt) - 1:]
        ours = np.stack(logits)
        assert ours.shape == ref.shape == (DECODE_STEPS + 1, cfg.vocab_size)
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
        assert gen.tokens == [int(t) for t in ref.argmax(-1)]  # HF's greedy tokens
        assert engine.phase == "decode" and len(engine.switches) == 2  # both ranks switched

        # TP-1 on the same weights and CPUs: the same greedy tokens, logits within 1e-4
        precompiler.ready(spec(one))
        single, _ = open_engine(spec(one))
        tp1_logits: list[np.ndarray] = []
        tp1 = single.generate(prompt, DECODE_STEPS + 1, logits_out=tp1_logits)
        del single
        assert tp1.tokens == gen.tokens
        np.testing.assert_allclose(ours, np.stack(tp1_logits), rtol=1e-4,
                                   atol=1e-4 * float(np.abs(ref).max()))

        # Prefix caching across the ranks: a request forked from a cached prefix on every rank
        # gives the tokens it gives alone
        other = prompt[:32] + [int(t) for t in np.random.default_rng(2).integers(0, cfg.vocab_size, 7)]
        alone = engine.generate(other, 6).tokens
        batch = BatchEngine(engine, SchedulerPolicy(max_batch=1, prefill_budget=64, chunk=64))
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for rid, p in (("a", prompt), ("b", other)):
            seq = batch.add(rid, p, greedy)
            out = [e.token for _ in range(50) if batch.has_work() for e in batch.step()
                   if e.token is not None]
        assert seq.cached_tokens == 32 and out == alone
        assert engine.available_pages() == batch.scheduler.pages.free()
        engine.clear()

        # Kill rank 1 mid-request: the request fails naming it, the group is shut down.
        segment = Path("/dev/shm", engine.group.name)
        worker = engine.group.pids[1]
        assert segment.exists() and worker != os.getpid()

        killer = KillAfter(worker, 5)
        with pytest.raises(EngineError, match=f"rank 1 \\(pid {worker}\\) exited"):
            engine.generate(prompt, 100, on_token=killer)
        assert killer.seconds_since() < 20  # not the collective's 60 s deadline
        assert killer.streamed == 5 and engine.disco is None
        assert not segment.exists() and not Path(f"/proc/{worker}").exists()
        with pytest.raises(EngineError, match="shut down"):
            engine.generate(prompt, 2)
    finally:
        engine.shutdown()
        os.sched_setaffinity(0, set(CPUS))


@pytest.mark.compile
@pytest.mark.skipif(len(CPUS) < 2, reason="a two-process plan needs two CPUs")
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_generate_runs_a_two_process_plan_file(hf_case, tmp_path, precompiler, plan_file_build):
    model_dir, hf = hf_case
    argv = _plan_file_argv(model_dir, _write_tp2_plan(tmp_path / "plans.json"))
    precompiler.ready(generate_spec(argv))
    run = subprocess.run([sys.executable, "-m", "sandwich_tvm.generate", *argv], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    prompt = synthetic_prompt(20, load_config(model_dir).vocab_size)
    ref = _reference(hf, prompt + out["tokens"][:-1])[len(prompt) - 1:]
    assert out["processes"] == 2 and out["tokens"] == [int(t) for t in ref.argmax(-1)]
