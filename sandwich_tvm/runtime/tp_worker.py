"""One rank of a tensor-parallel engine: a Disco worker that holds its shard of the weights,
its part of the KV cache and an ``Engine`` on its own CPUs.

Disco starts ``python -m sandwich_tvm.runtime.tp_worker`` for ranks 1..P-1; rank 0 is a thread
of the controller (``runtime.tp``), which imports this module too, so every rank registers:

- ``sandwich.tp_init(json)``: attach the process group's shared memory, load this rank's shard
  (first touched by the rank's own cores) and open its engine (``sandwich.tp_attach(json)``:
  only the shared memory, for sessions that use just the collectives);
- ``sandwich.tp_call(method, json)``: run one ``Engine`` method (prefill, decode, use, ...);
  rank 0's result is read by the controller in-process (``result()``);
- the collectives the sharded model calls (``model.parallel``): ``sandwich.tp_allreduce``,
  ``sandwich.tp_allreduce_add`` (the residual add fused in) and ``sandwich.tp_gather_last``,
  and Disco's own CPU all-reduce (``runtime.disco..allreduce``,
  which ``Session.allreduce`` and ``nn.op.ccl_allreduce`` reach on CPU workers).

An exception must not leave a registered function (Disco aborts the process): it is kept
(``error()``), printed, and the group is told (``ShmGroup.abort``) so peers waiting on this
rank raise at once instead of timing out.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import numpy as np
import tvm_ffi

from ..model.parallel import ALLREDUCE, ALLREDUCE_ADD, GATHER

_STATE: dict = {}  # this rank's group, engine, last result and last error

REDUCE_SUM, REDUCE_AVG = 0, 4  # Disco's ReduceKind values this collective supports


def worker_id() -> int:
    import tvm

    return int(tvm.get_global_func("runtime.disco.worker_id")()[0])


def error() -> str | None:
    """The last call's error on this rank (the controller reads rank 0's)."""
    return _STATE.get("error")


def result():
    """The last ``tp_call``'s result on this rank."""
    return _STATE.get("result")


def _guarded(fn: Callable) -> Callable:
    def run(*args):
        _STATE["error"] = None
        try:
            _STATE["result"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 -- Disco would abort the process
            _STATE["error"] = f"{type(err).__name__}: {err}"
            print(f"sandwich tensor-parallel rank {_STATE.get('rank', '?')} failed:", file=sys.stderr)
            traceback.print_exc()
            group = _STATE.get("group")
            if group is not None:
                group.abort()

    run.__name__ = fn.__name__
    return run


@tvm_ffi.register_global_func("sandwich.tp_init", override=True)
@_guarded
def _init(spec_json: str) -> None:
    from ..collective.shm import ShmGroup
    from ..compiler.artifact import CompiledModel
    from ..model.weights import load_params
    from ..topology.hwloc import bind_memory, numa_node_count
    from ..topology.plan import ExecPlan
    from .engine import Engine

    spec = json.loads(spec_json)
    rank = worker_id()
    _STATE["rank"] = rank
    plan = ExecPlan.processes([(tuple(p), tuple(d)) for p, d in spec["ranks"]], spec["source"],
                              numa=spec["numa"])
    mine = plan.rank(rank)
    os.sched_setaffinity(0, set(mine.prefill_cpus))  # this rank's cores touch its weights first
    if mine.numa and numa_node_count() > 1:  # and its memory is on its own NUMA nodes
        bind_memory(list(mine.numa[0]))
    group = ShmGroup.attach(spec["shm"], rank, plan.tp, spec["slot"], spec["timeout_s"])
    _STATE["group"] = group
    compiled = CompiledModel.load(spec["artifact"])
    isa, dtype = compiled.weight_layout
    params = load_params(spec["model"], compiled.config, compiled.params, isa, seed=spec["seed"], dtype=dtype,
                         layouts=compiled.layouts, shards=compiled.shards, rank=rank, tp=plan.tp)
    _STATE["engine"] = Engine(compiled, params, mine, **spec["engine"])
    ready = group.allreduce(np.ones(1, np.float32))  # every rank is up, or a peer's error raises
    if int(ready[0]) != plan.tp:
        raise RuntimeError(f"only {int(ready[0])} of {plan.tp} ranks started")


@tvm_ffi.register_global_func("sandwich.tp_attach", override=True)
@_guarded
def _attach(spec_json: str) -> None:
    """Join a process group's segment without a model (``{"shm", "slot", "world", "timeout_s"}``):
    for Disco sessions that only use the collectives (``Session.allreduce`` on CPU workers)."""
    from ..collective.shm import ShmGroup

    spec = json.loads(spec_json)
    rank = worker_id()
    _STATE["rank"] = rank
    _STATE["group"] = ShmGroup.attach(spec["shm"], rank, spec["world"], spec["slot"],
                                      spec.get("timeout_s", 60.0))


@tvm_ffi.register_global_func("sandwich.tp_call", override=True)
@_guarded
def _call(method: str, args_json: str):
    engine = _STATE.get("engine")
    if engine is None:
        raise RuntimeError("this rank has no engine (sandwich.tp_init failed or was not called)")
    result = getattr(engine, method)(*json.loads(args_json))
    if method == "use":  # every rank switched its plan: the switch took as long as the slowest one
        result = float(_STATE["group"].allgather(np.array([result], np.float32)).max())
    return result


@tvm_ffi.register_global_func(ALLREDUCE, override=True)
def _allreduce(x, out) -> None:
    _STATE["group"].allreduce(x, out)


@tvm_ffi.register_global_func(ALLREDUCE_ADD, override=True)
def _allreduce_add(x, residual, out) -> None:
    _STATE["group"].allreduce(x, out, residual)


@tvm_ffi.register_global_func(GATHER, override=True)
def _gather_last(x, out) -> None:
    """Rank r's ``x[..., w]`` into ``out[..., r * w : (r + 1) * w]`` (cut at ``out``'s width) on
    every rank: the shared-memory all-gather."""
    _STATE["group"].allgather(x, out)


@tvm_ffi.register_global_func("runtime.disco..allreduce", override=True)
def _disco_allreduce(send, kind: int, in_group: bool, recv) -> None:
    """Disco's collective for CPU workers (whose CCL name is empty): sum or average."""
    if kind not in (REDUCE_SUM, REDUCE_AVG):
        raise ValueError(f"the shared-memory all-reduce sums (ReduceKind 0) or averages (4), not kind {kind}")
    group = _STATE["group"]
    group.allreduce(send, recv)
    if kind == REDUCE_AVG:
        view = np.from_dlpack(recv)
        view /= group.world


if __name__ == "__main__":
    from tvm.exec import disco_worker

    from ..host import enable_amx

    enable_amx()  # the tile permission is per process: this worker runs AMX kernels too

    disco_worker.main()
