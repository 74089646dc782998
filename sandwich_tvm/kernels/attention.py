"""The paged KV cache's attention kernels for CPU, parallel and vectorized.

TVM's CPU versions of ``batch_prefill_ragged_kv`` and ``batch_decode_paged_kv_cpu`` are serial
scalar loop nests (at 512 tokens prefill attention was two thirds of llama-160m's prefill).
These kernels keep the signatures and semantics (scores in the log2 domain, the log-sum-exp
written for merging with the paged prefix) and are swapped in by
``compiler.kv_cache.replace_cache_kernels``.

Prefill works on tiles of ``ROWS`` query rows (two vectors of the ISA's fp32 lanes), a row
being one (token, head) of a KV head's group, so grouped-query heads share their K/V loads.
The rows are the vector lanes:

- Q is transposed once per tile (``qt[d, ROWS]``, pre-scaled by ``sm_scale·log2 e``), so a
  score block ``s[key, rows] += k[key, dd] · qt[dd, rows]`` is a broadcast-FMA register tile
  like the GEMM micro-kernel, and the softmax max, exp and sum are plain vector ops per key;
- keys come in blocks of ``KEYS`` with an online softmax; ``acc[dd, rows] += v[key, dd] ·
  p[key, rows]`` is the same register tile, ``DCOLS`` head-dim columns at a time;
- tiles run in zigzag order (0, n-1, 1, n-2, ...) so both threads get short and long causal rows.

Decode has one query token per sequence: a task is one (sequence, KV head), each key's K row
is loaded once for the whole head group, a score's lanes are summed by halving the vector
(log2 of the lanes vector adds, not a scalar add a lane), and the exp of a page's scores is
one vector op.

``exp2`` is a polynomial (|error| < 2e-7 relative) rather than libm's scalar call. The
buffers the FMA loops work on stay under 1 KB: TVM places those on the stack, where LLVM keeps
them in registers; larger ones are heap workspaces it cannot prove unaliased (the per-tile Q
and accumulator arrays are, and are touched once per key block).
"""

from __future__ import annotations

import textwrap
from functools import cache

from ..host import host_isa
from ..tvm_compat import parse_tvmscript, tvm
from .kv_int8 import quantize_row, row_width, scale_expr
from .microkernel import ISAS
from .vecmath import LOG2E, exp2, load_f32, store_as

KV_DTYPES = ("float32", "float16", "bfloat16", "int8")  # the cache's storage; kernels compute in fp32
DEFAULT_KV_DTYPE = "float16"  # llama.cpp's default: half the bytes of fp32 K/V, 10 mantissa bits
KEYS = 8    # keys per online-softmax step in prefill
KTILE = 4   # keys per score register tile: 4 keys x 2 vectors = 8 accumulators
DCOLS = 4   # head-dim columns per P.V register tile: 4 x 2 vectors


def check_kv_dtype(dtype: str) -> None:
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {dtype!r} is not one of {', '.join(KV_DTYPES)}")


def vector_lanes(isa: str, d: int) -> int:
    """fp32 lanes of the ISA's vectors, at most the largest power of two dividing ``d``."""
    lanes = ISAS[isa].lanes if isa in ISAS else 4
    while d % lanes:
        lanes //= 2
    return lanes


def _f32_buffers(**shapes: tuple[int, ...]) -> str:
    """TVMScript lines allocating a block's fp32 buffers, one per keyword."""
    return "".join(f'{name} = T.sblock_alloc_buffer({shape}, "float32", scope="global")\n'
                   for name, shape in shapes.items())


