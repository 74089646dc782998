"""Prefill self-attention for the paged KV cache's ragged (in-chunk) step, parallel and vectorized.

TVM's CPU version of ``batch_prefill_ragged_kv`` is one serial scalar loop nest that scores
every (query, key) pair, masked or not: at 512 tokens it took two thirds of llama-160m's
prefill. This kernel has the same signature and semantics (scores in the log2 domain, the
log-sum-exp written for merging with the paged prefix) and is swapped in by the
``ReplaceAttention`` pass:

- (query row, head) pairs run in parallel (rows in zigzag order to balance the causal
  triangle over the threads); each walks only the keys the causal mask allows,
  in blocks of ``BLOCK`` keys with an online softmax (one rescale of the accumulator per block);
- the dot products use 8-lane partial sums and the P·V update is vectorized over the head dim.

RoPE is applied by the cache before attention (``RopeMode.NORMAL``), so ``rotary_mode`` is 0.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from functools import cache

from ..tvm_compat import T, tvm
from .config import LlamaConfig
from .rope import rope_primfunc

BLOCK = 16
LANES = 8
LOG2E = math.log2(math.e)


def _attend(d: int, block: int, outer: str, inner: str, guard: str | None,
            q: Callable[[str], str], k: Callable[[str], str], v: Callable[[str], str],
            out: Callable[[str], str], lse: str) -> str:
    """One query row against its keys, ``block`` keys per online-softmax step (TVMScript lines).

    ``outer`` loops over key blocks, ``inner`` over the keys of one block (``j``); ``guard``
    masks keys past the visible ones. ``q``/``k``/``v``/``out`` map a head-dim index to an access.
    State: st = (running max, running sum, block max, rescale); sum starts at 1 with max -5e4 as
    in TVM's kernels, so the phantom term vanishes at the first real key (exp2(-5e4 - m) = 0).
    """
    dots = " + ".join(f"part[{lane}]" for lane in range(LANES))
    lane = f"dd * {LANES} + l"
    score = [f"for l in T.vectorized({LANES}):", "    part[l] = T.float32(0)",
             f"for dd in range({d // LANES}):", f"    for l in T.vectorized({LANES}):",
             f"        part[l] = part[l] + {q(lane)} * {k(lane)}",
             f"s[j] = ({dots}) * sm_scale * T.float32({LOG2E!r})", "st[2] = T.max(st[2], s[j])"]
    update = ["s[j] = T.exp2(s[j] - st[0])", "st[1] = st[1] + s[j]",
              f"for i in T.vectorized({d}):", f"    acc[i] = acc[i] + s[j] * {v('i')}"]
    if guard:
        score = [f"if {guard}:", *_ind(score), "else:", "    s[j] = T.float32(-1e30)"]
        update = [f"if {guard}:", *_ind(update)]
    lines = [
        f'acc = T.sblock_alloc_buffer(({d},), "float32", scope="global")',
        f'part = T.sblock_alloc_buffer(({LANES},), "float32", scope="global")',
        f's = T.sblock_alloc_buffer(({block},), "float32", scope="global")',
        'st = T.sblock_alloc_buffer((4,), "float32", scope="global")',
        f"for i in T.vectorized({d}):", "    acc[i] = T.float32(0)",
        "st[0] = T.float32(-5e4)", "st[1] = T.float32(1)",
        outer, "    st[2] = st[0]", f"    {inner}", *_ind(score, 2),
        "    st[3] = T.exp2(st[0] - st[2])", "    st[1] = st[1] * st[3]",
        f"    for i in T.vectorized({d}):", "        acc[i] = acc[i] * st[3]", "    st[0] = st[2]",
        f"    {inner}", *_ind(update, 2),
        f"for i in T.vectorized({d}):", f"    {out('i')} = acc[i] / st[1]",
        f"{lse} = st[0] + T.log2(st[1])",
    ]
    return "\n".join(lines)


def _ind(lines: list[str], levels: int = 1) -> list[str]:
    return ["    " * levels + ln for ln in lines]


@cache
def prefill_ragged_primfunc(h_kv: int, h_q: int, d: int, dtype: str = "float32") -> tvm.tirx.PrimFunc:
    if dtype != "float32" or d % LANES:
        raise ValueError(f"attention kernel needs float32 and head_dim % {LANES} == 0 (got {dtype}, {d})")
    group = h_q // h_kv
    qlen, klen = "(q_indptr[b + 1] - q_indptr[b])", "(kv_indptr[b + 1] - kv_indptr[b])"
    # Rows in zigzag order (0, n-1, 1, n-2, ...): TVM splits the parallel loop into contiguous
    # chunks, and causal rows grow in cost, so each thread gets both short and long rows.
    i = f"(task // {h_q})"
    row, head = f"T.if_then_else({i} % 2 == 0, {i} // 2, {qlen} - 1 - {i} // 2)", f"task % {h_q}"
    # Keys this query row may see: a causal row r sees klen - qlen + r + 1 keys.
    visible = f"T.if_then_else(causal > 0, {klen} - {qlen} + {row} + 1, {klen})"
    key = f"kv_indptr[b] + kb * {BLOCK} + j"
    qrow, kvh = f"q_indptr[b] + {row}", f"{head} // {group}"
    body = textwrap.indent(_attend(
        d, BLOCK, f"for kb in range(({visible} + {BLOCK - 1}) // {BLOCK}):", f"for j in range({BLOCK}):",
        f"kb * {BLOCK} + j < {visible}",
        q=lambda i: f"q[{qrow}, {head}, {i}]", k=lambda i: f"k[{key}, {kvh}, {i}]",
        v=lambda i: f"v[{key}, {kvh}, {i}]", out=lambda i: f"output[{qrow}, {head}, {i}]",
        lse=f"lse[{qrow}, {head}]"), " " * 20)
    src = f'''
@T.prim_func(s_tir=True)
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
    q = T.match_buffer(var_q, (qo_len, {h_q}, {d}), "float32")
    q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_off)
    k = T.match_buffer(var_k, (kv_len, {h_kv}, {d}), "float32")
    v = T.match_buffer(var_v, (kv_len, {h_kv}, {d}), "float32")
    kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_off)
    q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32", elem_offset=qr_off)
    k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=kr_off)
    output = T.match_buffer(var_output, (qo_len, {h_q}, {d}), "float32")
    lse = T.match_buffer(var_lse, (qo_len, {h_q}), "float32")
    with T.sblock("root"):
        for b in range(batch_size):
            for task in T.parallel({qlen} * {h_q}):
                with T.sblock("row"):
{body}
'''
    return tvm.script.from_source(src, extra_vars={"T": T})


@cache
def decode_paged_primfunc(h_kv: int, h_q: int, d: int, page: int = 16) -> tvm.tirx.PrimFunc:
    """``batch_decode_paged_kv_cpu`` (no sliding window): one query token per sequence against
    its paged K/V; (sequence, head) pairs in parallel, one page (``page`` keys) per softmax
    block, the same vector dot products and P·V update as the prefill kernel."""
    group = h_q // h_kv
    b, head = f"(task // {h_q})", f"(task % {h_q})"
    kvh = f"{head} // {group}"
    npages = f"(page_table_indptr[{b} + 1] - page_table_indptr[{b}])"
    rows = f"T.if_then_else(p == {npages} - 1, length_info[{b}], {page})"
    page_no = f"page_table_values[page_table_indptr[{b}] + p]"
    body = textwrap.indent(_attend(
        d, page, f"for p in range({npages}):", f"for j in range({rows}):", None,
        q=lambda i: f"Q[{b}, {head}, {i}]", k=lambda i: f"pages[{page_no}, 0, {kvh}, j, {i}]",
        v=lambda i: f"pages[{page_no}, 1, {kvh}, j, {i}]", out=lambda i: f"output[{b}, {head}, {i}]",
        lse=f"lse[{b}, {head}]"), " " * 16)
    src = f'''
@T.prim_func(s_tir=True)
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
    Q = T.match_buffer(Q_handle, (B, {h_q}, {d}), "float32")
    pages = T.match_buffer(pages_handle, (max_num_pages, 2, {h_kv}, {page}, {d}), "float32")
    page_table_indptr = T.match_buffer(page_table_indptr_handle, (B + 1,), "int32", elem_offset=o1)
    page_table_values = T.match_buffer(page_table_values_handle, (nnz_pages,), "int32", elem_offset=o2)
    k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=o3)
    q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=o4)
    output = T.match_buffer(output_handle, (B, {h_q}, {d}), "float32")
    lse = T.match_buffer(lse_handle, (B, {h_q}), "float32")
    length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=o5)
    with T.sblock("root"):
        for task in T.parallel(B * {h_q}):
            with T.sblock("seq_head"):
{body}
'''
    return tvm.script.from_source(src, extra_vars={"T": T})


def replace_cache_kernels(mod: tvm.IRModule, cfg: LlamaConfig) -> tvm.IRModule:
    """Swap the KV cache's ragged prefill attention and its RoPE for ours (same names and
    signatures, so the cache's runtime calls them unchanged)."""
    ours = {"batch_prefill_ragged_kv": prefill_ragged_primfunc(cfg.num_key_value_heads,
                                                               cfg.num_attention_heads, cfg.head_dim),
            "batch_decode_paged_kv_cpu": decode_paged_primfunc(cfg.num_key_value_heads,
                                                               cfg.num_attention_heads, cfg.head_dim),
            "fused_rope": rope_primfunc(cfg)}
    for gv, func in list(mod.functions_items()):
        if gv.name_hint in ours and isinstance(func, tvm.tirx.PrimFunc):
            new = ours[gv.name_hint]
            if len(new.params) != len(func.params):
                raise RuntimeError(f"TVM's {gv.name_hint} signature changed; update sandwich_tvm/model")
            mod[gv] = new
    return mod
