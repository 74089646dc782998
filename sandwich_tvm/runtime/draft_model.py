"""Speculative drafts from a draft model: a smaller model that shares the target's tokenizer.

``DraftModel`` is a ``speculative.Drafter`` over an ``Engine`` of its own (its weights and its
paged KV cache, in the same process and on the same cores as the target). Before a decode step
it brings each sequence's draft cache up to the sequence's tokens (one ``batch_prefill`` over
every sequence's missing tokens: usually the tokens emitted since the last step), then decodes
k - 1 more tokens greedily, all sequences in one ``batch_decode`` per position. The draft is a
function of the tokens so far, so ``speculative.accept`` keeps greedy outputs exact and
sampling's distribution unchanged.

A prefill step feeds the prompt chunks it runs to the draft model as well (``prefill``), so a
sequence's first decode step finds its draft cache holding the prompt. The draft cache keeps
the tokens it holds per sequence; the next proposal pops the ones the target rejected
(everything after the first token that differs) and feeds what was emitted. Its pages are
counted as TVM allocates them (``pages.KVPages``); a sequence that does not fit gets no draft
this step and gives its draft pages back (the target shares prompt prefixes, the draft cache
does not, so it can run out first). A draft-model call that fails clears the draft cache and
turns drafting off (the target goes on decoding alone); ``error`` says why, and ``log`` is told
once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .engine import Engine, EngineError
from .pages import KVPages

if TYPE_CHECKING:
    from ..model.config import LlamaConfig
    from ..model.tokenizer import ModelTokenizer
    from .sequence import Sequence as Seq

PREFILL_PLAN_TOKENS = 32  # a catch-up of more tokens than this runs on the prefill plan's cores


@dataclass
class _Cached:
    """One sequence's draft cache: its KV id, the tokens whose keys and values it holds, and how
    many of them are the sequence's own (before the last draft: a sequence only grows)."""

    kv_id: int
    tokens: list[int] = field(default_factory=list)
    synced: int = 0