def _prefill_body(h_kv: int, group: int, d: int, ROWS: int, page: int = 0,  # noqa: N803
                  dtype: str = "float32", window: int = 0) -> str:
    """One tile of ``ROWS`` query rows against every visible key. ``page`` = 0: keys ragged in
    ``k``/``v`` (``kv_indptr``); else keys in the paged cache (``pages``, ``page_indptr``,
    ``page_values``, ``length_info``), each key block's pages and slots looked up once. Q, K, V
    and the output are ``dtype``; everything is computed in fp32. int8 rows (``kv_int8``): each
    row's scale is read once (q per row, k and v per key), K's applied to the key's scores and
    V's to its loads; the output row is quantized again. ``window`` > 0: a row sees only the
    last ``window`` positions, itself included (``lo[r]``, its first visible key: by index among
    a sequence's new keys, by position -- ``q_rope_position`` against the pages' first,
    ``k_rope_pos_offset`` -- in the pages), and key blocks before every row's are skipped (the
    least ``lo``: a paged chunk can hold several sequences' tokens, not in position order)."""
    q8 = dtype == "int8"
    qlen = "(q_indptr[b + 1] - q_indptr[b])"
    if page:
        npages = "(page_indptr[b + 1] - page_indptr[b])"
        klen = f"T.if_then_else({npages} > 0, ({npages} - 1) * {page} + length_info[b], 0)"
    else:
        klen = "(kv_indptr[b + 1] - kv_indptr[b])"
    rows = f"({qlen} * {group})"
    ntiles = f"(({rows} + {ROWS - 1}) // {ROWS})"
    i = f"(task // {h_kv})"
    tile, kvh = f"T.if_then_else({i} % 2 == 0, {i} // 2, {ntiles} - 1 - {i} // 2)", f"(task % {h_kv})"
    row = f"T.min({tile} * {ROWS} + r, {rows} - 1)"  # rows past the end repeat the last one
    qrow = "q[q_indptr[b] + tok[r], hd[r], {}]"
    qload = load_f32(qrow.format("dd"), dtype) + (" * qsc[r]" if q8 else "")
    if page:
        krow, vrow = (f"pages[kp[{{j}}], {t}, {kvh}, ks[{{j}}], {{{{}}}}]" for t in (0, 1))
        keys = (f"kp[j] = page_values[page_indptr[b] + T.min(kb * {KEYS} + j, {klen} - 1) // {page}]\n"
                f"        ks[j] = T.min(kb * {KEYS} + j, {klen} - 1) % {page}")
    else:
        krow, vrow = f"k[ko[{{j}}], {kvh}, {{{{}}}}]", f"v[ko[{{j}}], {kvh}, {{{{}}}}]"
        keys = f"ko[j] = kv_indptr[b] + T.min(kb * {KEYS} + j, {klen} - 1)"
    kj = load_f32(krow.format(j=f"jt * {KTILE} + j").format("dd"), dtype)
    vj = load_f32(vrow.format(j="j").format(f"dc * {DCOLS} + c"), dtype) + (" * vsc[j]" if q8 else "")
    qscale, kscale, kapply, ostore = "", "", "", f"""for dd in range({d}):
            output[q_indptr[b] + tok[r], hd[r], dd] = {store_as("acc[dd, r] / sm[r]", dtype)}"""
    scales, first, lowest, kb0, seen = "", "", "", "0", ""
    if window:  # a tile may hold several sequences (TVM merges a shared block's): the least lo
        own = ("q_rope_position[q_indptr[b] + tok[r]] + 1 - k_rope_pos_offset[b]" if page else "vis[r]")
        first = f"\n    lo[r] = {own} - {window}"
        lowest = f"""lo0[0] = lo[0]
for r in range(1, {ROWS}):
    lo0[0] = T.min(lo0[0], lo[r])
"""
        kb0 = f"T.min(T.max(lo0[0], 0) // {KEYS}, (vis[{ROWS - 1}] + {KEYS - 1}) // {KEYS})"
        seen = " and kb * {KEYS} + j >= lo[r]".replace("{KEYS}", str(KEYS))
        scales = (f'lo = T.sblock_alloc_buffer(({ROWS},), "int32", scope="global")\n'
                  'lo0 = T.sblock_alloc_buffer((1,), "int32", scope="global")\n')
    if q8:
        scales += _f32_buffers(qsc=(ROWS,), ksc=(KEYS,), vsc=(KEYS,), ob=(d,), oz=(2,))
        qscale = f"\n    qsc[r] = {scale_expr(qrow, d)}"
        kscale = (f"\n        ksc[j] = {scale_expr(krow.format(j='j'), d)}"
                  f"\n        vsc[j] = {scale_expr(vrow.format(j='j'), d)}")
        kapply = f"""
        for j in T.unroll({KTILE}):
            for r in T.vectorized({ROWS}):
                s[jt * {KTILE} + j, r] = s[jt * {KTILE} + j, r] * ksc[jt * {KTILE} + j]"""
        ostore = f"""for dd in range({d}):
            ob[dd] = acc[dd, r] / sm[r]
{quantize_row("ob[{}]", "output[q_indptr[b] + tok[r], hd[r], {}]", d, "oz", 8)}"""
    return f'''
qt = T.sblock_alloc_buffer(({d}, {ROWS}), "float32", scope="global")
acc = T.sblock_alloc_buffer(({d}, {ROWS}), "float32", scope="global")
ar = T.sblock_alloc_buffer(({DCOLS}, {ROWS}), "float32", scope="global")
s = T.sblock_alloc_buffer(({KEYS}, {ROWS}), "float32", scope="global")
mx = T.sblock_alloc_buffer(({ROWS},), "float32", scope="global")
mn = T.sblock_alloc_buffer(({ROWS},), "float32", scope="global")
sc = T.sblock_alloc_buffer(({ROWS},), "float32", scope="global")
sm = T.sblock_alloc_buffer(({ROWS},), "float32", scope="global")
vis = T.sblock_alloc_buffer(({ROWS},), "int32", scope="global")
tok = T.sblock_alloc_buffer(({ROWS},), "int32", scope="global")
hd = T.sblock_alloc_buffer(({ROWS},), "int32", scope="global")
ko = T.sblock_alloc_buffer(({KEYS},), "int32", scope="global")
kp = T.sblock_alloc_buffer(({KEYS},), "int32", scope="global")
ks = T.sblock_alloc_buffer(({KEYS},), "int32", scope="global")
{scales}for r in range({ROWS}):
    tok[r] = {row} // {group}
    hd[r] = {kvh} * {group} + {row} % {group}{qscale}
    vis[r] = T.if_then_else(causal > 0, {klen} - {qlen} + tok[r] + 1, {klen}){first}
    mx[r] = T.float32(-5e4)
    sm[r] = T.float32(1)
{lowest}for dd in range({d}):
    for r in range({ROWS}):
        qt[dd, r] = {qload} * sm_scale * T.float32({LOG2E!r})
        acc[dd, r] = T.float32(0)
for kb in range({kb0}, (vis[{ROWS - 1}] + {KEYS - 1}) // {KEYS}):
    for j in range({KEYS}):
        {keys}{kscale}
    for jt in range({KEYS // KTILE}):
        for j in T.unroll({KTILE}):
            for r in T.vectorized({ROWS}):
                s[jt * {KTILE} + j, r] = T.float32(0)
        for dd in range({d}):
            for j in T.unroll({KTILE}):
                for r in T.vectorized({ROWS}):
                    s[jt * {KTILE} + j, r] = s[jt * {KTILE} + j, r] + {kj} * qt[dd, r]{kapply}
    for r in T.vectorized({ROWS}):
        mn[r] = mx[r]
    for j in range({KEYS}):
        for r in T.vectorized({ROWS}):
            s[j, r] = T.if_then_else(kb * {KEYS} + j < vis[r]{seen}, s[j, r], T.float32(-1e30))
            mn[r] = T.max(mn[r], s[j, r])
    for r in T.vectorized({ROWS}):
        sc[r] = T.max(mx[r] - mn[r], T.float32(-126))
        sc[r] = {exp2("sc[r]")}
        sm[r] = sm[r] * sc[r]
        mx[r] = mn[r]
    for j in range({KEYS}):
        for r in T.vectorized({ROWS}):
            s[j, r] = T.max(s[j, r] - mn[r], T.float32(-126))
            s[j, r] = {exp2("s[j, r]")}
            sm[r] = sm[r] + s[j, r]
    for dc in range({d // DCOLS}):
        for c in T.unroll({DCOLS}):
            for r in T.vectorized({ROWS}):
                ar[c, r] = acc[dc * {DCOLS} + c, r] * sc[r]
        for j in range({KEYS}):
            for c in T.unroll({DCOLS}):
                for r in T.vectorized({ROWS}):
                    ar[c, r] = ar[c, r] + {vj} * s[j, r]
        for c in T.unroll({DCOLS}):
            for r in T.vectorized({ROWS}):
                acc[dc * {DCOLS} + c, r] = ar[c, r]
for r in range({ROWS}):
    if {tile} * {ROWS} + r < {rows}:
        {ostore}
        lse[q_indptr[b] + tok[r], hd[r]] = mx[r] + T.log2(sm[r])
'''


