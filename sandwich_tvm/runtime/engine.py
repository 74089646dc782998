"""The serving engine: prefill on the prefill plan's cores, decode on the decode plan's, one
copy of the weights, and the switch between them measured.

TVM's thread pool is fixed in size when it starts (``TVM_NUM_THREADS``) and is re-shaped with
``runtime.config_threadpool(mode, n, cpus)``: mode -2 puts worker i on ``cpus[i]``. TVM pins
the calling thread as a side effect, so the engine re-pins it after each switch (notes §5).
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..compiler.artifact import CompiledModel
from ..host import require_own_cpu
from ..memory import huge_page_share
from ..model.config import LlamaConfig
from ..spec import DEFAULT_CONTEXT
from ..topology.plan import ExecPlan
from ..tvm_compat import pin_thread_pool, tensor_from_numpy, tvm

ShapeTuple = tvm.runtime.ShapeTuple


class EngineError(ValueError):
    """A request the engine cannot serve; the message names the limit."""


def check_token_ids(cfg: LlamaConfig, prompt: Sequence[int]) -> None:
    """Raise ``EngineError`` for an empty prompt or ids outside the vocabulary."""
    if not len(prompt):
        raise EngineError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise EngineError(f"token ids {bad[:5]} are outside the vocabulary (size {cfg.vocab_size})")


def check_length(cfg: LlamaConfig, prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Raise ``EngineError`` when the prompt and the new tokens do not fit a KV cache of ``context``."""
    if prompt_tokens + max_new_tokens > context:
        more = (f", or raise --context (the model allows {cfg.max_position_embeddings})"
                if context < cfg.max_position_embeddings else "")
        raise EngineError(
            f"prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens exceeds the context of "
            f"{context} tokens; shorten the prompt or lower --max-new-tokens{more}")


@dataclass
class Generation:
    """One request's tokens and timings (ms)."""

    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0
    decode_ms: list[float] = field(default_factory=list)
    switch_ms: float = 0.0

    @property
    def tpot_ms(self) -> float:
        """Median time per output token after the first (the decode steps); NaN with none."""
        return float(np.median(self.decode_ms)) if self.decode_ms else float("nan")

    def to_json(self) -> dict:
        """Valid JSON: ``tpot_ms`` is null when there was no decode step (one token or none)."""
        tpot = round(self.tpot_ms, 3) if self.decode_ms else None
        return {"ttft_ms": round(self.ttft_ms, 3), "tpot_ms": tpot,
                "prompt_tokens": self.prompt_tokens, "output_tokens": len(self.tokens),
                "switch_ms": round(self.switch_ms, 4), "tokens": self.tokens}


