"""bf16 weights: the compiled model against HF transformers on the same weights, and against
the fp32 model's greedy tokens on a preset."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sandwich_tvm.bench.agreement import greedy_agreement
from sandwich_tvm.cli.options import synthetic_prompt
from sandwich_tvm.host import can_run, cpu_flags, host_isa
from sandwich_tvm.kernels.microkernel import ISAS, kernel_isa
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS

from ..precompile import warm_up
from .hf_models import CONFIGS, hf_checkpoint

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.compile

CPUS = tuple(sorted(PROCESS_CPUS))
PLAN = ExecPlan(CPUS, CPUS[:1], "test: decode on one core")
STEPS = 32
PAIRS = ISAS[kernel_isa(host_isa(), "bfloat16", cpu_flags())].k_pack == 2
# Against HF on the bf16-rounded weights in fp32: the widening kernels differ only in summation
# order; vdpbf16ps, bfdot and AMX's tdpbf16ps also round each Linear's input to bf16, as
# torch's bf16 Linear does.
EXACT_TOL = 3e-2 if PAIRS else 1e-3


def bf16_spec(cfg, kv_dtype="float32") -> RunSpec:
    return RunSpec(cfg.name, cfg, PLAN, weight_dtype="bfloat16", kv_dtype=kv_dtype)


def fp32_spec(cfg) -> RunSpec:
    return RunSpec(cfg.name, cfg, PLAN, kv_dtype="float32")


warm_up(__name__, "test_bf16_model_matches_hf",
        lambda base: [bf16_spec(load_config(hf_checkpoint(base, case))) for case in sorted(CONFIGS)])
warm_up(__name__, "test_bf16_greedy_agrees_with_fp32_on_the_preset",
        lambda _base: [fp32_spec(load_config("llama-160m")), bf16_spec(load_config("llama-160m"))])


def open_bf16(model, cfg, precompiler, kv_dtype="float32") -> Engine:
    compiled = precompiler.build(bf16_spec(cfg, kv_dtype))
    isa, dtype = compiled.weight_layout
    assert (dtype, isa) == ("bfloat16", kernel_isa(host_isa(), "bfloat16", cpu_flags()))
    layouts = compiled.layouts  # the parameters' own layouts, through the artifact
    assert {x.dtype for x in layouts.values()} == {"bfloat16"}
    assert all(n.endswith("gate_up_proj.weight") for n, x in layouts.items() if x.interleave)
    params = load_params(model, cfg, compiled.params, isa, dtype=dtype, layouts=layouts)
    packed = [p for p in params if p.ndim == 3]
    assert packed and all(p.dtype.itemsize == 2 or p.dtype == np.uint32 for p in packed)
    return Engine(compiled, params, PLAN)


def bf16_rounded(hf):
    """HF's model in fp32 with every weight our bf16 model stores in bf16 rounded to it."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("proj.weight") or name == "lm_head.weight" or "embed_tokens" in name:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return ref


def test_bf16_model_matches_hf(hf_case, precompiler):
    model_dir, hf = hf_case
    cfg = load_config(model_dir)
    engine = open_bf16(model_dir, cfg, precompiler)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 45)]
    logits: list[np.ndarray] = []
    gen = engine.generate(prompt, STEPS + 1, logits_out=logits)
    ours = np.stack(logits)
    tokens = torch.tensor([prompt + gen.tokens[:-1]])
    with torch.no_grad():
        exact = bf16_rounded(hf)(tokens).logits[0].numpy()[len(prompt) - 1:]
        in_bf16 = copy.deepcopy(hf).to(torch.bfloat16)(tokens).logits[0].float().numpy()[len(prompt) - 1:]
    scale = float(np.abs(exact).max())
    np.testing.assert_allclose(ours, exact, rtol=EXACT_TOL, atol=EXACT_TOL * scale)
    # HF computing everything in bf16 (its activations and residual stream too) is further off
    np.testing.assert_allclose(ours, in_bf16, rtol=0.1, atol=0.1 * scale)
    assert np.mean(ours.argmax(-1) == in_bf16.argmax(-1)) >= 0.9
    os.sched_setaffinity(0, CPUS)


def test_bf16_greedy_agrees_with_fp32_on_the_preset(precompiler):
    """64 greedy steps of the fp32 model; the bf16 model, fed the same tokens, picks the same
    next token at >= 90% of them (the issue's bar is 95%, which `bench agreement` shows per
    preset; kernels and their summation order differ per CPU), and wherever it picks another,
    the fp32 margin between the two tokens is among the smallest quarter of the run's top-1
    margins (a near-tie of random weights, not a wrong model)."""
    cfg = load_config("llama-160m")
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, cfg.vocab_size, 32)]
    # Both builds take a minute: the session started them early on the other core (warm_up);
    # if it did not (this module alone), bf16 is built there while fp32 is built here.
    precompiler.submit(bf16_spec(cfg))

    def fp32() -> Engine:
        compiled = precompiler.build(fp32_spec(cfg))
        isa, _ = compiled.weight_layout
        return Engine(compiled, load_params("llama-160m", cfg, compiled.params, isa), PLAN)

    [result] = greedy_agreement(fp32, lambda: open_bf16("llama-160m", cfg, precompiler), [prompt], 64)
    print(f"bf16 picks the fp32 model's token at {result.agree:.1%} of {result.steps} steps")
    assert result.steps == 64
    for d in result.disagreements:
        assert d.margin_rank <= 0.25, f"step {d.step}: a {d.reference_margin:.4f} margin lost to bf16"
    assert result.agree >= 0.9
    assert result.logit_rms_error < 0.05 * result.logit_scale
    os.sched_setaffinity(0, CPUS)


CAPS = ["avx2", "avx512"]


@pytest.fixture(scope="module")
def capped_runs(hf_case, tmp_path_factory):
    """``generate`` under each cap this CPU can execute, all started at once (each compiles its
    model on one core); a test reads its own run."""
    model_dir, _ = hf_case
    env = {**os.environ, "SANDWICH_CACHE": str(tmp_path_factory.getbasetemp() / "cache")}
    runs = {cap: subprocess.Popen([sys.executable, "-m", "sandwich_tvm.generate", "--model", str(model_dir),
                                   "--dtype", "bfloat16", "--kv-dtype", "float32", "--prompt-len", "20",
                                   "--max-new-tokens", "8", "--json"], env={**env, "SANDWICH_MAX_ISA": cap},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for cap in CAPS if can_run(cap)}
    yield runs
    for run in runs.values():
        run.kill()
        run.communicate()


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_bf16_on_the_widening_kernels_gives_hfs_tokens(hf_case, cap, capped_runs):
    """bf16 weights on a CPU without a bf16 unit (here: this CPU capped by SANDWICH_MAX_ISA) are
    stored as bf16 and widened by the kernels: the run gives the greedy tokens of HF on the
    bf16-rounded weights. (Such weights cross into TVM as 16-bit words: DLPack has no bf16.)"""
    if not can_run(cap):
        pytest.skip(f"this CPU ({host_isa()}) cannot execute {cap} code")
    model_dir, hf = hf_case
    stdout, stderr = capped_runs[cap].communicate(timeout=600)
    assert capped_runs[cap].returncode == 0, stderr
    tokens = json.loads(stdout)["tokens"]
    cfg = load_config(model_dir)
    prompt = synthetic_prompt(20, cfg.vocab_size)
    with torch.no_grad():
        ref = bf16_rounded(hf)(torch.tensor([prompt + tokens[:-1]])).logits[0]
    assert tokens == [int(t) for t in ref[len(prompt) - 1:].argmax(-1)]
