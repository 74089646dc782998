"""Q4_K super-blocks regrouped as q4_1 blocks (``kernels.kquant``): the same 4-bit values, the
sub-scales unpacked as llama.cpp unpacks them, and every weight within fp16's rounding of the
block scales of what ``gguf`` dequantizes from the Q4_K bytes. Q5_0 blocks as q8_0 blocks:
every weight exact."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from sandwich_tvm.kernels.kquant import Q4_K_BYTES, q4_k_as_q4_1, q4_k_scales, q5_0_as_q8_0
from sandwich_tvm.kernels.packing import KernelError
from sandwich_tvm.kernels.quant import QTYPES

Q4_K = gguf.GGMLQuantizationType.Q4_K


def _blocks(rows: int, supers: int, d: np.ndarray, dmin: np.ndarray, seed: int = 0) -> np.ndarray:
    """Random Q4_K bytes with the given fp16 d and dmin per super-block."""
    raw = np.random.default_rng(seed).integers(0, 256, (rows, supers, Q4_K_BYTES), dtype=np.uint8)
    raw[..., :4] = np.stack([np.broadcast_to(d, (rows, supers)), np.broadcast_to(dmin, (rows, supers))],
                            axis=-1).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """llama.cpp's ``get_scale_min_k4``, one sub-block at a time."""
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def test_sub_scales_unpack_as_llama_cpp_does():
    packed = np.random.default_rng(1).integers(0, 256, (50, 12), dtype=np.uint8)
    sc, mn = q4_k_scales(packed)
    for row, (s, m) in zip(packed, zip(sc, mn, strict=True), strict=True):
        want = [_scale_min_k4(j, row) for j in range(8)]
        assert [(int(a), int(b)) for a, b in zip(s, m, strict=True)] == want


def test_exact_where_the_block_scales_are_exact_in_fp16():
    """With power-of-two d and dmin every d * sc and dmin * mn is an fp16 value: the q4_1
    blocks decode to exactly the Q4_K weights, so the 4-bit values moved one for one."""
    raw = _blocks(7, 3, np.float16(2.0 ** -9), np.float16(2.0 ** -10))
    want = gguf.quants.dequantize(raw, Q4_K)
    got = QTYPES["q4_1"].dequantize(q4_k_as_q4_1(raw))
    assert got.shape == want.shape == (7, 768)
    np.testing.assert_array_equal(got, want)


def test_any_scales_within_fp16_rounding_of_the_block_scales():
    rng = np.random.default_rng(2)
    d, dmin = rng.uniform(1e-5, 3e-2, (5, 4)), rng.uniform(1e-5, 3e-2, (5, 4))
    raw = _blocks(5, 4, d, dmin, seed=3)
    want = gguf.quants.dequantize(raw, Q4_K)
    regrouped = q4_k_as_q4_1(raw)
    got = QTYPES["q4_1"].dequantize(regrouped)
    blocks = regrouped.reshape(5, -1, 20)
    step = np.abs(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))  # d' per block of 32
    low = np.abs(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    bound = np.repeat((15 * step + low) * 2.0 ** -11, 32, axis=1) + 1e-7  # half an fp16 ulp of each
    assert np.all(np.abs(got - want) <= bound)
    assert np.abs(got - want).max() > 0  # these scales were not all exact: the bound was exercised


def test_a_scale_beyond_fp16_is_refused():
    raw = _blocks(1, 1, np.float16(60000.0), np.float16(0.0))
    raw.reshape(1, Q4_K_BYTES)[0, 4:8] = 63  # sub-blocks 0-3: sc = 63
    with pytest.raises(KernelError, match="blk.0.ffn_up.weight: a block scale .* exceeds fp16"):
        q4_k_as_q4_1(raw, "blk.0.ffn_up.weight")
    with pytest.raises(KernelError, match="not a whole number of Q4_K super-blocks"):
        q4_k_as_q4_1(raw[:, :100])


def test_q5_0_blocks_are_q8_0_blocks():
    """Every value of a Q5_0 block, its high bit (bit j of ``qh``) included, lands as ``q - 16``
    under the same scale: random bytes (every bit pattern) with finite scales decode exactly."""
    raw = np.random.default_rng(4).integers(0, 256, (9, 5, 22), dtype=np.uint8)
    scales = np.random.default_rng(5).uniform(-1, 1, (9, 5)).astype(np.float16)
    raw[..., :2] = scales[..., None].view(np.uint8)
    raw = raw.reshape(9, -1)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0)
    np.testing.assert_array_equal(QTYPES["q8_0"].dequantize(q5_0_as_q8_0(raw)), want)
    with pytest.raises(KernelError, match="not a whole number of Q5_0 blocks"):
        q5_0_as_q8_0(raw[:, :30])
