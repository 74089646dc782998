"""TVM's thread pool re-shaped to fewer workers and back really runs on every worker again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import threading, time
from sandwich_tvm.tvm_compat import T, host_target, pin_thread_pool, tvm

seen = set()

@tvm.register_global_func("sandwich_test.record")
def record(i):
    seen.add(threading.get_native_id())
    time.sleep(0.05)  # hold the task so the other worker takes the next one

@T.prim_func
def tasks(a: T.Buffer((2,), "int32")):
    for i in T.parallel(2):
        a[i] = T.call_packed("sandwich_test.record", i)

run = tvm.compile(tvm.IRModule({"tasks": tasks}), target=host_target())["tasks"]
buf = tvm.runtime.empty((2,), "int32", tvm.cpu())
pin_thread_pool([CPUS[0]])  # first call shrinks the pool before it ever ran
run(buf)
one = len(seen)
seen.clear()
pin_thread_pool(CPUS)
run(buf)
print(one, len(seen))
"""


@pytest.mark.compile
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_pool_grows_back_after_a_smaller_first_configuration(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    script = tmp_path / "pool.py"  # a file: TVMScript reads its own source
    script.write_text(f"CPUS = {cpus}\n" + SCRIPT)
    env = {**os.environ, "TVM_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "2"], out.stdout
