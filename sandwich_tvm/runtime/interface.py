"""The engine interface: what ``BatchEngine``, the server and ``generate`` use of an engine.

Two engines implement it: ``engine.Engine`` (one process) and ``tp.TPEngine`` (the ranks of a
sharded model, over Disco); both share the sizes, the prompt checks and the ``generate`` loop
through ``engine.EngineBase``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from ..model.config import LlamaConfig
    from ..topology.plan import ExecPlan
    from .engine import Generation


@runtime_checkable
class ServingEngine(Protocol):
    """A compiled model's steps over a paged KV cache, on the plan's prefill or decode cores."""

    cfg: LlamaConfig
    plan: ExecPlan
    context: int  # the longest sequence (prompt + output), tokens
    kv_tokens: int  # the KV cache's size, shared by up to max_batch sequences
    prefill_chunk: int  # the most tokens one prefill call takes
    page_size: int
    max_batch: int
    total_pages: int  # of the KV cache
    huge_page_share: float | None  # of the weights' resident memory in 2 MiB pages, when known
    phase: str | None  # the cores' phase now: "prefill", "decode" or None before the first step
    switches: list[float]  # every phase switch's time (ms)

    def use(self, phase: str) -> float:
        """Move to ``phase``'s cores; the switch time in ms (0 if already there)."""
        ...

    def available_pages(self) -> int:
        """Free pages of the KV cache."""
        ...

    def start(self, seq_id: int = 0) -> None:
        """Add a sequence to the KV cache."""
        ...

    def stop(self, seq_id: int = 0) -> None:
        """Remove a sequence from the KV cache."""
        ...

    def fork(self, parent: int, child: int, tokens: int) -> None:
        """Add ``child`` sharing ``parent``'s first ``tokens`` cached tokens (whole pages)."""
        ...

    def popn(self, seq_id: int, n: int) -> None:
        """Drop a sequence's last ``n`` cached tokens."""
        ...

    def batch_verify(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> np.ndarray:
        """``batch_prefill`` with every position's logits; ``[sum of lengths, vocab]``."""
        ...

    def clear(self) -> None:
        """Drop every sequence (after a failed step)."""
        ...

    def prefill(self, prompt: Sequence[int], seq_id: int = 0) -> np.ndarray:
        """Logits after the prompt, ``[vocab]``."""
        ...

    def decode(self, token: int, seq_id: int = 0) -> np.ndarray:
        """Logits after one more token, ``[vocab]``."""
        ...

    def batch_prefill(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> np.ndarray:
        """One forward over several sequences' chunks; ``[len(slots), vocab]``."""
        ...

    def batch_decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One decode step for every sequence in ``slots``; ``[len(slots), vocab]``."""
        ...

    def check_prompt(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        """Raise ``EngineError`` when the request cannot run."""
        ...

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, stop: set[int] | None = None,
                 on_token: Callable[[int], None] | None = None, logits_out: list | None = None,
                 sample: Callable[[np.ndarray], int] | None = None) -> Generation:
        """One request, prefill then decode."""
        ...

    def close(self) -> None:
        """Release what the engine holds besides memory (processes, shared memory)."""
        ...
