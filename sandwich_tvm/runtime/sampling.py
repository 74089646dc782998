"""Per-request sampling: OpenAI/vLLM parameters, logits processors and a seeded sampler.

One :class:`Sampler` per sequence turns that sequence's fp32 logits into the next token. The
order of the processors is vLLM's: repetition penalty (prompt and output tokens), then the
frequency and presence penalties (output tokens only); then greedy takes the argmax, and
sampling applies temperature, top-k, top-p (nucleus), min-p and draws from what is left.
Everything is numpy and cheap at vocab=128k: penalties touch only the tokens seen, top-k is an
``argpartition``, and top-p sorts only as many of the most likely tokens as the nucleus needs.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
_NUCLEUS_START = 64  # top-p first looks at this many of the most likely tokens, then 8x more


class SamplingError(ValueError):
    """A sampling parameter we cannot honour; the message names it, its value and the allowed range."""


def _number(name: str, value: object, interval: str, ok) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise SamplingError(f"{name} must be a number in {interval}, got {value!r}")
    try:
        x = float(value)
    except OverflowError:  # an int past float's range
        x = math.inf
    if not math.isfinite(x) or not ok(x):
        raise SamplingError(f"{name} must be in {interval}, got {value!r}")
    return x


def _integer(name: str, value: object, interval: str, ok) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise SamplingError(f"{name} must be an integer {interval}, got {value!r}")
    if not ok(value):
        raise SamplingError(f"{name} must be {interval}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters, with OpenAI/vLLM names, defaults and ranges.

    ``temperature=0`` (or ``top_k=1``) is greedy; ``top_k`` -1 or 0 is off. ``repetition_penalty``
    (HF/vLLM) divides positive and multiplies negative logits of tokens in the prompt or the
    output; ``presence_penalty`` and ``frequency_penalty`` (OpenAI) subtract
    ``presence * (count > 0) + frequency * count`` over output tokens. ``stop`` may be given as a
    single string or a list (stored as a tuple). ``max_tokens=None`` is the rest of the
    context (OpenAI's chat default). ``logprobs=n`` returns the chosen token's
    logprob and the ``n`` most likely alternatives. ``cache_prompt=False`` opts the request out of
    prefix caching. ``logit_bias`` (OpenAI's) adds a bias in [-100, 100] to a token's logit
    (-100 bans it, 100 all but forces it); a mapping of token id to bias, kept as sorted pairs.
    Bad values raise :class:`SamplingError`.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_prompt: bool = True  # llama-server's name; False: reuse no cached prefix, leave none
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        fix = {
            "max_tokens": None if self.max_tokens is None else _integer(
                "max_tokens", self.max_tokens, ">= 1 or null", lambda v: v >= 1),
            "temperature": _number("temperature", self.temperature, "[0, inf)", lambda v: v >= 0),
            "top_p": _number("top_p", self.top_p, "(0, 1]", lambda v: 0 < v <= 1),
            "top_k": _integer("top_k", self.top_k, ">= -1 (-1 or 0: off)", lambda v: v >= -1),
            "min_p": _number("min_p", self.min_p, "[0, 1]", lambda v: 0 <= v <= 1),
            "repetition_penalty": _number("repetition_penalty", self.repetition_penalty, "(0, inf)",
                                          lambda v: v > 0),
            "presence_penalty": _number("presence_penalty", self.presence_penalty, "[-2, 2]",
                                        lambda v: -2 <= v <= 2),
            "frequency_penalty": _number("frequency_penalty", self.frequency_penalty, "[-2, 2]",
                                         lambda v: -2 <= v <= 2),
            "seed": None if self.seed is None else _integer(
                "seed", self.seed, "in [-2**63, 2**64) or null", lambda v: -2**63 <= v < 2**64),
            "stop": self._stop_strings(),
            "stop_token_ids": self._stop_ids(),
            "logprobs": None if self.logprobs is None else _integer(
                "logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}] or null",
                lambda v: 0 <= v <= MAX_LOGPROBS),
        }
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise SamplingError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        fix["ignore_eos"] = bool(self.ignore_eos)
        if not isinstance(self.cache_prompt, (bool, np.bool_)):
            raise SamplingError(f"cache_prompt must be true or false, got {self.cache_prompt!r}")
        fix["cache_prompt"] = bool(self.cache_prompt)
        fix["logit_bias"] = self._bias()
        for name, value in fix.items():  # canonical types: hashable, JSON-ready
            object.__setattr__(self, name, value)

    def _stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else self.stop
        stops = tuple(stops) if isinstance(stops, Iterable) else None
        if stops is None or not all(isinstance(s, str) and s for s in stops):
            raise SamplingError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        return stops

    def _stop_ids(self) -> tuple[int, ...]:
        ids = self.stop_token_ids
        ok = not isinstance(ids, (str, bytes)) and isinstance(ids, Iterable)
        ids = tuple(ids) if ok else ()
        if not ok or not all(isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))
                             and t >= 0 for t in ids):
            raise SamplingError(f"stop_token_ids must be a list of integers >= 0, got "
                                f"{self.stop_token_ids!r}")
        return tuple(int(t) for t in ids)

    def _bias(self) -> tuple[tuple[int, float], ...]:
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, Mapping) else bias
        try:
            pairs = [(int(str(t)), float(b)) for t, b in items]
        except (TypeError, ValueError):
            raise SamplingError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
        bad = [(t, b) for t, b in pairs if t < 0 or not -100 <= b <= 100]
        if bad:
            raise SamplingError(f"logit_bias takes token ids >= 0 and biases in [-100, 100], got {bad[0]}")
        return tuple(sorted(dict(pairs).items()))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def stop_ids(self, eos_ids: Iterable[int]) -> frozenset[int]:
        """The token ids that end this request: ``stop_token_ids`` plus the EOS ids (unless
        ``ignore_eos``)."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_ids))


