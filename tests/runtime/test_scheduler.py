"""The scheduler alone (no model): steps, the token budget, pages, preemption and the prefix
cache's forks and evictions."""

from __future__ import annotations

import pytest

from sandwich_tvm.runtime.sampling import Sampler, SamplingParams
from sandwich_tvm.runtime.scheduler import QueueFull, Scheduler, SchedulerPolicy, pages_for
from sandwich_tvm.runtime.sequence import Sequence

PAGE = 4


class FakeKV:
    """The KV cache's sequences as the scheduler adds, forks and removes them: each holds its
    cached tokens; a fork copies the parent's leading ones (so a wrong fork shows)."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}
        self.forks: list[tuple[int, int, int]] = []
        self.freed: list[int] = []

    def start(self, seq_id: int) -> None:
        assert seq_id not in self.seqs
        self.seqs[seq_id] = []

    def fork(self, parent: int, child: int, tokens: int) -> None:
        assert child not in self.seqs and tokens % PAGE == 0 and tokens <= len(self.seqs[parent])
        self.seqs[child] = self.seqs[parent][:tokens]
        self.forks.append((parent, child, tokens))

    def stop(self, seq_id: int) -> None:
        del self.seqs[seq_id]
        self.freed.append(seq_id)


def _seq(rid: str, n: int, max_tokens: int = 8, prompt: list[int] | None = None,
         cache: bool = True) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, cache_prompt=cache)
    prompt = list(range(n)) if prompt is None else prompt
    return Sequence(rid, prompt, params, Sampler(params, prompt), max_tokens)


def _policy(caching: bool, **kw) -> SchedulerPolicy:
    return SchedulerPolicy(prefix_caching=caching, **kw)


def _check_pages(sched: Scheduler) -> None:
    used, cached, free = sched.pages_used(), sched.pages_cached(), sched.pages.free()
    assert min(used, cached, free) >= 0 and used + cached + free == sched.total_pages


def _run(sched: Scheduler, kv: FakeKV, steps: int = 500) -> list[str]:
    """Play the engine: apply each step (the fake cache appends the chunk's tokens, which must
    be the sequence's next ones), 'sample' a token for every sequence whose tokens are all
    cached, finish at max_tokens; the pages add up after every step."""
    phases = []
    for _ in range(steps):
        step = sched.schedule()
        if step is None:
            break
        phases.append("mixed" if step.mixed else step.phase)
        assert len(step.seqs) <= sched.policy.max_batch
        if step.mixed:  # decoders' one token each, then prompt chunks
            assert sum(step.lengths) <= max(sched.policy.prefill_budget, len(step.seqs))
            big = sum(step.lengths) > sched.policy.mixed_prefill_tokens
            assert step.phase == ("prefill" if big else "decode")
            assert any(s.decoding for s in step.seqs) and any(not s.decoding for s in step.seqs)
        elif step.phase == "prefill":
            assert sum(step.lengths) <= sched.policy.prefill_budget
            assert all(n <= sched.policy.chunk for n in step.lengths)
        else:
            assert step.lengths == [1] * len(step.seqs)
        for seq, n in zip(step.seqs, step.lengths, strict=True):
            assert kv.seqs[seq.slot] == seq.tokens[:seq.computed]  # the cache holds exactly these
            kv.seqs[seq.slot] += seq.tokens[seq.computed:seq.computed + n]
            seq.computed += n
            assert seq.computed <= len(seq.tokens)
        sched.index(step)
        _check_pages(sched)
        for seq in step.seqs:
            if seq.computed == len(seq.tokens):
                seq.tokens.append(7)
                if seq.num_output >= seq.max_tokens:
                    sched.remove(seq)
    return phases


@pytest.mark.parametrize("caching, steps", [(False, "split"), (True, "split"), (True, "mixed")])
def test_prefill_then_decode_batches_everything(caching, steps):
    kv = FakeKV()
    sched = Scheduler(_policy(caching, max_batch=4, prefill_budget=16, chunk=8, steps=steps), 100, PAGE, kv)
    seqs = [_seq(str(i), n, prompt=[100 * i + t for t in range(n)]) for i, n in enumerate((3, 10, 20, 5, 7))]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert first.phase == "prefill" and sum(first.lengths) <= 16
    assert first.lengths[:2] == [3, 8]  # chunk 8 cuts the second prompt
    for seq, n in zip(first.seqs, first.lengths, strict=True):
        kv.seqs[seq.slot] += seq.tokens[:n]
        seq.computed += n
    phases = ["prefill"] + _run(sched, kv)
    assert "decode" in phases
    assert ("mixed" in phases) == (steps == "mixed")
    assert all(s.num_output == s.max_tokens for s in seqs)
    assert not sched.has_work() and sched.pages_used() == 0
    if caching:  # every finished sequence stays cached (distinct prompts: nothing shared)
        assert not kv.freed and len(kv.seqs) == 5 and not kv.forks
        assert sched.pages_cached() == sum(pages_for(len(s.tokens) - 1, PAGE) for s in seqs)
    else:
        assert len(kv.freed) == 5 and not kv.seqs  # every finished sequence left the cache


@pytest.mark.parametrize("caching, steps", [(False, "split"), (True, "split"), (True, "mixed")])
def test_preemption_keeps_pages_within_the_cache_and_everyone_finishes(caching, steps):
    kv = FakeKV()
    total = pages_for(40, PAGE) + 1
    policy = _policy(caching, max_batch=8, prefill_budget=64, chunk=64, steps=steps)
    sched = Scheduler(policy, total, PAGE, kv)
    seqs = [_seq(str(i), 12, max_tokens=20, prompt=[100 * i + t for t in range(12)]) for i in range(6)]
    for s in seqs:  # 6 x 32 tokens >> 40
        sched.add(s)
    _run(sched, kv, steps=5000)
    assert all(s.num_output == 20 for s in seqs)
    assert any(s.preemptions for s in seqs)
    assert sched.pages_used() == 0
    if caching:
        assert sched.evictions > 0


def test_decode_priority_finishes_the_batch_first():
    sched = Scheduler(SchedulerPolicy(max_batch=4, priority="decode"), 100, PAGE)  # no cache behind it
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
    kv = FakeKV()
    sched = Scheduler(SchedulerPolicy(max_batch=1, max_queue=2, prefix_caching=False), 100, PAGE, kv)
    a, b, c = _seq("a", 3), _seq("b", 3), _seq("c", 3)
    for s in (a, b):
        sched.add(s)
    sched.schedule()  # admits a
    sched.add(c)
    with pytest.raises(QueueFull, match="retry later"):
        sched.add(_seq("d", 3))
    assert sched.remove(b) is False  # waiting: no KV slot
    assert sched.remove(a) is True and kv.freed == [0]


@pytest.mark.parametrize("field, value", [("max_batch", 0), ("prefill_budget", -1), ("chunk", 1.5),
                                          ("max_queue", True), ("priority", "fifo"),
                                          ("prefix_caching", 1), ("steps", "both"),
                                          ("num_speculative_tokens", -1), ("prompt_lookup_min", 9)])
def test_policy_validation(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerPolicy(**{field: value})


def _finish(sched: Scheduler, kv: FakeKV, seq: Sequence) -> None:
    """Run ``seq`` (alone) to its end."""
    sched.add(seq)
    _run(sched, kv)
    assert seq.num_output == seq.max_tokens


def test_a_prompt_sharing_a_cached_prefix_prefills_only_the_rest():
    kv = FakeKV()
    sched = Scheduler(_policy(True, max_batch=4, prefill_budget=64, chunk=64), 100, PAGE, kv)
    system = list(range(1000, 1030))  # 30 tokens: 7 whole pages
    a = _seq("a", 0, max_tokens=3, prompt=system + [1, 2, 3])
    _finish(sched, kv, a)
    b = _seq("b", 0, max_tokens=3, prompt=system + [4, 5])
    sched.add(b)
    step = sched.schedule()
    assert step.seqs == [b] and b.cached_tokens == 28 and step.lengths == [32 - 28]
    assert kv.forks == [(a.slot if a.slot is not None else 0, b.slot, 28)]
    assert sched.prefix.hit_tokens == 28 and sched.prefix.query_tokens == len(a.prompt) + len(b.prompt)
    kv.seqs[b.slot] += b.tokens[28:]
    b.computed = 32
    b.tokens.append(7)  # sampled: b decodes on
    sched.index(step)
    # the whole conversation so far (a multi-turn chat's next prompt) reuses b's pages
    c = _seq("c", 0, max_tokens=2, prompt=b.tokens + [9] * 9)
    sched.add(c)
    assert sched.schedule().seqs == [c] and c.cached_tokens == 32
    assert kv.forks[-1] == (b.slot, c.slot, 32)
    _check_pages(sched)


def test_the_last_prompt_token_is_always_computed():
    kv = FakeKV()
    sched = Scheduler(_policy(True, max_batch=2), 100, PAGE, kv)
    _finish(sched, kv, _seq("a", 12, max_tokens=2))  # 13 tokens cached: 3 whole pages
    again = _seq("b", 12, max_tokens=2)  # the same 12-token prompt: 2 pages shared, 4 tokens to go
    sched.add(again)
    step = sched.schedule()
    assert again.cached_tokens == 8 and step.lengths == [4]


def test_opting_out_neither_reuses_nor_leaves_pages():
    kv = FakeKV()
    sched = Scheduler(_policy(True, max_batch=2), 100, PAGE, kv)
    _finish(sched, kv, _seq("a", 20, max_tokens=2))
    b = _seq("b", 20, max_tokens=2, cache=False)
    _finish(sched, kv, b)
    assert b.cached_tokens == 0 and len(kv.forks) == 0
    assert kv.freed == [b.slot if b.slot is not None else 1]  # b left the cache; a's entry stays
    assert len(kv.seqs) == 1


def test_least_recently_used_entries_are_evicted_first():
    kv = FakeKV()
    total = 12  # pages: three 16-token conversations fit, a fourth evicts
    sched = Scheduler(_policy(True, max_batch=1, prefill_budget=64, chunk=64), total, PAGE, kv)
    prompts = {name: [ord(name) * 100 + t for t in range(14)] for name in "abcd"}
    ids = {}
    for name in "abc":
        seq = _seq(name, 0, max_tokens=2, prompt=prompts[name])
        _finish(sched, kv, seq)
        ids[name] = next(k for k in kv.seqs if kv.seqs[k][:14] == prompts[name])
    _finish(sched, kv, _seq("a2", 0, max_tokens=2, prompt=prompts["a"] + [1, 2]))  # touches a's entry
    _finish(sched, kv, _seq("d", 0, max_tokens=2, prompt=prompts["d"]))
    assert ids["b"] in kv.freed and ids["a"] not in kv.freed  # b was the least recently used
    assert sched.evictions >= 1
    _check_pages(sched)


def test_shared_pages_survive_their_entrys_eviction():
    kv = FakeKV()
    sched = Scheduler(_policy(True, max_batch=2, prefill_budget=64, chunk=64), 9, PAGE, kv)
    system = list(range(500, 516))  # 4 pages
    _finish(sched, kv, _seq("a", 0, max_tokens=1, prompt=system + [1]))
    b = _seq("b", 0, max_tokens=12, prompt=system + [2])
    sched.add(b)
    for _ in range(3):  # b runs on a's pages
        step = sched.schedule()
        for seq, n in zip(step.seqs, step.lengths, strict=True):
            kv.seqs[seq.slot] += seq.tokens[seq.computed:seq.computed + n]
            seq.computed += n
            if seq.computed == len(seq.tokens):
                seq.tokens.append(7)
        sched.index(step)
    assert b.cached_tokens == 16 and sched.pages_used() == 5
    c = _seq("c", 0, max_tokens=2, prompt=[9] * 12)  # needs 4 pages: a's entry must go
    sched.add(c)
    _run(sched, kv)
    assert sched.evictions >= 1 and b.num_output == 12
    _check_pages(sched)
