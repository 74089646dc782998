"""Iteration-level scheduling (continuous batching) over the paged KV cache.

Every iteration is *either* a prefill step, run on the prefill plan's cores, *or* a decode step
on the decode plan's: Sandwich hot-switches the thread pool between them over one copy of the
weights. A prefill step takes chunks of several sequences' missing tokens under a token budget;
a decode step takes every decoding sequence (m = batch for the GEMMs).

Pages are counted here exactly as TVM's cache allocates them (``pages.KVPages``), so a step
never asks the cache for a page it does not have. With prefix caching (``prefix_cache``) a new
sequence is forked from the longest cached prefix of its prompt and a finished one stays cached;
cached pages count as free, and the least recently used entries are evicted when a step needs
their pages. When running sequences alone need more pages than the cache has, the most recently
admitted one is preempted (its tokens kept to recompute later) until the step fits. The oldest
sequence therefore always makes progress, and a request that fits the cache alone always
finishes.

The scheduler adds, forks and removes the cache's sequences itself (``KVOps``) as it decides,
so the cache and the count never disagree: a fork is made before any page it shares can be
evicted.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Literal, Protocol

from .pages import KVPages, pages_for
from .prefix_cache import PrefixCache
from .sequence import Sequence, Status
from .speculative import Drafter, PromptLookup

__all__ = ["KVOps", "QueueFull", "Scheduler", "SchedulerPolicy", "Step", "pages_for"]


class KVOps(Protocol):
    """What the scheduler asks of the paged KV cache (an engine's ``start``/``fork``/``stop``)."""

    def start(self, seq_id: int) -> None: ...

    def fork(self, parent: int, child: int, tokens: int) -> None: ...

    def stop(self, seq_id: int) -> None: ...

    def popn(self, seq_id: int, n: int) -> None: ...


class NoKV:
    """No cache behind the scheduler (its tests play the engine)."""

    def start(self, seq_id: int) -> None:
        pass

    def fork(self, parent: int, child: int, tokens: int) -> None:
        pass

    def stop(self, seq_id: int) -> None:
        pass

    def popn(self, seq_id: int, n: int) -> None:
        pass


class QueueFull(RuntimeError):
    """The waiting queue is at ``SchedulerPolicy.max_queue``; retry later."""


@dataclass(frozen=True)
class SchedulerPolicy:
    """What the CLI and the benchmark choose.

    ``max_batch``: sequences holding KV slots at once (the decode GEMMs' m); ``prefill_budget``:
    tokens per prefill step (all sequences' chunks together); ``chunk``: tokens of one sequence
    per prefill step; ``priority``: which phase runs when both have work ("prefill" admits new
    requests as soon as they fit, as vLLM's default scheduler does; "decode" finishes the running
    batch first); ``max_queue``: requests waiting for a slot before new ones are refused;
    ``prefix_caching``: share cached prompt prefixes (on by default, as in vLLM and llama-server);
    ``num_speculative_tokens``: draft tokens per decoding sequence and step (0: off), from prompt
    lookup (``prompt_lookup_max``/``min``: the n-gram lengths matched, ``speculative.py``) unless
    the scheduler is given another ``Drafter`` (a draft model);
    ``steps``: "split" runs a step of prefill chunks *or* one of decodes (the plans hot-switched
    between them), "mixed" puts every decoding sequence's next token and prompt chunks under the
    rest of the budget in one step (chunked prefill piggybacked on decode, as Sarathi-Serve and
    vLLM do), on the prefill plan when it holds more than ``mixed_prefill_tokens`` tokens, else
    on the decode plan.
    """

    max_batch: int = 8
    prefill_budget: int = 512
    chunk: int = 512
    priority: Literal["prefill", "decode"] = "prefill"
    max_queue: int = 64
    prefix_caching: bool = True
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    steps: Literal["split", "mixed"] = "split"
    mixed_prefill_tokens: int = 32

    def __post_init__(self) -> None:
        for name in ("max_batch", "prefill_budget", "chunk", "max_queue", "prompt_lookup_max",
                     "prompt_lookup_min", "mixed_prefill_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SchedulerPolicy.{name} must be a positive integer, not {v!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"SchedulerPolicy.num_speculative_tokens must be 0 (off) or more, not {k!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"SchedulerPolicy.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"SchedulerPolicy.prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"SchedulerPolicy.prefix_caching must be True or False, "
                             f"not {self.prefix_caching!r}")
        if self.steps not in ("split", "mixed"):
            raise ValueError(f"SchedulerPolicy.steps must be 'split' or 'mixed', not {self.steps!r}")
        if self.priority not in ("prefill", "decode"):
            raise ValueError(f"SchedulerPolicy.priority must be 'prefill' or 'decode', not {self.priority!r}")


@dataclass
class Step:
    """One engine iteration: ``lengths[i]`` new tokens of ``seqs[i]`` go through the model."""

    phase: Literal["prefill", "decode"]
    seqs: list[Sequence]
    lengths: list[int]
    preempted: list[Sequence]
    drafts: list[list[int]] | None = None  # a decode step's draft tokens per sequence (speculative)
    mixed: bool = False  # decoding sequences' tokens and prompt chunks together (batch_prefill)


class Scheduler:
    """Waiting queue, running set and the KV cache's pages; ``schedule`` picks the next step."""

    def __init__(self, policy: SchedulerPolicy, total_pages: int, page_size: int, kv: KVOps | None = None,
                 drafter: Drafter | None = None):
        """``kv`` is the paged KV cache the scheduler's sequences live in (none: its tests);
        ``drafter`` drafts speculative tokens (default: prompt lookup, when the policy drafts)."""
        self.policy, self.kv = policy, kv or NoKV()
        self.drafter = drafter or PromptLookup(policy.prompt_lookup_max, policy.prompt_lookup_min)
        self.pages = KVPages(total_pages, page_size)
        self.prefix = PrefixCache(self.pages) if policy.prefix_caching else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._kv_ids = itertools.count()  # a KV sequence id per admission (an entry keeps its own)
        self._frozen = False  # after a preemption, admit nothing until a sequence finishes
        self.evictions = 0

    @property
    def total_pages(self) -> int:
        return self.pages.total

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    # ------------------------------------------------------------------ bookkeeping
    def pages_used(self) -> int:
        """Pages the running sequences hold."""
        return len(self.pages.held_by(s.slot for s in self.running))

    def pages_cached(self) -> int:
        """Pages only finished sequences (prefix-cache entries) hold: evicted when needed."""
        return self.total_pages - self.pages.free() - self.pages_used()

    def free_pages(self) -> int:
        """Pages a step may take: free, or held only by cached entries."""
        return self.total_pages - self.pages_used()

    def _grow(self, seq: Sequence, n: int) -> int:
        """Extra pages ``seq`` needs to cache ``n`` more tokens."""
        return self.pages.need(seq.slot, n)

    def add(self, seq: Sequence) -> None:
        p = self.policy
        if len(self.waiting) + len(self.running) >= p.max_batch + p.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting for one of {p.max_batch} batch slots "
                            f"(the queue holds {p.max_queue}); retry later")
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> bool:
        """Take a finished or cancelled ``seq`` out of the queue or the running set; True if it
        held a KV slot (its cached tokens stay as a prefix-cache entry unless it opted out)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return False
        if self._release(seq):
            self._frozen = False  # pages came back: admission may resume
            return True
        return False

    def _caches(self, seq: Sequence) -> bool:
        return self.prefix is not None and seq.params.cache_prompt

    def _release(self, seq: Sequence) -> bool:
        if seq not in self.running:
            return False
        self.running.remove(seq)
        self.drafter.release(seq)
        if self._caches(seq) and seq.computed:
            self.prefix.index(seq.slot, tuple(seq.tokens[:seq.computed]), seq.computed)
            self.prefix.keep(seq.slot)
        else:
            self._drop(seq.slot)
        seq.slot = None
        return True

    def _drop(self, kv_id: int) -> None:
        if self.prefix is not None:
            self.prefix.forget(kv_id)
        self.pages.remove(kv_id)
        self.kv.stop(kv_id)

    def drop_all(self) -> list[Sequence]:
        """The cache was cleared (a failed step): forget every page; the running sequences."""
        failed, self.running = self.running, []
        self.pages.clear()
        self.drafter.clear()
        if self.prefix is not None:
            self.prefix.clear()
        for seq in failed:
            seq.slot = None
        return failed

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ policy
    def schedule(self) -> Step | None:
        """The next step, or None when nothing can run. Its sequences' pages are taken (cached
        entries evicted, least recently used first, as they are needed)."""
        step = self._next()
        if step is None or not step.seqs:
            return step
        need = sum(self._grow(s, n) for s, n in zip(step.seqs, step.lengths, strict=True))
        while self.pages.free() < need:
            oldest = self.prefix.oldest() if self.prefix is not None else None
            if oldest is None:
                raise RuntimeError(f"a step needs {need} pages, the cache has {self.pages.free()} free")
            self._drop(oldest)
            self.evictions += 1
        for seq, n in zip(step.seqs, step.lengths, strict=True):
            self.pages.append(seq.slot, n)
        return step

    def index(self, step: Step) -> None:
        """After ``step`` ran: its sequences' newly full pages can be shared."""
        if self.prefix is None:
            return
        for seq in step.seqs:
            if seq.params.cache_prompt and seq.slot is not None:
                self.prefix.index(seq.slot, seq.tokens, seq.computed)

    def _next(self) -> Step | None:
        decoders = [s for s in self.running if s.decoding]
        want_prefill = any(not s.decoding for s in self.running) or self._can_admit()
        if self.policy.steps == "mixed" and decoders and want_prefill:
            return self._mixed_step(decoders)
        if decoders and (self.policy.priority == "decode" or not want_prefill):
            return self._decode_step(decoders)
        if want_prefill:
            step = self._prefill_step()
            if step.seqs:
                return step
            if step.preempted:  # nothing fit, but pages were freed
                return self._next()
        return self._decode_step(decoders) if decoders else None

    def _admission_pages(self, seq: Sequence) -> int:
        """Pages admitting ``seq`` takes from ``free_pages``: its whole prompt, less the cached
        prefix it would share with a running sequence."""
        found = self.prefix.match(seq.tokens) if self._caches(seq) else None
        if found is None:
            return pages_for(seq.missing, self.page_size)
        parent, n = found
        running = self.pages.held_by(s.slot for s in self.running)
        shared = self.pages.prefix_pages(parent, n)
        return pages_for(len(seq.tokens), self.page_size) - sum(p in running for p in shared)

    def _can_admit(self, free: int | None = None) -> bool:
        """The head of the queue fits in ``free`` pages (default: all free now): its whole
        prompt, plus a page of headroom per running sequence. Nothing is admitted between a
        preemption and the next finished sequence, so a preempted sequence is not re-admitted
        only to be preempted again."""
        if not self.waiting or len(self.running) >= self.policy.max_batch or self._frozen:
            return False
        free = self.free_pages() if free is None else free
        return self._admission_pages(self.waiting[0]) <= free - len(self.running)

    def _admit(self) -> Sequence:
        """The head of the queue into the cache: forked from its longest cached prefix, if any."""
        seq = self.waiting.popleft()
        seq.slot, seq.status = next(self._kv_ids), Status.RUNNING
        found = self.prefix.lookup(seq.tokens) if self._caches(seq) else None
        if found is None:
            self.pages.add(seq.slot)
            self.kv.start(seq.slot)
            seq.computed = 0
        else:
            parent, seq.computed = found
            self.pages.fork(parent, seq.slot, seq.computed)
            self.kv.fork(parent, seq.slot, seq.computed)
        if not seq.preemptions:  # what the request's usage reports
            seq.cached_tokens = seq.computed
        self.running.append(seq)
        return seq

    def _preempt_newest(self, keep: list[Sequence]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq not in keep:
                self._release(seq)  # with prefix caching its pages stay cached until evicted
                self._frozen = True
                seq.status, seq.computed = Status.WAITING, 0
                seq.preemptions += 1
                self.waiting.appendleft(seq)
                return seq
        return None

    def _decode_step(self, decoders: list[Sequence], drafts: bool = True) -> Step:
        preempted: list[Sequence] = []
        while sum(self._grow(s, 1) for s in decoders) > self.free_pages():
            victim = self._preempt_newest(keep=decoders[:1])
            if victim is None:
                break
            preempted.append(victim)
            if victim in decoders:
                decoders.remove(victim)
        proposed = self._drafts(decoders) if drafts else None
        if proposed is not None:
            return Step("decode", decoders, [1 + len(d) for d in proposed], preempted, proposed)
        return Step("decode", decoders, [1] * len(decoders), preempted)

    def _drafts(self, decoders: list[Sequence]) -> list[list[int]] | None:
        """The drafter's tokens for the decoders (none for a constrained sequence, none past its
        max_tokens), when the pages a whole draft takes are free and any were drafted; else None."""
        k = self.policy.num_speculative_tokens
        if not k or not decoders:
            return None
        ks = [0 if s.constraint is not None else max(min(k, s.max_tokens - s.num_output - 1), 0)
              for s in decoders]
        pages = sum(self._grow(s, 1 + n) for s, n in zip(decoders, ks, strict=True))  # a whole draft each
        if not any(ks) or pages > self.free_pages():
            return None
        drafts = self.drafter.propose(decoders, ks)
        return drafts if any(drafts) else None

    def rollback(self, seq: Sequence, n: int) -> None:
        """Drop ``seq``'s last ``n`` cached tokens (rejected draft positions)."""
        if n:
            self.pages.pop(seq.slot, n)
            self.kv.popn(seq.slot, n)

    def _mixed_step(self, decoders: list[Sequence]) -> Step:
        """Every decoder's next token, then prompt chunks under the rest of the budget; the
        cores of the plan its token count calls for."""
        decode = self._decode_step(list(decoders), drafts=False)
        if decode.preempted:  # pages were short: decode alone this time
            return decode
        step = self._prefill_step(decode.seqs, max(self.policy.prefill_budget - len(decode.seqs), 0))
        if len(step.seqs) == len(decode.seqs):
            return decode
        tokens = sum(step.lengths)
        phase = "prefill" if tokens > self.policy.mixed_prefill_tokens else "decode"
        return Step(phase, step.seqs, step.lengths, step.preempted, mixed=True)

    def _prefill_step(self, decoders: list[Sequence] = (), budget: int | None = None) -> Step:
        """Prompt chunks under the budget (after ``decoders``' one token each, in a mixed step)."""
        budget = self.policy.prefill_budget if budget is None else budget
        seqs: list[Sequence] = list(decoders)
        lengths: list[int] = [1] * len(seqs)
        preempted: list[Sequence] = []

        def free() -> int:  # what the step has not taken yet
            return self.free_pages() - sum(self._grow(s, k) for s, k in zip(seqs, lengths, strict=True))

        for seq in [s for s in self.running if not s.decoding]:
            if budget == 0:
                break
            n = min(seq.missing, self.policy.chunk, budget)
            while self._grow(seq, n) > free() and not decoders:
                victim = self._preempt_newest(keep=seqs + [seq])
                if victim is None:
                    break
                preempted.append(victim)
            if self._grow(seq, n) > free():
                break
            seqs.append(seq)
            lengths.append(n)
            budget -= n
        while budget > 0 and not preempted and self._can_admit(free()):
            seq = self._admit()
            n = min(seq.missing, self.policy.chunk, budget)
            seqs.append(seq)
            lengths.append(n)
            budget -= n
        return Step("prefill", seqs, lengths, preempted)
