"""RoPE for the KV cache's ``fused_rope`` step: one sin/cos per (token, frequency), shared by heads.

TVM's version evaluates ``pow``, ``sin`` and ``cos`` for every element of q and k. Here the
inverse frequencies (Llama-3, linear and YaRN scaling included, as HF computes them) are constants
of the kernel, each token computes its ``head_dim / 2`` angles once, and every q/k head reuses
them; YaRN's and LongRoPE's attention factor multiplies cos and sin, as in transformers and
llama.cpp. With fewer frequencies than half a head (Phi-4-mini's partial rotary), the leading
``2 * len(freqs)`` dimensions turn (pairs ``j`` and ``j + len(freqs)``, as transformers and
llama.cpp's NeoX order pair them) and the rest pass as they are.
``rope_primfunc`` has the signature of TVM's ``fused_rope``; swapped in by ``compiler.kv_cache``.
``rope_rows_primfunc`` turns the q and k heads of fp32 QKV rows in the model's graph instead,
for a model whose layers do not all take RoPE (SmolLM3's every fourth); its cache then runs
without RoPE (``fused_rope`` only splits). ``freqs`` are the
model's inverse frequencies (``model.rope.inv_freq``), ``dtype`` the KV cache's storage; int8
rows (``kernels.kv_int8``) are dequantized, rotated and quantized again, V's copied as bytes.
"""

from __future__ import annotations

from functools import cache

from ..tvm_compat import parse_tvmscript, tvm
from .kv_int8 import quantize_row, row_width, scale_expr
from .vecmath import load_f32, store_as


@cache
def rope_primfunc(h_q: int, h_kv: int, d: int, freqs: tuple[float, ...],
                   dtype: str = "float32", scale: float = 1.0) -> tvm.tirx.PrimFunc:
    """``fused_rope`` for ``freqs`` (the inverse frequencies of the leading ``2 * len(freqs)``
    dimensions), cos and sin multiplied by ``scale`` (YaRN's or LongRoPE's attention factor)."""
    half, heads, w = len(freqs), h_q + 2 * h_kv, row_width(d, dtype)
    rot = 2 * half
    if not 0 < rot <= d:
        raise ValueError(f"{half} RoPE frequencies do not fit a head of {d}")
    lo, hi = load_f32("qkv[s, h, j]", dtype), load_f32(f"qkv[s, h, j + {half}]", dtype)
    first = store_as(f"cs[j] * {lo} - sn[j] * {hi}", dtype)
    second = store_as(f"cs[j] * {hi} + sn[j] * {lo}", dtype)
    rotate = f"""for j in T.vectorized({half}):
                        if h < {h_q}:
                            q[s, h, j] = {first}
                            q[s, h, j + {half}] = {second}
                        else:
                            k[s, h - {h_q}, j] = {first}
                            k[s, h - {h_q}, j + {half}] = {second}"""
    if rot < d:  # the dimensions RoPE does not turn, as they are
        rotate += f"""
                    for j in T.vectorized({d - rot}):
                        if h < {h_q}:
                            q[s, h, j + {rot}] = qkv[s, h, j + {rot}]
                        else:
                            k[s, h - {h_q}, j + {rot}] = qkv[s, h, j + {rot}]"""
    rows = ""  # int8: a rotated row before it is quantized, and its scale
    if dtype == "int8":
        rows = f"""
                t = T.sblock_alloc_buffer(({d},), "float32", scope="global")
                tmp = T.sblock_alloc_buffer((2,), "float32", scope="global")"""
        store_q = quantize_row("t[{}]", "q[s, h, {}]", d, "tmp", 28)
        store_k = quantize_row("t[{}]", f"k[s, h - {h_q}, {{}}]", d, "tmp", 28)
        passed = "" if rot == d else f"""
                    for j in T.vectorized({d - rot}):
                        t[j + {rot}] = {load_f32(f"qkv[s, h, j + {rot}]", dtype)} * tmp[0]"""
        rotate = f"""tmp[0] = {scale_expr("qkv[s, h, {}]", d)}
                    for j in T.vectorized({half}):
                        t[j] = (cs[j] * {lo} - sn[j] * {hi}) * tmp[0]
                        t[j + {half}] = (cs[j] * {hi} + sn[j] * {lo}) * tmp[0]{passed}
                    if h < {h_q}:
{store_q}
                    else:
{store_k}"""
    angles = _angles(freqs, scale, "position_map[s]", "apply_rope > T.int64(0)")
    src = f'''
@D.prim_func(s_tir=True)
def fused_rope(var_qkv: T.handle, var_position_map: T.handle, var_q: T.handle, var_k: T.handle,
               var_v: T.handle, apply_rope: T.int64):
    T.func_attr({{"global_symbol": "fused_rope", "tir.noalias": True, "tirx.is_scheduled": True}})
    seq_len = T.int32()
    qkv = T.match_buffer(var_qkv, (seq_len, {heads}, {w}), "{dtype}")
    position_map = T.match_buffer(var_position_map, (seq_len,), "int32", offset_factor=1)
    q = T.match_buffer(var_q, (seq_len, {h_q}, {w}), "{dtype}")
    k = T.match_buffer(var_k, (seq_len, {h_kv}, {w}), "{dtype}")
    v = T.match_buffer(var_v, (seq_len, {h_kv}, {w}), "{dtype}")
    with T.sblock("root"):
        for s in T.parallel(seq_len):
            with T.sblock("token"):
                f = T.sblock_alloc_buffer(({half},), "float32", scope="global")
                cs = T.sblock_alloc_buffer(({rot},), "float32", scope="global")
                sn = T.sblock_alloc_buffer(({rot},), "float32", scope="global"){rows}
{angles}
                for h in range({h_q + h_kv}):
                    {rotate}
                for h in range({h_kv}):
                    for j in T.vectorized({w}):
                        v[s, h, j] = qkv[s, h + {h_q + h_kv}, j]
'''
    return parse_tvmscript(src)


