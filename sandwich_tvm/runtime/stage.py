"""One pipeline stage's engine: its layers' ``Engine`` and the hand-offs between the stages.

Every rank of a pipeline runs each engine operation (``runtime.tp_worker``), in the same order.
A forward step is split into micro-batches (the step's sequences in up to one group per stage,
or one long prompt chunk in pieces) that flow through the stages one tick apart, so every
stage works on its own micro-batch at once: stage s computes its layers on what stage s - 1
handed it the tick before (the first stage on the token ids). Hand-offs go through the process
group's shared memory (or, for stages on other hosts, through the controller: ``runtime.relay``);
every rank takes part in every one, so the ranks stay in step. The last stage's hidden states of
the positions asked for go back to stage 0, whose head (``Engine.head``) makes the logits that
its rank returns to the controller.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import numpy as np

from ..collective.shm import ShmGroup
from ..model.stages import MIN_PIECE, Stage
from .engine import Engine

GATHER, REDUCE = "gather", "reduce"  # a step's exchanges: hidden states on, the last stage's back
Exchanges = Generator[tuple[str, np.ndarray], np.ndarray, "np.ndarray | None"]


def _drive(ticks: Exchanges, exchange: Callable[[str, np.ndarray], np.ndarray]) -> np.ndarray | None:
    """Run a step's exchanges through ``exchange``; what the step returns."""
    try:
        op, mine = next(ticks)
        while True:
            op, mine = ticks.send(exchange(op, mine))
    except StopIteration as done:
        return done.value


