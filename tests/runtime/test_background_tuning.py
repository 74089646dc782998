"""Tuning while serving: the first request is answered on the kernels the model has, a worker
tunes and rebuilds, the engine swaps the build in between steps, greedy outputs do not change."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

from sandwich_tvm.runtime.async_engine import AsyncEngine
from sandwich_tvm.runtime.background_tuning import BackgroundTuner, RunningClock, gemms_to_tune
from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.metrics import ServingMetrics
from sandwich_tvm.runtime.sampling import SamplingParams
from sandwich_tvm.runtime.scheduler import SchedulerPolicy
from sandwich_tvm.spec import RunSpec


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_busy_engine_stops_the_tuning_worker_and_an_idle_one_continues_it():
    """The worker (``cat`` here, echoing its stdin) is stopped and continued, and told on its
    stdin how long the stop lasted, so its budget leaves that time out."""
    tuner = BackgroundTuner(None, None, mode="idle")
    tuner.proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  start_new_session=True)
    try:
        tuner.busy(True)
        deadline = time.monotonic() + 5
        while _state(tuner.proc.pid) != "T":
            assert time.monotonic() < deadline, "the worker was not stopped"
            time.sleep(0.01)
        time.sleep(0.3)
        tuner.busy(False)
        while _state(tuner.proc.pid) == "T":
            assert time.monotonic() < deadline + 5, "the worker was not continued"
            time.sleep(0.01)
        word, secs = tuner.proc.stdout.readline().decode().split()
        assert word == "stopped" and 0.3 <= float(secs) < 10
    finally:
        tuner.stop()
    assert tuner.proc.returncode in (0, -15)  # cat may see its stdin close before the signal
    with pytest.raises(ValueError, match="mode"):
        BackgroundTuner(None, None, mode="sometimes")


def test_the_running_clock_leaves_out_the_stops_it_is_told_of():
    read, write = os.pipe()
    clock = RunningClock(os.fdopen(read, "rb"))
    with os.fdopen(write, "wb", buffering=0) as out:
        out.write(b"stopped 5.5\nstopped nonsense\nsomething else\nstopped 2\n")
        deadline = time.monotonic() + 5
        while clock.stopped_s < 7.5:
            assert time.monotonic() < deadline, clock.stopped_s
            time.sleep(0.01)
    assert clock.stopped_s == 7.5
    assert abs(time.monotonic() - clock() - 7.5) < 0.1
    assert abs(RunningClock()() - time.monotonic()) < 0.1  # no stream: the plain clock


def test_the_worker_ends_cleanly_while_its_stdin_stays_open():
    """The server keeps the worker's stdin open (it reports stops there); the worker's reader
    of it must not make the interpreter's shutdown abort (status -6) when the worker ends."""
    import pickle
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "sandwich_tvm.runtime.background_tuning"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(pickle.dumps((None, 1.0, True)))  # no spec: the worker fails at once
    proc.stdin.flush()
    try:
        proc.wait(120)  # stdin open all along; the traceback fits in the pipe
    finally:
        proc.stdin.close()
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode == 1, err.decode()
    assert b"AttributeError" in err and b"Fatal Python error" not in err, err.decode()


async def _ask(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    return [e.token for e in [e async for e in engine.generate(rid, prompt, params)] if e.token is not None]


@pytest.mark.compile
def test_serving_an_untuned_model_answers_at_once_then_swaps_in_tuned_kernels(tiny_model, tmp_path):
    _, compiled, params, plan = tiny_model
    cfg = compiled.config
    spec = RunSpec(cfg.name, cfg, plan, max_batch=8, kv_dtype="float32", records=tmp_path, prefill_chunk=16)
    todo = gemms_to_tune(spec)
    assert {name for name, *_ in todo} == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert all(m == (8 if name == "lm_head" else 16) for name, _, _, m in todo)
    engine = Engine(compiled, params, plan, max_batch=8, prefill_chunk=16)
    batch = BatchEngine(engine, SchedulerPolicy(max_batch=8, prefill_budget=16, chunk=16))
    async_engine = AsyncEngine(batch).start()
    logs: list[str] = []
    metrics = ServingMetrics("tiny")
    tuner = BackgroundTuner(spec, async_engine, mode="always", budget_min=0.2, log=logs.append,
                            metrics=metrics).start()
    assert metrics.tuning_running._value.get() == 1
    prompt = [3, 17, 5, 9, 28, 2, 11]
    try:
        first = asyncio.run(_ask(async_engine, "a", prompt))
        assert first and not tuner.swaps  # answered before any tuning landed
        deadline = time.monotonic() + 240
        while not tuner.swaps:
            assert time.monotonic() < deadline, f"nothing was swapped in: {logs}"
            assert tuner.proc.poll() is None or tuner.swaps, f"the worker ended: {logs}"
            time.sleep(0.2)
        assert engine.kernel_swaps >= 1 and engine.compiled.path != compiled.path
        assert asyncio.run(_ask(async_engine, "b", prompt)) == first
        assert metrics.kernel_swaps._value.get() >= 1
        assert metrics.tuned_gemms._value.get() >= 1
    finally:
        tuner.stop()
        async_engine.shutdown()
    assert metrics.tuning_running._value.get() == 0  # /metrics shows the worker gone
    assert any(x.startswith("background tuning: landed") for x in logs)
    assert list(tmp_path.glob("*/t*/linear_*.json"))  # the records it tuned are kept


@pytest.mark.parametrize("shipped", [True, False])
def test_the_worker_learns_from_the_shipped_records_unless_told_not_to(monkeypatch, tmp_path, shipped):
    """``serve --costmodel-data records``: the cost model and transfer read the records
    directory alone (a new CPU's view, with this CPU's shipped records held out)."""
    from sandwich_tvm.kernels import costmodel, guided
    from sandwich_tvm.kernels.database import SHIPPED_DIR
    from sandwich_tvm.runtime import background_tuning as bt

    seen = {}

    class Seen(Exception):
        pass

    monkeypatch.setattr(costmodel, "training_samples",
                        lambda root, shipped=True: seen.setdefault("data", shipped))
    monkeypatch.setattr(costmodel.CostModel, "train", classmethod(lambda cls, samples: "model"))
    monkeypatch.setattr("sandwich_tvm.tvm_compat.preload_tensor_intrinsics", lambda: None)

    def tune(n, k, **kw):
        seen["roots"] = tuple(kw["transfer_roots"])
        seen["deadline"], seen["clock"] = kw["deadline"], kw["clock"]
        raise Seen  # nothing more to see: the worker stops here

    class Shape:
        n, k, dtype, epilogue = 4, 4, "float32", "none"

    monkeypatch.setattr(bt, "gemms_to_tune", lambda spec: [("o", Shape(), 2, 16)])
    monkeypatch.setattr(guided, "tune_gemm_guided", tune)
    spec = RunSpec.__new__(RunSpec)
    object.__setattr__(spec, "records", tmp_path)
    with pytest.raises(Seen):
        bt.worker(spec, 60.0, lambda _m: None, shipped=shipped, clock=lambda: 1000.0)
    assert seen["data"] is shipped
    assert seen["deadline"] == 1060.0 and seen["clock"]() == 1000.0  # the budget is on its clock
    assert (SHIPPED_DIR in seen["roots"]) is shipped and tmp_path in seen["roots"]
