"""Block-quantized weights (q8_0, q4_0, q4_1): GGUF's blocks packed and read back bit for bit,
and the generated kernels against numpy on the dequantized weight for m from 1 to 300, odd n,
an odd number of k blocks, every epilogue and split-K: dequantized in registers on the vector
ISAs, and on AVX512-VNNI int8 dot products with A quantized per row and block of 32 (the
reference quantizes A the same way). Every (ISA, type) kernel is built and its assembly
checked; it runs where this CPU can run it."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.bench.crosscheck import check_buckets, mode_at, modes_by_m, product_as_seen
from sandwich_tvm.kernels.codegen import Bucket, KernelError, linear_primfunc
from sandwich_tvm.kernels.defaults import default_buckets
from sandwich_tvm.kernels.microkernel import ISAS, MicroKernel, microkernels
from sandwich_tvm.kernels.packing import WeightLayout
from sandwich_tvm.kernels.quant import QTYPES, QuantBlocks, head_dtype
from sandwich_tvm.kernels.schedule import GemmSchedule, GemmShape, Polymerization, Slice
from sandwich_tvm.tvm_compat import host_target, isa_target, tvm

from ..isas import DOT_INSTRUCTION, QUANT_CASES, VECTOR_REGISTER, assembly, require_runnable

quant_cases = pytest.mark.parametrize(("isa", "dtype"), QUANT_CASES)


def _weight(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[: n // 3] *= 0.01  # rows of small and large scales
    w[:, :32] += 0.5  # a block with an offset (q4_1's minimum)
    return w


# values [k][lane]; 4-k words [quad][lane][4] (q8_0 offset, and signed for sdot)
LAYOUT_ISAS = ["avx512", "avx512vnni", "avx2dot", "avx512dot", "neondot"]


@pytest.mark.parametrize("dtype", sorted(QTYPES))
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("isa", LAYOUT_ISAS)
def test_gguf_blocks_pack_and_unpack_bit_for_bit(dtype, interleave, isa):
    q = QTYPES[dtype]
    n, k = 96, 160
    raw = q.quantize(_weight(n, k))
    assert raw.shape == (n, k // 32 * q.block_bytes)
    layout = WeightLayout(isa, dtype, interleave)
    packed = layout.pack(QuantBlocks(raw, q, k))
    assert packed.dtype == np.uint8 and packed.shape == layout.shape(n, k)
    assert packed.shape[2] == layout.lanes * q.block_bytes  # 8.5, 4.5, 5 bits a weight, as in GGUF
    np.testing.assert_array_equal(layout.unpack(packed, n, k), q.dequantize(raw))
    if not interleave:
        np.testing.assert_array_equal(q.from_panels(packed, n, layout.quads, layout.signed), raw)  # moved
    # a float weight is quantized by gguf's reference code (llama.cpp's rounding): the same bytes
    np.testing.assert_array_equal(layout.pack(_weight(n, k)), packed)


@pytest.mark.parametrize("dtype", sorted(QTYPES))
@pytest.mark.parametrize("isa", LAYOUT_ISAS)
def test_element_expression_reads_the_packed_value(dtype, isa):
    """``WeightLayout.element`` (the tied embedding's gather, MetaSchedule's workload) gives the
    dequantized value of every (n, k)."""
    from tvm import te

    n, k = 40, 96
    layout = WeightLayout(isa, dtype)
    packed = layout.pack(_weight(n, k, 2))
    wp = te.placeholder(packed.shape, "uint8", name="wp")
    out = te.compute((n, k), lambda i, j: layout.element(wp, i, j), name="w")
    fn = tvm.compile(te.create_prim_func([wp, out]), target=host_target(1))
    y = tvm.runtime.empty((n, k), "float32", tvm.cpu())
    fn(tvm.runtime.tensor(packed), y)
    np.testing.assert_array_equal(y.numpy(), layout.unpack(packed, n, k))


def test_k_not_in_blocks_of_32_is_refused():
    with pytest.raises(KernelError, match="multiple of 32"):
        WeightLayout("avx2", "q4_0").shape(64, 100)
    with pytest.raises(KernelError, match="multiple of 32"):
        buckets = default_buckets(GemmShape(64, 96, "q8_0"), 2, None, "avx2")
        linear_primfunc(GemmShape(64, 100, "q8_0"), buckets)


def test_head_stays_at_8_bits_under_4_bit_weights():
    assert head_dtype("q4_1") == head_dtype("q4_0") == "q8_0"
    assert head_dtype("q8_0") == "q8_0" and head_dtype("bfloat16") == "bfloat16"


def _sch(isa, dtype, mr, vectors, mc, nc_vectors, kc, pm=1, pn=2, pk=1) -> GemmSchedule:
    lanes = ISAS[isa].lanes
    return GemmSchedule(MicroKernel(isa, mr, vectors * lanes, dtype), Slice(mc, nc_vectors * lanes, kc),
                        Polymerization(pm, pn, pk))


def _build(shape: GemmShape, buckets, epilogue=None):
    func = linear_primfunc(shape, buckets, epilogue=epilogue)
    return tvm.compile(tvm.IRModule({"linear": func}), target=host_target(2)).mod["linear"]


@quant_cases
def test_every_m_with_tails_epilogues_and_split_k(isa, dtype):
    require_runnable(isa)
    rng = np.random.default_rng(0)
    lanes = ISAS[isa].lanes
    n, k = 6 * lanes + 5, 160  # odd n, 5 blocks of k (KC = 64: a tail block of 32)
    shape = GemmShape(n, k, dtype)
    layout = WeightLayout(isa, dtype)
    wp = layout.pack(_weight(n, k, 1))
    w = layout.unpack(wp, n, k)
    buckets = check_buckets(isa, dtype)  # 1 and 2-row tiles, split-K, a KC tail (AMX grids on AMX)
    modes = modes_by_m(buckets)
    fn = _build(shape, buckets)
    res_fn = _build(GemmShape(n, k, dtype, "residual"), buckets)
    wt = tvm.runtime.tensor(wp)
    for m in [*range(1, 9), 17, 40, 41, 64, 127, 300]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        want = product_as_seen(a, w, mode_at(modes, m))
        y = tvm.runtime.empty((m, n), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), wt, y)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4 * np.sqrt(k), err_msg=f"m={m}")
        r = rng.standard_normal((m, n)).astype(np.float32)
        res_fn(tvm.runtime.tensor(a), wt, tvm.runtime.tensor(r), y)
        np.testing.assert_allclose(y.numpy(), want + r, rtol=1e-4, atol=1e-4 * np.sqrt(k),
                                   err_msg=f"m={m}")
        if ISAS[isa].quantized_unit:  # int8 (or bf16) operands: within their rounding of the fp32 product
            np.testing.assert_allclose(y.numpy() - r, a @ w.T, atol=0.03 * np.abs(a @ w.T).max())


@pytest.mark.parametrize(("isa", "dtype"), [(i, d) for i, d in QUANT_CASES if d == "q4_1"])
def test_split_k_threads_left_without_a_kc_block(isa, dtype):
    """Split-K over more threads than KC blocks (k = 160 within one KC block; 5 blocks of 32
    over 4 threads with KC = 64): the threads left without one add nothing. (The split-K store
    and sum are the same code for every type; each ISA's kernel is another.)"""
    require_runnable(isa)
    if ISAS[isa].tile_rows:
        pytest.skip("these are vector tiles; AMX grids share the split-K store and sum they test")
    n, k = 3 * ISAS[isa].lanes + 5, 160
    buckets = [Bucket(4, _sch(isa, dtype, 2, 2, 4, 4, 256, pm=1, pn=1, pk=2)),
               Bucket(1 << 62, _sch(isa, dtype, 4, 2, 8, 4, 64, pm=1, pn=1, pk=4))]
    modes = modes_by_m(buckets)
    fn = _build(GemmShape(n, k, dtype), buckets)
    layout = WeightLayout(isa, dtype)
    wp = layout.pack(_weight(n, k, 6))
    w = layout.unpack(wp, n, k)
    rng = np.random.default_rng(7)
    for m in (1, 3, 4, 5, 17):
        a = rng.standard_normal((m, k)).astype(np.float32)
        y = tvm.runtime.empty((m, n), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), tvm.runtime.tensor(wp), y)
        np.testing.assert_allclose(y.numpy(), product_as_seen(a, w, mode_at(modes, m)), rtol=1e-4,
                                   atol=1e-4 * np.sqrt(k), err_msg=f"m={m}")


