"""Iteration-level scheduling (continuous batching) over the paged KV cache.

Every iteration is *either* a prefill step, run on the prefill plan's cores, *or* a decode step
on the decode plan's: Sandwich hot-switches the thread pool between them over one copy of the
weights. A prefill step takes chunks of several sequences' missing tokens under a token budget;
a decode step takes every decoding sequence (m = batch for the GEMMs).

Pages are counted here exactly as TVM's cache allocates them (``ceil(tokens / page_size)`` per
sequence), so a step never asks the cache for a page it does not have: when a step would, the
most recently admitted sequence is preempted (its cache freed, its tokens kept to recompute
later) until it fits. The oldest sequence therefore always makes progress, and a request that
fits the cache alone always finishes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .sequence import Sequence, Status


class QueueFull(RuntimeError):
    """The waiting queue is at ``SchedulerPolicy.max_queue``; retry later."""


@dataclass(frozen=True)
class SchedulerPolicy:
    """What the CLI and the benchmark choose.

    ``max_batch``: sequences holding KV slots at once (the decode GEMMs' m); ``prefill_budget``:
    tokens per prefill step (all sequences' chunks together); ``chunk``: tokens of one sequence
    per prefill step; ``priority``: which phase runs when both have work ("prefill" admits new
    requests as soon as they fit, as vLLM's default scheduler does; "decode" finishes the running
    batch first); ``max_queue``: requests waiting for a slot before new ones are refused.
    """

    max_batch: int = 8
    prefill_budget: int = 512
    chunk: int = 512
    priority: Literal["prefill", "decode"] = "prefill"
    max_queue: int = 64

    def __post_init__(self) -> None:
        for name in ("max_batch", "prefill_budget", "chunk", "max_queue"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SchedulerPolicy.{name} must be a positive integer, not {v!r}")
        if self.priority not in ("prefill", "decode"):
            raise ValueError(f"SchedulerPolicy.priority must be 'prefill' or 'decode', not {self.priority!r}")


@dataclass
class Step:
    """One engine iteration: ``lengths[i]`` new tokens of ``seqs[i]`` go through the model."""

    phase: Literal["prefill", "decode"]
    seqs: list[Sequence]
    lengths: list[int]
    preempted: list[Sequence]


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Scheduler:
    """Waiting queue, running set and the page count; ``schedule`` picks the next step."""

    def __init__(self, policy: SchedulerPolicy, total_pages: int, page_size: int,
                 free_slot: Callable[[int], None] = lambda _slot: None):
        """``free_slot(slot)`` is called whenever a sequence leaves the KV cache (finished,
        aborted or preempted), so the cache drops its pages."""
        self.policy, self.total_pages, self.page_size = policy, total_pages, page_size
        self._free_slot = free_slot
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._free_slots = list(range(policy.max_batch - 1, -1, -1))
        self._frozen = False  # after a preemption, admit nothing until a sequence finishes

    # ------------------------------------------------------------------ bookkeeping
    def pages_used(self) -> int:
        return sum(pages_for(s.computed, self.page_size) for s in self.running)

    def free_pages(self) -> int:
        return self.total_pages - self.pages_used()

    def _grow(self, seq: Sequence, n: int) -> int:
        """Extra pages ``seq`` needs to cache ``n`` more tokens."""
        return pages_for(seq.computed + n, self.page_size) - pages_for(seq.computed, self.page_size)

    def add(self, seq: Sequence) -> None:
        p = self.policy
        if len(self.waiting) + len(self.running) >= p.max_batch + p.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting for one of {p.max_batch} batch slots "
                            f"(the queue holds {p.max_queue}); retry later")
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> bool:
        """Take a finished or cancelled ``seq`` out of the queue or the running set; True if it
        held a KV slot."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return False
        if self._release(seq):
            self._frozen = False  # pages came back: admission may resume
            return True
        return False

    def _release(self, seq: Sequence) -> bool:
        if seq in self.running:
            self.running.remove(seq)
            self._free_slot(seq.slot)
            self._free_slots.append(seq.slot)
            seq.slot = None
            return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ policy
    def schedule(self) -> Step | None:
        """The next step, or None when nothing can run."""
        decoders = [s for s in self.running if s.decoding]
        want_prefill = any(not s.decoding for s in self.running) or self._can_admit()
        if decoders and (self.policy.priority == "decode" or not want_prefill):
            return self._decode_step(decoders)
        if want_prefill:
            step = self._prefill_step()
            if step.seqs:
                return step
            if step.preempted:  # nothing fit, but pages were freed
                return self.schedule()
        return self._decode_step(decoders) if decoders else None

    def _can_admit(self, free: int | None = None) -> bool:
        """The head of the queue fits in ``free`` pages (default: all free now): its whole
        prompt, plus a page of headroom per running sequence. Nothing is admitted between a
        preemption and the next finished sequence, so a preempted sequence is not re-admitted
        only to be preempted again."""
        if not self.waiting or len(self.running) >= self.policy.max_batch or self._frozen:
            return False
        free = self.free_pages() if free is None else free
        return pages_for(self.waiting[0].missing, self.page_size) <= free - len(self.running)

    def _admit(self) -> Sequence:
        seq = self.waiting.popleft()
        seq.slot, seq.status, seq.computed = self._free_slots.pop(), Status.RUNNING, 0
        self.running.append(seq)
        return seq

    def _preempt_newest(self, keep: list[Sequence]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq not in keep:
                self._release(seq)
                self._frozen = True
                seq.status, seq.computed = Status.WAITING, 0
                seq.preemptions += 1
                self.waiting.appendleft(seq)
                return seq
        return None

    def _decode_step(self, decoders: list[Sequence]) -> Step:
        preempted: list[Sequence] = []
        while sum(self._grow(s, 1) for s in decoders) > self.free_pages():
            victim = self._preempt_newest(keep=decoders[:1])
            if victim is None:
                break
            preempted.append(victim)
            if victim in decoders:
                decoders.remove(victim)
        return Step("decode", decoders, [1] * len(decoders), preempted)

    def _prefill_step(self) -> Step:
        budget, free = self.policy.prefill_budget, self.free_pages()
        seqs: list[Sequence] = []
        lengths: list[int] = []
        preempted: list[Sequence] = []
        for seq in [s for s in self.running if not s.decoding]:
            if budget == 0:
                break
            n = min(seq.missing, self.policy.chunk, budget)
            while self._grow(seq, n) > free:
                victim = self._preempt_newest(keep=seqs + [seq])
                if victim is None:
                    break
                preempted.append(victim)
                free = self.free_pages() - sum(self._grow(s, k) for s, k in zip(seqs, lengths, strict=True))
            if self._grow(seq, n) > free:
                break
            seqs.append(seq)
            lengths.append(n)
            budget -= n
            free -= self._grow(seq, n)
        while budget > 0 and not preempted and self._can_admit(free):
            n = min(self.waiting[0].missing, self.policy.chunk, budget)
            seq = self._admit()
            seqs.append(seq)
            lengths.append(n)
            budget -= n
            free -= self._grow(seq, n)
        return Step("prefill", seqs, lengths, preempted)
