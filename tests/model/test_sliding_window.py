"""A Mistral whose sliding window is shorter than its prompts, against transformers: the window
is applied by the attention kernels, by position, in one-shot and chunked prefill, in decode and
over a forked prefix's shared pages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.compiler.artifact import CompileError, compile_model
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.sampling import SamplingParams
from sandwich_tvm.runtime.scheduler import SchedulerPolicy
from sandwich_tvm.spec import RunSpec, resolve_run_spec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS, host_isa

from ..precompile import warm_up
from .hf_models import TINY, greedy_matches_hf, hf_greedy, hf_logits, save_tiny_hf

torch = pytest.importorskip("torch")
CPUS = tuple(sorted(PROCESS_CPUS))
PLAN = ExecPlan(CPUS, CPUS, "test")
WINDOW = 12
FIELDS = TINY | dict(max_position_embeddings=256, sliding_window=WINDOW)


def _checkpoint(base: Path) -> Path:
    """The session's windowed Mistral, written once at a fixed place (so its build can start early)."""
    import transformers

    out = base / "hf" / "mistral-window"
    if not (out / "config.json").is_file():
        save_tiny_hf(out, "MistralForCausalLM", transformers.MistralConfig(**FIELDS), seed=7)
    return out


def _spec(model_dir: Path) -> RunSpec:
    cfg = load_config(model_dir)
    return RunSpec(cfg.name, cfg, PLAN, kv_dtype="float32", max_batch=4)


warm_up(__name__, "test_a_window_shorter_than_the_prompt_gives_hfs_tokens",
        lambda base: [_spec(_checkpoint(base))])


@pytest.mark.compile
def test_a_window_shorter_than_the_prompt_gives_hfs_tokens(tmp_path_factory, precompiler):
    """A window of 12 positions under a 40-token prompt: HF's logits (1e-4) and greedy tokens
    with the prompt in one prefill call and in chunks of 5 (each chunk's tokens against the
    earlier chunks' pages), then requests forked from a cached 20-token prefix (their first
    tokens see part of the shared page, the later ones none of it) give HF's tokens. Without the
    window HF's logits differ (it matters), and TVM's stock build, whose kernels have none, is
    refused."""
    import transformers

    model_dir = _checkpoint(tmp_path_factory.getbasetemp())
    hf = transformers.MistralForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    spec = _spec(model_dir)
    cfg = spec.config
    assert (cfg.sliding_window, cfg.max_position_embeddings) == (WINDOW, 256)
    assert f"sliding window {WINDOW}" in spec.describe()
    compiled = precompiler.build(spec)
    params = load_params(model_dir, cfg, compiled.params, host_isa())
    for chunk in (64, 5):
        engine = Engine(compiled, params, PLAN, context=256, max_batch=4, prefill_chunk=chunk)
        tokens = greedy_matches_hf(engine, hf, cfg.vocab_size, steps=12, prompt_len=40)

    full = transformers.MistralForCausalLM(transformers.MistralConfig(**(FIELDS | {"sliding_window": None})))
    full.load_state_dict(hf.state_dict())
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, cfg.vocab_size, 40)] + tokens
    ref = hf_logits(hf, prompt)
    assert np.abs(hf_logits(full.eval(), prompt) - ref)[40:].max() > 1e-2 * np.abs(ref).max()

    engine = Engine(compiled, params, PLAN, context=256, max_batch=4, prefill_chunk=16)
    policy = SchedulerPolicy(max_batch=4, prefill_budget=16, chunk=16, prefix_caching=True)
    batch = BatchEngine(engine, policy)
    rng = np.random.default_rng(8)
    system = [int(t) for t in rng.integers(0, cfg.vocab_size, 20)]
    asks = {f"r{i}": system + [int(t) for t in rng.integers(0, cfg.vocab_size, n)]
            for i, n in enumerate((3, 1, 9))}
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {rid: [] for rid in asks}
    for wave in (["r0"], ["r1", "r2"]):  # r0 leaves its pages cached; r1 and r2 fork them
        for rid in wave:
            batch.add(rid, asks[rid], greedy)
        while batch.has_work():
            for event in batch.step():
                if event.token is not None:
                    got[event.request_id].append(event.token)
    assert batch.scheduler.prefix.hit_tokens >= 2 * 16  # a whole shared page each
    assert got == {rid: hf_greedy(hf, prompt, 8) for rid, prompt in asks.items()}

    with pytest.raises(CompileError, match="stock build cannot run .*no sliding window"):
        compile_model(resolve_run_spec(model_dir, stock=True))
