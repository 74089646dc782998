"""The tensor-parallel ranks over Disco without a model: a rank's error comes back naming it
(the first to fail first), nothing hangs, no worker outlives its group; both engines have the
engine interface."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandwich_tvm.collective.shm import ShmGroup
from sandwich_tvm.runtime import disco_group, tp_worker
from sandwich_tvm.runtime.disco_group import DiscoError, DiscoGroup
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.interface import ServingEngine
from sandwich_tvm.runtime.tp import TPEngine

from .tp_faults import ENTRYPOINT, FAIL_ON

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_ranks(monkeypatch):
    """A Disco group of two ranks joined to a shared-memory group; the workers import tests."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with ShmGroup.create(2, 4096, timeout_s=30) as group:
        disco = DiscoGroup(2, ENTRYPOINT)
        try:
            group.set_pid(1, disco.pids[1])
            disco.start(tp_worker.ATTACH, group.name, 2, group.slot, 30.0)
            yield disco
        finally:
            disco.close()


@pytest.mark.parametrize(("bad", "then"), [(1, 0), (0, 1)])
def test_a_failing_rank_is_named_first_and_nothing_hangs(two_ranks, bad, then):
    assert two_ranks.call(FAIL_ON, -1) == 2.0  # no rank fails: one from each
    workers = two_ranks.pids[1:]
    start = time.monotonic()
    with pytest.raises(DiscoError) as err:
        two_ranks.call(FAIL_ON, bad)
    assert time.monotonic() - start < 10  # the peer stopped waiting: not the collective's 30 s
    message = str(err.value)
    assert message.startswith(f"rank {bad}: ValueError: injected on rank {bad}; rank {then}: ")
    assert f"rank {bad} failed" in message  # the peer saw it fail
    two_ranks.close()
    assert not any(Path(f"/proc/{p}").exists() for p in workers)
    with pytest.raises(DiscoError, match="shut down"):
        two_ranks.call(FAIL_ON, -1)


def test_a_killed_rank_is_named_and_the_group_closes(two_ranks):
    assert two_ranks.call(FAIL_ON, -1) == 2.0  # both ranks are up
    worker = two_ranks.pids[1]
    os.kill(worker, signal.SIGKILL)
    while Path(f"/proc/{worker}/stat").exists() and " Z " not in Path(f"/proc/{worker}/stat").read_text():
        time.sleep(0.01)
    start = time.monotonic()
    with pytest.raises(DiscoError, match=rf"rank 1 \(pid {worker}\) exited"):
        two_ranks.call(FAIL_ON, -1)
    two_ranks.close()  # while the error (and its frames) lives: rank 0's thread must not deadlock
    assert time.monotonic() - start < 10 and not Path(f"/proc/{worker}").exists()


def test_a_rank_that_cannot_start_is_named():
    disco = DiscoGroup(2, tp_worker.ENTRYPOINT)
    try:
        with pytest.raises(DiscoError) as err:
            disco.start(tp_worker.ATTACH, "sandwich-none", 2, 4096, 1.0)
        missing = "CollectiveError: shared-memory segment 'sandwich-none' does not exist"
        assert f"rank 0: {missing}" in str(err.value) and f"rank 1: {missing}" in str(err.value)
    finally:
        disco.close()


def test_a_worker_that_dies_at_start_is_not_waited_for_and_its_exit_status_is_told():
    """The start's diagnosis: a new child that exited ends the wait for workers at once, and the
    error names its pid, command line and exit status."""
    earlier = disco_group._children()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    try:
        while disco_group._alive(child.pid):
            time.sleep(0.01)
        start = time.monotonic()
        assert disco_group._await_workers(tp_worker.ENTRYPOINT, earlier, 1, wait_s=30) == {}
        assert time.monotonic() - start < 5
        told = disco_group._unmatched(earlier, set())
        assert f"pid {child.pid} (exited, exit status 3)" in told
    finally:
        child.wait()
    assert disco_group._unmatched(earlier, set()) == "; no new child process"


def test_both_engines_have_the_engine_interface():
    for name, member in inspect.getmembers(ServingEngine, inspect.isfunction):
        if name.startswith("_"):
            continue
        for cls in (Engine, TPEngine):
            assert inspect.signature(getattr(cls, name)) == inspect.signature(member), (cls, name)
    assert not inspect.isabstract(Engine) and not inspect.isabstract(TPEngine)
