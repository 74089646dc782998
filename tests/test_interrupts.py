"""Ctrl-C that a loop swallows still ends the process: after ``STOP_GRACE_S`` it prints every
thread's stack (naming where it hung) and exits with status 1."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

SWALLOWS = """
import sys, time
from sandwich_tvm import interrupts
interrupts.STOP_GRACE_S = 1.0
interrupts.watch()
def swallowing_loop():
    ready = False
    while True:
        try:
            if not ready:
                ready = True
                print("ready", file=sys.stderr, flush=True)
            while True:
                time.sleep(0.05)
        except KeyboardInterrupt:  # what a callback's error report does to Ctrl-C
            print("swallowed", interrupts.requested(), file=sys.stderr, flush=True)
swallowing_loop()
"""


def test_a_swallowed_ctrl_c_still_stops_the_process_and_names_where_it_hung():
    proc = subprocess.Popen([sys.executable, "-c", SWALLOWS], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "swallowed True" in err
    assert proc.returncode == 1 and time.monotonic() - t0 < 30, (proc.returncode, err)
    assert "swallowing_loop" in err  # faulthandler's stack of the main thread


def test_check_raises_only_after_ctrl_c(monkeypatch):
    from sandwich_tvm import interrupts

    interrupts.check()
    monkeypatch.setattr(interrupts, "_requested", True)
    assert interrupts.requested()
    try:
        interrupts.check()
    except KeyboardInterrupt:
        return
    raise AssertionError("check() did not raise after Ctrl-C")
