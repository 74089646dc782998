"""Serving metrics in Prometheus form (``prometheus_client``), one registry per engine.

Names follow vLLM's where one exists (``time_to_first_token_seconds``, ...), prefixed
``sandwich_``. The engine thread updates them; ``/metrics`` renders ``registry``.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .sequence import Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
                   10.0, 20.0, 60.0)
MASK_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25)
RATE_WINDOW_S = 10.0  # tokens per second over this window


class ServingMetrics:
    """Queue, batch, KV cache, latency and throughput metrics of one engine."""

    def __init__(self, model: str):
        self.registry = r = CollectorRegistry()
        labels = {"model": model}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sandwich_{name}", doc, ["model"], registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"sandwich_{name}", doc, ["model"], registry=r).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"sandwich_{name}", doc, ["model"], buckets=LATENCY_BUCKETS,
                             registry=r).labels(**labels)

        self.waiting = gauge("num_requests_waiting", "Requests queued for a KV slot")
        self.running = gauge("num_requests_running", "Sequences in the KV cache")
        self.pages_used = gauge("kv_cache_pages_used", "Pages of the paged KV cache running sequences hold")
        self.pages_cached = gauge("kv_cache_pages_cached",
                                  "Pages only the prefix cache holds (evicted least recently used first)")
        self.pages_free = gauge("kv_cache_pages_free", "Pages of the paged KV cache no sequence holds")
        self.pages_total = gauge("kv_cache_pages_total", "Pages of the paged KV cache (used + cached + free)")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of the KV cache's pages running sequences hold")
        self.prefix_queries = gauge("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = gauge("prefix_cache_hits", "Prompt tokens found in the prefix cache (skipped)")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens")
        self.spec_drafts = counter("spec_decode_num_draft_tokens",
                                   "Draft tokens proposed (prompt lookup or draft model)")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_steps = counter("spec_decode_num_drafts", "Sequence steps verified with a draft")
        self.spec_rate = gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens so far")
        self.spec_tokens_per_step = gauge("spec_decode_tokens_per_step",
                                          "Tokens emitted per verified sequence step so far (accepted + 1)")
        self.spec_draft_seconds = counter("spec_decode_draft_seconds", "Time spent in the draft model")
        self.prefix_evictions = gauge("prefix_cache_evictions", "Cached sequences evicted to free pages")
        self.tokens_per_s = gauge("generation_tokens_per_second",
                                  f"Output tokens per second over the last {RATE_WINDOW_S:.0f} s")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (recomputation included)")
        self.generation_tokens = counter("generation_tokens", "Output tokens sampled")
        self.switches = counter("plan_switches", "Thread-pool switches between the prefill and decode plans")
        self.preemptions = counter("num_preemptions", "Sequences preempted (cache dropped, recomputed)")
        self.tuning_running = gauge("background_tuning_running",
                                    "1 while a background tuning worker runs (serve --tune-in-background)")
        self.tuned_gemms = counter("background_tuned_gemms", "GEMMs background tuning has landed records for")
        self.kernel_swaps = counter("kernel_swaps", "Builds with newly tuned kernels swapped in (serving)")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token")
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token")
        self.grammar_mask = Histogram("sandwich_grammar_mask_seconds",
                                      "Time a step spent in its constrained sequences' grammars "
                                      "(token masks, matchers advanced)",
                                      ["model"], buckets=MASK_BUCKETS, registry=r).labels(**labels)
        steps = Histogram("sandwich_step_seconds", "Engine iteration time by phase", ["model", "phase"],
                          buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = {p: steps.labels(model=model, phase=p) for p in ("prefill", "decode")}
        finished = Counter("sandwich_request_success", "Finished requests by reason", ["model", "reason"],
                           registry=r)
        self.finished = {k: finished.labels(model=model, reason=k)
                         for k in ("stop", "length", "abort", "error")}
        self._drafted = self._accepted = self._verified = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def on_step(self, phase: str, tokens: int, switched: int, seconds: float, preempted: int) -> None:
        """One engine step; ``switched``: thread-pool switches it made (a draft model's included)."""
        self.step_time[phase].observe(seconds)
        if phase == "prefill":
            self.prompt_tokens.inc(tokens)
        if switched:
            self.switches.inc(switched)
        if preempted:
            self.preemptions.inc(preempted)

    def on_draft(self, proposed: int, accepted: int) -> None:
        """One sequence's draft was verified: ``accepted`` of ``proposed`` tokens kept (the step
        emitted ``accepted + 1`` tokens)."""
        self.spec_drafts.inc(proposed)
        self.spec_accepted.inc(accepted)
        self.spec_steps.inc()
        self._drafted, self._accepted = self._drafted + proposed, self._accepted + accepted
        self.spec_rate.set(self._accepted / self._drafted if self._drafted else 0.0)
        self._verified += 1
        self.spec_tokens_per_step.set((self._accepted + self._verified) / self._verified)

    def on_masks(self, seconds: float) -> None:
        """A step spent ``seconds`` in its constrained sequences' grammars (masks, and advancing
        them by the sampled tokens), all of them together."""
        self.grammar_mask.observe(seconds)

    def on_tokens(self, n: int) -> None:
        """``n`` output tokens were sampled just now."""
        self.generation_tokens.inc(n)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            self.tokens_per_s.set(sum(k for _, k in self._recent) / RATE_WINDOW_S)

    def on_state(self, waiting: int, running: int, pages_used: int, pages_cached: int, pages_free: int,
                 pages_total: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.pages_used.set(pages_used)
        self.pages_cached.set(pages_cached)
        self.pages_free.set(pages_free)
        self.pages_total.set(pages_total)
        self.kv_usage.set(pages_used / pages_total if pages_total else 0.0)

    def on_prefix_cache(self, hits: int, queries: int, evictions: int) -> None:
        """The prefix cache's totals so far (tokens; sequences evicted)."""
        self.prefix_hits.set(hits)
        self.prefix_queries.set(queries)
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        self.prefix_evictions.set(evictions)

    def on_finish(self, seq: Sequence) -> None:
        self.finished[seq.finish_reason or "error"].inc()
        if seq.finish_reason in ("abort", "error"):
            return
        if (ttft := seq.ttft_s()) is not None:
            self.ttft.observe(ttft)
        if (tpot := seq.tpot_s()) is not None:
            self.tpot.observe(tpot)
        if seq.finished_at is not None:
            self.e2e.observe(seq.finished_at - seq.arrival)
