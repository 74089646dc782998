"""The paged KV cache's attention kernels against a numpy softmax(QKᵀ)V, ragged and paged."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sandwich_tvm.kernels.attention import (
    decode_paged_primfunc,
    exp2,
    prefill_paged_primfunc,
    prefill_ragged_primfunc,
)
from sandwich_tvm.kernels.attention_amx import prefill_paged_amx_primfunc
from sandwich_tvm.kernels.norm import rms_norm_primfunc
from sandwich_tvm.tvm_compat import T, host_target, isa_target, tvm

from ..isas import VECTOR_REGISTER, assembly, every_isa, require_runnable

pytestmark = pytest.mark.compile
D = 64


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """(output [n, h_q, d], log2-sum-exp [n, h_q]) of one sequence; the last len(q) keys are new."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1).astype(np.float64), np.repeat(v, group, axis=1).astype(np.float64)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    if causal:
        prefix = len(k) - len(q)
        s[:, np.arange(len(k))[None, :] > np.arange(len(q))[:, None] + prefix] = -np.inf
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    total = p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p / total, v), ((np.log(total) + m)[..., 0] / np.log(2)).T


def run_ragged(run, rng, seqs, h_kv, h_q, causal, dtype, scale=1.0):
    """Random Q, K, V for ``seqs`` (new tokens, keys before them) through a compiled
    ``batch_prefill_ragged_kv``; returns the inputs, q_indptr and the output and lse tensors."""
    qs = [(rng.standard_normal((n, h_q, D), dtype=np.float32) * scale).astype(dtype) for n, _ in seqs]
    ks = [(rng.standard_normal((n + pre, h_kv, D), dtype=np.float32) * scale).astype(dtype)
          for n, pre in seqs]
    vs = [rng.standard_normal((n + pre, h_kv, D), dtype=np.float32).astype(dtype) for n, pre in seqs]
    q_indptr = np.cumsum([0] + [n for n, _ in seqs]).astype(np.int32)
    kv_indptr = np.cumsum([0] + [n + pre for n, pre in seqs]).astype(np.int32)
    q = np.concatenate(qs)
    out = tvm.runtime.tensor(np.zeros_like(q))
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    args = [q, q_indptr, np.concatenate(ks), np.concatenate(vs), kv_indptr,
            np.zeros(len(q), np.int32), np.zeros(len(seqs), np.int32)]
    run(*[tvm.runtime.tensor(a) for a in args], out, lse, causal, 0, 1.0, 1e4, 1 / np.sqrt(D))
    return qs, ks, vs, q_indptr, out, lse


# 16-bit K/V: inputs are rounded to float16, the output too (10 mantissa bits)
OUT_TOL = {"float32": (1e-4, 2e-5), "float16": (2e-3, 2e-3)}


