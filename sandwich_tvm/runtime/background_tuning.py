"""Tuning while serving: the model answers at once on the kernels it has, a worker process tunes
the GEMMs that lack records (the model-guided search, decode thread count first), rebuilds the
model after each GEMM lands, and the engine thread swaps to the new build between two steps
(``Engine.swap_kernels``: same weights, same KV cache, no request dropped).

``mode`` "idle" (``serve --tune-in-background idle``): the worker's process group is stopped
(SIGSTOP) while the engine has work and continued (SIGCONT) when it goes idle, so tuning takes
only cores the server is not using; "always": it runs beside the server.

The budget counts only the time the worker runs: after each stop the server writes ``stopped
SECONDS`` on the worker's stdin, and the worker's ``RunningClock`` leaves those seconds out.

The worker is ``python -m sandwich_tvm.runtime.background_tuning``: it reads the pickled run spec,
budget and training choice on stdin and prints ``landed <gemm>`` and ``compiled <artifact dir>``
lines. Its cost model and transfer learn from the records directory and, unless ``shipped`` is
False (``serve --costmodel-data records``, to hold this CPU's shipped records out), the records
shipped in the package.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

MODES = ("off", "idle", "always")
SWAP_TIMEOUT_S = 600.0  # a swap waits for the engine's current step; an engine this slow is stuck


def gemms_to_tune(spec) -> list[tuple[str, object, int, int]]:
    """(name, shape, threads, max m) of every GEMM of ``spec`` without a record covering its
    range, or whose guided tuning left m of it unmeasured: the decode thread count's first (every
    token pays for them), then the prefill's."""
    from ..kernels.database import ScheduleDbError, find_record
    from ..model.shapes import linear_shapes

    plan = spec.plan
    shapes = linear_shapes(spec.config, spec.weight_dtype, plan.tp, wider=spec.wider_linears)
    wanted: dict[tuple[str, int], int] = {}  # (gemm, threads) -> largest m; decode's threads first
    for threads, top in ((plan.decode_threads, spec.max_batch), (plan.prefill_threads, spec.prefill_chunk)):
        for name in shapes:
            m = min(top, spec.max_batch) if name == "lm_head" else min(top, 512)
            wanted[(name, threads)] = max(m, wanted.get((name, threads), 0))
    out = []
    for (name, threads), max_m in wanted.items():
        shape = shapes[name]
        try:
            rec = find_record(shape, threads, spec.records)
        except ScheduleDbError:
            rec = None
        if rec is None or rec.shape != shape or max(t.m for t in rec.tuned) < max_m or unmeasured(rec, max_m):
            out.append((name, shape, threads, max_m))
    return out


def unmeasured(rec, max_m: int) -> bool:
    """Whether a guided record's budget (or an interrupt) left some m up to ``max_m`` on a
    neighbour's schedule: such a GEMM is taken up again (the full search reuses m on purpose)."""
    return rec.search == "model" and not all(t.searched for t in rec.tuned if t.m <= max_m)


class RunningClock:
    """``time.monotonic`` less the seconds this process spent stopped, as ``stopped SECONDS``
    lines on ``stream`` (the worker's stdin) report them: a budget on it is spent only while
    the worker runs. A line that arrives late shows a stop late, never twice."""

    def __init__(self, stream=None) -> None:
        self.stopped_s = 0.0
        if stream is not None:
            threading.Thread(target=self._read, args=(stream,), name="stops", daemon=True).start()

    def _read(self, stream) -> None:
        for raw in stream:
            word, _, secs = raw.decode(errors="replace").strip().partition(" ")
            if word == "stopped":
                with contextlib.suppress(ValueError):
                    self.stopped_s += max(0.0, float(secs))

    def __call__(self) -> float:
        return time.monotonic() - self.stopped_s


def worker(spec, budget_s: float, say: Callable[[str], None], shipped: bool = True,
           clock: Callable[[], float] = time.monotonic) -> None:
    """Tune ``spec``'s untuned GEMMs within ``budget_s`` seconds on ``clock``, rebuilding the
    model after each."""
    from ..compiler.artifact import compile_model
    from ..kernels.costmodel import CostModel, training_roots, training_samples
    from ..kernels.guided import tune_gemm_guided
    from ..kernels.tuner import tune_gemm
    from ..tvm_compat import preload_tensor_intrinsics

    todo = gemms_to_tune(spec)
    if not todo:
        say("nothing to tune")
        return
    try:
        model = CostModel.train(training_samples(spec.records, shipped=shipped))
    except ValueError as err:  # nothing to learn from: the full search, within the same budget
        say(f"{err}")
        model = None
    preload_tensor_intrinsics()  # seconds, once: not out of the first GEMM's share
    start = clock()
    for i, (name, shape, threads, max_m) in enumerate(todo):
        left = budget_s - (clock() - start)
        if left <= 0:
            break
        if model is None:
            rec = tune_gemm(shape.n, shape.k, threads=threads, max_m=max_m, root=spec.records,
                            dtype=shape.dtype, epilogue=shape.epilogue)
        else:
            rec = tune_gemm_guided(shape.n, shape.k, threads=threads, model=model, max_m=max_m,
                                   root=spec.records, dtype=shape.dtype, epilogue=shape.epilogue,
                                   deadline=clock() + left / (len(todo) - i), clock=clock,
                                   transfer_roots=training_roots(spec.records, shipped))
        if not rec.tuned:
            continue
        say(f"landed {name} {shape.name} t{threads}: {sum(t.searched for t in rec.tuned)} m measured")
        compiled = compile_model(spec)
        say(f"compiled {compiled.path}")


