"""Sampling: greedy is the plain argmax, seeds reproduce, the processors cut exactly what their
definitions say, penalties follow HF/OpenAI formulas, logprobs are a log-softmax, and every bad
parameter is a SamplingError naming the field."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from sandwich_tvm.runtime.sampling import (
    Sampler,
    SamplingError,
    SamplingParams,
    apply_penalties,
    candidates,
    log_softmax,
)

LOGITS = np.array([2.0, 1.5, 0.3, -0.4, 1.1, -2.0, 0.8, 0.0], dtype=np.float32)


def softmax(x: np.ndarray, t: float = 1.0) -> np.ndarray:
    z = np.asarray(x, np.float64) / t
    e = np.exp(z - z.max())
    return e / e.sum()


def draw(params: SamplingParams, logits: np.ndarray, n: int) -> list[int]:
    sampler = Sampler(params, [])
    return [sampler(logits).token for _ in range(n)]


def big_logits(seed: int = 0, vocab: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, vocab).astype(np.float32)


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_leaves_input_alone():
    logits = big_logits()
    before = logits.copy()
    sampler = Sampler(SamplingParams(temperature=0), [1, 2, 3])
    for _ in range(3):
        assert sampler(logits).token == int(np.argmax(logits))
    np.testing.assert_array_equal(logits, before)


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0])
def test_top_k_1_is_argmax_at_any_temperature(temperature):
    logits = big_logits(1)
    params = SamplingParams(temperature=temperature, top_k=1, seed=3)
    assert params.greedy
    assert set(draw(params, logits, 50)) == {int(np.argmax(logits))}


def test_sampling_does_not_modify_the_logits():
    logits = big_logits(2)
    before = logits.copy()
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.5, seed=0, logprobs=5)
    sampler = Sampler(params, [1, 2, 3])
    for _ in range(10):
        sampler(logits)
    np.testing.assert_array_equal(logits, before)


# --------------------------------------------------------------------------- seeds


def test_same_seed_same_samples_different_seed_different_samples():
    logits = big_logits(3, 50)
    a = draw(SamplingParams(seed=42), logits, 200)
    assert a == draw(SamplingParams(seed=42), logits, 200)
    assert a != draw(SamplingParams(seed=43), logits, 200)
    assert draw(SamplingParams(seed=-1), logits, 20) == draw(SamplingParams(seed=-1), logits, 20)


# --------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_temperature_sampling_matches_softmax(temperature):
    n = 20000
    counts = Counter(draw(SamplingParams(temperature=temperature, seed=7), LOGITS, n))
    freq = np.array([counts[i] for i in range(LOGITS.size)]) / n
    # The largest standard error is sqrt(0.25 / 20000) ~ 0.0035; 0.02 is over 5 of them.
    assert np.abs(freq - softmax(LOGITS, temperature)).max() < 0.02


def test_top_k_keeps_the_k_best():
    logits = big_logits(4)
    best = set(np.argsort(-logits)[:10].tolist())
    ids, probs = candidates(logits, SamplingParams(top_k=10))
    assert set(ids.tolist()) == best
    np.testing.assert_allclose(probs, softmax(logits[ids]), rtol=1e-12)
    assert set(draw(SamplingParams(top_k=10, temperature=2.0, seed=0), logits, 500)) <= best



@pytest.mark.parametrize("k", [1, 7, 100, 2000])
def test_top_k_with_ties_keeps_k_tokens_of_the_k_best_values(k):
    logits = np.random.default_rng(9).integers(-50, 50, 128256).astype(np.float32)  # many ties
    ids, _ = candidates(logits, SamplingParams(top_k=k))
    assert len(set(ids.tolist())) == k
    np.testing.assert_array_equal(np.sort(logits[ids]), np.sort(logits)[-k:])

def nucleus_reference(logits: np.ndarray, top_p: float, t: float = 1.0) -> set[int]:
    p = softmax(logits, t)
    order = np.argsort(-p)
    n = int(np.argmax(np.cumsum(p[order]) >= top_p)) + 1  # smallest prefix with mass >= top_p
    return set(order[:n].tolist())


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.77, 0.95, 0.999])
def test_top_p_keeps_exactly_the_nucleus(top_p):
    logits = big_logits(5, 5000)  # larger than the first partition, so the search widens
    ids, probs = candidates(logits, SamplingParams(top_p=top_p, temperature=0.9))
    assert set(ids.tolist()) == nucleus_reference(logits, top_p, 0.9)
    assert len(ids) == len(set(ids.tolist())) and math.isclose(probs.sum(), 1.0)


def test_top_p_always_keeps_one_token_and_is_sampled_within():
    ids, _ = candidates(LOGITS, SamplingParams(top_p=1e-9))
    assert ids.tolist() == [0]
    allowed = nucleus_reference(LOGITS, 0.6)
    drawn = set(draw(SamplingParams(top_p=0.6, seed=1), LOGITS, 2000))
    assert drawn == allowed  # each allowed token has p > 0.1: all of them show up


def test_top_p_applies_to_what_top_k_kept():
    logits = big_logits(6)
    top = np.argsort(-logits)[:20]
    ids, _ = candidates(logits, SamplingParams(top_k=20, top_p=0.5))
    expected = {int(top[i]) for i in nucleus_reference(logits[top], 0.5)}
    assert set(ids.tolist()) == expected


@pytest.mark.parametrize(("min_p", "t"), [(0.05, 1.0), (0.3, 0.7), (0.9, 2.0)])
def test_min_p_drops_tokens_below_a_share_of_the_best(min_p, t):
    logits = big_logits(7, 3000)
    p = softmax(logits, t)
    ids, _ = candidates(logits, SamplingParams(min_p=min_p, temperature=t))
    assert set(ids.tolist()) == set(np.flatnonzero(p >= min_p * p.max()).tolist())
    drawn = draw(SamplingParams(min_p=0.3, seed=2), LOGITS, 500)
    assert set(drawn) <= set(np.flatnonzero(softmax(LOGITS) >= 0.3 * softmax(LOGITS).max()).tolist())


# --------------------------------------------------------------------------- penalties


def penalties_reference(logits, prompt, output, rep, presence, frequency):
    x = logits.astype(np.float64)
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in Counter(output).items():
        x[t] -= presence * (c > 0) + frequency * c
    return x


@pytest.mark.parametrize(("rep", "presence", "frequency"),
                         [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -0.4), (0.8, -1.5, 2.0)])
def test_penalties_follow_the_formulas(rep, presence, frequency):
    logits = np.array([2.0, -1.0, 0.5, -0.25, 3.0, 0.0, 1.0], dtype=np.float32)
    prompt, output = [0, 1, 1], [2, 2, 2, 3, 1]
    params = SamplingParams(repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency)
    before = logits.copy()
    got = apply_penalties(logits, params, prompt, Counter(output))
    np.testing.assert_allclose(got, penalties_reference(logits, prompt, output, rep, presence, frequency),
                               rtol=1e-6)
    np.testing.assert_array_equal(logits, before)


def test_no_penalty_returns_the_same_array():
    assert apply_penalties(LOGITS, SamplingParams(), [0, 1], {2: 1}) is LOGITS


def test_repetition_penalty_covers_the_prompt_and_steers_greedy():
    logits = np.array([1.0, 0.9, -0.1, -0.2], dtype=np.float32)
    # Token 0 is in the prompt: 1.0 / 1.2 < 0.9, so greedy takes token 1; then 1 is penalised
    # too (0.75 < 0.83), and 0 is the best again.
    sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0])
    assert [sampler(logits).token for _ in range(2)] == [1, 0]
    # Negative logits are multiplied: token 0 (in the prompt) falls from -0.1 to -0.3, below token 1.
    sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=3.0), prompt=[0])
    assert sampler(np.array([-0.1, -0.2], dtype=np.float32)).token == 1


def test_presence_and_frequency_count_output_tokens_only():
    logits = np.array([1.0, 0.8, 0.0], dtype=np.float32)
    # Prompt tokens are not penalised: token 0 wins the first step despite being in the prompt.
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=0.1, frequency_penalty=0.06), [0, 0])
    tokens = [sampler(logits).token for _ in range(7)]
    # Token 0 after n uses: 1 - 0.1 - 0.06 n = 0.84, 0.78, 0.72, 0.66, 0.60; token 1: 0.8, 0.64.
    assert tokens == [0, 0, 1, 0, 0, 0, 1]
    assert sampler.counts == Counter(tokens)
    expected = penalties_reference(logits, [], tokens, 1.0, 0.1, 0.06)
    np.testing.assert_allclose(apply_penalties(logits, sampler.params, [0, 0], sampler.counts), expected,
                               rtol=1e-6)


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_logprobs_are_a_log_softmax(n):
    logits = big_logits(8, 128)
    sample = Sampler(SamplingParams(temperature=0.5, top_k=10, seed=0, logprobs=n), [])(logits)
    ref = log_softmax(logits)
    assert math.isclose(np.exp(ref).sum(), 1.0, rel_tol=1e-12)
    expected = np.log(softmax(logits))
    assert math.isclose(sample.logprob, expected[sample.token], rel_tol=1e-9, abs_tol=1e-12)
    top = sample.top_logprobs
    assert len(top) == n
    assert [t for t, _ in top] == np.argsort(-logits, kind="stable")[:n].tolist()
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))
    for t, lp in top:
        assert math.isclose(lp, expected[t], rel_tol=1e-9, abs_tol=1e-12)



def test_top_logprobs_over_a_full_vocabulary_break_ties_by_id():
    logits = np.random.default_rng(10).integers(-8, 8, 128256).astype(np.float32)
    sample = Sampler(SamplingParams(temperature=0, logprobs=20), [])(logits)
    lp = log_softmax(logits)
    order = np.lexsort((np.arange(lp.size), -lp))[:20]
    assert sample.top_logprobs == [(int(i), float(lp[i])) for i in order]
    assert sample.token == int(np.argmax(logits)) == sample.top_logprobs[0][0]

def test_logprobs_are_after_penalties_and_off_by_default():
    logits = np.array([3.0, 1.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=1)
    sample = Sampler(params, prompt=[0])(logits)
    expected = log_softmax(np.array([1.5, 1.0, 0.0]))
    assert sample.token == 0 and math.isclose(sample.logprob, expected[0], rel_tol=1e-12)
    plain = Sampler(SamplingParams(), [])(logits)
    assert plain.logprob is None and plain.top_logprobs is None


def test_logprobs_are_stable_for_large_logits():
    logits = np.array([1e4, 1e4 - 1, -1e4], dtype=np.float32)
    lp = log_softmax(logits)
    assert np.all(np.isfinite(lp[:2])) and math.isclose(np.exp(lp).sum(), 1.0)


def test_nan_logits_are_an_error_when_sampling():
    with pytest.raises(ValueError, match="finite"):
        Sampler(SamplingParams(seed=0), [])(np.full(4, np.nan, dtype=np.float32))


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 2.0), ("top_k", True),
    ("min_p", 2.0), ("min_p", -0.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0), ("frequency_penalty", -math.inf),
    ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 1.5),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", False),
    ("seed", 1.5), ("seed", True), ("seed", 2**64),
    ("stop", [""]), ("stop", [1]), ("stop", 3),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", "12"),
    ("ignore_eos", 1),
])
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(SamplingError, match=field) as err:
        SamplingParams(**{field: value})
    assert repr(value) in str(err.value)


def test_params_are_canonical_values():
    p = SamplingParams(temperature=1, stop="END", stop_token_ids=[5, 6], top_k=np.int64(5), seed=0)
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.stop == ("END",) and p.stop_token_ids == (5, 6) and type(p.top_k) is int
    assert hash(p) == hash(SamplingParams(temperature=1.0, stop=("END",), stop_token_ids=(5, 6),
                                          top_k=5, seed=0))
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert p.stop_ids({2}) == {2, 5, 6}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).stop_ids({2}) == {5}


def test_logit_bias_bans_and_forces_tokens():
    logits = np.array([0.0, 5.0, 1.0, 4.0], np.float32)
    ban = Sampler(SamplingParams(temperature=0.0, logit_bias={"1": -100}), [])
    assert ban(logits).token == 3 and logits[1] == 5.0  # the best is banned; the input untouched
    force = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias={2: 100.0}), [])
    assert {force(logits).token for _ in range(20)} == {2}
    lp = Sampler(SamplingParams(temperature=0.0, logprobs=1, logit_bias={"0": 10}), [])(logits)
    assert lp.token == 0 and lp.logprob > -0.01  # logprobs see the biased logits
    assert SamplingParams(logit_bias={"7": 1, 3: -2.5}).logit_bias == ((3, -2.5), (7, 1.0))
    for bad in ({"a": 1}, {"-1": 1}, {"1": 101}, {"1": float("nan")}, [1, 2]):
        with pytest.raises(SamplingError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
