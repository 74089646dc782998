"""One request as the scheduler sees it: its tokens, how many are in the KV cache, its state.

A sequence is *prefilling* while more than one of its tokens is missing from the KV cache (a
new prompt, or a preempted sequence being recomputed) and *decoding* once only the token it
last sampled is missing. Preemption drops a sequence's cache and keeps its tokens, so it comes
back as one longer prompt (vLLM's recompute).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    from .grammar import Constraint


class Status(enum.Enum):
    WAITING = "waiting"    # not in the KV cache
    RUNNING = "running"    # holds a KV slot (prefilling or decoding)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """``tokens`` is the prompt followed by the output; ``computed`` of them are cached."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()  # stop token ids and EOS (unless ignore_eos)
    arrival: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(init=False)
    computed: int = 0
    cached_tokens: int = 0  # of the prompt, found in the prefix cache when it was admitted
    slot: int | None = None  # the KV cache's sequence id while RUNNING
    status: Status = Status.WAITING
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    constraint: Constraint | None = None  # a grammar its tokens must follow (structured output)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def missing(self) -> int:
        """Tokens not yet in the KV cache."""
        return len(self.tokens) - self.computed

    @property
    def decoding(self) -> bool:
        return self.num_output > 0 and self.missing == 1

    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finished_at is None or self.first_token_at is None or self.num_output < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.num_output - 1)
