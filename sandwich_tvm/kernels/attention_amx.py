"""Prefill attention on AMX tiles, for bf16 models on CPUs with ``amx_bf16``.

Same signatures and semantics as ``attention.prefill_ragged_primfunc`` and
``prefill_paged_primfunc`` (scores in the log2 domain, the log2-sum-exp for merging the new
keys' part with the paged prefix's); Q, K, P and V are rounded to
bf16 for ``tdpbf16ps`` (what torch's bf16 SDPA feeds oneDNN), sums and softmax stay fp32.

Everything is computed transposed, so a vector lane is a query row as in the fp32 kernel and
the softmax needs no horizontal reductions. Per sequence, K and V (ragged, or gathered from its
pages) are packed once into tiles:
``Ka[head, 16 keys, 16 d-pairs]`` (A operand) and ``Va[head, 16 d, 16 key-pairs]`` (A operand).
A task is a tile of 16 query rows (token, head of the group) of one KV head:

- ``qb[16 d-pairs, 16 rows]`` is Q transposed, pre-scaled by ``sm_scale·log2 e`` (B operand;
  each row is rounded to bf16 words in one vector pass, ``qw``, then the pairs transposed);
- keys come in chunks of ``CHUNK``: ``Sᵀ[key, row] = Ka · qb``, 16 keys per accumulator tile,
  stored to ``st``; the online softmax runs on ``st`` with rows as lanes, and writes ``Pᵀ`` as
  bf16 key pairs ``pb[key pair, row]`` (a B operand again);
- ``Oᵀ[d, row] += Va · pb`` in up to four accumulator tiles (16 d each); the chunk's ``Oᵀ`` is
  added to the fp32 accumulator after rescaling it by the chunk's change of the running max.

Tile registers: S phase, 0 = Sᵀ, 1.. = Q (d / 32 tiles), then two K tiles alternating; PV
phase, 0..3 = Oᵀ, 4 = Pᵀ, 5 and 6 = V alternating.
"""

from __future__ import annotations

import functools
import textwrap
from functools import cache

from ..tvm_compat import parse_tvmscript, tvm
from .amx import PAIRS, TILE_BYTES, TILE_ROWS, amx, tile_config
from .attention import check_kv_dtype, paged_prefill_source, ragged_prefill_source
from .vecmath import LOG2E, bf16_bits, bf16_pair, exp2

CHUNK = 256  # keys per online-softmax step (a multiple of 32: whole key-pair tiles)
O_TILES = 4  # accumulator tiles of Oᵀ per pass over the chunk's P (16 head-dim rows each)
CHAINS = 4  # independent max / sum chains over a chunk's keys (one would wait on each add)


def supports(d: int) -> bool:
    """Whether the AMX kernel handles head dim ``d`` (whole 32-value Q tiles, at most 4 of them)."""
    return d % (2 * PAIRS) == 0 and d // (2 * PAIRS) <= 4