@pytest.mark.parametrize("h_kv,h_q", [(3, 3), (2, 8)])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("dtype", sorted(OUT_TOL))
def test_prefill_matches_numpy(h_kv, h_q, causal, dtype):
    run = tvm.compile(prefill_ragged_primfunc(h_kv, h_q, D, dtype), target=host_target())
    run = run["batch_prefill_ragged_kv"]
    rng = np.random.default_rng(h_q + causal)
    # (new tokens, keys already in the cache): one row, tile tails, a prefix, a long sequence
    seqs = [(1, 0), (17, 0), (5, 40), (70, 3), (300, 0)]
    qs, ks, vs, q_indptr, out, lse = run_ragged(run, rng, seqs, h_kv, h_q, causal, dtype, scale=2)
    rtol, atol = OUT_TOL[dtype]
    for i in range(len(seqs)):
        want, want_lse = _reference(qs[i], ks[i], vs[i], bool(causal))
        rows = slice(q_indptr[i], q_indptr[i + 1])
        np.testing.assert_allclose(out.numpy()[rows].astype(np.float32), want, rtol=rtol, atol=atol)
        np.testing.assert_allclose(lse.numpy()[rows], want_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("h_kv,h_q", [(3, 3), (2, 8)])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("dtype", sorted(OUT_TOL))
@pytest.mark.parametrize("kernel", ["vector", "amx"])
def test_paged_prefill_matches_numpy(h_kv, h_q, causal, dtype, kernel):
    """A chunk of new tokens against the keys in its sequence's pages (chunked prefill); the
    AMX kernel (bf16 operands, its arithmetic checked in test_attention_amx) within bf16's
    precision, which any page or slot mixed up would exceed."""
    page = 16
    if kernel == "amx":
        require_runnable("amx")
        func, target = prefill_paged_amx_primfunc(h_kv, h_q, D, page, dtype), isa_target("amx")
    else:
        func, target = prefill_paged_primfunc(h_kv, h_q, D, page, dtype=dtype), host_target()
    run = tvm.compile(func, target=target)["batch_prefill_paged_kv_cpu"]
    rng = np.random.default_rng(10 * h_q + causal)
    seqs = [(1, 16), (17, 40), (5, 1), (70, 33), (40, 0), (300, 512)]  # (new tokens, keys in pages)
    npages = [-(-k // page) for _, k in seqs]
    pages = (rng.standard_normal((sum(npages) + 5, 2, h_kv, page, D), dtype=np.float32) * 2).astype(dtype)
    table = rng.permutation(len(pages))[:sum(npages)].astype(np.int32)
    indptr = np.cumsum([0] + npages).astype(np.int32)
    last = np.array([k - (p - 1) * page if p else 0
                     for (_, k), p in zip(seqs, npages, strict=True)], np.int32)
    qs = [(rng.standard_normal((n, h_q, D), dtype=np.float32) * 2).astype(dtype) for n, _ in seqs]
    q_indptr = np.cumsum([0] + [n for n, _ in seqs]).astype(np.int32)
    q = np.concatenate(qs)
    out = tvm.runtime.tensor(np.zeros_like(q))
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    zeros = np.zeros(len(seqs), np.int32)
    args = [q, q_indptr, pages, indptr, table, last, zeros, np.zeros(len(q), np.int32)]
    rtol, atol = OUT_TOL[dtype] if kernel == "vector" else (0.15, 0.15)
    run(*[tvm.runtime.tensor(a) for a in args], out, lse, causal, 0, 1.0, 1e4, 1 / np.sqrt(D))
    for b, (n, keys) in enumerate(seqs):
        rows = slice(q_indptr[b], q_indptr[b + 1])
        if keys == 0:
            assert np.all(out.numpy()[rows] == 0)
            continue
        own = pages[table[indptr[b]:indptr[b + 1]]]
        k, v = (own[:, i].transpose(0, 2, 1, 3).reshape(-1, h_kv, D)[:keys] for i in (0, 1))
        if causal and keys < n:  # TVM's mask: query i sees keys < keys - n + i + 1
            continue
        want, want_lse = _reference(qs[b], k, v, bool(causal))
        got = out.numpy()[rows].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
        assert kernel == "vector" or np.abs(got - want).mean() < 0.015
        lse_tol = 1e-4 if kernel == "vector" else 0.015
        np.testing.assert_allclose(lse.numpy()[rows], want_lse, rtol=lse_tol, atol=lse_tol)


@pytest.mark.parametrize("h_kv,h_q,split", [(3, 3, 4), (2, 8, 3)])
@pytest.mark.parametrize("dtype", sorted(OUT_TOL))
def test_decode_matches_numpy(h_kv, h_q, split, dtype):
    page = 16
    func = decode_paged_primfunc(h_kv, h_q, D, page, split, dtype=dtype)
    run = tvm.compile(func, target=host_target())["batch_decode_paged_kv_cpu"]
    rng = np.random.default_rng(h_q)
    lengths = [1, 16, 17, 100, 333]  # fewer pages than chunks, full and partial last pages
    npages = [-(-n // page) for n in lengths]
    pages = rng.standard_normal((sum(npages) + 3, 2, h_kv, page, D), dtype=np.float32).astype(dtype)
    table = rng.permutation(len(pages))[:sum(npages)].astype(np.int32)
    indptr = np.cumsum([0] + npages).astype(np.int32)
    last = np.array([n - (p - 1) * page for n, p in zip(lengths, npages, strict=True)], np.int32)
    q = (rng.standard_normal((len(lengths), h_q, D), dtype=np.float32) * 2).astype(dtype)
    out = tvm.runtime.tensor(np.zeros_like(q))
    rtol, atol = OUT_TOL[dtype]
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    zeros = np.zeros(len(lengths), np.int32)
    args = [q, pages, indptr, table, last, zeros, zeros]
    run(*[tvm.runtime.tensor(a) for a in args], out, lse, 0, 1.0, 1e4, 1 / np.sqrt(D))
    for b, n in enumerate(lengths):
        own = pages[table[indptr[b]:indptr[b + 1]]]  # [pages, 2, h_kv, page, d]
        k, v = (own[:, i].transpose(0, 2, 1, 3).reshape(-1, h_kv, D)[:n] for i in (0, 1))
        want, want_lse = _reference(q[b:b + 1], k, v, causal=False)
        np.testing.assert_allclose(out.numpy()[b].astype(np.float32), want[0], rtol=rtol, atol=atol)
        np.testing.assert_allclose(lse.numpy()[b], want_lse[0], rtol=1e-4, atol=1e-4)


def test_exp2_polynomial_is_accurate_over_the_softmax_range():
    src = f'''
@T.prim_func(s_tir=True)
def ex(a: T.Buffer((4096,), "float32"), b: T.Buffer((4096,), "float32")):
    for i in T.vectorized(4096):
        b[i] = {exp2("a[i]")}
'''
    run = tvm.compile(tvm.script.from_source(src, extra_vars={"T": T}), target=host_target())["ex"]
    x = np.concatenate([np.linspace(-126, 0, 4000), [-0.5, 0.5 - 1, -1e-7, 0.0] * 24]).astype(np.float32)
    y = tvm.runtime.tensor(np.zeros_like(x))
    run(tvm.runtime.tensor(x), y)
    np.testing.assert_allclose(y.numpy(), np.exp2(x.astype(np.float64)), rtol=3e-7)


def test_bench_attention_compares_with_tvms_kernels(capsys):
    from sandwich_tvm.bench import cli as bench

    assert bench.main(["attention", "--model", "llama-3.2-1b", "--prompt", "40", "--context", "70",
                       "--layers", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["heads"], result["kv_heads"]) == (32, 8)
    prefill, decode = result["rows"]
    assert (prefill["kernel"], prefill["tokens"], decode["kernel"], decode["context"]) == (
        "prefill", 40, "decode", 70)
    for row in (prefill, decode):  # the same attention as TVM's own kernels, both timed
        assert row["max_abs_diff"] < 1e-4
        assert row["sandwich_ms"] > 0 and row["tvm_ms"] > 0
        assert row["ratio"] == pytest.approx(row["sandwich_ms"] / row["tvm_ms"])
    f16, int8 = result["kv_dtypes"]  # the decode kernel on a 16-bit and an int8 cache, taking turns
    assert (f16["kv_dtype"], int8["kv_dtype"], f16["vs_first"]) == ("float16", "int8", 1.0)
    assert int8["max_abs_diff_vs_first"] < 0.05 and int8["ms"] > 0 and int8["rounds"] == 5


def test_bench_attention_refuses_an_unknown_kv_dtype(capsys):
    from sandwich_tvm.bench import cli as bench

    assert bench.main(["attention", "--kv-dtypes", "float16,int4"]) == 2
    out = capsys.readouterr()
    assert "int4" in out.err + out.out


@every_isa
def test_attention_and_norm_build_with_the_isas_vector_registers(isa):
    """Built (not run) for every ISA: the kernels vectorize to that ISA's full-width registers."""
    funcs = {"prefill": prefill_ragged_primfunc(2, 8, D, isa=isa),
             "decode": decode_paged_primfunc(2, 8, D, 16, 4, isa=isa),
             "norm": rms_norm_primfunc(96, 1e-5, isa)}
    for name, func in funcs.items():
        asm = assembly(tvm.compile(tvm.IRModule({name: func}), target=isa_target(isa, 2)))
        assert VECTOR_REGISTER[isa] in asm, name


def _windowed(q, k, v, q_pos, k_pos, window):
    """numpy attention of one sequence's queries at positions ``q_pos`` over keys at ``k_pos``:
    a key is seen when it is at most ``window`` - 1 positions before the query (or the query
    itself), as transformers' sliding-window mask; None where a query sees no key."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1).astype(np.float64), np.repeat(v, group, axis=1).astype(np.float64)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    s[:, ~seen] = -np.inf
    m = np.maximum(s.max(-1, keepdims=True), -1e30)  # a row that sees nothing: no NaN
    p = np.exp(s - m)
    total = np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("hqk,khd->qhd", p / total, v), ((np.log(total) + m)[..., 0] / np.log(2)).T, seen.any(1)


def test_windowed_kernels_build_for_every_kv_dtype():
    """bf16 and int8 rows share the window's generated code; it builds for them too (their
    arithmetic is checked without a window in this file and ``test_attention_int8``)."""
    for dtype in ("bfloat16", "int8"):
        for func in (prefill_ragged_primfunc(2, 8, D, dtype, window=5),
                     prefill_paged_primfunc(2, 8, D, 16, dtype=dtype, window=5),
                     decode_paged_primfunc(2, 8, D, 16, 3, dtype=dtype, window=5)):
            tvm.compile(func, target=host_target())


@pytest.mark.parametrize("dtype", sorted(OUT_TOL))
@pytest.mark.parametrize("window", [1, 5, 37])
def test_a_sliding_window_sees_only_the_last_window_positions(dtype, window):
    """Ragged (new keys by index), paged (by position: pages from ``k_rope_pos_offset``, tokens at
    ``q_rope_position``) and decode kernels with a window give numpy's attention over the keys
    within it; a token whose window holds none of a depth's keys gets nothing from it (an
    output of zeros whose log-sum-exp the cache's merge weighs as nothing)."""
    h_kv, h_q, page = 2, 8, 16
    rng = np.random.default_rng(window)
    rtol, atol = OUT_TOL[dtype]
    target = host_target()

    ragged = tvm.compile(prefill_ragged_primfunc(h_kv, h_q, D, dtype, window=window), target=target)
    seqs = [(1, 0), (17, 0), (70, 3), (300, 0)]
    qs, ks, vs, q_indptr, out, lse = run_ragged(ragged["batch_prefill_ragged_kv"], rng, seqs, h_kv, h_q, 1,
                                                dtype, scale=2)
    for i, (n, pre) in enumerate(seqs):
        positions = np.arange(pre + n)
        want, want_lse, _ = _windowed(qs[i], ks[i], vs[i], positions[pre:], positions, window)
        rows = slice(q_indptr[i], q_indptr[i + 1])
        np.testing.assert_allclose(out.numpy()[rows].astype(np.float32), want, rtol=rtol, atol=atol)
        np.testing.assert_allclose(lse.numpy()[rows], want_lse, rtol=1e-4, atol=1e-4)

    # (the tokens' positions, keys in pages, the pages' first position): a depth's block can start
    # anywhere, and TVM merges the sequences that share a block into one chunk, whose tokens need
    # not be in position order (a further one first: the tile's least visible key is not row 0's)
    seqs = [(np.arange(16, 17), 16, 0), (np.arange(140, 157), 40, 100), (np.arange(40, 110), 33, 7),
            (np.arange(305, 345), 300, 5), (np.r_[60:65, 32:40], 32, 0)]
    npages = [-(-k // page) for _, k, _ in seqs]
    pages = (rng.standard_normal((sum(npages) + 5, 2, h_kv, page, D), dtype=np.float32) * 2).astype(dtype)
    table = rng.permutation(len(pages))[:sum(npages)].astype(np.int32)
    indptr = np.cumsum([0] + npages).astype(np.int32)
    last = np.array([k - (p - 1) * page for (_, k, _), p in zip(seqs, npages, strict=True)], np.int32)
    k_off = np.array([o for _, _, o in seqs], np.int32)
    q_pos = np.concatenate([p for p, _, _ in seqs]).astype(np.int32)
    q = (rng.standard_normal((len(q_pos), h_q, D), dtype=np.float32) * 2).astype(dtype)
    q_indptr = np.cumsum([0] + [len(p) for p, _, _ in seqs]).astype(np.int32)
    paged = tvm.compile(prefill_paged_primfunc(h_kv, h_q, D, page, dtype=dtype, window=window), target=target)
    kinds = set()
    out = tvm.runtime.tensor(np.zeros_like(q))
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    args = [q, q_indptr, pages, indptr, table, last, k_off, q_pos]
    paged["batch_prefill_paged_kv_cpu"](*[tvm.runtime.tensor(a) for a in args], out, lse, 0, 0, 1.0, 1e4,
                                        1 / np.sqrt(D))
    for b, (_, keys, o) in enumerate(seqs):
        own = pages[table[indptr[b]:indptr[b + 1]]]
        k, v = (own[:, i].transpose(0, 2, 1, 3).reshape(-1, h_kv, D)[:keys] for i in (0, 1))
        rows = slice(q_indptr[b], q_indptr[b + 1])
        want, want_lse, sees = _windowed(q[rows], k, v, q_pos[rows], np.arange(o, o + keys), window)
        got = out.numpy()[rows].astype(np.float32)
        np.testing.assert_allclose(got[sees], want[sees], rtol=rtol, atol=atol)
        np.testing.assert_allclose(lse.numpy()[rows][sees], want_lse[sees], rtol=1e-4, atol=1e-4)
        assert np.all(np.abs(got[~sees]) < 1e-30) and np.all(lse.numpy()[rows][~sees] < -1e4)
        kinds.update(sees.tolist())
    assert kinds == ({True, False} if window > 1 else {False})  # a window of 1 sees only its own key

    # the last case's query is 50 positions past its keys: a depth wholly before a short window
    lengths, offsets, ahead = [1, 16, 17, 100, 333, 20], [0, 3, 40, 0, 1000, 0], [0, 0, 0, 0, 0, 50]
    npages = [-(-n // page) for n in lengths]
    pages = rng.standard_normal((sum(npages) + 3, 2, h_kv, page, D), dtype=np.float32).astype(dtype)
    table = rng.permutation(len(pages))[:sum(npages)].astype(np.int32)
    indptr = np.cumsum([0] + npages).astype(np.int32)
    last = np.array([n - (p - 1) * page for n, p in zip(lengths, npages, strict=True)], np.int32)
    k_off = np.array(offsets, np.int32)
    q_pos = (np.array(offsets) + np.array(lengths) - 1 + np.array(ahead)).astype(np.int32)
    q = (rng.standard_normal((len(lengths), h_q, D), dtype=np.float32) * 2).astype(dtype)
    decode = tvm.compile(decode_paged_primfunc(h_kv, h_q, D, page, 3, dtype=dtype, window=window),
                         target=target)
    out = tvm.runtime.tensor(np.zeros_like(q))
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    args = [q, pages, indptr, table, last, k_off, q_pos]
    decode["batch_decode_paged_kv_cpu"](*[tvm.runtime.tensor(a) for a in args], out, lse, 0, 1.0, 1e4,
                                        1 / np.sqrt(D))
    for b, (n, o) in enumerate(zip(lengths, offsets, strict=True)):
        own = pages[table[indptr[b]:indptr[b + 1]]]
        k, v = (own[:, i].transpose(0, 2, 1, 3).reshape(-1, h_kv, D)[:n] for i in (0, 1))
        want, want_lse, sees = _windowed(q[b:b + 1], k, v, q_pos[b:b + 1], np.arange(o, o + n), window)
        if not sees[0]:  # nothing from this depth: zeros, weighed as nothing by the merge
            assert np.all(out.numpy()[b] == 0) and np.all(lse.numpy()[b] < -1e4)
            continue
        np.testing.assert_allclose(out.numpy()[b].astype(np.float32), want[0], rtol=rtol, atol=atol)
        np.testing.assert_allclose(lse.numpy()[b], want_lse[0], rtol=1e-4, atol=1e-4)
    assert ahead[-1] >= window  # the last case saw nothing: checked as such
