"""The int8 KV cache's row format and the kernels that enter and leave it.

TVM's paged KV cache keeps one dtype for its pages and for the q, k, v and output tensors it
passes its kernels, and no scales. An int8 cache therefore carries its scales inside the rows:
every (token, head) row of q, k, v and the attention output is ``head_dim`` int8 values followed
by :data:`SCALE_BYTES` bytes holding the row's fp32 scale (little-endian), so the cache is
created with a head dim of ``head_dim + SCALE_BYTES`` and dtype int8. Quantization is symmetric
per row (``scale = max|x| / 127``), as the cache-resident design stores its KV in int8.

The model quantizes q, k, v after the QKV projection (:func:`quantize_rows_primfunc`) and
dequantizes the attention output before the O projection (:func:`dequantize_rows_primfunc`);
RoPE (``kernels.rope``) and the attention kernels (``kernels.attention``) read rows with
:func:`scale_expr` and write them with :func:`quantize_row`; the cache's own copy kernels
(append, fork, compaction) move rows as bytes, scales included. The merge of a prompt's new
keys with its cached prefix (``tir_attention_merge_state_cpu``) is :func:`merge_state_primfunc`.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ..tvm_compat import parse_tvmscript, tvm

SCALE_BYTES = 4  # the row's fp32 scale, stored after its int8 values
QMAX = 127


def row_width(d: int, dtype: str) -> int:
    """Elements of one (token, head) row as the cache stores it."""
    return d + SCALE_BYTES if dtype == "int8" else d


def scale_expr(row: str, d: int) -> str:
    """The fp32 scale of an int8 row; ``row`` formats an index of the last axis (``{}``)."""
    parts = [f'(T.Cast("uint32", T.Cast("uint8", {row.format(d + i)})) << T.uint32({8 * i}))'
             for i in range(SCALE_BYTES)]
    return f'T.reinterpret("float32", {" | ".join(parts)})'


def quantize_row(value: str, dest: str, d: int, tmp: str, indent: int = 0) -> str:
    """Statements writing the fp32 values ``value`` (formats an index, ``{}``) as one int8 row at
    ``dest`` (formats an index). ``tmp`` is a float32 buffer of 2 elements the caller allocates."""
    v, out = value.format("i"), dest.format
    lines = [f"{tmp}[0] = T.float32(0)",
             f"for i in range({d}):",
             f"    {tmp}[0] = T.max({tmp}[0], T.fabs({v}))",
             f"{tmp}[0] = T.max({tmp}[0], T.float32(1e-30)) / T.float32({QMAX})",
             f"{tmp}[1] = T.float32(1) / {tmp}[0]",
             f"for i in T.vectorized({d}):",
             f'    {out("i")} = T.Cast("int8", T.max(T.min(T.nearbyint({v} * {tmp}[1]), '
             f'T.float32({QMAX})), T.float32({-QMAX})))']
    bits = f'T.reinterpret("uint32", {tmp}[0])'
    lines += [f'{out(d + i)} = T.Cast("int8", T.Cast("uint8", ({bits} >> T.uint32({8 * i})) & T.uint32(255)))'
              for i in range(SCALE_BYTES)]
    pad = " " * indent
    return "\n".join(pad + line for line in lines)


@cache
def quantize_rows_primfunc(heads: int, d: int) -> tvm.tirx.PrimFunc:
    """fp32 ``(n, heads, d)`` to int8 rows ``(n, heads, d + SCALE_BYTES)``: the model's fused
    QKV entering the cache."""
    w = row_width(d, "int8")
    body = quantize_row("x[t, h, {}]", "y[t, h, {}]", d, "tmp", 20)
    src = f'''
@D.prim_func(s_tir=True)
def quantize_kv_rows(var_x: T.handle, var_y: T.handle):
    T.func_attr({{"global_symbol": "quantize_kv_rows", "tir.noalias": True, "tirx.is_scheduled": True}})
    n = T.int64()
    x = T.match_buffer(var_x, (n, {heads}, {d}), "float32")
    y = T.match_buffer(var_y, (n, {heads}, {w}), "int8")
    with T.sblock("root"):
        for t in T.parallel(n):
            for h in range({heads}):
                with T.sblock("row"):
                    tmp = T.sblock_alloc_buffer((2,), "float32", scope="global")
{body}
'''
    return parse_tvmscript(src)


@cache
def dequantize_rows_primfunc(heads: int, d: int) -> tvm.tirx.PrimFunc:
    """int8 rows ``(n, heads, d + SCALE_BYTES)`` to fp32 ``(n, heads, d)``: the attention output
    leaving the cache."""
    w = row_width(d, "int8")
    src = f'''
@D.prim_func(s_tir=True)
def dequantize_kv_rows(var_x: T.handle, var_y: T.handle):
    T.func_attr({{"global_symbol": "dequantize_kv_rows", "tir.noalias": True, "tirx.is_scheduled": True}})
    n = T.int64()
    x = T.match_buffer(var_x, (n, {heads}, {w}), "int8")
    y = T.match_buffer(var_y, (n, {heads}, {d}), "float32")
    with T.sblock("root"):
        for t in T.parallel(n):
            for h in range({heads}):
                with T.sblock("row"):
                    sc = T.sblock_alloc_buffer((1,), "float32", scope="global")
                    sc[0] = {scale_expr("x[t, h, {}]", d)}
                    for i in T.vectorized({d}):
                        y[t, h, i] = T.Cast("float32", x[t, h, i]) * sc[0]
'''
    return parse_tvmscript(src)


@cache
def merge_state_primfunc(d: int) -> tvm.tirx.PrimFunc:
    """``tir_attention_merge_state_cpu`` on int8 rows: ``v`` (with log2-sum-exp ``s``) merged in
    place with ``v_other`` (``s_other``), in fp32, and written back as one int8 row."""
    w = row_width(d, "int8")
    store = quantize_row("o[{}]", "V[n, h, {}]", d, "tmp", 20)
    src = f'''
@D.prim_func(s_tir=True)
def merge_state_inplace_cpu(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
    T.func_attr({{"tirx.is_scheduled": True, "tir.noalias": True}})
    N = T.int32()
    H = T.int32()
    V = T.match_buffer(v, (N, H, {w}), "int8")
    S = T.match_buffer(s, (N, H), "float32")
    V_other = T.match_buffer(v_other, (N, H, {w}), "int8")
    S_other = T.match_buffer(s_other, (N, H), "float32")
    with T.sblock("root"):
        for n in range(N):
            for h in range(H):
                with T.sblock("merge"):
                    o = T.sblock_alloc_buffer(({d},), "float32", scope="global")
                    tmp = T.sblock_alloc_buffer((2,), "float32", scope="global")
                    st = T.sblock_alloc_buffer((4,), "float32", scope="global")
                    st[0] = T.max(S[n, h], S_other[n, h])
                    st[1] = T.exp2(S[n, h] - st[0])
                    st[2] = T.exp2(S_other[n, h] - st[0])
                    st[3] = st[1] + st[2]
                    st[1] = st[1] / st[3] * {scale_expr("V[n, h, {}]", d)}
                    st[2] = st[2] / st[3] * {scale_expr("V_other[n, h, {}]", d)}
                    for i in T.vectorized({d}):
                        o[i] = (T.Cast("float32", V[n, h, i]) * st[1]
                                + T.Cast("float32", V_other[n, h, i]) * st[2])
{store}
                    S[n, h] = T.log2(st[3]) + st[0]
'''
    return parse_tvmscript(src)


def pack_rows(x: np.ndarray) -> np.ndarray:
    """fp32 rows (last axis ``d``) in the cache's int8 row format (numpy; tests and debugging)."""
    scale = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-30)) / np.float32(QMAX)
    values = np.clip(np.rint(x * (np.float32(1) / scale)), -QMAX, QMAX).astype(np.int8)
    return np.concatenate([values, scale.astype(np.float32).view(np.int8)], axis=-1)


def unpack_rows(rows: np.ndarray) -> np.ndarray:
    """The fp32 values of int8 rows (inverse of :func:`pack_rows` up to rounding)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = np.ascontiguousarray(rows[..., d:]).view(np.float32)
    return rows[..., :d].astype(np.float32) * scale
