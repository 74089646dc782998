"""RMSNorm as a generated TIR kernel: rows in parallel, one vector of partial sums, one pass to scale.

DLight's CPU reduction rule mis-schedules the decode shape [1, 1, hidden] (unit loops are
dropped, the reduction is recomputed inside a parallel loop over the hidden dimension and
races on its accumulator), so the norm is generated like the Linear kernels instead.
"""

from __future__ import annotations

from functools import cache

from ..host import host_isa
from ..tvm_compat import parse_tvmscript, tvm
from .microkernel import ISAS


@cache
def rms_norm_primfunc(hidden: int, eps: float, isa: str | None = None) -> tvm.tirx.PrimFunc:
    """``Y[i, :] = X[i, :] * rsqrt(mean(X[i, :]^2) + eps) * w`` for a symbolic number of rows;
    the sum of squares runs in vectors of the ISA's fp32 lanes."""
    LANES = ISAS[isa or host_isa()].lanes  # noqa: N806
    h, main = hidden, hidden // LANES * LANES
    tail = "" if main == h else f'''
                for j in range({h - main}):
                    ss[0] = ss[0] + X[i, {main} + j] * X[i, {main} + j]'''
    src = f'''
@D.prim_func(s_tir=True)
def rms_norm_h{h}(var_x: T.handle, w: T.Buffer(({h},), "float32"), var_y: T.handle):
    T.func_attr({{"global_symbol": "rms_norm_h{h}", "tir.noalias": True, "tirx.is_scheduled": True}})
    m = T.int64()
    X = T.match_buffer(var_x, (m, {h}), "float32")
    Y = T.match_buffer(var_y, (m, {h}), "float32")
    with T.sblock("root"):
        for i in T.parallel(m):
            with T.sblock("row"):
                acc = T.sblock_alloc_buffer(({LANES},), "float32", scope="global")
                ss = T.sblock_alloc_buffer((1,), "float32", scope="global")
                for l in T.vectorized({LANES}):
                    acc[l] = T.float32(0)
                for j in range({main // LANES}):
                    for l in T.vectorized({LANES}):
                        acc[l] = acc[l] + X[i, j * {LANES} + l] * X[i, j * {LANES} + l]
                ss[0] = {" + ".join(f"acc[{lane}]" for lane in range(LANES))}{tail}
                ss[0] = T.rsqrt(ss[0] / T.float32({h}) + T.float32({eps!r}))
                for j in T.vectorized({h}):
                    Y[i, j] = X[i, j] * ss[0] * w[j]
'''
    return parse_tvmscript(src)
