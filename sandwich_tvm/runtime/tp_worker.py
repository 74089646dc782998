"""One rank of a tensor- or pipeline-parallel engine: its shard of the weights (or its stage's
layers), its part of the KV cache and an ``Engine`` on its own CPUs (in a pipeline, wrapped in
a ``StageEngine`` that hands activations on), driven over Disco (``runtime.disco_group``).

Disco starts ``python -m sandwich_tvm.runtime.tp_worker`` for ranks 1..P-1; rank 0 is a thread
of the controller (``runtime.tp``), which imports this module too, so every rank registers:

- ``INIT(spec_json)``: join the process group's shared memory, load this rank's shard (first
  touched by the rank's own cores) and open its engine; returns the rank's ``Rank``, which
  Disco holds for the calls below (``ATTACH``: only the shared memory, for sessions that use
  just the collectives);
- one rank function per engine operation, with typed arguments (token ids as shapes);
- when a rank joins its group, the collectives the sharded model calls (``model.parallel``:
  all-reduce, all-reduce with the residual add, the gather of the last axis) and Disco's own
  CPU all-reduce (``runtime.disco..allreduce``), each bound to that group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import tvm_ffi

from ..collective.shm import ShmGroup
from ..model.parallel import ALLREDUCE, ALLREDUCE_ADD, GATHER
from ..model.separation import WA_ATTEND, WA_RECEIVE, WA_REPLY
from . import relay
from .disco_group import Failure, RankState, rank_function, start_rank
from .engine import Engine
from .stage import Exchanges, StageEngine

ENTRYPOINT = "sandwich_tvm.runtime.tp_worker"
INIT = "sandwich.tp.init"  # (spec json) -> Rank
ATTACH = "sandwich.tp.attach"  # (shm name, world, slot, timeout_s) -> Rank, with no engine
USE = "sandwich.tp.use"  # (phase) -> the slowest rank's switch time (ms)
AVAILABLE_PAGES = "sandwich.tp.available_pages"  # () -> free pages of the KV cache
START, STOP = "sandwich.tp.start", "sandwich.tp.stop"  # (seq_id)
FORK = "sandwich.tp.fork"  # (parent, child, tokens)
POPN = "sandwich.tp.popn"  # (seq_id, n)
CLEAR = "sandwich.tp.clear"  # ()
PREFILL = "sandwich.tp.prefill"  # (seq_id, tokens) -> logits [vocab]
DECODE = "sandwich.tp.decode"  # (seq_id, token) -> logits [vocab]
BATCH_PREFILL = "sandwich.tp.batch_prefill"  # (slots, lengths, tokens) -> logits [len(slots), vocab]
BATCH_DECODE = "sandwich.tp.batch_decode"  # (slots, tokens) -> logits [len(slots), vocab]
# a pipeline step relayed by the controller (ranks on other hosts; runtime.relay): each returns
# this rank's next exchange, or DONE (rank 0: with the logits), as bytes
RELAY_PREFILL = "sandwich.tp.relay_prefill"  # (slots, lengths, tokens)
RELAY_DECODE = "sandwich.tp.relay_decode"  # (slots, tokens)
RELAY_RESUME = "sandwich.tp.relay_resume"  # (the exchange's result, packed)
HOP_INIT = "sandwich.tp.hop_init"  # () -> a RankState with no model (bench hop)
HOP_ECHO = "sandwich.tp.hop_echo"  # (payload bytes, answer size) -> that many bytes

REDUCE_SUM, REDUCE_AVG = 0, 4  # Disco's ReduceKind values this collective supports


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs (sent as one JSON string): the process group's segment, the
    compiled model (one per pipeline stage), and the run spec (``RunSpec.to_json``: plan,
    context, KV cache, batch)."""

    shm: str  # the process group's segment ("" for ranks on several hosts: the controller relays)
    slot: int
    timeout_s: float
    artifact: str  # the compiled model's directory
    run: str  # RunSpec.to_json()
    page_size: int = 16
    stages: list[str] = field(default_factory=list)  # a pipeline's compiled stages, in order
    # stages of several ranks: each stage's own segment (its TP collectives; the slot is ``slot``)
    stage_shms: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


