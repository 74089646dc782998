"""Speculative decoding: who drafts (``Drafter``), prompt-lookup drafts, and the acceptance walk.

A ``Drafter`` proposes up to k tokens per decoding sequence before a decode step. Two exist:
``PromptLookup`` here (the sequence's own tokens, no second model) and ``DraftModel`` in
``draft_model.py`` (a smaller model sharing the tokenizer, run greedily on its own KV cache).

``propose`` finds the most recent earlier occurrence of the sequence's last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, vLLM's names) and drafts the tokens that
followed it: outputs that copy from the prompt (summaries, edits, code) get long drafts. A decode
step then runs the last token and its draft as one small-m chunk (the GEMMs are tuned for every
m) and reads the logits of every position (``Engine.batch_verify``).

``accept`` walks the positions in order and samples each from the sequence's own sampler: the
draft token is accepted when the sample equals it, and the first sample that differs is emitted
in its place, ending the walk (or, with every draft token accepted, the last position gives a
bonus token). For a draft that is one token, not a distribution, this is exactly rejection
sampling: the draft token survives with its probability under the model, and a rejection draws
from the rest of the distribution. Greedy decoding therefore gives exactly the tokens it gives
without drafts, and sampling keeps its distribution. This holds for any draft that depends on
the tokens so far only, a draft model's greedy tokens included. The cache keeps the keys and
values of the accepted positions; the rest are popped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from .sequence import Sequence as Seq


def propose(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens`` from its last n-gram's previous occurrence."""
    if k < 1 or len(tokens) < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every n-gram but the last
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence
            return [int(t) for t in arr[start:start + k]]
    return []


def accept(draft: Sequence[int], rows: np.ndarray, sample: Callable[[np.ndarray], object],
           token_of: Callable[[object], int]) -> list:
    """The samples a verified step emits: ``rows[j]`` is the logits after the last token and
    ``draft[:j]``. Each is sampled in order; the walk ends at the first sample that is not the
    draft's token (or after the bonus sample past the whole draft)."""
    out = []
    for j in range(len(draft) + 1):
        s = sample(rows[j])
        out.append(s)
        if j == len(draft) or token_of(s) != draft[j]:
            break
    return out


class Drafter(Protocol):
    """What the scheduler asks of a draft source before a decode step; ``seconds``: the time it
    has spent drafting."""

    seconds: float

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` draft tokens continuing ``seqs[i].tokens`` (none where ``ks[i]`` is 0)."""
        ...

    def prefill(self, seqs: list[Seq], upto: list[int]) -> None:
        """A prefill step gave the target ``seqs[i].tokens[:upto[i]]`` (a drafter with a cache of
        its own may take them too)."""
        ...

    def release(self, seq: Seq) -> None:
        """``seq`` left the running set (finished, cancelled or preempted): drop what it holds."""
        ...

    def clear(self) -> None:
        """Forget every sequence (the target's cache was cleared)."""
        ...


class PromptLookup:
    """Drafts by prompt lookup (``propose``): no state, nothing to release."""

    seconds = 0.0  # drafts come from the tokens: no model time

    def __init__(self, n_max: int = 4, n_min: int = 2) -> None:
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        return [propose(s.tokens, k, self.n_max, self.n_min) for s, k in zip(seqs, ks, strict=True)]

    def prefill(self, seqs: list[Seq], upto: list[int]) -> None:
        pass

    def release(self, seq: Seq) -> None:
        pass

    def clear(self) -> None:
        pass
