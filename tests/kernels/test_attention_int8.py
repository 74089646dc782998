"""The int8 KV cache's rows (``kernels.kv_int8``) and the attention kernels reading them,
against numpy on the dequantized values."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.kernels.attention import (
    decode_paged_primfunc,
    prefill_paged_primfunc,
    prefill_ragged_primfunc,
)
from sandwich_tvm.kernels.kv_int8 import (
    SCALE_BYTES,
    dequantize_rows_primfunc,
    merge_state_primfunc,
    pack_rows,
    quantize_rows_primfunc,
    unpack_rows,
)
from sandwich_tvm.tvm_compat import host_target, tvm

from .test_attention import _reference

pytestmark = pytest.mark.compile
D = 64


def _close_rows(got_rows: np.ndarray, want: np.ndarray) -> None:
    """int8 output rows equal ``want`` within one quantization step of each row (plus fp32)."""
    got = unpack_rows(got_rows)
    step = np.abs(want).max(-1, keepdims=True) / 127
    assert np.all(np.abs(got - want) <= 0.5 * step + 1e-4 * (1 + np.abs(want)) + 1e-6)


def test_rows_round_trip_through_the_kernels_as_through_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 5, D), dtype=np.float32) * 3
    x[2, 1] = 0  # an all-zero row keeps a finite scale
    quant = tvm.compile(quantize_rows_primfunc(5, D), target=host_target())
    rows = tvm.runtime.tensor(np.zeros((7, 5, D + SCALE_BYTES), np.int8))
    quant(tvm.runtime.tensor(x), rows)
    np.testing.assert_array_equal(rows.numpy()[..., :D], pack_rows(x)[..., :D])
    np.testing.assert_allclose(unpack_rows(rows.numpy()), unpack_rows(pack_rows(x)), rtol=1e-6)
    _close_rows(rows.numpy(), x)
    dequant = tvm.compile(dequantize_rows_primfunc(5, D), target=host_target())
    back = tvm.runtime.tensor(np.zeros_like(x))
    dequant(rows, back)
    np.testing.assert_allclose(back.numpy(), unpack_rows(rows.numpy()), rtol=1e-6)
    assert np.all(back.numpy()[2, 1] == 0)


def test_merge_state_merges_int8_rows_in_place():
    rng = np.random.default_rng(1)
    a, b = (pack_rows(rng.standard_normal((6, 4, D), dtype=np.float32)) for _ in range(2))
    sa, sb = (rng.standard_normal((6, 4)).astype(np.float32) for _ in range(2))
    run = tvm.compile(merge_state_primfunc(D), target=host_target())
    v, s = tvm.runtime.tensor(a), tvm.runtime.tensor(sa)
    run(v, s, tvm.runtime.tensor(b), tvm.runtime.tensor(sb))
    m = np.maximum(sa, sb)
    wa, wb = np.exp2(sa - m)[..., None], np.exp2(sb - m)[..., None]
    _close_rows(v.numpy(), (unpack_rows(a) * wa + unpack_rows(b) * wb) / (wa + wb))
    np.testing.assert_allclose(s.numpy(), np.log2(wa + wb)[..., 0] + m, rtol=1e-5, atol=1e-5)


def _rows(rng, shape, scale=1.0):
    return pack_rows(rng.standard_normal((*shape, D), dtype=np.float32) * scale)


@pytest.mark.parametrize("h_kv,h_q", [(3, 3), (2, 8)])
@pytest.mark.parametrize("causal", [1, 0])
def test_ragged_prefill_reads_int8_rows(h_kv, h_q, causal):
    run = tvm.compile(prefill_ragged_primfunc(h_kv, h_q, D, "int8"), target=host_target())
    rng = np.random.default_rng(h_q + causal)
    seqs = [(1, 0), (17, 0), (5, 40), (70, 3), (300, 0)]
    qs = [_rows(rng, (n, h_q), 2) for n, _ in seqs]
    ks = [_rows(rng, (n + pre, h_kv), 2) for n, pre in seqs]
    vs = [_rows(rng, (n + pre, h_kv)) for n, pre in seqs]
    q_indptr = np.cumsum([0] + [n for n, _ in seqs]).astype(np.int32)
    kv_indptr = np.cumsum([0] + [n + pre for n, pre in seqs]).astype(np.int32)
    q = np.concatenate(qs)
    out, lse = tvm.runtime.tensor(np.zeros_like(q)), tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    args = [q, q_indptr, np.concatenate(ks), np.concatenate(vs), kv_indptr,
            np.zeros(len(q), np.int32), np.zeros(len(seqs), np.int32)]
    run["batch_prefill_ragged_kv"](*[tvm.runtime.tensor(a) for a in args], out, lse, causal, 0, 1.0, 1e4,
                                   1 / np.sqrt(D))
    for i in range(len(seqs)):
        want, want_lse = _reference(*(unpack_rows(x[i]) for x in (qs, ks, vs)), bool(causal))
        rows = slice(q_indptr[i], q_indptr[i + 1])
        _close_rows(out.numpy()[rows], want)
        np.testing.assert_allclose(lse.numpy()[rows], want_lse, rtol=1e-4, atol=1e-4)


def _paged(rng, lengths, h_kv, page):
    npages = [-(-n // page) for n in lengths]
    pages = _rows(rng, (sum(npages) + 3, 2, h_kv, page), 2)
    table = rng.permutation(len(pages))[:sum(npages)].astype(np.int32)
    indptr = np.cumsum([0] + npages).astype(np.int32)
    last = np.array([n - (p - 1) * page if p else 0 for n, p in zip(lengths, npages, strict=True)], np.int32)

    def keys(b: int) -> tuple[np.ndarray, np.ndarray]:
        own = unpack_rows(pages[table[indptr[b]:indptr[b + 1]]])
        return tuple(own[:, i].transpose(0, 2, 1, 3).reshape(-1, h_kv, D)[:lengths[b]] for i in (0, 1))

    return pages, table, indptr, last, keys


@pytest.mark.parametrize("h_kv,h_q", [(3, 3), (2, 8)])
def test_paged_prefill_reads_int8_pages(h_kv, h_q):
    page, causal = 16, 1
    run = tvm.compile(prefill_paged_primfunc(h_kv, h_q, D, page, dtype="int8"), target=host_target())
    rng = np.random.default_rng(h_q)
    seqs = [(1, 16), (17, 40), (5, 6), (70, 333)]  # (new tokens, keys in pages)
    pages, table, indptr, last, keys = _paged(rng, [k for _, k in seqs], h_kv, page)
    qs = [_rows(rng, (n, h_q), 2) for n, _ in seqs]
    q_indptr = np.cumsum([0] + [n for n, _ in seqs]).astype(np.int32)
    q = np.concatenate(qs)
    out, lse = tvm.runtime.tensor(np.zeros_like(q)), tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    zeros = np.zeros(len(seqs), np.int32)
    args = [q, q_indptr, pages, indptr, table, last, zeros, np.zeros(len(q), np.int32)]
    run["batch_prefill_paged_kv_cpu"](*[tvm.runtime.tensor(a) for a in args], out, lse, causal, 0, 1.0, 1e4,
                                      1 / np.sqrt(D))
    for b in range(len(seqs)):
        want, want_lse = _reference(unpack_rows(qs[b]), *keys(b), True)
        rows = slice(q_indptr[b], q_indptr[b + 1])
        _close_rows(out.numpy()[rows], want)
        np.testing.assert_allclose(lse.numpy()[rows], want_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("h_kv,h_q,split", [(3, 3, 4), (2, 8, 3)])
def test_decode_reads_int8_pages(h_kv, h_q, split):
    page = 16
    run = tvm.compile(decode_paged_primfunc(h_kv, h_q, D, page, split, dtype="int8"), target=host_target())
    rng = np.random.default_rng(h_q)
    lengths = [1, 16, 17, 100, 333]
    pages, table, indptr, last, keys = _paged(rng, lengths, h_kv, page)
    q = _rows(rng, (len(lengths), h_q), 2)
    out, lse = tvm.runtime.tensor(np.zeros_like(q)), tvm.runtime.tensor(np.zeros(q.shape[:2], np.float32))
    zeros = np.zeros(len(lengths), np.int32)
    args = [q, pages, indptr, table, last, zeros, zeros]
    run["batch_decode_paged_kv_cpu"](*[tvm.runtime.tensor(a) for a in args], out, lse, 0, 1.0, 1e4,
                                     1 / np.sqrt(D))
    for b in range(len(lengths)):
        want, want_lse = _reference(unpack_rows(q[b:b + 1]), *keys(b), causal=False)
        _close_rows(out.numpy()[b:b + 1], want)
        np.testing.assert_allclose(lse.numpy()[b], want_lse[0], rtol=1e-4, atol=1e-4)


def test_rope_rotates_int8_rows_as_the_fp32_kernel_does():
    from sandwich_tvm.kernels.rope import rope_primfunc

    h_q, h_kv, n = 4, 2, 9
    freqs = tuple(float(10000 ** (-2 * i / D)) for i in range(D // 2))
    rng = np.random.default_rng(2)
    qkv = pack_rows(rng.standard_normal((n, h_q + 2 * h_kv, D), dtype=np.float32) * 3)
    pos = rng.permutation(100)[:n].astype(np.int32)
    outs = {}
    for dtype, x in (("float32", unpack_rows(qkv)), ("int8", qkv)):
        run = tvm.compile(rope_primfunc(h_q, h_kv, D, freqs, dtype), target=host_target())
        w = x.shape[-1]
        q, k, v = (tvm.runtime.tensor(np.zeros((n, h, w), x.dtype)) for h in (h_q, h_kv, h_kv))
        run(tvm.runtime.tensor(x), tvm.runtime.tensor(pos), q, k, v, 1)
        outs[dtype] = (q.numpy(), k.numpy(), v.numpy())
    for want, got in zip(outs["float32"][:2], outs["int8"][:2], strict=True):
        _close_rows(got, want)
    np.testing.assert_array_equal(outs["int8"][2], qkv[:, h_q + h_kv:])  # V's bytes, scales included