def ragged_prefill_source(h_kv: int, h_q: int, d: int, dtype: str, root: str) -> str:
    """TVMScript of ``batch_prefill_ragged_kv`` (the signature the KV cache calls) whose root
    block holds the statements ``root``."""
    w = row_width(d, dtype)
    return f'''
@D.prim_func(s_tir=True)
def batch_prefill_ragged_kv(var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle,
                            var_kv_indptr: T.handle, var_q_rope_position: T.handle,
                            var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
                            causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32,
                            rope_theta: T.float32, sm_scale: T.float32):
    T.func_attr({{"global_symbol": "batch_prefill_ragged_kv", "tir.noalias": True,
                 "tirx.is_scheduled": True}})
    batch_size = T.int32()
    qo_len = T.int32()
    kv_len = T.int32()
    q_off = T.int32()
    kv_off = T.int32()
    qr_off = T.int32()
    kr_off = T.int32()
    q = T.match_buffer(var_q, (qo_len, {h_q}, {w}), "{dtype}")
    q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_off)
    k = T.match_buffer(var_k, (kv_len, {h_kv}, {w}), "{dtype}")
    v = T.match_buffer(var_v, (kv_len, {h_kv}, {w}), "{dtype}")
    kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_off)
    q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=qr_off)
    k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=kr_off)
    output = T.match_buffer(var_output, (qo_len, {h_q}, {w}), "{dtype}")
    lse = T.match_buffer(var_lse, (qo_len, {h_q}), "float32")
    with T.sblock("root"):
{textwrap.indent(root.strip(chr(10)), " " * 8)}
'''


