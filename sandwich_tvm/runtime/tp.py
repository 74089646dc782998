"""The tensor-parallel engine: a plan of P processes run as P ranks of a sharded model on TVM's
Disco, summing their partial products through the shared-memory all-reduce.

The controller creates the process group's segment and a Disco ``ProcessSession`` whose
workers run ``runtime.tp_worker`` (rank 0 is a thread of this process). Every rank loads its
own shard on its own cores and opens an ``Engine`` on its CPUs of the plan; each ``Engine``
call here (prefill, decode, the phase switch, ...) runs on every rank in the same order, and
rank 0's logits come back in-process. A rank that fails or dies ends the request with an
error naming it, and the group is shut down: workers stopped, the segment removed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from ..collective.shm import DEFAULT_TIMEOUT_S, ShmGroup
from ..compiler.artifact import CompiledModel
from ..topology.plan import ExecPlan
from . import tp_worker
from .engine import Engine, EngineError

WORKER = "sandwich_tvm.runtime.tp_worker"
_OPEN: weakref.WeakSet = weakref.WeakSet()  # engines to shut down at exit (Ctrl-C of a server)


@atexit.register
def _shutdown_all() -> None:
    for engine in list(_OPEN):
        with contextlib.suppress(Exception):
            engine.shutdown()


class TPEngine(Engine):
    """``Engine``'s interface over the ranks of a sharded model (``compiled.tp`` processes).
    ``model`` is what the ranks load their shards from (a preset name or a checkpoint)."""

    def __init__(self, compiled: CompiledModel, model: str, plan: ExecPlan, *, context: int | None = None,
                 prefill_chunk: int = 2048, page_size: int = 16, max_batch: int = 1,
                 kv_tokens: int | None = None, seed: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S,
                 log: Callable[[str], None] = lambda _m: None):
        if compiled.tp != plan.tp:
            raise EngineError(f"the model was compiled for {compiled.tp} processes, the plan has {plan.tp}")
        self._limits(compiled, plan, context, prefill_chunk, page_size, max_batch, kv_tokens)
        self.huge_page_share = None
        self.session = self._call = None
        self._pipes: list[int] = []
        # the largest message: a prefill chunk's hidden states, or a decode batch's logits
        slot = 4 * max(self.prefill_chunk * self.cfg.hidden_size, max_batch * self.cfg.vocab_size)
        self.group = ShmGroup.create(plan.tp, slot, timeout_s)
        _OPEN.add(self)
        try:
            import tvm.runtime.disco as di
            import tvm_ffi

            tvm_ffi.init_ffi_api("runtime.disco", "tvm.runtime.disco._ffi_api")
            t0 = time.perf_counter()
            every = {c for p, _ in plan.ranks for c in p}
            before = os.sched_getaffinity(0)
            os.sched_setaffinity(0, every | before)  # workers inherit it, then pin to their rank's
            earlier = _children()  # another engine's workers are not ours
            try:
                self.session = di.ProcessSession(num_workers=plan.tp, entrypoint=WORKER)
            finally:
                os.sched_setaffinity(0, before)
            workers = _workers(exclude=earlier)
            for rank, (pid, _) in workers.items():
                self.group.set_pid(rank, pid)
            self._pipes = [fd for _, fd in workers.values()]
            if len(workers) != plan.tp - 1:
                raise EngineError(f"started {len(workers)} of {plan.tp - 1} tensor-parallel worker processes")
            log(f"started {plan.tp} tensor-parallel ranks on Disco ({time.perf_counter() - t0:.1f} s)")
            self._call = self.session.get_global_func("sandwich.tp_call")
            spec = {"shm": self.group.name, "slot": self.group.slot, "timeout_s": timeout_s,
                    "ranks": [[list(p), list(d)] for p, d in plan.ranks], "source": plan.source,
                    "numa": [list(n) for n in plan.numa],
                    "artifact": str(compiled.path), "model": str(model), "seed": seed,
                    "engine": {"context": self.context, "prefill_chunk": prefill_chunk,
                               "page_size": page_size, "max_batch": max_batch, "kv_tokens": self.kv_tokens}}
            self.session.get_global_func("sandwich.tp_init")(json.dumps(spec))
            self._wait("loading the shards")
            self.total_pages = self.available_pages()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ the ranks
    def _wait(self, what: str):
        """Rank 0's result of the last call, after it finished; a failure shuts the group down."""
        self.session._sync_worker(0)
        err = tp_worker.error()
        if err is not None:
            self.shutdown()
            raise EngineError(f"tensor-parallel {what} failed on rank 0: {err}. The process group is shut "
                              "down; a rank's own error, if it failed first, is printed above")
        return tp_worker.result()

    def _on_ranks(self, method: str, *args):
        if self.session is None:
            raise EngineError("the tensor-parallel process group is shut down; open a new engine")
        try:
            self._call(method, json.dumps(args))
        except Exception as err:  # the command could not reach a worker: say which one is gone
            gone = [f"rank {r} (pid {p})" for r, p in enumerate(self.group.pids) if r and not _alive(p)]
            self.shutdown()
            raise EngineError(f"tensor-parallel {method}: {', '.join(gone) or 'a worker'} exited ({err}). "
                              "The process group is shut down") from None
        return self._wait(method)

    def shutdown(self) -> None:
        """Stop the workers and remove the shared-memory segment (idempotent).

        A healthy group is stopped by Disco itself (the session's destructor sends every worker
        the shutdown command, joins rank 0's thread and reaps the processes). In a broken one
        (a rank failed or died) every worker is killed first, and its command pipe is pointed
        at a pipe of ours, so Disco's shutdown command does not fail on a closed pipe."""
        pids = [p for p in self.group.pids if p and p != os.getpid()]
        session, self.session = self.session, None
        if session is not None:
            if not all(_alive(p) for p in pids) or tp_worker.error() is not None:
                for pid in pids:
                    _kill(pid)
                _plug(self._pipes)
            # Only now drop the remote function: freeing it sends every worker a command, which
            # on a dead worker's unplugged pipe fails inside a destructor and aborts the process.
            self._call = None
            del session  # the destructor: Disco's own shutdown
            for pid in pids:  # reaped by Disco; anything left is killed
                _kill(pid)
        self.group.close()

    close = shutdown

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter teardown
            self.shutdown()

    # ------------------------------------------------------------------ Engine's interface
    def use(self, phase: str) -> float:
        """Every rank moves to ``phase``'s cores; returns the slowest rank's switch time (ms)."""
        if phase == self.phase:
            return 0.0
        ms = float(self._on_ranks("use", phase))
        self.phase = phase
        self.switches.append(ms)
        return ms

    def available_pages(self) -> int:
        return int(self._on_ranks("available_pages"))

    def prefill(self, prompt: Sequence[int], seq_id: int = 0) -> np.ndarray:
        return self._on_ranks("prefill", [int(t) for t in prompt], seq_id)

    def decode(self, token: int, seq_id: int = 0) -> np.ndarray:
        return self._on_ranks("decode", int(token), seq_id)

    def batch_prefill(self, slots: Sequence[int], chunks: Sequence[Sequence[int]]) -> np.ndarray:
        return self._on_ranks("batch_prefill", list(slots), [[int(t) for t in c] for c in chunks])

    def batch_decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        return self._on_ranks("batch_decode", list(slots), [int(t) for t in tokens])

    def clear(self) -> None:
        self._on_ranks("clear")

    def start(self, seq_id: int = 0) -> None:
        self._on_ranks("start", seq_id)

    def stop(self, seq_id: int = 0) -> None:
        if self.session is not None:  # after a failure the group is gone, and so is the sequence
            self._on_ranks("stop", seq_id)


