"""The scheduler alone (no model): steps, the token budget, pages and preemption."""

from __future__ import annotations

import pytest

from sandwich_tvm.runtime.sampling import Sampler, SamplingParams
from sandwich_tvm.runtime.scheduler import QueueFull, Scheduler, SchedulerPolicy, pages_for
from sandwich_tvm.runtime.sequence import Sequence

PAGE = 4


def _seq(rid: str, n: int, max_tokens: int = 8) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Sequence(rid, list(range(n)), params, Sampler(params, range(n)), max_tokens)


def _run(sched: Scheduler, freed: list[int], steps: int = 500) -> list[str]:
    """Play the engine: apply each step, 'sample' a token for every sequence whose tokens are
    all cached, finish at max_tokens; the page count must match a recount after every step."""
    phases = []
    for _ in range(steps):
        step = sched.schedule()
        if step is None:
            break
        phases.append(step.phase)
        assert len(step.seqs) <= sched.policy.max_batch
        if step.phase == "prefill":
            assert sum(step.lengths) <= sched.policy.prefill_budget
            assert all(n <= sched.policy.chunk for n in step.lengths)
        else:
            assert step.lengths == [1] * len(step.seqs)
        for seq, n in zip(step.seqs, step.lengths, strict=True):
            seq.computed += n
            assert seq.computed <= len(seq.tokens)
        assert sched.pages_used() <= sched.total_pages
        for seq in step.seqs:
            if seq.computed == len(seq.tokens):
                seq.tokens.append(7)
                if seq.num_output >= seq.max_tokens:
                    sched.remove(seq)
    return phases


def test_prefill_then_decode_batches_everything():
    freed: list[int] = []
    sched = Scheduler(SchedulerPolicy(max_batch=4, prefill_budget=16, chunk=8), 100, PAGE, freed.append)
    seqs = [_seq(str(i), n) for i, n in enumerate((3, 10, 20, 5, 7))]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert first.phase == "prefill" and sum(first.lengths) <= 16
    assert first.lengths[:2] == [3, 8]  # chunk 8 cuts the second prompt
    for seq, n in zip(first.seqs, first.lengths, strict=True):
        seq.computed += n
    phases = ["prefill"] + _run(sched, freed)
    assert "decode" in phases
    assert all(s.num_output == s.max_tokens for s in seqs)
    assert not sched.has_work() and sched.pages_used() == 0
    assert len(freed) == 5  # every finished sequence gave its slot back to the cache


def test_preemption_keeps_pages_within_the_cache_and_everyone_finishes():
    freed: list[int] = []
    total = pages_for(40, PAGE) + 1
    sched = Scheduler(SchedulerPolicy(max_batch=8, prefill_budget=64, chunk=64), total, PAGE, freed.append)
    seqs = [_seq(str(i), 12, max_tokens=20) for i in range(6)]  # 6 x 32 tokens >> 40
    for s in seqs:
        sched.add(s)
    _run(sched, freed, steps=5000)
    assert all(s.num_output == 20 for s in seqs)
    assert any(s.preemptions for s in seqs)
    assert sched.pages_used() == 0


def test_decode_priority_finishes_the_batch_first():
    sched = Scheduler(SchedulerPolicy(max_batch=4, priority="decode"), 100, PAGE)
    a = _seq("a", 5)
    sched.add(a)
    step = sched.schedule()
    a.computed += step.lengths[0]
    a.tokens.append(1)
    sched.add(_seq("b", 5))
    assert sched.schedule().phase == "decode"
    prefill_first = Scheduler(SchedulerPolicy(max_batch=4), 100, PAGE)
    c = _seq("c", 5)
    prefill_first.add(c)
    step = prefill_first.schedule()
    c.computed += step.lengths[0]
    c.tokens.append(1)
    prefill_first.add(_seq("d", 5))
    assert prefill_first.schedule().phase == "prefill"


def test_queue_bound_and_removal():
    freed: list[int] = []
    sched = Scheduler(SchedulerPolicy(max_batch=1, max_queue=2), 100, PAGE, freed.append)
    a, b, c = _seq("a", 3), _seq("b", 3), _seq("c", 3)
    for s in (a, b):
        sched.add(s)
    sched.schedule()  # admits a
    sched.add(c)
    with pytest.raises(QueueFull, match="retry later"):
        sched.add(_seq("d", 3))
    assert sched.remove(b) is False  # waiting: no KV slot
    assert sched.remove(a) is True and freed == [0]


@pytest.mark.parametrize("field, value", [("max_batch", 0), ("prefill_budget", -1), ("chunk", 1.5),
                                          ("max_queue", True), ("priority", "fifo")])
def test_policy_validation(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerPolicy(**{field: value})