@cache
def prefill_ragged_primfunc(h_kv: int, h_q: int, d: int, dtype: str = "float32",
                            isa: str | None = None, window: int = 0) -> tvm.tirx.PrimFunc:
    """``batch_prefill_ragged_kv``: every sequence's new tokens against its new keys (within a
    sliding ``window`` of positions where one is given)."""
    check_kv_dtype(dtype)
    if d % DCOLS:
        raise ValueError(f"attention kernel needs head_dim % {DCOLS} == 0 (got {d})")
    group, rows = h_q // h_kv, 2 * ISAS[isa or host_isa()].lanes
    ntiles = f"((q_indptr[b + 1] - q_indptr[b]) * {group} + {rows - 1}) // {rows}"
    body = textwrap.indent(_prefill_body(h_kv, group, d, rows, dtype=dtype, window=window), " " * 12)
    root = f'''
for b in range(batch_size):
    for task in T.parallel(({ntiles}) * {h_kv}):
        with T.sblock("tile"):
{body}'''
    src = ragged_prefill_source(h_kv, h_q, d, dtype, root)
    return parse_tvmscript(src)


def paged_prefill_source(h_kv: int, h_q: int, d: int, page: int, dtype: str, root: str) -> str:
    """TVMScript of ``batch_prefill_paged_kv_cpu`` (the signature the KV cache calls) whose root
    block holds the statements ``root``."""
    w = row_width(d, dtype)
    return f'''
@D.prim_func(s_tir=True)
def batch_prefill_paged_kv_cpu(var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle,
                               var_page_indptr: T.handle, var_page_values: T.handle,
                               var_length_info: T.handle,
                               var_k_rope_pos_offset: T.handle, var_q_rope_position: T.handle,
                               var_output: T.handle, var_lse: T.handle, causal: T.int32, rotary_mode: T.int32,
                               rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
    T.func_attr({{"global_symbol": "batch_prefill_paged_kv_cpu", "tir.noalias": True,
                 "tirx.is_scheduled": True}})
    batch_size = T.int32()
    total_len = T.int32()
    nnz_pages = T.int32()
    max_num_pages = T.int32()
    o1 = T.int32()
    o2 = T.int32()
    o3 = T.int32()
    o4 = T.int32()
    o5 = T.int32()
    o6 = T.int32()
    q = T.match_buffer(var_q, (total_len, {h_q}, {w}), "{dtype}")
    q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=o1)
    pages = T.match_buffer(var_pages, (max_num_pages, 2, {h_kv}, {page}, {w}), "{dtype}")
    page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=o2)
    page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=o3)
    length_info = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=o4)
    k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=o5)
    q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=o6)
    output = T.match_buffer(var_output, (total_len, {h_q}, {w}), "{dtype}")
    lse = T.match_buffer(var_lse, (total_len, {h_q}), "float32")
    with T.sblock("root"):
{textwrap.indent(root.strip(chr(10)), " " * 8)}
'''