def _angles(freqs: tuple[float, ...], scale: float, position: str, on: str = "") -> str:
    """TVMScript lines (in a token's block) filling ``f`` with ``freqs`` and ``cs``/``sn`` with
    the cos and sin of ``position`` times each, times ``scale``; cos 1 and sin 0 unless ``on``."""
    half = len(freqs)
    angle = f'T.Cast("float32", {position}) * f[i]'
    scaled = "" if scale == 1.0 else f" * T.float32({float(scale)!r})"
    cos, sin = f"T.cos({angle}){scaled}", f"T.sin({angle}){scaled}"
    if on:
        cos, sin = f"T.if_then_else({on}, {cos}, T.float32(1))", f"T.if_then_else({on}, {sin}, T.float32(0))"
    init = "\n".join(f"                f[{i}] = T.float32({v!r})" for i, v in enumerate(freqs))
    return f"""{init}
                for i in range({half}):
                    cs[i] = {cos}
                    sn[i] = {sin}
                    cs[i + {half}] = cs[i]
                    sn[i + {half}] = sn[i]"""


@cache
def rope_rows_primfunc(h_q: int, h_kv: int, d: int, freqs: tuple[float, ...],
                       scale: float = 1.0) -> tvm.tirx.PrimFunc:
    """``rope_rows(qkv, positions) -> out``: fp32 rows ``[tokens, h_q + 2 h_kv, d]`` with each q
    and k head's leading ``2 * len(freqs)`` dimensions turned to the token's position (as
    ``rope_primfunc`` turns them), the rest and the v heads as they are."""
    half, heads = len(freqs), h_q + 2 * h_kv
    rot = 2 * half
    if not 0 < rot <= d:
        raise ValueError(f"{half} RoPE frequencies do not fit a head of {d}")
    rest = "" if rot == d else f"""
                    for j in T.vectorized({d - rot}):
                        out[s, h, j + {rot}] = qkv[s, h, j + {rot}]"""
    src = f'''
@D.prim_func(s_tir=True)
def rope_rows(var_qkv: T.handle, var_positions: T.handle, var_out: T.handle):
    T.func_attr({{"global_symbol": "rope_rows", "tir.noalias": True, "tirx.is_scheduled": True}})
    n = T.int64()
    qkv = T.match_buffer(var_qkv, (n, {heads}, {d}), "float32")
    positions = T.match_buffer(var_positions, (n,), "int32", offset_factor=1)
    out = T.match_buffer(var_out, (n, {heads}, {d}), "float32")
    with T.sblock("root"):
        for s in T.parallel(n):
            with T.sblock("token"):
                f = T.sblock_alloc_buffer(({half},), "float32", scope="global")
                cs = T.sblock_alloc_buffer(({rot},), "float32", scope="global")
                sn = T.sblock_alloc_buffer(({rot},), "float32", scope="global")
{_angles(freqs, scale, "positions[s]")}
                for h in range({h_q + h_kv}):
                    for j in T.vectorized({half}):
                        out[s, h, j] = cs[j] * qkv[s, h, j] - sn[j] * qkv[s, h, j + {half}]
                        out[s, h, j + {half}] = cs[j] * qkv[s, h, j + {half}] + sn[j] * qkv[s, h, j]{rest}
                for h in range({h_kv}):
                    for j in T.vectorized({d}):
                        out[s, h + {h_q + h_kv}, j] = qkv[s, h + {h_q + h_kv}, j]
'''
    return parse_tvmscript(src)
