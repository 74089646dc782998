"""Use Sandwich's kernel generator from your own TVM flow: tune one GEMM, build its kernel.

    python examples/tune_one_gemm.py            # n=512, k=512, m up to 64 (about a minute)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from sandwich_tvm.kernels import linear_primfunc, pack_weight
from sandwich_tvm.kernels.tuner import tune_gemm
from sandwich_tvm.tvm_compat import host_isa, host_target, tvm


def main() -> None:
    n, k, threads = 512, 512, len(os.sched_getaffinity(0))
    root = Path(tempfile.mkdtemp(prefix="sandwich-example-"))
    rec = tune_gemm(n, k, threads=threads, max_m=64, root=root,
                    progress=lambda t: print(f"m={t.m:3d} {t.schedule.key}"))
    func = linear_primfunc(rec.shape, rec.buckets())  # one kernel, dispatching on m at run time
    kernel = tvm.compile(tvm.IRModule({"linear": func}), target=host_target(threads)).mod["linear"]
    w = np.random.rand(n, k).astype("float32")
    wp = tvm.runtime.tensor(pack_weight(w, host_isa()))  # pack once, at load time
    for m in (1, 7, 100):  # any m, including ones never tuned
        x = np.random.rand(m, k).astype("float32")
        y = tvm.runtime.empty((m, n), "float32", tvm.cpu())
        kernel(tvm.runtime.tensor(x), wp, y)
        print(f"m={m}: max |error| vs numpy = {np.abs(y.numpy() - x @ w.T).max():.2e}")


if __name__ == "__main__":
    main()
