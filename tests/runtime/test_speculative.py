"""Prompt-lookup drafts, their acceptance and a draft model's tokenizer check, without a model."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.runtime.speculative import accept, propose


def test_propose_continues_the_most_recent_earlier_ngram():
    tokens = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7]
    assert propose(tokens, 3, 4, 2) == [9, 2, 5]  # "5 6 7" last seen before "9 2 5 ..."
    assert propose(tokens, 1, 4, 2) == [9]
    assert propose([1, 2, 3, 4], 3, 4, 2) == []  # no earlier occurrence
    assert propose([3, 4, 3], 2, 4, 1) == [4, 3]  # down to unigrams
    assert propose([3, 4, 3], 2, 4, 2) == []
    assert propose([1, 1], 0, 4, 1) == []


def test_accept_stops_at_the_first_sample_that_differs():
    rows = np.arange(4)[:, None] * np.ones((1, 3))
    said = iter([7, 8, 4])  # the samples, in order

    def sample(_row):
        return next(said)

    assert accept([7, 8, 9], rows, sample, int) == [7, 8, 4]  # two accepted, the third replaced
    said = iter([1, 2, 3])
    assert accept([1, 2], rows, sample, int) == [1, 2, 3]  # all accepted, then the bonus
    said = iter([0])
    assert accept([], rows, sample, int) == [0]


def test_accepting_preserves_the_sampled_distribution():
    """A one-token draft is accepted with its probability and replaced by a draw from the rest:
    the emitted first token is distributed as the model says, whatever the draft."""
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.2])
    for draft_token in (0, 2):
        firsts = [accept([draft_token], np.zeros((2, 3)), lambda _r: int(rng.choice(3, p=p)), int)[0]
                  for _ in range(20000)]
        freq = np.bincount(firsts, minlength=3) / len(firsts)
        np.testing.assert_allclose(freq, p, atol=0.015)


def test_a_draft_model_must_share_the_tokenizer():
    from dataclasses import replace

    from sandwich_tvm.model.config import PRESETS
    from sandwich_tvm.model.tokenizer import ModelTokenizer
    from sandwich_tvm.runtime.draft_model import check_draft_model
    from sandwich_tvm.runtime.engine import EngineError

    from ..model.hf_models import byte_level_tokenizer

    cfg = replace(PRESETS["llama-160m"], vocab_size=257)
    plain = ModelTokenizer(byte_level_tokenizer([(b"a", b"b")]), frozenset(), source="target")
    other = ModelTokenizer(byte_level_tokenizer([(b"c", b"d")]), frozenset(), source="draft")
    check_draft_model(cfg, cfg, plain, plain)  # the same tokenizer: fine
    with pytest.raises(EngineError, match=r"tokenizer \(draft\) maps tokens differently .*'ab', 256"):
        check_draft_model(cfg, cfg, plain, other)
    check_draft_model(cfg, PRESETS["llama-160m"], plain, plain)  # padded embeddings, one tokenizer: fine
    with pytest.raises(EngineError, match="vocabulary of 32000 tokens, the model llama-160m one of 257"):
        check_draft_model(cfg, PRESETS["llama-160m"], plain, None)  # nothing to compare but the sizes