@cache
def prefill_paged_primfunc(h_kv: int, h_q: int, d: int, page: int = 16, isa: str | None = None,
                           dtype: str = "float32", window: int = 0) -> tvm.tirx.PrimFunc:
    """``batch_prefill_paged_kv_cpu``: every sequence's new tokens against the keys already in
    its pages (a chunked prompt's earlier chunks), with the log-sum-exp the cache merges with
    the ragged part; ``window`` > 0, only the keys within that many positions of each token.
    TVM's CPU version walks every page of the whole cache, serially, for each query row and head."""
    check_kv_dtype(dtype)
    if d % DCOLS:
        raise ValueError(f"attention kernel needs head_dim % {DCOLS} == 0 (got {d})")
    group, rows = h_q // h_kv, 2 * ISAS[isa or host_isa()].lanes
    ntiles = f"((q_indptr[b + 1] - q_indptr[b]) * {group} + {rows - 1}) // {rows}"
    body = textwrap.indent(_prefill_body(h_kv, group, d, rows, page, dtype, window), " " * 12)
    root = f'''
for b in range(batch_size):
    for task in T.parallel(({ntiles}) * {h_kv}):
        with T.sblock("tile"):
{body}'''
    src = paged_prefill_source(h_kv, h_q, d, page, dtype, root)
    return parse_tvmscript(src)