def _children() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children()}


def _workers(exclude: set[int]) -> dict[int, tuple[int, int]]:
    """Rank -> (pid, our write end of its command pipe) for this process's live Disco workers
    (children not in ``exclude``). A worker runs ``python -m WORKER rank world groups read_fd
    write_fd``; its ``read_fd`` is the pipe's read end, ours the write-only one on that pipe."""
    import psutil

    found = {}
    for child in psutil.Process().children():
        if child.pid in exclude:
            continue
        try:
            cmd = child.cmdline()
            if WORKER not in cmd or child.status() == psutil.STATUS_ZOMBIE:
                continue
            rank, read_fd = int(cmd[cmd.index(WORKER) + 1]), int(cmd[-2])
            found[rank] = (child.pid, os.readlink(f"/proc/{child.pid}/fd/{read_fd}"))
        except (psutil.Error, OSError, ValueError, IndexError):
            continue
    ours = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ours.setdefault(os.readlink(f"/proc/self/fd/{fd}"), []).append(int(fd))
    out = {}
    for rank, (pid, pipe) in found.items():
        for fd in ours.get(pipe, []) if pipe.startswith("pipe:") else []:
            with open(f"/proc/self/fdinfo/{fd}") as info:
                flags = int(info.read().split("flags:")[1].split()[0], 8)
            if flags & 3 == os.O_WRONLY:
                out[rank] = (pid, fd)
    return out


_SINKS: list[int] = []  # read ends kept open so writes to plugged pipes succeed


def _plug(fds: list[int]) -> None:
    """Point each write end in ``fds`` at a fresh pipe whose read end we keep: a command sent to
    a dead worker lands there instead of failing (a few bytes; the pipe holds 64 KB)."""
    for fd in fds:
        r, w = os.pipe()
        with contextlib.suppress(OSError):
            os.dup2(w, fd)
        os.close(w)
        _SINKS.append(r)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _kill(pid: int, grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; reaped when it is our child."""
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.01)
        if not _alive(pid):
            break
        deadline = time.monotonic() + grace_s
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)