class EngineBase(ABC):
    """What every engine shares (``interface.ServingEngine``): the run's sizes, the prompt checks
    and the one-request ``generate`` loop over the model steps that a subclass runs."""

    def __init__(self, compiled: CompiledModel, plan: ExecPlan, *, context: int | None = None,
                 prefill_chunk: int = 2048, page_size: int = 16, max_batch: int = 1,
                 kv_tokens: int | None = None) -> None:
        self._limits(compiled, plan, context, prefill_chunk, page_size, max_batch, kv_tokens)

    def _limits(self, compiled: CompiledModel, plan: ExecPlan, context: int | None, prefill_chunk: int,
                page_size: int, max_batch: int, kv_tokens: int | None) -> None:
        """The run's sizes (a ``RunSpec``'s, checked when it was resolved)."""
        require_own_cpu("running a model")  # not one built for the CPU SANDWICH_CPU describes
        cfg = compiled.config
        self.cfg, self.plan, self.compiled = cfg, plan, compiled
        # the run spec checked these against the model and the memory (spec.check_context)
        self.context = min(DEFAULT_CONTEXT if context is None else context, cfg.max_position_embeddings)
        self.kv_tokens = max(kv_tokens or self.context, self.context)
        self.prefill_chunk = min(prefill_chunk, self.context)
        self.page_size, self.max_batch = page_size, max_batch
        self.phase: str | None = None
        self.switches: list[float] = []

    @abstractmethod
    def use(self, phase: str) -> float: ...

    def swap_kernels(self, compiled: CompiledModel) -> None:
        """Run another build of the same model from the next step on (``Engine``'s)."""
        raise EngineError(f"{type(self).__name__} does not swap kernels while serving: "
                          "one-process plans only")

    @abstractmethod
    def start(self, seq_id: int = 0) -> None: ...

    @abstractmethod
    def stop(self, seq_id: int = 0) -> None: ...

    @abstractmethod
    def fork(self, parent: int, child: int, tokens: int) -> None: ...

    @abstractmethod
    def popn(self, seq_id: int, n: int) -> None: ...

    @abstractmethod
    def prefill(self, prompt: Sequence[int], seq_id: int = 0) -> np.ndarray: ...

    @abstractmethod
    def decode(self, token: int, seq_id: int = 0) -> np.ndarray: ...

    def check_prompt(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        if max_new_tokens < 0:
            raise EngineError(f"max_new_tokens is {max_new_tokens}; ask for 0 (prefill only) or more")
        check_token_ids(self.cfg, prompt)
        check_length(self.cfg, len(prompt), max_new_tokens, self.context)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, stop: set[int] | None = None,
                 on_token: Callable[[int], None] | None = None, logits_out: list | None = None,
                 sample: Callable[[np.ndarray], int] | None = None) -> Generation:
        """One request: prefill plan for the prompt, then the decode plan. Greedy unless
        ``sample`` (logits -> token, e.g. a ``Sampler``'s) is given.
        ``max_new_tokens=0`` runs the prefill only (``ttft_ms`` is its time, no tokens)."""
        pick = sample or (lambda logits: int(np.argmax(logits)))
        self.check_prompt(prompt, max_new_tokens)
        gen = Generation(len(prompt))
        self.start()
        try:
            self.use("prefill")
            t0 = time.perf_counter()
            logits = self.prefill(prompt)
            token = pick(logits)
            gen.ttft_ms = (time.perf_counter() - t0) * 1e3
            while max_new_tokens > 0:
                gen.tokens.append(token)
                if logits_out is not None:
                    logits_out.append(logits)
                if on_token:
                    on_token(token)
                if len(gen.tokens) >= max_new_tokens or (stop and token in stop):
                    break
                gen.switch_ms += self.use("decode")
                t0 = time.perf_counter()
                logits = self.decode(token)
                token = pick(logits)
                gen.decode_ms.append((time.perf_counter() - t0) * 1e3)
        finally:
            self.stop()
        return gen