def _decode_body(h_kv: int, group: int, d: int, page: int, split: int, LANES: int,  # noqa: N803
                 dtype: str = "float32", window: int = 0) -> str:
    """One chunk of one sequence's pages. ``window`` > 0: the chunks cut only the pages that
    hold a key within ``window`` positions of the query (``lo[0]``, the first such key), and a
    page's keys before it are masked."""
    h_q = h_kv * group
    b, c = f"(task // {split})", f"(task % {split})"
    npages = f"(page_table_indptr[{b} + 1] - page_table_indptr[{b}])"
    first, pages_from, seen, masked = "", "0", "", "s[h, j]"
    if window:
        first = (f'lo = T.sblock_alloc_buffer((1,), "int32", scope="global")\n'
                 f"lo[0] = q_rope_position[{b}] + 1 - k_rope_pos_offset[{b}] - {window}\n")
        pages_from = f"T.min(T.max(lo[0], 0) // {page}, {npages})"
        seen = f" and p * {page} + j >= lo[0]"
        masked = f"T.if_then_else(p * {page} + j >= lo[0], s[h, j], T.float32(-1e30))"
    span = f"({npages} - {pages_from})"
    keys = f"T.if_then_else(p == {npages} - 1, length_info[{b}], {page})"
    base = f"page_table_values[page_table_indptr[{b}] + p]"
    hq, i = f"kvh * {group} + h", f"dd * {LANES} + l"
    halves, width = [], LANES  # the lanes summed by halving vectors (~2 ops a step), not one by one
    while width > 2:
        width //= 2
        halves.append(f"""
            for h in T.unroll({group}):
                for l in T.vectorized({width}):
                    part[h, l] = part[h, l] + part[h, l + {width}]""")
    dots = " + ".join(f"part[h, {lane}]" for lane in range(min(width, LANES)))
    qi, ki = load_f32(f"Q[{b}, {hq}, {i}]", dtype), load_f32(f"pages[{base}, 0, kvh, j, {i}]", dtype)
    vi = load_f32(f"pages[{base}, 1, kvh, j, i]", dtype)
    scales, qscale, kscale, qk = "", "", "", f"sm_scale * T.float32({LOG2E!r})"
    if dtype == "int8":  # q scaled per head, K per key on its score, V per key on its loads
        scales = _f32_buffers(qsc=(h_q,), kvs=(2, page))
        qscale = f"\n    qsc[h] = {scale_expr(f'Q[{b}, h, {{}}]', d)}"
        kscale = "".join(f"\n            kvs[{t}, j] = {scale_expr(f'pages[{base}, {t}, kvh, j, {{}}]', d)}"
                         for t in (0, 1))
        qk, vi = f"{qk} * qsc[{hq}] * kvs[0, j]", f"{vi} * kvs[1, j]"
    return f'''
part = T.sblock_alloc_buffer(({group}, {LANES}), "float32", scope="global")
s = T.sblock_alloc_buffer(({group}, {page}), "float32", scope="global")
ar = T.sblock_alloc_buffer(({d},), "float32", scope="global")
mx = T.sblock_alloc_buffer(({h_q},), "float32", scope="global")
sm = T.sblock_alloc_buffer(({h_q},), "float32", scope="global")
mn = T.sblock_alloc_buffer(({group},), "float32", scope="global")
sc = T.sblock_alloc_buffer(({group},), "float32", scope="global")
{scales}{first}for h in range({h_q}):{qscale}
    mx[h] = T.float32(-5e4)
    sm[h] = T.float32(1)
    for i in T.vectorized({d}):
        cacc[{b}, {c}, h, i] = T.float32(0)
for p in range({pages_from} + {span} * {c} // {split}, {pages_from} + {span} * ({c} + 1) // {split}):
    for kvh in range({h_kv}):
        for j in range({keys}):{kscale}
            for h in T.unroll({group}):
                for l in T.vectorized({LANES}):
                    part[h, l] = T.float32(0)
            for dd in T.unroll({d // LANES}):
                for h in T.unroll({group}):
                    for l in T.vectorized({LANES}):
                        part[h, l] = part[h, l] + {qi} * {ki}{"".join(halves)}
            for h in T.unroll({group}):
                s[h, j] = ({dots}) * {qk}
        for h in range({group}):
            mn[h] = mx[{hq}]
            for j in range({keys}):
                mn[h] = T.max(mn[h], {masked})
            sc[h] = T.max(mx[{hq}] - mn[h], T.float32(-126))
            sc[h] = {exp2("sc[h]")}
            mx[{hq}] = mn[h]
            for j in T.vectorized({page}):
                s[h, j] = T.max(s[h, j] - mn[h], T.float32(-126))
                s[h, j] = T.if_then_else(j < {keys}{seen}, {exp2("s[h, j]")}, T.float32(0))
            sm[{hq}] = sm[{hq}] * sc[h]
            for j in range({page}):
                sm[{hq}] = sm[{hq}] + s[h, j]
            for i in T.vectorized({d}):
                ar[i] = cacc[{b}, {c}, {hq}, i] * sc[h]
            for j in range({keys}):
                for i in T.vectorized({d}):
                    ar[i] = ar[i] + s[h, j] * {vi}
            for i in T.vectorized({d}):
                cacc[{b}, {c}, {hq}, i] = ar[i]
for h in range({h_q}):
    cmx[{b}, {c}, h] = mx[h]
    csm[{b}, {c}, h] = sm[h]
'''