class Rank(RankState):
    """This rank's view of the process group and its engine."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self._group: ShmGroup | None = None
        self._stage_group: ShmGroup | None = None  # a stage of several ranks: its TP collectives
        self._engine: Engine | StageEngine | None = None
        self.step: Exchanges | None = None  # a relayed pipeline step between its exchanges
        self.inbox: np.ndarray | None = None  # rank 0: an exchange's result the controller handed it

    @property
    def group(self) -> ShmGroup:
        if self._group is None:
            raise RuntimeError("this rank has not joined a process group")
        return self._group

    @property
    def engine(self) -> Engine | StageEngine:
        if self._engine is None:
            raise RuntimeError("this rank has no engine (its init failed or was not called)")
        return self._engine

    def abort(self) -> None:
        for group in (self._group, self._stage_group):
            if group is not None:
                group.abort()

    def join(self, shm: str, world: int, slot: int, timeout_s: float, stage_shm: str = "",
             tp: int = 1) -> None:
        """Attach the group's segment and bind the collectives to it; in a pipeline of stages of
        ``tp`` ranks, the model's collectives to this rank's stage's segment ``stage_shm`` (the
        stages hand their activations on through the whole group's)."""
        self._group = ShmGroup.attach(shm, self.rank, world, slot, timeout_s)
        if stage_shm:
            self._stage_group = ShmGroup.attach(stage_shm, self.rank % tp, tp, slot, timeout_s)
        _register_collectives(self._stage_group or self._group)

    def load(self, spec: RankSpec) -> None:
        """Join the group, load this rank's shard (or stage) on its cores and open its engine;
        returns when every rank has (or raises when a peer failed)."""
        from ..compiler.artifact import CompiledModel
        from ..model.weights import load_params
        from ..spec import RunSpec
        from ..topology.hwloc import bind_memory, numa_node_count

        run = RunSpec.from_json(spec.run)
        plan = run.plan
        mine = plan.rank(self.rank)
        os.sched_setaffinity(0, set(mine.prefill_cpus))  # this rank's cores touch its weights first
        if mine.numa and numa_node_count() > 1:  # and its memory is on its own NUMA nodes
            bind_memory(list(mine.numa[0]))
        if spec.shm:
            stage_shm = spec.stage_shms[plan.stage_of(self.rank)] if spec.stage_shms else ""
            self.join(spec.shm, plan.processes, spec.slot, spec.timeout_s, stage_shm, plan.tp)
        compiled = CompiledModel.load(spec.stages[plan.part_of(self.rank)] if spec.stages else spec.artifact)
        isa, dtype = compiled.weight_layout
        # a separated model's attention side has no weights: nothing to read
        params = [] if not compiled.params else load_params(
            run.model, compiled.config, compiled.params, isa, seed=run.seed, dtype=dtype,
            layouts=compiled.layouts, shards=compiled.shards, rank=self.rank % plan.tp, tp=plan.tp,
            imatrix=run.imatrix)
        engine = Engine(compiled, params, mine, context=run.context, prefill_chunk=run.prefill_chunk,
                        page_size=spec.page_size, max_batch=run.max_batch, kv_tokens=run.kv_tokens)
        stage = compiled.stage
        self._engine = engine if stage is None else StageEngine(engine, stage, self._group, plan.tp,
                                                                self.rank % plan.tp)
        if self._group is None:  # the controller checks every rank's answer itself
            return
        ready = self.group.allreduce(np.ones(1, np.float32))  # every rank is up, or a peer's error raises
        if int(ready[0]) != plan.processes:
            raise RuntimeError(f"only {int(ready[0])} of {plan.processes} ranks started")

    def stage_engine(self) -> StageEngine:
        if not isinstance(self.engine, StageEngine):
            raise RuntimeError("this rank is not a pipeline stage: only stages relay their steps")
        return self.engine

    def advance(self, result: np.ndarray | None) -> bytes:
        """Run the relayed step on to its next exchange (sent ``result`` of the last one)."""
        if self.step is None:
            raise RuntimeError("no pipeline step is under way on this rank")
        try:
            op, mine = self.step.send(result) if result is not None else next(self.step)
            return relay.pack(op, mine)
        except StopIteration as done:
            self.step = None
            return relay.pack(relay.DONE, done.value)


