"""Weight-attention separation: the weights and every weight-centric operator on one process,
the KV cache and attention on another, each layer's QKV and attention output handed over
through shared memory; against HF transformers on the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.cli.options import synthetic_prompt
from sandwich_tvm.compiler.artifact import build_key, model_part
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.separation import ATTENTION, WEIGHTS, Role
from sandwich_tvm.runtime.loader import open_engine
from sandwich_tvm.spec import resolve_run_spec
from sandwich_tvm.topology.plan import ExecPlan, PlanError
from sandwich_tvm.tvm_compat import PROCESS_CPUS

from ..precompile import generate_spec, warm_up
from .hf_models import hf_checkpoint
from .test_pipeline_parallel import _reference, assert_batched_as_alone_then_rank1_killed, assert_hf_greedy

torch = pytest.importorskip("torch")

CPUS = sorted(PROCESS_CPUS)
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="a separated plan here runs one core per side")


def _plan_file(path: Path, **fields) -> Path:
    path.write_text(json.dumps({"version": 3, "plans": [fields]}))
    return path


def _wa() -> ExecPlan:
    return ExecPlan.of_ranks([((CPUS[0],), (CPUS[0],)), ((CPUS[-1],), (CPUS[-1],))], "test: WA", wa=True)


def _wa_spec(model_dir: Path, kv_dtype: str = "float32"):
    return resolve_run_spec(model_dir, plan=_wa(), context=256, max_batch=8, kv_dtype=kv_dtype,
                            dtype="float32")


def wa_specs(base: Path) -> list:
    """For ``warm_up``: both sides, built while the kernel tests run."""
    return [_wa_spec(hf_checkpoint(base, "gqa-tied-llama3"))] if len(CPUS) >= 2 else []


warm_up(__name__, "test_separated_sides_match_hf_batch_and_a_killed_attention_rank_ends_cleanly", wa_specs)


def test_a_plan_file_asks_for_separation_with_wa(tmp_path):
    """The issue's interface: ``"wa": true``, processes = tp x pp + the attention rank."""
    cpus = {"prefill_cpus": [[CPUS[0]], [CPUS[-1]]], "decode_cpus": [[CPUS[0]], [CPUS[-1]]]}
    plan = ExecPlan.from_file(_plan_file(tmp_path / "p.json", processes=2, tp=1, pp=1, wa=True, **cpus))
    assert (plan.processes, plan.tp, plan.pp, plan.wa, plan.parts) == (2, 1, 1, True, 2)
    assert (plan.part_of(0), plan.part_of(1)) == (0, 1) and "weight-attention" in plan.describe()
    back = ExecPlan.from_dict(plan.to_dict(), "round trip")
    assert (back.wa, back.tp, back.ranks) == (True, 1, plan.ranks)
    assert "wa" not in ExecPlan.from_dict({**cpus, "processes": 2}, "tp").to_dict()  # default: colocated
    assert Role(WEIGHTS).to_json() == {"name": WEIGHTS}
    assert Role(**Role(ATTENTION).to_json()).name == ATTENTION


@pytest.mark.parametrize("fields, message", [
    ({"processes": 2, "tp": 2, "wa": True}, "processes must be tp x pp plus the attention rank"),
    ({"processes": 2, "wa": "yes"}, "wa \\(weight-attention separation\\) is 'yes'"),
])
def test_a_separated_plan_that_does_not_add_up_is_refused(tmp_path, fields, message):
    cpus = {"prefill_cpus": [[CPUS[0]], [CPUS[-1]]], "decode_cpus": [[CPUS[0]], [CPUS[-1]]]}
    with pytest.raises(PlanError, match=message):
        ExecPlan.from_file(_plan_file(tmp_path / "p.json", **fields, **cpus))


def test_separation_with_more_ranks_is_refused_by_name(tmp_path):
    cpus = {"prefill_cpus": [[0], [1], [2]], "decode_cpus": [[0], [1], [2]]}
    with pytest.raises(PlanError, match="one weight rank and one attention rank in this version"):
        ExecPlan.from_dict({"processes": 3, "tp": 2, "wa": True, **cpus}, "three ranks")


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_separated_sides_match_hf_batch_and_a_killed_attention_rank_ends_cleanly(hf_case, precompiler):
    model_dir, hf = hf_case
    cfg = load_config(model_dir)
    spec = _wa_spec(model_dir)
    precompiler.ready(spec)
    engine, compiled = open_engine(spec)
    try:
        assert compiled.role == Role(WEIGHTS) and compiled.stage is None
        assert "model.layers.0.self_attn.qkv_proj.weight" in dict(compiled.params)
        prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 45)]
        assert_hf_greedy(engine, hf, prompt)

        assert_batched_as_alone_then_rank1_killed(engine, cfg, prompt)  # the attention rank
    finally:
        engine.shutdown()
        os.sched_setaffinity(0, set(CPUS))


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_generate_runs_a_separated_plan_file(hf_case, tmp_path, precompiler):
    model_dir, hf = hf_case
    cpus = {"prefill_cpus": [[CPUS[0]], [CPUS[-1]]], "decode_cpus": [[CPUS[0]], [CPUS[-1]]]}
    plan = _plan_file(tmp_path / "plans.json", processes=2, tp=1, pp=1, wa=True, **cpus)
    argv = ["--model", str(model_dir), "--plan", str(plan), "--prompt-len", "20", "--max-new-tokens", "6",
            "--dtype", "float32", "--kv-dtype", "float32", "--context", "256", "--max-batch", "8", "--json"]
    spec = generate_spec(argv)
    same = build_key(_wa_spec(model_dir), Role(ATTENTION))
    assert spec.plan.wa and build_key(spec, model_part(spec, 1)) == same
    precompiler.ready(spec)  # the build the test above ran
    run = subprocess.run([sys.executable, "-m", "sandwich_tvm.generate", *argv], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    prompt = synthetic_prompt(20, load_config(model_dir).vocab_size)
    ref = _reference(hf, prompt + out["tokens"][:-1])[len(prompt) - 1:]
    assert out["processes"] == 2 and out["tokens"] == [int(t) for t in ref.argmax(-1)]