def _body(h_kv: int, group: int, d: int, dtype: str, klen: str) -> str:
    """One task: 16 query rows of one KV head against every visible key of sequence ``b``."""
    R = TILE_ROWS  # noqa: N806 - query rows per task, the tile height
    nq, kc16, kc32 = d // (2 * PAIRS), CHUNK // 16, CHUNK // 32
    qlen = "(q_indptr[b + 1] - q_indptr[b])"
    n32 = f"((T.min({CHUNK}, vis[{TILE_ROWS - 1}] - ch * {CHUNK}) + 31) // 32)"  # key-pair tiles
    rows = f"({qlen} * {group})"
    ntiles = f"(({rows} + {R - 1}) // {R})"
    i = f"(task // {h_kv})"
    tile, kvh = f"T.if_then_else({i} % 2 == 0, {i} // 2, {ntiles} - 1 - {i} // 2)", f"(task % {h_kv})"
    row = f"T.min({tile} * {R} + r, {rows} - 1)"  # rows past the end repeat the last one
    scale = f"sm_scale * T.float32({LOG2E!r})"

    def qv(c: str) -> str:
        return f'T.Cast("float32", q[q_indptr[b] + tok[r], hd[r], {c}]) * {scale}'

    s_phase = [amx("tileloadd64", 1 + j, f"T.address_of(qb[{j * PAIRS}, 0])", f"T.int64({TILE_BYTES})")
               for j in range(nq)]
    s_phase += [f"for kt in range({n32} * 2):", "    " + amx("tilezero", 0)]
    for j in range(nq):
        kreg = 1 + nq + j % 2
        s_phase += ["    " + amx("tileloadd64", kreg, f"T.address_of(Ka[{kvh}, ch * {kc16} + kt, {j}, 0, 0])",
                                 f"T.int64({TILE_BYTES})"),
                    "    " + amx("tdpbf16ps", 0, kreg, 1 + j)]
    s_phase += ["    " + amx("tilestored64", 0, "T.address_of(st[kt * 16, 0])", f"T.int64({TILE_BYTES})")]

    pv_phase = []
    for g0 in range(0, d // 16, O_TILES):
        group_tiles = range(g0, min(g0 + O_TILES, d // 16))
        pv_phase += [amx("tilezero", t - g0) for t in group_tiles]
        pv_phase += [f"for kp in range({n32}):",
                     "    " + amx("tileloadd64", 4, "T.address_of(pb[kp * 16, 0])", f"T.int64({TILE_BYTES})")]
        for t in group_tiles:
            vreg = 5 + (t - g0) % 2
            v_tile = f"T.address_of(Va[{kvh}, ch * {kc32} + kp, {t}, 0, 0])"
            pv_phase += ["    " + amx("tileloadd64", vreg, v_tile, f"T.int64({TILE_BYTES})"),
                         "    " + amx("tdpbf16ps", t - g0, vreg, 4)]
        pv_phase += [amx("tilestored64", t - g0, f"T.address_of(oc[{t * 16}, 0])", f"T.int64({TILE_BYTES})")
                     for t in group_tiles]

    j, j2 = f"jq * {CHAINS} + u", f"jq * {CHAINS} + 2 * u"  # key of chain u; first key of pair u

    def fold(op: str) -> str:  # the chains' partial maxima or sums, combined: op is "{a} + {b}"...
        return functools.reduce(lambda a, b: op.format(a=a, b=b), [f"part[{u}, r]" for u in range(CHAINS)])

    def ind(lines: list[str], n: int) -> str:
        return "\n".join("    " * n + ln for ln in lines)

    return f'''
qw = T.sblock_alloc_buffer(({R}, {d}), "uint16")
qb = T.sblock_alloc_buffer(({d // 2}, {R}), "uint32")
st = T.sblock_alloc_buffer(({CHUNK}, {R}), "float32")
pb = T.sblock_alloc_buffer(({CHUNK // 2}, {R}), "uint32")
oc = T.sblock_alloc_buffer(({d}, {R}), "float32")
acc = T.sblock_alloc_buffer(({d}, {R}), "float32")
mx = T.sblock_alloc_buffer(({R},), "float32", scope="global")
mn = T.sblock_alloc_buffer(({R},), "float32", scope="global")
part = T.sblock_alloc_buffer(({CHAINS}, {R}), "float32", scope="global")
al = T.sblock_alloc_buffer(({R},), "float32", scope="global")
sm = T.sblock_alloc_buffer(({R},), "float32", scope="global")
vis = T.sblock_alloc_buffer(({R},), "int32", scope="global")
tok = T.sblock_alloc_buffer(({R},), "int32", scope="global")
hd = T.sblock_alloc_buffer(({R},), "int32", scope="global")
{ind(tile_config(), 0)}
for r in range({R}):
    tok[r] = {row} // {group}
    hd[r] = {kvh} * {group} + {row} % {group}
    vis[r] = T.if_then_else(causal > 0, {klen} - {qlen} + tok[r] + 1, {klen})
    mx[r] = T.float32(-5e4)
    sm[r] = T.float32(1)
for r in range({R}):
    for c in T.vectorized({d}):
        qw[r, c] = T.Cast("uint16", {bf16_bits(qv("c"))})
for p, r in T.grid({d // 2}, {R}):
    qb[p, r] = T.Cast("uint32", qw[r, 2 * p]) | (T.Cast("uint32", qw[r, 2 * p + 1]) << T.uint32(16))
for dd in range({d}):
    for r in T.vectorized({R}):
        acc[dd, r] = T.float32(0)
for ch in range((vis[{R - 1}] + {CHUNK - 1}) // {CHUNK}):
{ind(s_phase, 1)}
    for u in T.unroll({CHAINS}):
        for r in T.vectorized({R}):
            part[u, r] = mx[r]
    for jq in range({n32} * {32 // CHAINS}):
        for u in T.unroll({CHAINS}):
            for r in T.vectorized({R}):
                st[{j}, r] = T.if_then_else(ch * {CHUNK} + {j} < vis[r], st[{j}, r], T.float32(-1e30))
                part[u, r] = T.max(part[u, r], st[{j}, r])
    for r in T.vectorized({R}):
        mn[r] = {fold("T.max({a}, {b})")}
        al[r] = T.max(mx[r] - mn[r], T.float32(-126))
        al[r] = {exp2("al[r]")}
        mx[r] = mn[r]
    for u in T.unroll({CHAINS}):
        for r in T.vectorized({R}):
            part[u, r] = T.float32(0)
    for jq in range({n32} * {32 // CHAINS}):
        for u in T.unroll({CHAINS}):
            for r in T.vectorized({R}):
                st[{j}, r] = T.max(st[{j}, r] - mn[r], T.float32(-126))
                st[{j}, r] = {exp2(f"st[{j}, r]")}
                part[u, r] = part[u, r] + st[{j}, r]
        for u in T.unroll({CHAINS // 2}):
            for r in T.vectorized({R}):
                pb[jq * {CHAINS // 2} + u, r] = {bf16_pair(f"st[{j2}, r]", f"st[{j2} + 1, r]")}
    for r in T.vectorized({R}):
        sm[r] = sm[r] * al[r] + {fold("({a} + {b})")}
{ind(pv_phase, 1)}
    for dd in range({d}):
        for r in T.vectorized({R}):
            acc[dd, r] = acc[dd, r] * al[r] + oc[dd, r]
{amx("tilerelease")}
for r in range({R}):
    if {tile} * {R} + r < {rows}:
        for dd in range({d}):
            output[q_indptr[b] + tok[r], hd[r], dd] = T.Cast("{dtype}", acc[dd, r] / sm[r])
        lse[q_indptr[b] + tok[r], hd[r]] = mx[r] + T.log2(sm[r])
'''


# Sequence b's keys and one element of its K (0) or V (1), ragged or in pages.
RAGGED = ("(kv_indptr[b + 1] - kv_indptr[b])", "{buf}[kv_indptr[b] + {key}, {h}, {col}]")
PAGED = ("T.if_then_else({n} > 0, ({n} - 1) * {page} + length_info[b], 0)".format(
    n="(page_indptr[b + 1] - page_indptr[b])", page="{page}"),
    "pages[page_values[page_indptr[b] + ({key}) // {page}], {kv}, {h}, ({key}) % {page}, {col}]")


def _pack(h_kv: int, d: int, keys: tuple[str, str], page: int = 0) -> str:
    """Sequence ``b``'s K and V as bf16 A tiles, zero past its last key."""
    klen = keys[0].format(page=page)
    h, kp = f"(hk % {h_kv})", f"(hk // {h_kv})"

    def val(buf: str, key: str, col: str) -> str:
        elem = keys[1].format(buf=buf, kv=int(buf == "v"), key=f"T.min({key}, {klen} - 1)", h=h, col=col,
                              page=page)
        return f'T.if_then_else({key} < {klen}, T.Cast("float32", {elem}), T.float32(0))'

    key = f"{kp} * 32 + kk"
    ka = bf16_pair(val("k", key, "dp * 32 + 2 * p"), val("k", key, "dp * 32 + 2 * p + 1"))
    va = bf16_pair(val("v", f"{kp} * 32 + 2 * p", "dt * 16 + dr"),
                   val("v", f"{kp} * 32 + 2 * p + 1", "dt * 16 + dr"))
    return f'''
for hk in T.parallel({h_kv} * (({klen} + 31) // 32)):
    with T.sblock("pack"):
        for kk, dp, p in T.grid(32, {d // 32}, 16):
            Ka[{h}, {kp} * 2 + kk // 16, dp, kk % 16, p] = {ka}
        for dt, dr, p in T.grid({d // 16}, 16, 16):
            Va[{h}, {kp}, dt, dr, p] = {va}
'''


def _root(h_kv: int, h_q: int, d: int, dtype: str, keys: tuple[str, str], max_keys: str,
          page: int = 0) -> str:
    """The kernel's root block: K/V tiles for up to ``max_keys`` keys, per sequence the packing
    and a parallel loop over (16-row tile, KV head) tasks."""
    check_kv_dtype(dtype)
    if dtype == "int8":
        raise ValueError("the AMX attention kernels read 16-bit or fp32 caches; an int8 cache's rows carry "
                         "scales (kernels.kv_int8) that only the vector kernels read")
    if not supports(d):
        raise ValueError(f"the AMX attention kernel needs head_dim a multiple of 32, at most 128 (got {d})")
    group = h_q // h_kv
    ntiles = f"((q_indptr[b + 1] - q_indptr[b]) * {group} + {TILE_ROWS - 1}) // {TILE_ROWS}"
    body = textwrap.indent(_body(h_kv, group, d, dtype, keys[0].format(page=page)).strip("\n"), " " * 12)
    return f'''
Ka = T.sblock_alloc_buffer(({h_kv}, ({max_keys} + 31) // 32 * 2, {d // 32}, 16, 16), "uint32")
Va = T.sblock_alloc_buffer(({h_kv}, ({max_keys} + 31) // 32, {d // 16}, 16, 16), "uint32")
for b in range(batch_size):
{textwrap.indent(_pack(h_kv, d, keys, page).strip(chr(10)), " " * 4)}
    for task in T.parallel(({ntiles}) * {h_kv}):
        with T.sblock("tile"):
{body}'''


@cache
def prefill_ragged_amx_primfunc(h_kv: int, h_q: int, d: int, dtype: str = "float32") -> tvm.tirx.PrimFunc:
    """``batch_prefill_ragged_kv`` on AMX tiles (see the module docstring)."""
    root = _root(h_kv, h_q, d, dtype, RAGGED, "kv_len")
    return parse_tvmscript(ragged_prefill_source(h_kv, h_q, d, dtype, root))


@cache
def prefill_paged_amx_primfunc(h_kv: int, h_q: int, d: int, page: int = 16,
                               dtype: str = "float32") -> tvm.tirx.PrimFunc:
    """``batch_prefill_paged_kv_cpu`` on AMX tiles: a chunk of new tokens against the keys in
    its sequence's pages (at most the batch's pages' worth, ``nnz_pages x page``)."""
    root = _root(h_kv, h_q, d, dtype, PAGED, f"nnz_pages * {page}", page)
    return parse_tvmscript(paged_prefill_source(h_kv, h_q, d, page, dtype, root))
