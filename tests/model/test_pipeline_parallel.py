"""Pipeline parallelism: a model split into stages of consecutive layers, one process per stage
on TVM Disco, activations handed on through shared memory, against HF transformers and one
process on the same weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.cli.options import synthetic_prompt
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.stages import Stage, split_layers
from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.engine import EngineError
from sandwich_tvm.runtime.loader import open_engine
from sandwich_tvm.runtime.sampling import SamplingParams
from sandwich_tvm.runtime.scheduler import SchedulerPolicy
from sandwich_tvm.spec import resolve_run_spec
from sandwich_tvm.topology.plan import ExecPlan, PlanError
from sandwich_tvm.tvm_compat import PROCESS_CPUS

from ..precompile import warm_up
from .hf_models import hf_checkpoint

torch = pytest.importorskip("torch")

CPUS = sorted(PROCESS_CPUS)
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="a two-stage plan here runs one core per stage")


def test_stages_own_consecutive_layers_under_the_whole_models_names():
    stages = split_layers(30, 4)
    assert [(s.first_layer, s.end_layer) for s in stages] == [(0, 7), (7, 14), (14, 22), (22, 30)]
    assert stages[0].first and stages[3].last and not stages[1].first and not stages[1].last
    assert stages[2].global_name("model.layers.3.mlp.down_proj.weight") == (
        "model.layers.17.mlp.down_proj.weight")
    assert stages[2].global_name("lm_head.weight") == "lm_head.weight"
    assert Stage(**stages[1].to_json()) == stages[1]
    with pytest.raises(ValueError, match="splits into 1 to 2 pipeline stages, not 3"):
        split_layers(2, 3)


def _plan(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"plans": [fields]}))
    return path


def test_a_plan_file_names_processes_tp_and_pp(tmp_path):
    """The issue's example: two stages of one core each."""
    plan = ExecPlan.from_file(_plan(tmp_path, processes=2, tp=1, pp=2, prefill_cpus=[[CPUS[0]], [CPUS[-1]]],
                                    decode_cpus=[[CPUS[0]], [CPUS[-1]]]))
    assert (plan.processes, plan.tp, plan.pp) == (2, 1, 2) and plan.stage_of(1) == 1
    assert "2 pipeline stages" in plan.describe()
    back = ExecPlan.from_dict(plan.to_dict(), "round trip")
    assert (back.processes, back.tp, back.pp, back.ranks) == (2, 1, 2, plan.ranks)
    tp2 = ExecPlan.from_file(_plan(tmp_path, tp=2, prefill_cpus=[[CPUS[0]], [CPUS[-1]]],
                                   decode_cpus=[[CPUS[0]], [CPUS[-1]]]))
    assert (tp2.processes, tp2.tp, tp2.pp) == (2, 2, 1)  # older files: every process a TP rank