@quant_cases
def test_silu_mul_on_an_interleaved_quantized_gate_up(isa, dtype):
    require_runnable(isa)
    lanes, k = ISAS[isa].lanes, 96
    n = 2 * 3 * lanes
    shape = GemmShape(n, k, dtype, "silu_mul")
    layout = WeightLayout(isa, dtype, interleave=True)
    gate_up = _weight(n, k, 3)
    wp = layout.pack(gate_up)
    w = layout.unpack(wp, n, k)  # de-interleaved: cat(gate, up)
    buckets = default_buckets(shape, 2, None, isa)
    modes = modes_by_m(buckets)
    fn = _build(shape, buckets)
    rng = np.random.default_rng(4)
    for m in (1, 3, 33, 200):
        a = rng.standard_normal((m, k)).astype(np.float32)
        g, u = np.split(product_as_seen(a, w, mode_at(modes, m)), 2, axis=1)
        y = tvm.runtime.empty((m, n // 2), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), tvm.runtime.tensor(wp), y)
        np.testing.assert_allclose(y.numpy(), g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-3,
                                   err_msg=f"m={m}")


@pytest.mark.parametrize("isa", [isa for isa, spec in sorted(ISAS.items()) if spec.emulated_dot])
def test_emulated_dot_pair_sums_at_their_largest_do_not_saturate(isa):
    """``vpmaddubsw`` adds two byte products into a saturating int16. q8_0 values of +-127 against
    activations of +-127 signed alike, so every pair sum is the largest it can be (2 x 127 x 127),
    still give the exact product; stored unsigned (q + 128), they would saturate."""
    require_runnable(isa)
    n, k = 3 * ISAS[isa].lanes, 128
    signs = np.where(np.random.default_rng(5).random((n, k)) < 0.5, -1.0, 1.0).astype(np.float32)
    layout = WeightLayout(isa, "q8_0")
    wp = layout.pack(signs)
    w = layout.unpack(wp, n, k)
    shape = GemmShape(n, k, "q8_0")
    fn = _build(shape, default_buckets(shape, 2, None, isa))
    for m in (1, 2, 4, 7):
        a = 0.5 * signs[:m]
        y = tvm.runtime.empty((m, n), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), tvm.runtime.tensor(wp), y)
        want = product_as_seen(a, w, "int8")
        assert np.allclose(np.diag(want[:, :m]), 0.5 * k, rtol=1e-3)  # the all-positive dot products
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-4, err_msg=f"m={m}")


