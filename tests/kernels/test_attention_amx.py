"""Prompt attention on AMX tiles against numpy: built for AMX on any host, run where AMX is."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.kernels.attention_amx import CHUNK, prefill_ragged_amx_primfunc, supports
from sandwich_tvm.kernels.packing import to_bfloat16
from sandwich_tvm.kernels.vecmath import LOG2E
from sandwich_tvm.tvm_compat import isa_target, tvm

from ..isas import assembly, require_runnable
from .test_attention import _reference, run_ragged

pytestmark = pytest.mark.compile
D = 64


def _bf16(x: np.ndarray) -> np.ndarray:
    return to_bfloat16(np.asarray(x, np.float32)).astype(np.float64)


@pytest.mark.parametrize("h_kv,h_q", [(3, 3), (2, 8)])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_amx_prefill_matches_numpy(h_kv, h_q, causal, dtype):
    """Against softmax(QKᵀ)V on the operands the tiles see (Q·scale, K and V rounded to bf16):
    only P's rounding to bf16 is left; and against the exact inputs within bf16's precision."""
    require_runnable("amx")
    run = tvm.compile(prefill_ragged_amx_primfunc(h_kv, h_q, D, dtype), target=isa_target("amx"))
    run = run["batch_prefill_ragged_kv"]
    rng = np.random.default_rng(h_q + causal)
    # (new tokens, keys before them): one row, tile tails, a prefix, several key chunks
    seqs = [(1, 0), (17, 0), (5, 40), (70, 3), (2 * CHUNK + 44, 0), (30, CHUNK + 1)]
    qs, ks, vs, q_indptr, out, lse = run_ragged(run, rng, seqs, h_kv, h_q, causal, dtype)
    sm_scale = 1 / np.sqrt(D)
    c = np.float32(sm_scale * LOG2E)
    for i in range(len(seqs)):
        rows = slice(q_indptr[i], q_indptr[i + 1])
        got = out.numpy()[rows].astype(np.float64)
        q_tiles = _bf16(qs[i].astype(np.float32) * c) / c
        want, want_lse = _reference(q_tiles, _bf16(ks[i]), _bf16(vs[i]), bool(causal))
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2, err_msg=str(seqs[i]))
        assert np.abs(got - want).mean() < 2e-3, seqs[i]  # P's bf16 rounding, unbiased
        np.testing.assert_allclose(lse.numpy()[rows], want_lse, rtol=1e-4, atol=1e-4)
        exact, _ = _reference(qs[i], ks[i], vs[i], bool(causal))
        np.testing.assert_allclose(got, exact, rtol=0.1, atol=0.1, err_msg=str(seqs[i]))


def test_amx_prefill_is_built_for_amx_anywhere():
    """The kernel's assembly holds the tile configuration, loads, bf16 dot products and stores,
    on any host (built, not run)."""
    exe = tvm.compile(prefill_ragged_amx_primfunc(8, 32, 128, "float16"), target=isa_target("amx", 2))
    asm = assembly(exe)
    for instr in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilezero", "tilerelease"):
        assert instr in asm, instr


def test_head_dims_the_amx_kernel_takes():
    assert supports(64) and supports(128) and supports(96)
    assert not supports(80) and not supports(256)
    with pytest.raises(ValueError, match="multiple of 32"):
        prefill_ragged_amx_primfunc(2, 2, 80)
