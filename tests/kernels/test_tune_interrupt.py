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
        [sys.executable, "-m", "sandwich_tvm.tune", "kernels", "--model", "llama-34m", "--dtype", "float32",
         "--search", "full", "--max-m", "64", "--threads", "1", "--records", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_reaches_it)
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("*/t1/measured/*.jsonl")):  # inside the search: candidates timed
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert list(tmp_path.glob("*/t1/measured/*.jsonl"))
