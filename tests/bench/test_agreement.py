"""Scoring a candidate model's teacher-forced choices against its reference's."""

from __future__ import annotations

import numpy as np

from sandwich_tvm.bench.agreement import score


def test_score_counts_agreement_and_ranks_the_flips_margin():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(8, 50))
    tokens = ref.argmax(-1)
    cand = ref.copy()
    # step 5: make the runner-up win in the candidate; its reference margin is that step's top-1 margin
    second = np.argsort(ref[5])[-2]
    cand[5, second] = ref[5].max() + 1.0
    result = score(tokens, ref, cand, candidate_tokens=list(tokens[:3]) + [int(second)] * 5)
    assert result.steps == 8 and result.agree == 7 / 8
    assert result.free_run_prefix == 3
    [flip] = result.disagreements
    assert (flip.step, flip.reference_token, flip.candidate_token) == (5, tokens[5], second)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    assert np.isclose(flip.reference_margin, margins[5])
    assert flip.margin_rank == np.mean(margins < margins[5])
    assert result.logit_rms_error > 0 and np.isclose(result.median_margin, np.median(margins))


def test_identical_logits_agree_everywhere():
    ref = np.random.default_rng(1).normal(size=(4, 10))
    result = score(ref.argmax(-1), ref, ref.copy(), candidate_tokens=list(ref.argmax(-1)))
    assert result.agree == 1.0 and result.disagreements == [] and result.free_run_prefix == 4
    assert result.logit_rms_error == 0.0


def test_a_reference_too_big_for_memory_is_refused_before_loading(monkeypatch):
    import psutil

    from sandwich_tvm.bench.agreement_cmd import _fits
    from sandwich_tvm.model.config import load_config

    class Mem:
        available = 24 << 30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem)
    why = _fits(load_config("llama-3-8b"), 4)
    assert why is not None and "GiB" in why and "llama-3-8b" in why
    assert _fits(load_config("llama-160m"), 4) is None