@dataclass
class Sample:
    """One sampled token; the logprobs are set when the request asked for them."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _penalize(x: np.ndarray, params: SamplingParams, rep_ids: np.ndarray, out_ids: np.ndarray,
              out_counts: np.ndarray) -> None:
    """Apply the penalties to ``x`` in place; the id arrays hold distinct token ids."""
    r = params.repetition_penalty
    if r != 1 and rep_ids.size:
        v = x[rep_ids]
        x[rep_ids] = np.where(v > 0, v / r, v * r)
    if out_ids.size and (params.frequency_penalty or params.presence_penalty):
        x[out_ids] -= params.frequency_penalty * out_counts + params.presence_penalty


def apply_penalties(logits: np.ndarray, params: SamplingParams, prompt: Iterable[int] = (),
                    counts: Mapping[int, int] | None = None) -> np.ndarray:
    """``logits`` after ``params``' penalties, given the prompt's tokens and the output's token
    counts. A new array when a penalty is active, else ``logits`` itself (never modified)."""
    if not params.penalized:
        return logits
    counts = counts or {}
    out_ids = np.fromiter(counts.keys(), np.int64, len(counts))
    rep_ids = np.union1d(np.fromiter(prompt, np.int64), out_ids)
    x = logits.copy()
    _penalize(x, params, rep_ids, out_ids, np.fromiter(counts.values(), np.float64, len(counts)))
    return x


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Stable float64 log-softmax of 1-D logits."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    if not np.isfinite(m):
        raise ValueError(f"logits have no finite maximum (max is {m})")
    shifted = x - m
    return shifted - np.log(np.exp(shifted).sum())


def _largest(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries of 1-D ``x``, in no particular order.

    A strided sample's k-th largest value is at most the k-th largest of ``x``, so only the
    entries at or above it need partitioning: about sqrt(n k) + n/step entries instead of n."""
    n = x.size
    if k >= n:
        return np.arange(n)
    step = math.isqrt(n // k)
    if step >= 4:
        sample = x[::step]
        if sample.size > k:
            idx = np.flatnonzero(x >= np.partition(sample, sample.size - k)[sample.size - k])
            if idx.size >= k:  # fewer only with NaNs about
                return idx[np.argpartition(x[idx], idx.size - k)[idx.size - k:]]
    return np.argpartition(x, n - k)[n - k:]


def top_logprobs(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely ``(token, logprob)`` pairs, by descending logprob (ties: lower id first)."""
    if n <= 0:
        return []
    idx = _largest(logprobs, n)
    if idx.size:  # among ties at the cut, keep the lowest ids (the argmax's choice)
        cut = logprobs[idx].min()
        above = idx[logprobs[idx] > cut]
        idx = np.concatenate([above, np.flatnonzero(logprobs == cut)[:idx.size - above.size]])
    idx = idx[np.lexsort((idx, -logprobs[idx]))]
    return [(int(i), float(logprobs[i])) for i in idx]


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of the most likely entries of ``probs`` (unnormalised) whose
    mass is at least ``top_p`` of the total, most likely first. Sorts only a prefix: the top 64,
    then 8x more until their mass reaches ``top_p``."""
    n, target = probs.size, top_p * probs.sum()
    k = min(n, _NUCLEUS_START)
    while True:
        part = _largest(probs, k)
        if k == n or probs[part].sum() >= target:
            break
        k = min(n, k * 8)
    order = part[np.argsort(-probs[part], kind="stable")]
    keep = int(np.searchsorted(np.cumsum(probs[order]), target, side="left")) + 1
    return order[:keep]


def _filter(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
    """``candidates`` without the normalisation; ids None means the whole vocabulary."""
    ids = None
    z = logits
    if 0 < params.top_k < z.size:
        ids = _largest(z, params.top_k)
        z = z[ids]
    z = z.astype(np.float64)  # a copy: the in-place steps below never reach the caller's array
    m = z.max()
    if not np.isfinite(m):
        raise ValueError(f"logits have no finite maximum (max is {m})")
    z -= m
    z /= params.temperature
    with np.errstate(over="ignore"):  # a tiny temperature sends the unlikely tokens to -inf
        probs = np.exp(z, out=z)  # unnormalised; the most likely token is 1.0
    keep = _nucleus(probs, params.top_p) if params.top_p < 1 else None
    if params.min_p > 0:  # p < min_p * p_max, and p_max is 1 here
        keep = np.flatnonzero(probs >= params.min_p) if keep is None else keep[probs[keep] >= params.min_p]
    if keep is not None:
        probs = probs[keep]
        ids = keep if ids is None else ids[keep]
    return ids, probs


def candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens sampling may pick from (already penalised) ``logits`` and their probabilities
    (float64, summing to 1): softmax(logits / temperature) cut by top-k, then top-p over what
    top-k kept, then min-p. Greedy parameters give the argmax alone."""
    if params.greedy:
        return np.array([int(np.argmax(logits))]), np.ones(1)
    ids, probs = _filter(logits, params)
    return (np.arange(logits.size) if ids is None else ids), probs / probs.sum()


class Sampler:
    """Picks one sequence's tokens under its :class:`SamplingParams`.

    Keeps the random generator (seeded from ``params.seed`` when given), the prompt's tokens
    and the output's token counts for the penalties. Logprobs are the log-softmax of the logits
    after the penalties and ``logit_bias`` and before temperature, top-k, top-p and min-p: the model's own
    distribution (vLLM's raw logprobs when no penalty is set), not the one sampled from.
    """

    def __init__(self, params: SamplingParams, prompt: Sequence[int]):
        self.params = params
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.counts: dict[int, int] = {}  # output token -> times generated
        self._prompt_set: set[int] = set()
        self._prompt_ids = np.zeros(0, np.int64)
        if params.repetition_penalty != 1:
            self._prompt_set = {int(t) for t in prompt}
            self._prompt_ids = np.fromiter(self._prompt_set, np.int64, len(self._prompt_set))
        self._new_ids: list[int] = []  # output tokens not in the prompt, in order of appearance

    def __call__(self, logits: np.ndarray) -> Sample:
        """The next token for this sequence's 1-D ``logits`` (not modified); records it."""
        if logits.ndim != 1:
            raise ValueError(f"logits must be 1-D (vocab,), got shape {logits.shape}")
        p = self.params
        x = logits
        if (p.penalized and self.counts) or (p.repetition_penalty != 1 and self._prompt_ids.size):
            x = logits.copy()
            out_ids = np.fromiter(self.counts.keys(), np.int64, len(self.counts))
            out_counts = np.fromiter(self.counts.values(), np.float64, len(self.counts))
            rep_ids = np.concatenate([self._prompt_ids, np.asarray(self._new_ids, np.int64)])
            _penalize(x, p, rep_ids, out_ids, out_counts)
        if p.logit_bias:
            x = x.copy() if x is logits else x
            ids, bias = zip(*p.logit_bias, strict=True)
            x[list(ids)] += np.asarray(bias, x.dtype)
        if p.greedy:
            token = int(np.argmax(x))
        else:
            ids, probs = _filter(x, p)
            cum = np.cumsum(probs, out=probs)
            i = min(int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right")), cum.size - 1)
            token = i if ids is None else int(ids[i])
        sample = Sample(token)
        if p.logprobs is not None:
            lp = log_softmax(x)
            sample.logprob = float(lp[token])
            sample.top_logprobs = top_logprobs(lp, p.logprobs)
        self._record(token)
        return sample

    def _record(self, token: int) -> None:
        n = self.counts.get(token, 0)
        self.counts[token] = n + 1
        if n == 0 and token not in self._prompt_set:
            self._new_ids.append(token)