def _merge_body(h_q: int, d: int, split: int, dtype: str = "float32") -> str:
    """Combine the chunks' (max, sum, accumulator) of one (sequence, head)."""
    b, h = f"(task // {h_q})", f"(task % {h_q})"
    store = f"""for i in T.vectorized({d}):
    output[{b}, {h}, i] = {store_as("o[i] / st[1]", dtype)}"""
    if dtype == "int8":
        store = f"""oz = T.sblock_alloc_buffer((2,), "float32", scope="global")
for i in T.vectorized({d}):
    o[i] = o[i] / st[1]
{quantize_row("o[{}]", f"output[{b}, {h}, {{}}]", d, "oz")}"""
    return f'''
w = T.sblock_alloc_buffer(({split},), "float32", scope="global")
st = T.sblock_alloc_buffer((2,), "float32", scope="global")
o = T.sblock_alloc_buffer(({d},), "float32", scope="global")
st[0] = cmx[{b}, 0, {h}]
for c in range(1, {split}):
    st[0] = T.max(st[0], cmx[{b}, c, {h}])
st[1] = T.float32(0)
for i in T.vectorized({d}):
    o[i] = T.float32(0)
for c in range({split}):
    w[c] = T.max(cmx[{b}, c, {h}] - st[0], T.float32(-126))
    w[c] = {exp2("w[c]")}
    st[1] = st[1] + w[c] * csm[{b}, c, {h}]
    for i in T.vectorized({d}):
        o[i] = o[i] + w[c] * cacc[{b}, c, {h}, i]
{store}
lse[{b}, {h}] = st[0] + T.log2(st[1])
'''


@cache
def decode_paged_primfunc(h_kv: int, h_q: int, d: int, page: int = 16, split: int = 4,
                          isa: str | None = None, dtype: str = "float32",
                          window: int = 0) -> tvm.tirx.PrimFunc:
    """``batch_decode_paged_kv_cpu``: one query token per sequence against its paged K/V (the
    last ``window`` positions where one is given), each sequence's pages cut into ``split``
    chunks that run in parallel."""
    check_kv_dtype(dtype)
    group, lanes = h_q // h_kv, vector_lanes(isa or host_isa(), d)
    body = textwrap.indent(_decode_body(h_kv, group, d, page, split, lanes, dtype, window), " " * 16)
    merge = textwrap.indent(_merge_body(h_q, d, split, dtype), " " * 16)
    w = row_width(d, dtype)
    src = f'''
@D.prim_func(s_tir=True)
def batch_decode_paged_kv_cpu(Q_handle: T.handle, pages_handle: T.handle, page_table_indptr_handle: T.handle,
                              page_table_values_handle: T.handle, var_length_info: T.handle,
                              k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
                              output_handle: T.handle, lse_handle: T.handle, rotary_mode: T.int32,
                              rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32):
    T.func_attr({{"global_symbol": "batch_decode_paged_kv_cpu", "tir.noalias": True,
                 "tirx.is_scheduled": True}})
    B = T.int32()
    nnz_pages = T.int32()
    max_num_pages = T.int32()
    o1 = T.int32()
    o2 = T.int32()
    o3 = T.int32()
    o4 = T.int32()
    o5 = T.int32()
    Q = T.match_buffer(Q_handle, (B, {h_q}, {w}), "{dtype}")
    pages = T.match_buffer(pages_handle, (max_num_pages, 2, {h_kv}, {page}, {w}), "{dtype}")
    page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=o1)
    page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32", elem_offset=o2)
    k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=o3)
    q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=o4)
    output = T.match_buffer(output_handle, (B, {h_q}, {w}), "{dtype}")
    lse = T.match_buffer(lse_handle, (B, {h_q}), "float32")
    length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=o5)
    with T.sblock("root"):
        cacc = T.sblock_alloc_buffer((B, {split}, {h_q}, {d}), "float32")
        cmx = T.sblock_alloc_buffer((B, {split}, {h_q}), "float32")
        csm = T.sblock_alloc_buffer((B, {split}, {h_q}), "float32")
        for task in T.parallel(B * {split}):
            with T.sblock("chunk"):
{body}
        for task in T.parallel(B * {h_q}):
            with T.sblock("merge"):
{merge}
'''
    return parse_tvmscript(src)
