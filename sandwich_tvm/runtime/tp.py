"""The tensor- and pipeline-parallel engine: a plan of P processes run as P ranks on TVM's
Disco, of a sharded model (summing their partial products through the shared-memory
all-reduce) or of pipeline stages (each stage's activations handed to the next through it).

The controller creates the process group's segment and a ``DiscoGroup`` whose workers run
``runtime.tp_worker`` (rank 0 is a thread of this process). Every rank loads its own shard on
its own cores and opens an ``Engine`` on its CPUs of the plan; each operation of the engine
interface runs on every rank in the same order, and rank 0's value comes back in-process. A
rank that fails or dies ends the request with an error naming it, and the group is shut down:
workers stopped, the segment removed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..collective.shm import DEFAULT_TIMEOUT_S, ShmGroup
from ..compiler.artifact import CompiledModel
from ..spec import RunSpec
from ..tvm_compat import tvm
from . import relay, tp_worker
from .disco_group import DiscoError, DiscoGroup, close_at_exit
from .engine import EngineBase, EngineError

ShapeTuple = tvm.runtime.ShapeTuple
LOAD_TIMEOUT_S = 600.0  # how long a host may take to load its stage (calls then take --host-timeout)


class TPEngine(EngineBase):
    """The engine interface over the ranks of a sharded model (``compiled.tp`` processes) or of a
    pipeline (``stages``: every stage's compiled model, ``compiled`` the first's), run as ``run``
    says (its plan, sizes, and the model each rank loads its weights from)."""

    def __init__(self, compiled: CompiledModel, run: RunSpec, *, page_size: int = 16,
                 timeout_s: float = DEFAULT_TIMEOUT_S, log: Callable[[str], None] = lambda _m: None,
                 stages: Sequence[CompiledModel] = ()):
        plan, max_batch = run.plan, run.max_batch
        if compiled.tp != plan.tp:
            raise EngineError(f"the model was compiled for {compiled.tp} processes, the plan has {plan.tp}")
        if len(stages) != plan.parts:
            raise EngineError(f"the plan's ranks run {plan.parts} compiled parts, {len(stages)} given")
        super().__init__(compiled, plan, context=run.context, prefill_chunk=run.prefill_chunk,
                         page_size=page_size, max_batch=max_batch, kv_tokens=run.kv_tokens)
        self.huge_page_share: float | None = None
        self.total_pages = 0
        self.disco: DiscoGroup | None = None
        self.relayed = bool(run.hosts)  # stages on other hosts: the controller relays their exchanges
        self.group: ShmGroup | None = None
        self.stage_groups: list[ShmGroup] = []  # stages of several ranks: each stage's TP collectives
        if self.relayed and (plan.wa or plan.tp != 1 or plan.pp != plan.processes):
            raise EngineError(f"ranks on other hosts run pipeline stages of one process each; the plan has "
                              f"{plan.processes} processes in {plan.pp} stages of {plan.tp}"
                              + (" with an attention rank" if plan.wa else ""))
        close_at_exit(self)
        try:
            if not self.relayed:
                # the largest message: a prefill chunk's hidden states (a separated model's: its fused
                # QKV), or a TP decode batch's logits
                cfg = self.cfg
                heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
                width = cfg.head_dim * heads if plan.wa else 0
                slot = 4 * max(self.prefill_chunk * max(cfg.hidden_size, width), max_batch * cfg.vocab_size)
                self.group = ShmGroup.create(plan.processes, slot, timeout_s)
                if plan.pp > 1 and plan.tp > 1:  # each kept as it is made, so a failure closes it
                    for _ in range(plan.pp):
                        self.stage_groups.append(ShmGroup.create(plan.tp, slot, timeout_s))
            t0 = time.perf_counter()
            with self._failing("start"):
                if self.relayed:
                    from .hosts import parse_hosts

                    hosts = parse_hosts(",".join(run.hosts))  # loading a stage may take longer than a call
                    self.disco = DiscoGroup(plan.processes, tp_worker.ENTRYPOINT, hosts=hosts,
                                            timeout_s=max(run.host_timeout_s, LOAD_TIMEOUT_S))
                else:
                    self.disco = DiscoGroup(plan.processes, tp_worker.ENTRYPOINT, plan.all_prefill_cpus)
            for r, pid in enumerate(self.disco.pids[1:], start=1):
                if self.group is not None:
                    self.group.set_pid(r, pid)  # a rank that dies while starting fails the others' waits
                if self.stage_groups:
                    self.stage_groups[plan.stage_of(r)].set_pid(r % plan.tp, pid)
            kind = ("ranks: weights and attention" if plan.wa else "tensor-parallel ranks" if plan.pp == 1
                    else f"ranks in {plan.pp} pipeline stages")
            where = f", ranks 1-{plan.processes - 1} on {', '.join(run.hosts)}" if self.relayed else ""
            log(f"started {plan.processes} {kind} on Disco{where} ({time.perf_counter() - t0:.1f} s)")
            spec = tp_worker.RankSpec(shm=self.group.name if self.group else "",
                                      slot=self.group.slot if self.group else 0, timeout_s=timeout_s,
                                      artifact=str(compiled.path), run=run.to_json(), page_size=page_size,
                                      stages=[str(s.path) for s in stages],
                                      stage_shms=[g.name for g in self.stage_groups])
            with self._failing("loading the shards"):
                self.disco.start(tp_worker.INIT, spec.to_json())
            if self.disco.remote is not None:
                self.disco.remote.set_timeout(run.host_timeout_s)
            self.total_pages = self.available_pages()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the ranks
    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """A rank's failure (or death) as an ``EngineError`` naming it; the group is shut down."""
        try:
            yield
        except DiscoError as err:
            self.close()
            raise EngineError(f"tensor-parallel {what} failed: {err}. The process group is shut "
                              "down") from None

    def _call(self, what: str, name: str, *args: Any) -> Any:
        """The rank function ``name`` on every rank; rank 0's value."""
        if self.disco is None:
            raise EngineError("the tensor-parallel process group is shut down; open a new engine")
        with self._failing(what):
            return self.disco.call(name, *args)

    def close(self) -> None:
        """Stop the workers and remove the shared-memory segment (idempotent)."""
        disco, self.disco = self.disco, None
        try:
            if disco is not None:
                disco.close()
        finally:
            for group in [self.group, *self.stage_groups]:
                if group is not None:
                    group.close()

    shutdown = close

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter teardown
            self.close()

    # ------------------------------------------------------------------ the engine interface
    def use(self, phase: str) -> float:
        """Every rank moves to ``phase``'s cores; returns the slowest rank's switch time (ms)."""
        if phase == self.phase:
            return 0.0
        ms = float(self._call(f"switch to {phase}", tp_worker.USE, phase))
        self.phase = phase
        self.switches.append(ms)
        return ms

    def available_pages(self) -> int:
        return int(self._call("page count", tp_worker.AVAILABLE_PAGES))

    def prefill(self, prompt: Sequence[int], seq_id: int = 0) -> np.ndarray:
        if self.relayed:
            if not len(prompt):
                raise EngineError("the prompt is empty")
            logits = None
            for s in range(0, len(prompt), self.prefill_chunk):
                logits = self.batch_prefill([seq_id], [prompt[s:s + self.prefill_chunk]])
            return logits[0]
        return self._call("prefill", tp_worker.PREFILL, seq_id, _ids(prompt)).numpy()

    def decode(self, token: int, seq_id: int = 0) -> np.ndarray:
        if self.relayed:
            return self.batch_decode([seq_id], [token])[0]
        return self._call("decode", tp_worker.DECODE, seq_id, int(token)).numpy()

    def batch_prefill(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> np.ndarray:
        lengths, tokens = _ids([len(c) for c in chunks]), _ids([t for c in chunks for t in c])
        if self.relayed:
            return self._relay("prefill", tp_worker.RELAY_PREFILL, _ids(slots), lengths, tokens)
        return self._call("prefill", tp_worker.BATCH_PREFILL, _ids(slots), lengths, tokens).numpy()

    def batch_decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        if self.relayed:
            return self._relay("decode", tp_worker.RELAY_DECODE, _ids(slots), _ids(tokens))
        return self._call("decode", tp_worker.BATCH_DECODE, _ids(slots), _ids(tokens)).numpy()

    def _relay(self, what: str, name: str, *args: Any) -> np.ndarray:
        """A pipeline step whose exchanges this process carries (``runtime.relay``): every rank
        runs to its next exchange; their arrays, combined, go back to every rank; until each is
        done. Returns rank 0's logits."""
        if self.disco is None:
            raise EngineError("the tensor-parallel process group is shut down; open a new engine")
        disco = self.disco
        with self._failing(what):
            answers = disco.gather(name, *args)
            while True:
                try:
                    op, arrays = relay.unpack_all(answers)
                except Exception as err:  # noqa: BLE001 -- an answer that is not an exchange
                    raise disco.failed(str(err) if isinstance(err, relay.RelayError)
                                       else f"a rank's answer could not be read: {err}") from None
                if op == relay.DONE:
                    return arrays[0].copy()
                result = relay.combine(op, arrays)
                if op == relay.REDUCE:  # for stage 0's head alone, and rank 0 is in this process
                    disco.local_state().inbox = result
                    result = np.zeros((0, 0), np.float32)
                answers = disco.gather(tp_worker.RELAY_RESUME, relay.pack(op, result))

    def clear(self) -> None:
        self._call("clear", tp_worker.CLEAR)

    def start(self, seq_id: int = 0) -> None:
        self._call("start", tp_worker.START, seq_id)

    def fork(self, parent: int, child: int, tokens: int) -> None:
        self._call("fork", tp_worker.FORK, parent, child, tokens)

    def popn(self, seq_id: int, n: int) -> None:
        self._call("pop", tp_worker.POPN, seq_id, n)

    def batch_verify(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> np.ndarray:
        raise EngineError("speculative decoding runs on one-process plans: the ranks exchange at most "
                          "max_batch rows of logits")

    def stop(self, seq_id: int = 0) -> None:
        if self.disco is not None:  # after a failure the group is gone, and so is the sequence
            self._call("stop", tp_worker.STOP, seq_id)


def _ids(values: Sequence[int]) -> ShapeTuple:
    """Token ids (or slots, lengths) as Disco carries them: a shape."""
    return ShapeTuple([int(v) for v in values])