def test_ranks_share_cpus_only_when_the_plan_says_oversubscribe(tmp_path):
    """Two stages of two tensor-parallel ranks on two cores: four processes, so two share each
    core; refused unless the plan says so (a layout tried on a smaller machine)."""
    cpus = [[CPUS[0]], [CPUS[-1]], [CPUS[0]], [CPUS[-1]]]
    fields = {"processes": 4, "tp": 2, "pp": 2, "prefill_cpus": cpus, "decode_cpus": cpus}
    with pytest.raises(PlanError, match="two processes share a CPU.*oversubscribe"):
        ExecPlan.from_file(_plan(tmp_path, **fields))
    plan = ExecPlan.from_file(_plan(tmp_path, **fields, oversubscribe=True))
    assert (plan.processes, plan.tp, plan.pp, plan.oversubscribe) == (4, 2, 2, True)
    assert [plan.stage_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert plan.all_prefill_cpus == tuple(dict.fromkeys([CPUS[0], CPUS[-1]]))  # each core once
    assert "2 pipeline stages of 2 tensor-parallel ranks" in plan.describe()
    back = ExecPlan.from_dict(plan.to_dict(), "round trip")
    assert (back.ranks, back.pp, back.oversubscribe) == (plan.ranks, 2, True)
    with pytest.raises(PlanError, match="oversubscribe .* is 'yes', not true or false"):
        ExecPlan.from_file(_plan(tmp_path, **fields, oversubscribe="yes"))


def test_a_plan_of_more_processes_than_one_group_holds_is_refused():
    ranks = [((CPUS[0],), (CPUS[0],))] * 65
    with pytest.raises(PlanError, match="at most 64 processes"):
        ExecPlan.of_ranks(ranks, "test", pp=65, oversubscribe=True)


@pytest.mark.parametrize("fields, message", [
    ({"processes": 2, "tp": 2, "pp": 2}, "processes must be tp x pp"),
    ({"processes": 2, "pp": 0}, "pp \\(pipeline stages\\) is 0"),
    ({"processes": 2, "pp": 2, "wa": True}, "processes must be tp x pp plus the attention rank"),
])
def test_a_plan_whose_stages_do_not_add_up_is_refused(tmp_path, fields, message):
    cpus = {"prefill_cpus": [[CPUS[0]], [CPUS[-1]]], "decode_cpus": [[CPUS[0]], [CPUS[-1]]]}
    with pytest.raises(PlanError, match=message):
        ExecPlan.from_file(_plan(tmp_path, **fields, **cpus))


def _pp2() -> ExecPlan:
    return ExecPlan.of_ranks([((CPUS[0],), (CPUS[0],)), ((CPUS[1],), (CPUS[1],))], "test: PP-2", pp=2)


def _pp2_spec(model_dir: Path):
    """The two-stage build every test here and in ``test_pipeline_hosts`` runs."""
    return resolve_run_spec(model_dir, plan=_pp2(), context=256, max_batch=8, kv_dtype="float32",
                            dtype="float32")


def pp2_specs(base: Path, case: str = "gqa-tied-llama3") -> list:
    """For ``warm_up``: both stages, built while the kernel tests run."""
    return [_pp2_spec(hf_checkpoint(base, case))] if len(CPUS) >= 2 else []


def _pp2_tp2_spec(model_dir: Path):
    """Two stages of two tensor-parallel ranks, one core each: four processes on two cores."""
    ranks = [((c,), (c,)) for c in (CPUS[0], CPUS[1], CPUS[0], CPUS[1])]
    plan = ExecPlan.of_ranks(ranks, "test: PP-2 x TP-2", pp=2, oversubscribe=True)
    return resolve_run_spec(model_dir, plan=plan, context=256, max_batch=8, kv_dtype="float32",
                            dtype="float32")


warm_up(__name__, "test_two_stages_match_hf_batch_and_a_killed_stage_ends_cleanly", pp2_specs)
warm_up(__name__, "test_an_untied_head_on_the_first_stage_matches_hf", lambda b: pp2_specs(b, "mha-untied"))
warm_up(__name__, "test_stages_of_two_tensor_parallel_ranks_match_hf",
        lambda b: [_pp2_tp2_spec(hf_checkpoint(b, "gqa-tied-llama3"))] if len(CPUS) >= 2 else [])


class KillAfter:
    """An ``on_token`` that kills ``pid`` once ``tokens`` tokens have streamed (mid-request);
    ``at``: when it killed (``time.monotonic``), so a test times the failure from the kill, not
    from a prefill a loaded machine may slow down."""

    def __init__(self, pid: int, tokens: int):
        self.pid, self.tokens, self.streamed, self.at = pid, tokens, 0, None

    def __call__(self, token: int) -> None:
        self.streamed += 1
        if self.streamed == self.tokens:
            self.at = time.monotonic()
            os.kill(self.pid, signal.SIGKILL)

    def seconds_since(self) -> float:
        assert self.at is not None, "the request ended before the kill"
        return time.monotonic() - self.at


def _reference(hf, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


def assert_hf_greedy(engine, hf, prompt: list[int]) -> None:
    """13 greedy tokens: HF's logits (within 1e-4 of the largest) and HF's tokens."""
    logits: list[np.ndarray] = []
    gen = engine.generate(prompt, 13, logits_out=logits)
    ref = _reference(hf, prompt + gen.tokens[:-1])[len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(logits), ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    assert gen.tokens == [int(t) for t in ref.argmax(-1)]  # HF's greedy tokens


def assert_batched_as_alone_then_rank1_killed(engine, cfg, prompt: list[int]) -> None:
    """Three requests at once (chunked prompts, two sharing a cached prefix) give each one's
    tokens alone; then rank 1 killed mid-request fails it naming the rank within seconds of
    the kill, and the group is shut down with its segment and process gone."""
    assert_batched_as_alone(engine, cfg, prompt)
    segment = Path("/dev/shm", engine.group.name)
    worker = engine.group.pids[1]
    killer = KillAfter(worker, 3)
    with pytest.raises(EngineError, match=f"rank 1 \\(pid {worker}\\) exited"):
        engine.generate(prompt, 100, on_token=killer)
    assert killer.seconds_since() < 20
    assert engine.disco is None and not segment.exists() and not Path(f"/proc/{worker}").exists()


def assert_batched_as_alone(engine, cfg, prompt: list[int]) -> None:
    """Three requests at once (chunked prompts, two sharing a cached prefix) give each one's
    tokens alone."""
    rng = np.random.default_rng(2)
    prompts = {"a": prompt, "b": prompt[:32] + [int(t) for t in rng.integers(0, cfg.vocab_size, 9)],
               "c": [int(t) for t in rng.integers(0, cfg.vocab_size, 70)]}
    alone, batched = _tokens_alone_and_batched(engine, prompts, 8)
    assert batched == alone


def _tokens_alone_and_batched(engine, prompts: dict[str, list[int]], new: int) -> tuple[dict, dict]:
    alone = {rid: engine.generate(p, new).tokens for rid, p in prompts.items()}
    batch = BatchEngine(engine, SchedulerPolicy(max_batch=4, prefill_budget=32, chunk=32))
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for rid, p in prompts.items():
        batch.add(rid, p, greedy)
    out: dict[str, list[int]] = defaultdict(list)
    while batch.has_work():
        for e in batch.step():
            if e.token is not None:
                out[e.request_id].append(e.token)
    assert engine.available_pages() == batch.scheduler.pages.free()
    engine.clear()  # the prefix cache's entries: the engine is the one-request loop's again
    return alone, dict(out)


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_two_stages_match_hf_batch_and_a_killed_stage_ends_cleanly(hf_case, precompiler):
    model_dir, hf = hf_case
    cfg = load_config(model_dir)
    spec = _pp2_spec(model_dir)  # the build the CLI tests below reuse
    precompiler.ready(spec)
    engine, compiled = open_engine(spec)
    try:
        assert compiled.stage == Stage(0, 2, 0, 1)
        assert "lm_head.weight" not in dict(compiled.params)  # tied: the embedding's one copy is the head
        prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 45)]
        assert_hf_greedy(engine, hf, prompt)
        assert engine.phase == "decode" and len(engine.switches) == 2

        assert_batched_as_alone_then_rank1_killed(engine, cfg, prompt)  # the last stage
    finally:
        engine.shutdown()
        os.sched_setaffinity(0, set(CPUS))


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_stages_of_two_tensor_parallel_ranks_match_hf(hf_case, precompiler):
    """PP-2 x TP-2: each stage's ranks hold half its heads and FFN and all-reduce over the
    stage's own segment, the stages hand their activations on over the group's; HF's logits and
    tokens, requests batched as alone, and the last stage's second rank killed mid-request (its
    stage peer, rank 2, waits on it in the stage's segment) ends the group with every segment and
    worker gone."""
    model_dir, hf = hf_case
    cfg = load_config(model_dir)
    spec = _pp2_tp2_spec(model_dir)
    precompiler.ready(spec)
    engine, compiled = open_engine(spec)
    try:
        assert compiled.stage == Stage(0, 2, 0, 1) and compiled.tp == 2
        assert engine.disco is not None and len(engine.disco.pids) == 4
        segments = [Path("/dev/shm", g.name) for g in [engine.group, *engine.stage_groups]]
        assert len(segments) == 3 and all(s.exists() for s in segments)
        prompt = [int(t) for t in np.random.default_rng(3).integers(0, cfg.vocab_size, 45)]
        assert_hf_greedy(engine, hf, prompt)
        assert_batched_as_alone(engine, cfg, prompt)

        workers = engine.group.pids[1:]
        killer = KillAfter(workers[2], 3)  # rank 3
        with pytest.raises(EngineError, match=f"rank 3 \\(pid {workers[2]}\\) exited"):
            engine.generate(prompt, 100, on_token=killer)
        assert killer.seconds_since() < 20
        assert engine.disco is None and not any(s.exists() for s in segments)
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
    finally:
        engine.shutdown()
        os.sched_setaffinity(0, set(CPUS))


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["mha-untied"], indirect=True)
def test_an_untied_head_on_the_first_stage_matches_hf(hf_case, precompiler):
    """An untied ``lm_head`` lives on stage 0 with the embedding (the last stage holds neither):
    HF's logits, prompt pieces in flight."""
    model_dir, hf = hf_case
    spec = _pp2_spec(model_dir)
    precompiler.ready(spec)
    engine, compiled = open_engine(spec)
    try:
        from sandwich_tvm.compiler.artifact import compile_model

        assert "lm_head.weight" in dict(compiled.params) and "model.norm.weight" in dict(compiled.params)
        last = dict(compile_model(spec, stage=1).params)  # built already: the engine runs it
        assert "lm_head.weight" not in last and "model.norm.weight" not in last
        prompt = [int(t) for t in np.random.default_rng(4).integers(0, load_config(model_dir).vocab_size, 40)]
        logits: list[np.ndarray] = []
        gen = engine.generate(prompt, 6, logits_out=logits)
        ref = _reference(hf, prompt + gen.tokens[:-1])[len(prompt) - 1:]
        np.testing.assert_allclose(np.stack(logits), ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    finally:
        engine.shutdown()


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_generate_runs_a_two_stage_plan_file(hf_case, tmp_path):
    model_dir, hf = hf_case
    plan = _plan(tmp_path, processes=2, tp=1, pp=2, prefill_cpus=[[CPUS[0]], [CPUS[1]]],
                 decode_cpus=[[CPUS[0]], [CPUS[1]]])
    argv = ["--model", str(model_dir), "--plan", str(plan), "--prompt-len", "20", "--max-new-tokens", "6",
            "--dtype", "float32", "--kv-dtype", "float32", "--json"]
    run = subprocess.run([sys.executable, "-m", "sandwich_tvm.generate", *argv], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    prompt = synthetic_prompt(20, load_config(model_dir).vocab_size)
    ref = _reference(hf, prompt + out["tokens"][:-1])[len(prompt) - 1:]
    assert out["processes"] == 2 and out["tokens"] == [int(t) for t in ref.argmax(-1)]


def _hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(int(_reference(hf, tokens)[-1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_the_server_runs_two_stages_with_eight_requests_at_once(hf_case, tmp_path):
    """`serve --plan` with two stages of one process each: 8 concurrent greedy requests, each
    answered with HF's tokens."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from sandwich_tvm.bench.baselines.server_process import ServerProcess, free_port
    from sandwich_tvm.model.tokenizer import load_model_tokenizer, placeholder_tokenizer

    src, hf = hf_case
    model_dir = tmp_path / src.name  # the same name: the same compiled stages as the tests above
    shutil.copytree(src, model_dir)
    cfg = load_config(model_dir)
    placeholder_tokenizer(cfg.vocab_size).save(str(model_dir / "tokenizer.json"))
    tok = load_model_tokenizer(model_dir)
    plan = _plan(tmp_path, processes=2, tp=1, pp=2, prefill_cpus=[[CPUS[0]], [CPUS[1]]],
                 decode_cpus=[[CPUS[0]], [CPUS[1]]])
    port = free_port()
    cmd = [sys.executable, "-m", "sandwich_tvm.serve", "--model", str(model_dir), "--plan", str(plan),
           "--dtype", "float32", "--kv-dtype", "float32", "--max-batch", "8", "--context", "128",
           "--prefill-budget", "64",
           "--port", str(port), "--served-model-name", "tiny"]
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, int(n))] for n in rng.integers(5, 40, 8)]
    new = 8

    def complete(url: str, prompt: list[int]) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    log = tmp_path / "serve.log"
    with ServerProcess("sandwich pp2", cmd, port, log_path=log, ready_timeout_s=600) as srv:
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: complete(srv.base_url, p), prompts))
        metrics = httpx.get(f"{srv.base_url}/metrics", timeout=30).text
    assert texts == [tok.decode(_hf_greedy(hf, p, new)) for p in prompts]
    decode_steps = sum(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("sandwich_step_seconds_count") and 'phase="decode"' in line)
    assert 0 < decode_steps < len(prompts) * (new - 1)  # the requests decoded together, not one by one