def worker_id() -> int:
    import tvm

    return int(tvm.get_global_func("runtime.disco.worker_id")()[0])


def _register_collectives(group: ShmGroup) -> None:
    """The model's collectives and Disco's CPU all-reduce, over ``group`` (a VM looks them up
    when it is created, so each engine keeps the group its rank joined)."""

    def allreduce(x, out) -> None:
        group.allreduce(x, out)

    def allreduce_add(x, residual, out) -> None:
        group.allreduce(x, out, residual)

    def gather_last(x, out) -> None:
        """Rank r's ``x[..., w]`` into ``out[..., r * w : (r + 1) * w]`` (cut at ``out``'s width)."""
        group.allgather(x, out)

    def disco_allreduce(send, kind: int, in_group: bool, recv) -> None:
        """Disco's collective for CPU workers (whose CCL name is empty): sum or average."""
        if kind not in (REDUCE_SUM, REDUCE_AVG):
            raise ValueError(f"the shared-memory all-reduce sums (ReduceKind 0) or averages (4), not {kind}")
        group.allreduce(send, recv)
        if kind == REDUCE_AVG:
            view = np.from_dlpack(recv)
            view /= group.world

    # weight-attention separation (``model.separation``): the side with nothing to send adds zeros
    def wa_attend(qkv, out) -> None:
        """Weight rank: ``qkv`` to the attention rank, its attention output into ``out``."""
        group.allreduce(qkv, qkv)
        np.from_dlpack(out)[...] = 0
        group.allreduce(out, out)

    def wa_receive(_after, out) -> None:
        """Attention rank: the weight rank's next QKV into ``out``."""
        np.from_dlpack(out)[...] = 0
        group.allreduce(out, out)

    def wa_reply(x, out) -> None:
        """Attention rank: ``x`` to the weight rank; ``out`` (the marker the next receive waits on)
        zeros."""
        group.allreduce(x, x)
        np.from_dlpack(out)[...] = 0

    for name, fn in ((ALLREDUCE, allreduce), (ALLREDUCE_ADD, allreduce_add), (GATHER, gather_last),
                     (WA_ATTEND, wa_attend), (WA_RECEIVE, wa_receive), (WA_REPLY, wa_reply),
                     ("runtime.disco..allreduce", disco_allreduce)):
        tvm_ffi.register_global_func(name, fn, override=True)


# ---------------------------------------------------------------------- init
@tvm_ffi.register_global_func(INIT, override=True)
def _init(spec_json: str) -> Rank | Failure:
    rank = Rank(worker_id())
    return start_rank(rank, lambda: rank.load(RankSpec.from_json(spec_json)))


@tvm_ffi.register_global_func(ATTACH, override=True)
def _attach(shm: str, world: int, slot: int, timeout_s: float) -> Rank | Failure:
    """A rank with the group's segment and no model: for Disco sessions that only use the
    collectives (``Session.allreduce`` on CPU workers)."""
    rank = Rank(worker_id())
    return start_rank(rank, rank.join, shm, world, slot, timeout_s)


@tvm_ffi.register_global_func(HOP_INIT, override=True)
def _hop_init() -> RankState:
    return RankState(worker_id())


# ---------------------------------------------------------------------- engine operations
@rank_function(USE)
def _use(rank: Rank, phase: str) -> float:
    ms = rank.engine.use(phase)  # every rank switches: it took as long as the slowest one
    if rank._group is None:  # ranks on several hosts: rank 0's own time
        return ms
    return float(rank.group.allgather(np.array([ms], np.float32)).max())


