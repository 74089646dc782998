"""The machine's fp32 FMA peak, measured: a register-only loop of independent vector FMAs.

Each thread keeps ``CHAINS`` accumulators of the ISA's full vector width and updates them with
``acc = acc * x + x`` (one FMA each, no memory traffic); enough independent chains cover the
FMA latency times the FMA pipes of current x86 and Arm cores. GFLOPS = 2 x lanes x chains x
iterations x threads / seconds. This is the roof a GEMM kernel is judged against.
"""

from __future__ import annotations

import os
import time
from functools import cache

import numpy as np

from ..host import isa_of, own_cpu_flags
from ..tvm_compat import PROCESS_CPUS, local_target, parse_tvmscript, pin_thread_pool, tvm
from .microkernel import ISAS

CHAINS = 12


@cache
def _fma_loop(threads: int, lanes: int):
    total = " + ".join(f"acc[{j}, l]" for j in range(CHAINS))
    src = f'''
@D.prim_func(s_tir=True)
def fma_loop(x: T.Buffer(({lanes},), "float32"), out: T.Buffer(({threads}, {lanes}), "float32"),
             n: T.int32):
    T.func_attr({{"global_symbol": "fma_loop", "tir.noalias": True, "tirx.is_scheduled": True}})
    with T.sblock("root"):
        for t in T.parallel({threads}):
            with T.sblock("thread"):
                acc = T.sblock_alloc_buffer(({CHAINS}, {lanes}), "float32", scope="global")
                for j in T.unroll({CHAINS}):
                    for l in T.vectorized({lanes}):
                        acc[j, l] = x[l] + T.float32(j)
                for i in range(n):
                    for j in T.unroll({CHAINS}):
                        for l in T.vectorized({lanes}):
                            acc[j, l] = acc[j, l] * x[l] + x[l]
                for l in T.vectorized({lanes}):
                    out[t, l] = {total}
'''
    mod = tvm.IRModule({"fma_loop": parse_tvmscript(src)})
    return tvm.compile(mod, target=local_target(threads)).mod["fma_loop"]


def fma_peak_gflops(threads: int, seconds: float = 0.3, repeats: int = 5,
                    cpus: list[int] | None = None) -> float:
    """Median GFLOPS of ``threads`` threads running only FMAs, one per CPU of this process.

    The pool is pinned first: a caller left on one core (numpy benchmarks pin it) would put
    both workers there, and a bench gemm run once read half the peak that way.
    """
    cpus = sorted(PROCESS_CPUS)[:threads] if cpus is None else list(cpus)[:threads]
    threads = len(cpus)
    os.sched_setaffinity(0, PROCESS_CPUS)
    pin_thread_pool(cpus)
    lanes = ISAS.get(isa_of(own_cpu_flags()), ISAS["neon"]).lanes  # this CPU's: the probe runs here
    fn = _fma_loop(threads, lanes)
    x = tvm.runtime.tensor(np.full(lanes, 0.999, np.float32))
    out = tvm.runtime.empty((threads, lanes), "float32", tvm.cpu())
    n = 1 << 14
    while True:  # calibrate: one call lasts about ``seconds``
        t0 = time.perf_counter()
        fn(x, out, n)
        dt = time.perf_counter() - t0
        if dt > seconds / 4 or n > 1 << 30:
            break
        n *= 4
    n = max(1, int(n * seconds / dt))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x, out, n)
        runs.append(time.perf_counter() - t0)
    return 2.0 * lanes * CHAINS * n * threads / float(np.median(runs)) / 1e9