class Engine(EngineBase):
    """Runs a compiled model under an execution plan. ``params`` are numpy arrays (ideally in
    huge pages); they are wrapped zero-copy and shared by every function and phase.

    ``context`` is the longest sequence (prompt + output) in tokens: capped at the model's
    context; by default ``DEFAULT_CONTEXT``. ``kv_tokens`` is the paged KV cache's size, shared by
    up to ``max_batch`` sequences (default: ``context``). The cache is allocated up front, so
    size it to the run (``spec.run_context``).
    """

    def __init__(self, compiled: CompiledModel, params: Sequence[np.ndarray], plan: ExecPlan, *,
                 context: int | None = None, prefill_chunk: int = 2048, page_size: int = 16,
                 max_batch: int = 1, kv_tokens: int | None = None):
        super().__init__(compiled, plan, context=context, prefill_chunk=prefill_chunk, page_size=page_size,
                         max_batch=max_batch, kv_tokens=kv_tokens)
        pool = int(os.environ.get("TVM_NUM_THREADS", "1"))
        if max(plan.prefill_threads, plan.decode_threads) > pool:
            raise EngineError(f"the plan needs {max(plan.prefill_threads, plan.decode_threads)} threads "
                              f"but TVM's pool has {pool}; set TVM_NUM_THREADS before starting")
        if len(params) != len(compiled.params):
            raise EngineError(f"{len(params)} weights given, the compiled model takes {len(compiled.params)}")
        self.vm = compiled.load_vm()
        self._retired: list = []  # modules swapped out (swap_kernels), kept while the cache lives
        self.kernel_swaps = 0
        self.params = [tensor_from_numpy(a) for a in params]
        g = tvm.get_global_func
        self._add_seq = g("vm.builtin.kv_state_add_sequence")
        self._remove_seq = g("vm.builtin.kv_state_remove_sequence")
        self._fork_seq = g("vm.builtin.kv_state_fork_sequence")
        self._popn = g("vm.builtin.kv_state_popn")
        self._begin = g("vm.builtin.kv_state_begin_forward")
        self._end = g("vm.builtin.kv_state_end_forward")
        self._available_pages = g("vm.builtin.attention_kv_cache_get_num_available_pages")
        self._clear = g("vm.builtin.kv_state_clear")
        self.kv = self.vm["create_paged_kv_cache"](
            ShapeTuple([max_batch]), ShapeTuple([self.kv_tokens]), ShapeTuple([self.prefill_chunk]),
            ShapeTuple([page_size]), ShapeTuple([0]))
        self._prefill, self._decode = self.vm["prefill"], self.vm["decode"]
        self._batch_prefill, self._batch_decode = self.vm["batch_prefill"], self.vm["batch_decode"]
        self.total_pages = self.available_pages()
        self.huge_page_share = huge_page_share(params)  # of the weights' resident memory

    def close(self) -> None:
        """Release what the engine holds besides memory (a tensor-parallel engine's processes)."""

    def swap_kernels(self, compiled: CompiledModel) -> None:
        """Run ``compiled``'s functions from the next step on, over the same weights and KV cache:
        the same model built with other kernel records (tuning landed). Call it between steps,
        on the engine's thread; a sequence in flight goes on where it was."""
        same = ("config", "params", "layouts", "kv_dtype", "dtype", "max_batch", "prefill_threads",
                "decode_threads", "kernel_isa", "tp", "stage", "role")
        diff = [k for k in same if compiled.meta.get(k) != self.compiled.meta.get(k)]
        if diff:
            raise EngineError(f"{compiled.path} is not the running model with other kernels: it differs in "
                              f"{', '.join(diff)}")
        vm = compiled.load_vm()
        # the cache was made by the first module (its attention functions live there): keep it loaded
        self._retired.append(self.vm)
        self.vm, self.compiled = vm, compiled
        self._prefill, self._decode = vm["prefill"], vm["decode"]
        self._batch_prefill, self._batch_decode = vm["batch_prefill"], vm["batch_decode"]
        self.kernel_swaps += 1

    # ------------------------------------------------------------------ thread plans
    def use(self, phase: str) -> float:
        """Put the thread pool on ``phase``'s cores; returns the switch time in ms (0 if already)."""
        if phase == self.phase:
            return 0.0
        cpus = self.plan.prefill_cpus if phase == "prefill" else self.plan.decode_cpus
        t0 = time.perf_counter()
        pin_thread_pool(list(cpus))
        os.sched_setaffinity(0, {cpus[0]})  # the caller runs task 0 on the plan's first core
        ms = (time.perf_counter() - t0) * 1e3
        self.phase = phase
        self.switches.append(ms)
        return ms

    # ------------------------------------------------------------------ model steps
    def _step(self, fn, ids: np.ndarray, seq_id: int) -> np.ndarray:
        self._begin(self.kv, ShapeTuple([seq_id]), ShapeTuple([ids.shape[1]]))
        logits, self.kv = fn(tvm.runtime.tensor(ids), self.kv, self.params)
        self._end(self.kv)
        return logits.numpy().reshape(-1)

    def available_pages(self) -> int:
        """Free pages of the paged KV cache, as the cache counts them."""
        return int(self._available_pages(self.kv))

    def forward(self, phase: str, x: np.ndarray, slots: Sequence[int], lengths: Sequence[int],
                rows: np.ndarray | None = None) -> np.ndarray:
        """One call of ``batch_prefill`` (``phase`` "prefill": ``x`` is ``[1, tokens]``, the
        chunks one after the other, and ``rows`` the positions whose output comes back) or
        ``batch_decode`` ("decode": ``x`` is ``[batch, 1]``); ``x`` holds token ids, or hidden
        states (``[..., hidden]``) in a pipeline stage after the first. The output, one row per
        position asked for (the logits; a pipeline stage's hidden states: every token's, the
        last stage's of those positions, for the first stage's ``head``)."""
        self._begin(self.kv, ShapeTuple(list(slots)), ShapeTuple(list(lengths)))
        try:
            if phase == "prefill":
                args = [tvm.runtime.tensor(x), tvm.runtime.tensor(np.asarray(rows, dtype=np.int32))]
                out, self.kv = self._batch_prefill(*args, self.kv, self.params)
            else:
                out, self.kv = self._batch_decode(tvm.runtime.tensor(x), self.kv, self.params)
        finally:
            self._end(self.kv)
        out = out.numpy()
        return out.reshape(-1, out.shape[-1])

    def head(self, phase: str, hidden: np.ndarray) -> np.ndarray:
        """A pipeline's head, on its first stage: the last stage's hidden states (one row per
        position) to logits, ``[rows, vocab]``, on ``phase``'s kernels."""
        width = hidden.shape[-1]
        if phase == "decode":
            out = self.vm["decode_head"](tvm.runtime.tensor(hidden.reshape(-1, 1, width)), self.params)
        else:
            out = self.vm["head"](tvm.runtime.tensor(hidden.reshape(1, -1, width)), self.params)
        out = out.numpy()
        return out.reshape(-1, out.shape[-1])

    def _chunks_forward(self, slots: Sequence[int], chunks: Sequence[Sequence[int]],
                        every: bool) -> np.ndarray:
        """``batch_prefill`` over the chunks; the logits after each chunk's last token, or after
        every token (``every``), one row each."""
        lengths = [len(c) for c in chunks]
        ids = np.concatenate([np.asarray(c, dtype=np.int32) for c in chunks]).reshape(1, -1)
        rows = (np.arange(ids.shape[1], dtype=np.int32) if every
                else np.cumsum(lengths, dtype=np.int32) - 1)
        return self.forward("prefill", ids, slots, lengths, rows)

    def batch_prefill(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> np.ndarray:
        """One forward over several sequences' chunks (each appended to its cached prefix);
        the logits after each chunk's last token, ``[len(slots), vocab]``."""
        return self._chunks_forward(slots, chunks, every=False)

    def batch_verify(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> np.ndarray:
        """``batch_prefill`` with the logits of every position (a speculative step's last token
        and draft per sequence): ``[sum of the chunks' lengths, vocab]``."""
        return self._chunks_forward(slots, chunks, every=True)

    def batch_decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One decode step for every sequence in ``slots`` (m = batch); ``[len(slots), vocab]``."""
        ids = np.asarray(tokens, dtype=np.int32).reshape(-1, 1)
        return self.forward("decode", ids, slots, [1] * len(slots))

    def clear(self) -> None:
        """Drop every sequence from the KV cache (after a failed step)."""
        self._clear(self.kv)

    def start(self, seq_id: int = 0) -> None:
        self._add_seq(self.kv, seq_id)

    def stop(self, seq_id: int = 0) -> None:
        self._remove_seq(self.kv, seq_id)

    def fork(self, parent: int, child: int, tokens: int) -> None:
        self._fork_seq(self.kv, parent, child, tokens)

    def popn(self, seq_id: int, n: int) -> None:
        self._popn(self.kv, seq_id, n)

    def prefill(self, prompt: Sequence[int], seq_id: int = 0) -> np.ndarray:
        """Logits after the prompt (chunks of ``prefill_chunk`` tokens)."""
        ids = np.asarray(prompt, dtype=np.int32).reshape(1, -1)
        logits = None
        for s in range(0, ids.shape[1], self.prefill_chunk):
            logits = self._step(self._prefill, ids[:, s:s + self.prefill_chunk], seq_id)
        return logits

    def decode(self, token: int, seq_id: int = 0) -> np.ndarray:
        return self._step(self._decode, np.array([[token]], dtype=np.int32), seq_id)