class DraftModel:
    """Greedy drafts from ``engine`` (the draft model); ``use`` puts the thread pool on a phase's
    cores (the target engine's ``use``, so the two never disagree about where the pool is)."""

    def __init__(self, engine: Engine, use: Callable[[str], float], vocab_size: int | None = None,
                 log: Callable[[str], None] = lambda _m: None) -> None:
        """``vocab_size``: the target's, when the draft's embedding rows are padded past it (draft
        tokens are taken from the first ``vocab_size`` logits)."""
        self.engine, self.use, self.log = engine, use, log
        self.vocab = vocab_size or engine.cfg.vocab_size
        engine.clear()
        self.pages = KVPages(engine.available_pages(), engine.page_size)
        self._seqs: dict[str, _Cached] = {}
        self._next_id = 0
        self.error: str | None = None  # why drafting stopped, if it did
        self.seconds = 0.0  # spent in the draft model
        self.forwards = 0  # its batch_prefill and batch_decode calls

    # ------------------------------------------------------------------ Drafter
    def propose(self, seqs: list[Seq], ks: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        if self.error is not None:
            return drafts
        with self._calls():
            todo = self._sync(seqs, ks)
            if todo:
                self._draft(seqs, ks, todo, drafts)
        return drafts if self.error is None else [[] for _ in seqs]

    def prefill(self, seqs: list[Seq], upto: list[int]) -> None:
        """A prefill step gave the target ``seqs[i].tokens[:upto[i]]``: the draft model takes
        them too, in the same step (on the same cores), so that a prompt's first decode step
        drafts without catching up on the whole prompt while other sequences wait. A sequence
        whose tokens do not fit the draft cache is left to the decode step's catch-up."""
        if self.error is not None:
            return
        with self._calls():
            cached, missing = [], []
            for seq, n in zip(seqs, upto, strict=True):
                c = self._entry(seq)
                if len(c.tokens) >= n or self.pages.need(c.kv_id, n - len(c.tokens)) > self.pages.free():
                    continue
                self.pages.append(c.kv_id, n - len(c.tokens))
                cached.append(c)
                missing.append(list(seq.tokens[len(c.tokens):n]))
            if cached:
                self._feed(cached, missing)

    def release(self, seq: Seq) -> None:
        cached = self._seqs.pop(seq.request_id, None)
        if cached is not None and self.error is None:
            self.pages.remove(cached.kv_id)
            with self._calls():
                self.engine.stop(cached.kv_id)

    def clear(self) -> None:
        self.pages.clear()
        self._seqs.clear()
        if self.error is None:
            with self._calls():
                self.engine.clear()

    @contextlib.contextmanager
    def _calls(self) -> Iterator[None]:
        """Calls into the draft model: timed, and a failure (never into the serving loop) turns
        drafting off; the target decodes alone from here on."""
        t0 = time.perf_counter()
        try:
            yield
        except Exception as err:
            self._fail(err)
        finally:
            self.seconds += time.perf_counter() - t0

    def _fail(self, err: Exception) -> None:
        """Drafting off for good: the draft cache's state is unknown after a failed call (emptied
        if it still can be)."""
        if self.error is None:
            self.error = f"{type(err).__name__}: {err}"
            self.log(f"the draft model failed ({self.error}); decoding goes on without drafts")
        self.pages.clear()
        self._seqs.clear()
        with contextlib.suppress(Exception):
            self.engine.clear()

    # ------------------------------------------------------------------ steps
    def _sync(self, seqs: list[Seq], ks: list[int]) -> list[int]:
        """Pop what each sequence's draft cache holds beyond its agreement with the sequence;
        the indices of the sequences that get a draft (those whose whole draft fits the pages)."""
        todo = []
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            if k < 1:
                continue
            cached = self._entry(seq)
            keep = _agreement(cached, seq.tokens)
            if keep < len(cached.tokens):
                self.pages.pop(cached.kv_id, len(cached.tokens) - keep)
                self.engine.popn(cached.kv_id, len(cached.tokens) - keep)
                del cached.tokens[keep:]
                cached.synced = min(cached.synced, keep)
            grow = len(seq.tokens) + k - 1 - keep  # it will hold the sequence and k - 1 draft tokens
            if self.pages.need(cached.kv_id, grow) <= self.pages.free():
                self.pages.append(cached.kv_id, grow)
                cached.synced = len(seq.tokens)
                todo.append(i)
            else:  # no draft this step, and its pages go back to the others
                self.release(seq)
        return todo

    def _entry(self, seq: Seq) -> _Cached:
        """``seq``'s draft cache, made (empty) if it has none."""
        cached = self._seqs.get(seq.request_id)
        if cached is None:
            cached = self._seqs[seq.request_id] = _Cached(self._next_id)
            self._next_id += 1
            self.pages.add(cached.kv_id)
            self.engine.start(cached.kv_id)
        return cached

    def _feed(self, cached: list[_Cached], missing: list[list[int]]) -> list[int]:
        """Append ``missing[j]`` to ``cached[j]`` (pages already counted), at most the cache's
        prefill chunk per call; the greedy next token after each."""
        last = [0] * len(cached)
        done = [0] * len(cached)  # tokens of ``missing`` fed so far
        while any(d < len(m) for d, m in zip(done, missing, strict=True)):
            budget, slots, chunks, rows = self.engine.prefill_chunk, [], [], []
            for j, (c, m) in enumerate(zip(cached, missing, strict=True)):
                n = min(len(m) - done[j], budget)
                if n > 0:
                    slots.append(c.kv_id)
                    chunks.append(m[done[j]:done[j] + n])
                    rows.append(j)
                    done[j] += n
                    budget -= n
            logits = self.engine.batch_prefill(slots, chunks)
            self.forwards += 1
            for r, j in enumerate(rows):
                cached[j].tokens += chunks[r]
                if done[j] == len(missing[j]):
                    last[j] = int(np.argmax(logits[r, :self.vocab]))
        return last

    def _draft(self, seqs: list[Seq], ks: list[int], todo: list[int], drafts: list[list[int]]) -> None:
        eng = self.engine
        cached = [self._seqs[seqs[i].request_id] for i in todo]
        missing = [seqs[i].tokens[len(c.tokens):] for i, c in zip(todo, cached, strict=True)]
        self.use("prefill" if sum(map(len, missing)) > PREFILL_PLAN_TOKENS else "decode")
        for i, first in zip(todo, self._feed(cached, missing), strict=True):
            drafts[i].append(first)
        self.use("decode")
        for pos in range(1, max(ks[i] for i in todo)):
            live = [j for j, i in enumerate(todo) if ks[i] > pos]
            logits = eng.batch_decode([cached[j].kv_id for j in live], [drafts[todo[j]][-1] for j in live])
            self.forwards += 1
            for r, j in enumerate(live):
                cached[j].tokens.append(drafts[todo[j]][-1])
                drafts[todo[j]].append(int(np.argmax(logits[r, :self.vocab])))


def _agreement(cached: _Cached, tokens: Sequence[int]) -> int:
    """How many leading tokens of the draft cache match the sequence (its first ``synced`` do),
    leaving at least the sequence's last token to feed (its logits give the first draft token)."""
    n = min(len(cached.tokens), len(tokens) - 1)
    for i in range(min(cached.synced, n), n):
        if cached.tokens[i] != tokens[i]:
            return i
    return max(n, 0)


def check_draft_model(target: LlamaConfig, draft: LlamaConfig, target_tok: ModelTokenizer | None,
                      draft_tok: ModelTokenizer | None) -> None:
    """Raise ``EngineError`` unless the draft model shares the target's tokenizer: the same
    token-to-id map where both have a tokenizer (embedding tables padded to other sizes are fine),
    else the same vocabulary size."""
    if target_tok is None or draft_tok is None:
        if draft.vocab_size != target.vocab_size:
            raise EngineError(f"the draft model {draft.name} has a vocabulary of {draft.vocab_size} tokens, "
                              f"the model {target.name} one of {target.vocab_size}: a draft model must share "
                              "the model's tokenizer")
    else:
        a, b = target_tok.tok.get_vocab(), draft_tok.tok.get_vocab()
        if a != b:
            differ = sorted(set(a.items()) ^ set(b.items()))[:3]
            raise EngineError(f"the draft model's tokenizer ({draft_tok.source}) maps tokens differently "
                              f"from the model's ({target_tok.source}), e.g. {differ}: a draft model must "
                              "share the model's tokenizer")
