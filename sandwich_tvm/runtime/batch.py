"""Continuous batching: many sequences in the paged KV cache, one scheduled step at a time.

``BatchEngine.step`` asks the scheduler for the next iteration, puts the thread pool on that
phase's cores (prefill plan or decode plan, hot-switched), runs one ``batch_prefill`` or
``batch_decode`` over the compiled model, samples every sequence that produced logits and
returns what happened as ``TokenEvent`` values. It is synchronous and single-threaded:
``AsyncEngine`` runs it on its own thread for the server.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from .engine import EngineError, check_token_ids
from .grammar import Constraint, grammar_ending
from .interface import ServingEngine
from .metrics import ServingMetrics
from .sampling import Sample, Sampler, SamplingParams
from .scheduler import Scheduler, SchedulerPolicy, Step
from .sequence import Sequence, Status
from .speculative import Drafter, accept


@dataclass
class TokenEvent:
    """A sampled token of ``request_id`` (``token`` None when the request ended without one).

    ``finish_reason``: None while running, else "stop" (an EOS or stop token: ``stop_token``
    is True and the token is not part of the text), "length", "abort" or "error"
    (``error`` says what failed)."""

    request_id: str
    token: int | None
    sample: Sample | None = None
    finish_reason: str | None = None
    stop_token: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    cached_tokens: int = 0  # of the prompt, shared from the prefix cache


class BatchEngine:
    """Scheduler + samplers over a ``ServingEngine``'s model steps and KV cache (one process or
    tensor-parallel ranks). ``drafter``: where speculative drafts come from when the policy
    drafts (default prompt lookup; a ``draft_model.DraftModel``)."""

    def __init__(self, engine: ServingEngine, policy: SchedulerPolicy, *,
                 eos_ids: frozenset[int] = frozenset(), metrics: ServingMetrics | None = None,
                 drafter: Drafter | None = None):
        if policy.max_batch > engine.max_batch:
            raise EngineError(f"the policy batches {policy.max_batch} sequences but the KV cache was made "
                              f"for {engine.max_batch}")
        if min(policy.prefill_budget, policy.chunk) > engine.prefill_chunk:
            raise EngineError(f"a prefill step of {policy.prefill_budget} tokens exceeds the KV cache's "
                              f"prefill chunk of {engine.prefill_chunk}")
        if policy.prefill_budget > engine.prefill_chunk:  # several sequences' chunks add up to the budget
            policy = dataclasses.replace(policy, prefill_budget=engine.prefill_chunk)
        self.engine, self.policy, self.eos_ids, self.metrics = engine, policy, eos_ids, metrics
        if policy.num_speculative_tokens and engine.plan.processes > 1:
            raise EngineError("speculative decoding runs on one-process plans; this plan has "
                              f"{engine.plan.processes} processes")
        engine.clear()  # the scheduler owns the cache's sequences from here on
        if drafter is not None:
            drafter.clear()
        self.scheduler = Scheduler(policy, engine.available_pages(), engine.page_size, engine, drafter)
        self.seqs: dict[str, Sequence] = {}
        self.drafted = self.accepted = 0  # speculative draft tokens proposed and accepted
        self.grammar_s = 0.0  # time spent in grammars (masks and advancing them), all steps
        self._step_grammar_s = 0.0
        self.steps: Counter[str] = Counter()  # steps run: "prefill", "decode", "mixed"

    # ------------------------------------------------------------------ requests
    def check(self, prompt: Seq[int], max_tokens: int | None) -> int:
        """The max_tokens a request gets (the rest of the context when None); raises
        ``EngineError`` naming the limit when the request cannot fit."""
        context = self.engine.context
        check_token_ids(self.engine.cfg, prompt)
        if len(prompt) >= context:
            raise EngineError(f"the prompt has {len(prompt)} tokens; this server's context is {context} "
                              "tokens (prompt + completion)")
        room = context - len(prompt)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise EngineError(f"the prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds this "
                              f"server's context of {context} tokens; lower max_tokens to {room} or less")
        return max_tokens

    def add(self, request_id: str, prompt: Seq[int], params: SamplingParams,
            arrival: float | None = None, constraint: Constraint | None = None) -> Sequence:
        """Queue a request (``QueueFull`` when the queue is at its bound); ``constraint``: a
        grammar its output follows (``grammar.Grammars.constraint``)."""
        if request_id in self.seqs:
            raise EngineError(f"request id {request_id!r} is already running")
        max_tokens = self.check(prompt, params.max_tokens)
        if params.logit_bias and params.logit_bias[-1][0] >= self.engine.cfg.vocab_size:
            raise EngineError(f"logit_bias names token id {params.logit_bias[-1][0]}, outside the vocabulary "
                              f"(size {self.engine.cfg.vocab_size})")
        seq = Sequence(request_id, list(prompt), params, Sampler(params, prompt), max_tokens,
                       stop_ids=params.stop_ids(self.eos_ids))
        seq.constraint = constraint
        if arrival is not None:
            seq.arrival = arrival
        self.scheduler.add(seq)
        self.seqs[request_id] = seq
        return seq

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request (its pages are freed); None if it is not known (already finished)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "abort", None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def pages_in_use(self) -> int:
        """Pages the KV cache holds now, running and cached sequences' (the cache's own count)."""
        return self.engine.total_pages - self.engine.available_pages()

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[TokenEvent]:
        """Run the next scheduled iteration; [] when there is nothing to run."""
        drafting_s = self.scheduler.drafter.seconds  # a draft model's time, this step's added below
        switches = len(self.engine.switches)  # a draft model may switch the pool too
        step = self.scheduler.schedule()
        if step is None or not step.seqs:
            return []
        self.steps["mixed" if step.mixed else step.phase] += 1
        self.engine.use(step.phase)
        switched = len(self.engine.switches) - switches
        t0 = time.perf_counter()
        try:
            logits = self._forward(step)
        except Exception as err:  # a failed kernel: end every request in the cache, keep serving
            return self._fail_all(f"{type(err).__name__}: {err}")
        if self.policy.num_speculative_tokens and not step.drafts:
            self._draft_prefill(step)
        try:
            events = self._sample(step, logits)
        except Exception as err:  # e.g. NaN logits: end the requests of the cache, keep serving
            return self._fail_all(f"sampling failed: {type(err).__name__}: {err}")
        self.scheduler.index(step)
        if self.metrics is not None:
            self.metrics.spec_draft_seconds.inc(self.scheduler.drafter.seconds - drafting_s)
            self.metrics.on_tokens(sum(e.token is not None for e in events))
            self.metrics.on_step(step.phase, sum(step.lengths), switched, time.perf_counter() - t0,
                                 len(step.preempted))
            self.update_gauges()
        return events

    def update_gauges(self) -> None:
        if self.metrics is not None:
            s = self.scheduler
            self.metrics.on_state(len(s.waiting), len(s.running), s.pages_used(), s.pages_cached(),
                                  s.pages.free(), self.engine.total_pages)
            if s.prefix is not None:
                self.metrics.on_prefix_cache(s.prefix.hit_tokens, s.prefix.query_tokens, s.evictions)

    def _forward(self, step: Step) -> np.ndarray:
        slots = [s.slot for s in step.seqs]
        if step.drafts:  # the last token and its draft, every position's logits
            return self.engine.batch_verify(slots, [[s.tokens[-1], *d] for s, d in
                                                    zip(step.seqs, step.drafts, strict=True)])
        if step.phase == "decode" and not step.mixed:
            return self.engine.batch_decode(slots, [s.tokens[-1] for s in step.seqs])
        chunks = [s.tokens[s.computed:s.computed + n] for s, n in zip(step.seqs, step.lengths, strict=True)]
        return self.engine.batch_prefill(slots, chunks)

    def _draft_prefill(self, step: Step) -> None:
        """The step's prompt chunks (of sequences that will draft) to the drafter as well."""
        fed = [(s, s.computed + n) for s, n in zip(step.seqs, step.lengths, strict=True)  # will draft:
               if s.computed < len(s.tokens) - 1 and s.constraint is None and s.max_tokens > 2]
        if fed:
            self.scheduler.drafter.prefill([s for s, _ in fed], [n for _, n in fed])

    def _sample(self, step: Step, logits: np.ndarray) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        now = time.perf_counter()
        self._step_grammar_s = 0.0
        row = 0
        for i, (seq, n) in enumerate(zip(step.seqs, step.lengths, strict=True)):
            draft = step.drafts[i] if step.drafts else []
            rows = logits[row:row + n] if step.drafts else logits[i:i + 1]
            row += n
            seq.computed += n
            if seq.computed < len(seq.tokens):
                continue  # a chunk in the middle of the prompt: no token yet
            try:
                if seq.constraint is not None:
                    t0 = time.perf_counter()
                    seq.constraint.mask(rows[0])
                    self._step_grammar_s += time.perf_counter() - t0
                samples = (accept(draft, rows, seq.sampler, lambda x: x.token) if draft
                           else [seq.sampler(rows[0])])
            except Exception as err:  # e.g. NaN logits: this request ends, the others go on
                why = f"sampling failed: {type(err).__name__}: {err}"
                events.append(self._finish(seq, "error", None, error=why))
                continue
            if draft:
                self.drafted += len(draft)
                self.accepted += len(samples) - 1
                if self.metrics is not None:
                    self.metrics.on_draft(len(draft), len(samples) - 1)
            events += self._emit(seq, samples, now)
        self.grammar_s += self._step_grammar_s
        if self._step_grammar_s and self.metrics is not None:
            self.metrics.on_masks(self._step_grammar_s)
        return events

    def _emit(self, seq: Sequence, samples: list[Sample], now: float) -> list[TokenEvent]:
        """Append ``samples``' tokens to ``seq`` up to the first that ends it; the cache keeps the
        keys and values of every token but the last (a rejected draft's are popped)."""
        ending, kept, error = None, [], None
        for sample in samples:
            token = sample.token
            kept.append(sample)
            seq.tokens.append(token)
            if seq.first_token_at is None:
                seq.first_token_at = now
            if seq.constraint is not None and token not in seq.stop_ids:
                t0 = time.perf_counter()
                seq.constraint.accept(token)
                self._step_grammar_s += time.perf_counter() - t0
            if token in seq.stop_ids:
                ending = ("stop", True)
            elif seq.constraint is not None and (ended := grammar_ending(seq.constraint)):
                ending, error = (ended[0], False), ended[1]
            elif seq.num_output >= seq.max_tokens:  # check() keeps max_tokens inside the context
                ending = ("length", False)
            if ending:
                break
        extra = seq.computed - (len(seq.tokens) - 1)
        if extra > 0:
            self.scheduler.rollback(seq, extra)
            seq.computed -= extra
        first = seq.num_output - len(kept)
        events = [TokenEvent(seq.request_id, s.token, s, prompt_tokens=len(seq.prompt),
                             cached_tokens=seq.cached_tokens, output_tokens=first + j + 1)
                  for j, s in enumerate(kept[:-1] if ending else kept)]
        if ending:
            events.append(self._finish(seq, ending[0], kept[-1].token, kept[-1], stop_token=ending[1],
                                       error=error))
        return events

    def _finish(self, seq: Sequence, reason: str, token: int | None, sample: Sample | None = None, *,
                stop_token: bool = False, error: str | None = None) -> TokenEvent:
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason, seq.finished_at = Status.FINISHED, reason, time.perf_counter()
        del self.seqs[seq.request_id]
        if self.metrics is not None:
            self.metrics.on_finish(seq)
        return TokenEvent(seq.request_id, token, sample, reason, stop_token, len(seq.prompt),
                          seq.num_output, error, seq.cached_tokens)

    def _fail_all(self, message: str) -> list[TokenEvent]:
        self.engine.clear()  # the cache may hold half a step
        return [self._finish(seq, "error", None, error=message) for seq in self.scheduler.drop_all()]