@rank_function(AVAILABLE_PAGES)
def _available_pages(rank: Rank) -> int:
    return rank.engine.available_pages()


@rank_function(START)
def _start(rank: Rank, seq_id: int) -> None:
    rank.engine.start(seq_id)


@rank_function(STOP)
def _stop(rank: Rank, seq_id: int) -> None:
    rank.engine.stop(seq_id)


@rank_function(FORK)
def _fork(rank: Rank, parent: int, child: int, tokens: int) -> None:
    rank.engine.fork(parent, child, tokens)


@rank_function(POPN)
def _popn(rank: Rank, seq_id: int, n: int) -> None:
    rank.engine.popn(seq_id, n)


@rank_function(CLEAR)
def _clear(rank: Rank) -> None:
    rank.engine.clear()


@rank_function(PREFILL)
def _prefill(rank: Rank, seq_id: int, tokens) -> np.ndarray:
    return rank.engine.prefill(list(tokens), seq_id)


@rank_function(DECODE)
def _decode(rank: Rank, seq_id: int, token: int) -> np.ndarray:
    return rank.engine.decode(token, seq_id)


@rank_function(BATCH_PREFILL)
def _batch_prefill(rank: Rank, slots, lengths, tokens) -> np.ndarray:
    chunks = np.split(np.asarray(list(tokens), np.int32), np.cumsum(list(lengths))[:-1])
    return rank.engine.batch_prefill(list(slots), chunks)


@rank_function(BATCH_DECODE)
def _batch_decode(rank: Rank, slots, tokens) -> np.ndarray:
    return rank.engine.batch_decode(list(slots), list(tokens))


def bytes_function(name: str) -> Callable[[Callable[..., bytes]], Callable[..., bytes]]:
    """Register ``fn(rank, *args) -> bytes``, whose every rank's answer the controller reads: a
    failure is answered as packed error bytes (a remote rank's Python object cannot be read
    back), kept for LAST_ERROR, and ends a relayed step under way."""

    def register(fn: Callable[..., bytes]) -> Callable[..., bytes]:
        def guarded(rank: RankState | Failure, *args: Any) -> bytes:
            if isinstance(rank, Failure):
                return relay.pack_error(rank.message)
            answer = rank.run(fn, rank, *args)
            if isinstance(answer, Failure):
                if isinstance(rank, Rank):
                    rank.step = None
                return relay.pack_error(answer.message)
            return answer

        tvm_ffi.register_global_func(name, guarded, override=True)
        return fn

    return register


@bytes_function(RELAY_PREFILL)
def _relay_prefill(rank: Rank, slots, lengths, tokens) -> bytes:
    chunks = np.split(np.asarray(list(tokens), np.int32), np.cumsum(list(lengths))[:-1])
    rank.step = rank.stage_engine().prefill_ticks(list(slots), chunks)
    return rank.advance(None)


@bytes_function(RELAY_DECODE)
def _relay_decode(rank: Rank, slots, tokens) -> bytes:
    rank.step = rank.stage_engine().decode_ticks(list(slots), list(tokens))
    return rank.advance(None)


@bytes_function(RELAY_RESUME)
def _relay_resume(rank: Rank, result: bytes) -> bytes:
    _, array = relay.unpack(result, 0)
    if rank.inbox is not None:  # rank 0, handed the result in-process
        array, rank.inbox = rank.inbox, None
    return rank.advance(array)


@bytes_function(HOP_ECHO)
def _hop_echo(_state: RankState, payload: bytes, size: int) -> bytes:
    return bytes(payload)[:size].ljust(size, b"\0")


def main() -> None:
    """A Disco worker process: this module's functions are registered; serve commands."""
    from tvm.exec import disco_worker

    from ..host import enable_amx

    enable_amx()  # the tile permission is per process: this worker runs AMX kernels too
    disco_worker.main()


if __name__ == "__main__":
    main()