@quant_cases
def test_default_kernel_builds_for_every_isa_and_type(isa, dtype):
    """Built (not run) for every ISA: its registers in the assembly, and micro-kernels enumerated."""
    assert microkernels(isa, dtype) and all(mk.kc_align % 32 == 0 for mk in microkernels(isa, dtype))
    shape = GemmShape(8 * ISAS[isa].lanes, 128, dtype)
    buckets = default_buckets(shape, 2, None, isa)
    if ISAS[isa].tile_rows:  # untuned, AMX-INT8 runs the VNNI tiles: a tile grid for large m
        buckets[-1] = Bucket(1 << 62, _sch(isa, dtype, 32, 2, 64, 4, 64))
    func = linear_primfunc(shape, buckets)
    asm = assembly(tvm.compile(tvm.IRModule({"linear": func}), target=isa_target(isa, 2)))
    assert VECTOR_REGISTER[isa] in asm
    if isa in ("avx2", "avxvnni"):
        assert "%zmm" not in asm
    if isa in DOT_INSTRUCTION:
        assert DOT_INSTRUCTION[isa] in asm


@pytest.mark.parametrize("dtype", ["q4_0", "q4_1"])
def test_importance_weighted_blocks_cut_the_weighted_error(dtype):
    """An importance vector moves the rounding error onto the columns it weighs least: the
    importance-weighted squared error falls below the reference quantizer's, and the blocks
    still decode as GGUF's (gguf's own dequantizer reads them)."""
    from sandwich_tvm.kernels.quant import row_mean_square, weighted_blocks

    q = QTYPES[dtype]
    w = _weight(48, 7 * 32, seed=3)
    imp = np.random.default_rng(4).gamma(0.5, 2.0, w.shape[1]).astype(np.float32)
    imp[:32] = 0.0  # a block nobody weighs still gets finite values
    ref, ours = q.dequantize(q.quantize(w)), q.dequantize(q.quantize(w, imp))
    assert ours.shape == w.shape and np.all(np.isfinite(ours))
    err = lambda r: float(np.sum(imp * (w - r) ** 2))  # noqa: E731
    assert err(ours) < 0.9 * err(ref)
    # a shard of whole rows' columns, given those rows' mean squares, rounds as the whole does
    half = w.shape[1] // 2 // 32 * 32
    sigma2 = row_mean_square(w)
    whole = q.quantize(w, imp)
    first = whole[:, :half // 32 * q.block_bytes]
    assert np.array_equal(weighted_blocks(w[:, :half], imp[:half], q, sigma2), first)
    assert not np.array_equal(weighted_blocks(w[:, :half], imp[:half], q), first)
    q8 = QTYPES["q8_0"]
    assert np.array_equal(q8.quantize(w, imp), q8.quantize(w))  # 8 bits: the reference quantizer
    for bad in (imp[:-1], -imp, np.full_like(imp, np.nan)):
        with pytest.raises(ValueError, match="importance vector must hold"):
            weighted_blocks(w, bad, q)
