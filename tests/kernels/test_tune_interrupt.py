"""Ctrl-C in the middle of `tune kernels`: TVM's FFI returns a KeyboardInterrupt raised in one of
the tuner's Python callbacks (builder, runner, search) as a RuntimeError; the command still ends
with "interrupted" and status 130, no traceback, and what was measured stays on disk."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.compile


def _ctrl_c_reaches_it() -> None:  # a background test run ignores SIGINT; a terminal does not
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_tuning_ends_with_130_and_keeps_the_measurements(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "sandwich_tvm.tune", "kernels", "--model", "llama-34m",
         "--dtype", "float32", "--search", "full", "--max-m", "64", "--threads", "1",
         "--records", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_reaches_it)
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("*/t1/measured/*.jsonl")):  # inside the search: candidates timed
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # every thread's stack (faulthandler, without the GIL)
            proc.send_signal(signal.SIGABRT)
            pytest.fail(f"still running 120 s after Ctrl-C:\n{proc.communicate(timeout=60)[1][-8000:]}")
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert list(tmp_path.glob("*/t1/measured/*.jsonl"))


def test_the_builder_lets_ctrl_c_through_where_it_reports_any_other_error(monkeypatch):
    """TVM hands Ctrl-C back from a callback as a bare RuntimeError: a failed candidate before
    Ctrl-C, the interrupt after it."""
    from tvm.s_tir import meta_schedule as ms

    from sandwich_tvm import interrupts
    from sandwich_tvm.kernels.defaults import default_schedule
    from sandwich_tvm.kernels.metaschedule import InProcessBuilder, linear_workload
    from sandwich_tvm.kernels.metaschedule.workload import annotate
    from sandwich_tvm.kernels.schedule import GemmShape
    from sandwich_tvm.tvm_compat import host_isa, host_target

    class Cache:  # its build fails as TVM reports Ctrl-C in a callback; ``ctrl_c``: it came
        ctrl_c = False

        def get(self, shape, schedule):
            if self.ctrl_c:
                monkeypatch.setattr(interrupts, "_requested", True)
            raise RuntimeError("")

    isa, cache = host_isa(), Cache()
    sch = default_schedule(GemmShape(32, 32, "float32"), 4, 1, isa)
    inputs = [ms.builder.BuilderInput(annotate(linear_workload(4, 32, 32, isa, "float32", "none"), sch).mod,
                                      host_target(1))]
    builder = InProcessBuilder(cache)
    (result,) = builder.build(inputs)
    assert result.artifact_path is None and result.error_msg == ""
    cache.ctrl_c = True
    with pytest.raises((KeyboardInterrupt, RuntimeError)):
        builder.build(inputs)
