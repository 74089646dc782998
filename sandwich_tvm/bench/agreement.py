"""Does a reduced-precision model pick the tokens its fp32 reference picks?

The reference generates greedily; the candidate is then fed the same tokens (teacher forcing)
and, at every step, we ask whether its argmax is the reference's token. Where it is not, the
reference's own margin between the two tokens says whether that step was a near-tie (random
weights make many) or a real loss of precision. The candidate's free-running greedy output is
compared too: how many leading tokens equal the reference's.

Only one engine is open at a time, so a model whose fp32 and bf16 copies do not fit in memory
together can still be compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ..runtime.engine import Engine


def forced_logits(engine: Engine, prompt: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """Logits after the prompt and after each of ``tokens`` but the last: row i scores the
    choice of ``tokens[i]``."""
    engine.start()
    try:
        engine.use("prefill")
        rows = [engine.prefill(prompt).reshape(-1)]
        engine.use("decode")
        rows += [engine.decode(t).reshape(-1) for t in tokens[:-1]]
    finally:
        engine.stop()
    return np.stack(rows)


@dataclass
class Disagreement:
    """A step where the candidate's argmax is not the reference's token."""

    step: int
    reference_token: int
    candidate_token: int
    reference_margin: float  # reference logit of its token minus that of the candidate's pick
    margin_rank: float  # share of all steps whose reference top-1 margin is smaller than this one's


@dataclass
class Agreement:
    """Teacher-forced agreement of a candidate model with its reference over ``steps`` steps."""

    steps: int
    agree: float  # share of steps where the candidate's argmax is the reference's token
    free_run_prefix: int  # leading tokens of the candidate's own greedy output equal to the reference's
    logit_rms_error: float  # RMS of candidate - reference logits over all steps
    logit_scale: float  # RMS of the reference logits
    median_margin: float  # the reference's median top-1 minus top-2 logit
    tokens: list[int] = field(default_factory=list)  # the reference's greedy tokens
    disagreements: list[Disagreement] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def score(tokens: Sequence[int], reference: np.ndarray, candidate: np.ndarray,
          candidate_tokens: Sequence[int]) -> Agreement:
    """Compare teacher-forced logits (rows: steps) of the reference and the candidate."""
    tokens = np.asarray(tokens)
    picks = candidate.argmax(-1)
    top2 = np.sort(reference, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    wrong = []
    for i in np.flatnonzero(picks != tokens):
        margin = float(reference[i, tokens[i]] - reference[i, picks[i]])
        wrong.append(Disagreement(int(i), int(tokens[i]), int(picks[i]), margin,
                                  float(np.mean(margins < margin))))
    prefix = 0
    for ours, ref in zip(candidate_tokens, tokens, strict=False):
        if ours != ref:
            break
        prefix += 1
    return Agreement(steps=len(tokens), agree=float(np.mean(picks == tokens)), free_run_prefix=prefix,
                     logit_rms_error=float(np.sqrt(np.mean((candidate - reference) ** 2))),
                     logit_scale=float(np.sqrt(np.mean(reference ** 2))),
                     median_margin=float(np.median(margins)), tokens=[int(t) for t in tokens],
                     disagreements=wrong)


def greedy_agreement(open_reference: Callable[[], Engine], open_candidate: Callable[[], Engine],
                     prompts: Sequence[Sequence[int]], steps: int) -> list[Agreement]:
    """Per prompt: greedy ``steps`` tokens of the reference, then the candidate's choices on
    them. Each engine is opened, used for every prompt and released before the other is
    opened. The reference tokens are ``Agreement.tokens``."""
    engine = open_reference()
    try:
        tokens = [engine.generate(p, steps).tokens for p in prompts]
        reference = [forced_logits(engine, p, t) for p, t in zip(prompts, tokens, strict=True)]
    finally:
        engine.close()
    del engine
    for ref, toks in zip(reference, tokens, strict=True):
        if [int(t) for t in ref.argmax(-1)] != list(toks):
            raise RuntimeError("the reference's teacher-forced argmax differs from its own greedy "
                               "tokens: its prefill and decode paths disagree")
    engine = open_candidate()
    try:
        candidate = [forced_logits(engine, p, t) for p, t in zip(prompts, tokens, strict=True)]
        own = [engine.generate(p, steps).tokens for p in prompts]
    finally:
        engine.close()
    return [score(*args) for args in zip(tokens, reference, candidate, own, strict=True)]


def pooled(results: Sequence[Agreement]) -> float:
    """The share of all steps, over every prompt, where the candidate agrees."""
    return sum(r.agree * r.steps for r in results) / sum(r.steps for r in results)