class StageEngine:
    """The engine interface of one stage's rank; the forward operations return the logits on
    stage 0 and None on the others."""

    def __init__(self, engine: Engine, stage: Stage, group: ShmGroup | None, tp: int = 1, tp_rank: int = 0):
        self.engine, self.stage, self.group = engine, stage, group
        self.hidden = engine.cfg.hidden_size
        # a stage of ``tp`` ranks: the group's ranks s * tp .. (s + 1) * tp - 1, whose outputs are
        # equal (the model's last all-reduce); the next stage reads its first rank's
        self.tp, self.tp_rank = tp, tp_rank

    # the cache and the cores: every stage's own
    def use(self, phase: str) -> float:
        return self.engine.use(phase)

    def available_pages(self) -> int:
        return self.engine.available_pages()

    def start(self, seq_id: int) -> None:
        self.engine.start(seq_id)

    def stop(self, seq_id: int) -> None:
        self.engine.stop(seq_id)

    def fork(self, parent: int, child: int, tokens: int) -> None:
        self.engine.fork(parent, child, tokens)

    def popn(self, seq_id: int, n: int) -> None:
        self.engine.popn(seq_id, n)

    def clear(self) -> None:
        self.engine.clear()

    # ------------------------------------------------------------------ forward steps
    def _ticks(self, phase: str, parts: list[MicroBatch]) -> Exchanges:
        """One step as micro-batches through the stages: at tick t stage s runs part t - s, so
        as many parts are in flight as there are stages. After each tick the stages before the
        last hand their outputs on (an all-gather: stage s + 1 reads stage s's part), and the
        last stage's hidden states of the positions asked for go to stage 0 (an all-reduce the
        others add zeros to), whose head makes the logits (of the parts whose logits are
        wanted: one prompt's pieces but the last need none). Yields each
        exchange, ``(GATHER or REDUCE, this rank's array)``, and is sent its result, so that the
        shared memory (``_pipeline_exchange``) or the controller (``TPEngine._relay`` and
        ``Rank.advance``, ranks on other hosts)
        carries it. Returns the parts' logit rows in order on stage 0, None on the others."""
        count, me = self.stage.count, self.stage.index
        tokens = max(p.tokens for p in parts)
        rows = max(p.rows for p in parts)
        received: dict[int, np.ndarray] = {}
        logits: dict[int, np.ndarray] = {}
        for tick in range(len(parts) + count - 1):
            j = tick - me
            out = None
            if 0 <= j < len(parts):
                part = parts[j]
                x = part.ids if self.stage.first else received.pop(j)[:part.tokens].reshape(part.hidden_shape)
                out = self.engine.forward(phase, x, part.slots, part.lengths, part.positions)
            if any(0 <= tick - s < len(parts) for s in range(count - 1)):  # a stage before the last ran
                mine = np.zeros((tokens, self.hidden), np.float32)
                if out is not None and not self.stage.last:
                    mine[:len(out)] = out
                every = yield GATHER, mine
                if not self.stage.first and 0 <= tick - (me - 1) < len(parts):
                    src = (me - 1) * self.tp  # the previous stage's first rank
                    received[tick - (me - 1)] = every[:, src * self.hidden:(src + 1) * self.hidden].copy()
            last = tick - (count - 1)
            if 0 <= last < len(parts) and parts[last].wanted:  # the last stage's rows to stage 0's head
                mine = np.zeros((rows, self.hidden), np.float32)
                if self.stage.last and self.tp_rank == 0:  # one rank of the last stage adds its rows
                    mine[:len(out)] = out
                total = yield REDUCE, mine
                if self.stage.first:
                    logits[last] = self.engine.head(phase, np.ascontiguousarray(total[:parts[last].rows]))
        return np.concatenate([logits[j] for j in sorted(logits)]) if self.stage.first else None

    def _parts(self, slots: Sequence[int], chunks: Sequence[np.ndarray], decode: bool) -> list[MicroBatch]:
        """The step's sequences in up to ``count`` micro-batches of consecutive sequences; one
        sequence's long prompt chunk in consecutive pieces instead (each stage then runs the
        next piece while the one after it runs this one; only the last piece's logits count)."""
        count = self.stage.count
        if len(slots) == 1 and not decode and len(chunks[0]) >= 2 * MIN_PIECE:
            n = min(count, len(chunks[0]) // MIN_PIECE)
            return [MicroBatch(list(slots), [piece], decode, self.hidden, wanted=i == n - 1)
                    for i, piece in enumerate(np.array_split(chunks[0], n))]
        groups = np.array_split(np.arange(len(slots)), min(count, len(slots)))
        return [MicroBatch([slots[i] for i in g], [chunks[i] for i in g], decode, self.hidden)
                for g in groups]

    def batch_prefill(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> np.ndarray | None:
        """Logits after each chunk's last token on stage 0 (``Engine.batch_prefill``)."""
        return _drive(self.prefill_ticks(slots, chunks), self._pipeline_exchange)

    def batch_decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray | None:
        """One decode step of every sequence in ``slots``; logits on stage 0."""
        return _drive(self.decode_ticks(slots, tokens), self._pipeline_exchange)

    def prefill_ticks(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> Exchanges:
        """``batch_prefill`` as its exchanges (``_ticks``)."""
        parts = self._parts(slots, [np.asarray(c, np.int32) for c in chunks], decode=False)
        return (yield from self._ticks("prefill", parts))  # one prompt in pieces: the last one's row

    def decode_ticks(self, slots: Sequence[int], tokens: Sequence[int]) -> Exchanges:
        """``batch_decode`` as its exchanges (``_ticks``)."""
        ids = [np.asarray([t], np.int32) for t in tokens]
        return (yield from self._ticks("decode", self._parts(slots, ids, decode=True)))

    def _pipeline_exchange(self, op: str, mine: np.ndarray) -> np.ndarray:
        """An exchange through the process group's shared memory."""
        if self.group is None:
            raise RuntimeError("this stage's rank has no shared memory: the controller relays its exchanges")
        return self.group.allgather(mine) if op == GATHER else self.group.allreduce(mine)

    def prefill(self, prompt: Sequence[int], seq_id: int = 0) -> np.ndarray | None:
        """Logits after the prompt, in chunks of the engine's ``prefill_chunk``."""
        logits = None
        step = self.engine.prefill_chunk
        for s in range(0, len(prompt), step):
            logits = self.batch_prefill([seq_id], [list(prompt[s:s + step])])
        return None if logits is None else logits[0]

    def decode(self, token: int, seq_id: int = 0) -> np.ndarray | None:
        logits = self.batch_decode([seq_id], [token])
        return None if logits is None else logits[0]


class MicroBatch:
    """Some sequences' part of a step: their slots, token chunks (one token each in a decode
    step), the positions whose output comes back, the hidden states' shape between stages, and
    whether its logits are wanted (of one prompt's pieces, only the last one's)."""

    def __init__(self, slots: list[int], chunks: list[np.ndarray], decode: bool, hidden: int,
                 wanted: bool = True):
        self.slots, self.decode, self.wanted = slots, decode, wanted
        self.lengths = [len(c) for c in chunks]
        self.tokens, self.rows = sum(self.lengths), len(chunks)
        self.ids = np.concatenate(chunks).reshape((-1, 1) if decode else (1, -1))
        self.positions = None if decode else np.cumsum(self.lengths, dtype=np.int32) - 1
        self.hidden_shape = (self.tokens, 1, hidden) if decode else (1, self.tokens, hidden)
