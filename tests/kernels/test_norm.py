"""The RMSNorm kernel against numpy: a decode step's row, a prompt's rows, a hidden size with a
tail past the vector lanes."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.kernels.norm import rms_norm_primfunc
from sandwich_tvm.tvm_compat import host_target, tvm


@pytest.mark.parametrize("hidden", [96, 100])
def test_rms_norm_matches_numpy(hidden):
    eps = 1e-5
    run = tvm.compile(rms_norm_primfunc(hidden, eps), target=host_target())[f"rms_norm_h{hidden}"]
    rng = np.random.default_rng(hidden)
    w = rng.standard_normal(hidden).astype(np.float32)
    for m in (1, 3, 33):
        x = rng.standard_normal((m, hidden)).astype(np.float32) * 3
        y = tvm.runtime.empty((m, hidden), "float32", tvm.cpu())
        run(tvm.runtime.tensor(x), tvm.runtime.tensor(w), y)
        ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + eps) * w
        np.testing.assert_allclose(y.numpy(), ref, rtol=2e-6, atol=2e-6)
