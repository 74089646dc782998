"""The ``fused_rope`` and ``rope_rows`` kernels (``kernels.rope``) against numpy, turning a whole
head or its leading dimensions only (Phi-4-mini's partial rotary), with an attention factor on cos
and sin, in every KV cache dtype."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.kernels.kv_int8 import pack_rows, unpack_rows
from sandwich_tvm.kernels.packing import numpy_dtype
from sandwich_tvm.kernels.rope import rope_primfunc, rope_rows_primfunc
from sandwich_tvm.tvm_compat import host_target, tvm

pytestmark = pytest.mark.compile
D, H_Q, H_KV, N = 16, 4, 2, 9


def _reference(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, scale: float) -> np.ndarray:
    """transformers' ``apply_rotary_pos_emb`` on ``x[n, heads, D]``: the leading ``2 len(freqs)``
    dimensions turned in rotate-half order, the rest passed."""
    rot, half = 2 * len(freqs), len(freqs)
    angle = pos[:, None].astype(np.float64) * freqs[None, :]
    cos = np.concatenate([np.cos(angle)] * 2, -1)[:, None, :] * scale
    sin = np.concatenate([np.sin(angle)] * 2, -1)[:, None, :] * scale
    turned = x[..., :rot].astype(np.float64)
    halves = np.concatenate([-turned[..., half:], turned[..., :half]], -1)
    return np.concatenate([turned * cos + halves * sin, x[..., rot:]], -1)


@pytest.mark.parametrize("pairs", [D // 2, 6], ids=["whole-head", "partial"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_rope_turns_the_leading_pairs_and_passes_the_rest(pairs, dtype):
    freqs = 1.0 / (10000.0 ** (np.arange(0, 2 * pairs, 2) / (2 * pairs))) / np.linspace(1, 3, pairs)
    scale = 1.2
    rng = np.random.default_rng(pairs)
    x = rng.standard_normal((N, H_Q + 2 * H_KV, D), dtype=np.float32) * 3
    pos = rng.permutation(300)[:N].astype(np.int32)
    if dtype == "int8":
        stored = pack_rows(x)
        x = unpack_rows(stored)  # what the rows hold
    else:
        stored = x.astype(numpy_dtype(dtype))
        x = stored.astype(np.float32)
    run = tvm.compile(rope_primfunc(H_Q, H_KV, D, tuple(float(f) for f in freqs), dtype, scale),
                      target=host_target())
    w = stored.shape[-1]
    q, k, v = (tvm.runtime.tensor(np.zeros((N, h, w), stored.dtype)) for h in (H_Q, H_KV, H_KV))
    run(tvm.runtime.tensor(stored), tvm.runtime.tensor(pos), q, k, v, 1)
    want = _reference(x[:, :H_Q + H_KV], pos, freqs, scale)
    got = np.concatenate([q.numpy(), k.numpy()], 1)
    got = unpack_rows(got) if dtype == "int8" else got.astype(np.float32)
    # one rounding of the stored dtype (int8: half a step of the row's largest value)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}.get(dtype, 0.5 / 127 + 1e-4)
    bound = tol * np.abs(want).max(-1, keepdims=True) + 1e-5
    assert np.all(np.abs(got - want) <= bound)
    if dtype != "int8":
        np.testing.assert_array_equal(got[..., 2 * pairs:], x[:, :H_Q + H_KV, 2 * pairs:])  # passed as is
    np.testing.assert_array_equal(v.numpy(), stored[:, H_Q + H_KV:])
    run(tvm.runtime.tensor(stored), tvm.runtime.tensor(pos), q, k, v, 0)  # apply_rope off: copied
    got = np.concatenate([q.numpy(), k.numpy()], 1)
    want = x[:, :H_Q + H_KV]
    got = unpack_rows(got) if dtype == "int8" else got.astype(np.float32)
    off = (tol if dtype == "int8" else 0) * np.abs(want).max(-1, keepdims=True) + 1e-6
    assert np.all(np.abs(got - want) <= off)


@pytest.mark.parametrize("pairs", [D // 2, 6], ids=["whole-head", "partial"])
def test_rope_rows_turns_q_and_k_in_the_graph_and_passes_v(pairs):
    """``rope_rows`` (a model with layers without RoPE turns the others' q and k in its graph):
    the same turn as numpy's at each token's position, v and the unturned dimensions as they are."""
    freqs = 1.0 / (10000.0 ** (np.arange(0, 2 * pairs, 2) / (2 * pairs)))
    rng = np.random.default_rng(pairs + 1)
    x = rng.standard_normal((N, H_Q + 2 * H_KV, D), dtype=np.float32) * 3
    pos = rng.permutation(300)[:N].astype(np.int32)
    run = tvm.compile(rope_rows_primfunc(H_Q, H_KV, D, tuple(float(f) for f in freqs), 1.2),
                      target=host_target())
    out = tvm.runtime.tensor(np.zeros_like(x))
    run(tvm.runtime.tensor(x), tvm.runtime.tensor(pos), out)
    got = out.numpy()
    want = _reference(x[:, :H_Q + H_KV], pos, freqs, 1.2)
    np.testing.assert_allclose(got[:, :H_Q + H_KV], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got[:, H_Q + H_KV:], x[:, H_Q + H_KV:])