class BackgroundTuner:
    """Runs the worker for a serving engine (an ``AsyncEngine``) and swaps in what it builds."""

    def __init__(self, spec, engine, mode: str = "idle", budget_min: float = 8.0,
                 log: Callable[[str], None] = lambda _m: None, metrics=None, shipped: bool = True) -> None:
        """``metrics``: a ``ServingMetrics`` whose background-tuning gauge and counters follow
        the worker (running, GEMMs landed, builds swapped in); ``shipped``: whether the worker's
        cost model and transfer read the package's records besides the records directory."""
        if mode not in MODES[1:]:
            raise ValueError(f"background tuning mode {mode!r}; one of {MODES[1:]}")
        self.spec, self.engine, self.mode, self.budget_s, self.log = spec, engine, mode, 60 * budget_min, log
        self.metrics, self.shipped = metrics, shipped
        self._reader: threading.Thread | None = None
        self.proc: subprocess.Popen | None = None
        self.swaps: list[tuple[float, str]] = []  # (time, artifact) of every build swapped in
        self._paused = False
        self._stopped_at = 0.0
        self._lock = threading.Lock()

    def start(self) -> BackgroundTuner:
        self.proc = subprocess.Popen([sys.executable, "-m", "sandwich_tvm.runtime.background_tuning"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False,
                                     start_new_session=True)  # its own group: stopped as one
        self.proc.stdin.write(pickle.dumps((self.spec, self.budget_s, self.shipped)))
        self.proc.stdin.flush()  # kept open: each stop's length follows (``RunningClock``)
        if self.metrics is not None:
            self.metrics.tuning_running.set(1)
        if self.mode == "idle":
            self.engine.set_busy_listener(self.busy)
        self._reader = threading.Thread(target=self._read, name="sandwich-tuner", daemon=True)
        self._reader.start()
        return self

    def busy(self, busy: bool) -> None:
        """The engine started (True) or ran out of (False) work: stop or continue the worker."""
        with self._lock:
            if self.proc is None or self.proc.poll() is not None or busy == self._paused:
                return
            if busy:
                self._stopped_at = time.monotonic()
            else:
                self._report_stop(time.monotonic() - self._stopped_at)
            try:
                os.killpg(self.proc.pid, signal.SIGSTOP if busy else signal.SIGCONT)
                self._paused = busy
            except ProcessLookupError:
                pass

    def _report_stop(self, seconds: float) -> None:
        """Tell the worker how long it was stopped (read once it runs again)."""
        if self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(f"stopped {seconds:.3f}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def stop(self) -> None:
        with self._lock:
            if self.proc is not None and self.proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    self.proc.stdin.close()
            if self.proc is not None and self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGCONT)
                    os.killpg(self.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._reader is not None:
            self._reader.join(10)

    def _read(self) -> None:
        try:
            self._follow()
        finally:
            if self.metrics is not None:
                self.metrics.tuning_running.set(0)

    def _follow(self) -> None:
        from ..compiler.artifact import CompiledModel

        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith("compiled "):
                path = Path(line.split(" ", 1)[1])
                try:
                    err = self.engine.swap_kernels(CompiledModel.load(path), timeout=SWAP_TIMEOUT_S)
                except Exception as exc:  # a damaged build: keep serving on the running one
                    err = f"{type(exc).__name__}: {exc}"
                if err is None:
                    if self.metrics is not None:  # counted before ``swaps`` shows it
                        self.metrics.kernel_swaps.inc()
                    self.swaps.append((time.time(), str(path)))
                    self.log(f"background tuning: now serving {path.name}")
                else:
                    self.log(f"background tuning: kept the running build ({err})")
            elif line:
                self.log(f"background tuning: {line}")
                if line.startswith("landed ") and self.metrics is not None:
                    self.metrics.tuned_gemms.inc()
        code = self.proc.wait()
        if code not in (0, -signal.SIGTERM):
            self.log(f"background tuning stopped with status {code}; serving goes on with the kernels it has")


def main() -> int:
    spec, budget_s, shipped = pickle.load(sys.stdin.buffer)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what tuning and compiling print stays off the protocol

    def say(msg: str) -> None:
        out.write(msg + "\n")

    worker(spec, budget_s, say, shipped, clock=RunningClock(sys.stdin.buffer))
    return 0


if __name__ == "__main__":
    # Ended with os._exit: the stop reader, a daemon thread blocked in reading stdin, holds
    # stdin's lock, and the interpreter's shutdown aborts on it (status -6).
    status = 1
    try:
        status = main()
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
