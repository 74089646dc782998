"""TVM MetaSchedule's default search on a static-shape Linear: the tuner users have without Sandwich.

The workload is ``Y[m, n] = sum_k X[m, k] * W[n, k]`` with m fixed (MetaSchedule cannot tune a
symbolic m), searched by ``ms.tune_tir`` with its defaults (evolutionary search, XGBoost cost
model, the CPU schedule rules), built by ``LocalBuilder`` and timed by ``LocalRunner``.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time

from ...tvm_compat import host_target, preload_tensor_intrinsics, tvm


def linear_te(m: int, n: int, k: int) -> tvm.IRModule:
    from tvm import te

    x = te.placeholder((m, k), "float32", name="X")
    w = te.placeholder((n, k), "float32", name="W")
    r = te.reduce_axis((0, k), name="r")
    y = te.compute((m, n), lambda i, j: te.sum(x[i, r] * w[j, r], axis=r), name="Y")
    func = te.create_prim_func([x, w, y]).with_attr("global_symbol", "main")
    return tvm.IRModule({"main": func})


def tune_default(m: int, n: int, k: int, threads: int, trials: int, log=lambda msg: None):
    """MetaSchedule's best kernel after ``trials`` measured candidates: (compiled main, seconds)."""
    from tvm.s_tir import meta_schedule as ms

    mod, target = linear_te(m, n, k), host_target(threads)
    t0 = time.perf_counter()
    preload_tensor_intrinsics()  # what its TuneContext imports, here too
    # MetaSchedule prints its task table to stdout: keep stdout for our JSON.
    with tempfile.TemporaryDirectory() as work_dir, contextlib.redirect_stdout(sys.stderr):
        log(f"MetaSchedule default search: m={m} n={n} k={k}, {trials} trials ...")
        # The stock build function imports tvm.s_tir.tensor_intrin in each builder process, as
        # the search does here (~30 s each, inspect.stack): both import it the cheap way first.
        # Only the search's wall time changes (it shrinks: the baseline's is not inflated).
        db = ms.tune_tir(mod, target=target, work_dir=work_dir, max_trials_global=trials,
                         num_trials_per_iter=min(trials, 32),
                         builder=ms.builder.LocalBuilder(timeout_sec=120,
                                                         initializer=preload_tensor_intrinsics),
                         runner=ms.runner.LocalRunner(timeout_sec=60))
        sch = ms.tir_integration.compile_tir(db, mod, target)
    seconds = time.perf_counter() - t0
    if sch is None:
        raise RuntimeError(f"MetaSchedule found no valid kernel for m={m} n={n} k={k} in {trials} trials")
    return tvm.compile(sch.mod, target=target)["main"], seconds
