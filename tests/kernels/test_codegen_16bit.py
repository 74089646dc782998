"""16-bit weights: every (ISA, dtype) micro-kernel against numpy (bf16/f16 inputs, fp32
reference) for m from 1 to 300 (every tail) with odd n and k, tails, split-K and the fused epilogues; each is
built for its ISA everywhere and its instructions checked, and run only where this CPU can."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.host import cpu_flags, enable_amx
from sandwich_tvm.kernels.codegen import Bucket, KernelError, linear_primfunc, linear_source
from sandwich_tvm.kernels.defaults import default_buckets
from sandwich_tvm.kernels.microkernel import ISAS, MicroKernel, kernel_isa, microkernels
from sandwich_tvm.kernels.packing import WeightLayout, numpy_dtype, to_bfloat16
from sandwich_tvm.kernels.schedule import GemmSchedule, GemmShape, Polymerization, Slice
from sandwich_tvm.spec import resolve_weight_dtype as resolve_dtype
from sandwich_tvm.tvm_compat import host_target, isa_target, tvm

from ..isas import ALL_ISAS, HALF_CASES, TAIL_MS, VECTOR_REGISTER, assembly, require_runnable

pytestmark = pytest.mark.compile
half_cases = pytest.mark.parametrize(("isa", "dtype"), HALF_CASES)


def sch(isa, dtype, mr, vectors, mc, nc_vectors, kc, pm=1, pn=2, pk=1) -> GemmSchedule:
    lanes = ISAS[isa].lanes
    return GemmSchedule(MicroKernel(isa, mr, vectors * lanes, dtype), Slice(mc, nc_vectors * lanes, kc),
                        Polymerization(pm, pn, pk))


def buckets_with_every_path(isa: str, dtype: str) -> list[Bucket]:
    if ISAS[isa].tile_rows:
        return amx_buckets(dtype)
    big = 256 // (4 * ISAS[isa].lanes)  # a 4-vector tile over 1 KB: one accumulator per column
    return [
        Bucket(1, sch(isa, dtype, 1, 2, 1, 4, 16)),  # several KC blocks per thread
        Bucket(5, sch(isa, dtype, 2, 3, 4, 6, 32, pm=2, pn=1)),
        Bucket(40, sch(isa, dtype, 4, 3, 8, 6, 24, pn=1, pk=2)),  # split-K
        Bucket(80, sch(isa, dtype, big, 4, 2 * big, 8, 48)),
        Bucket(1 << 62, sch(isa, dtype, 4, 2, 8, 8, 64, pm=2, pn=1)),
    ]


def amx_buckets(dtype: str) -> list[Bucket]:
    """AMX tiles of every grid shape, the avx512bf16 register tile serving small m on the same
    weight, several KC blocks per thread (16-pair blocks over k = 101's 64 padded pairs), split-K."""
    return [
        Bucket(3, sch("avx512bf16", dtype, 1, 2, 1, 4, 16)),
        Bucket(20, sch("amx", dtype, 16, 1, 16, 1, 16)),
        Bucket(40, sch("amx", dtype, 16, 3, 16, 3, 32, pn=1, pk=2)),
        Bucket(90, sch("amx", dtype, 32, 2, 64, 4, 64, pm=2, pn=1)),
        Bucket(1 << 62, sch("amx", dtype, 48, 1, 48, 2, 32)),
    ]


def quantized(x: np.ndarray, dtype: str) -> np.ndarray:
    """What the kernel computes with: ``x`` rounded to ``dtype``, as fp32."""
    return x.astype(numpy_dtype(dtype)).astype(np.float32)


def expected_a(a: np.ndarray, isa: str) -> np.ndarray:
    """vdpbf16ps multiplies bf16 pairs: A is rounded to bf16 when packed; widening kernels keep A."""
    return quantized(a, "bfloat16") if ISAS[isa].k_pack == 2 else a


def build(shape: GemmShape, buckets, epilogue="none"):
    func = linear_primfunc(shape, buckets, epilogue=epilogue)
    return tvm.compile(tvm.IRModule({"linear": func}), target=host_target(2)).mod["linear"]


@half_cases
def test_every_m_odd_n_and_k(isa, dtype):
    require_runnable(isa)
    shape = GemmShape(200, 101, dtype)  # n: no multiple of 3 or 4 vectors; k odd (a half pair)
    fn = build(shape, buckets_with_every_path(isa, dtype))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((shape.n, shape.k)).astype(np.float32)
    layout = WeightLayout(isa, dtype)
    wp = tvm.runtime.tensor(layout.pack(w))
    wq = quantized(w, dtype)
    for m in TAIL_MS:
        a = rng.standard_normal((m, shape.k)).astype(np.float32)
        y = tvm.runtime.empty((m, shape.n), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), wp, y)
        want = expected_a(a, isa).astype(np.float64) @ wq.T.astype(np.float64)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4 * np.sqrt(shape.k), err_msg=f"m={m}")


@half_cases
def test_residual_and_silu_mul_epilogues(isa, dtype):
    require_runnable(isa)
    lanes, k = ISAS[isa].lanes, 75
    rng = np.random.default_rng(1)
    buckets = buckets_with_every_path(isa, dtype)
    inter = 13 * lanes
    gate_up, res = GemmShape(2 * inter, k, dtype), GemmShape(200, k, dtype)
    f_gu, f_res = build(gate_up, buckets, "silu_mul"), build(res, buckets, "residual")
    w_gu = rng.standard_normal((gate_up.n, k)).astype(np.float32) * 0.3
    w_res = rng.standard_normal((res.n, k)).astype(np.float32)
    wp_gu = tvm.runtime.tensor(WeightLayout(isa, dtype, interleave=True).pack(w_gu))
    wp_res = tvm.runtime.tensor(WeightLayout(isa, dtype).pack(w_res))
    for m in (1, 2, 3, 5, 9, 33, 61, 90):
        a = rng.standard_normal((m, k)).astype(np.float32)
        aq = expected_a(a, isa).astype(np.float64)
        g, u = np.split(aq @ quantized(w_gu, dtype).T, 2, axis=1)
        y = tvm.runtime.empty((m, inter), "float32", tvm.cpu())
        f_gu(tvm.runtime.tensor(a), wp_gu, y)
        silu_up = g / (1 + np.exp(-g)) * u
        np.testing.assert_allclose(y.numpy(), silu_up, rtol=2e-4, atol=2e-3, err_msg=f"m={m}")
        r = rng.standard_normal((m, res.n)).astype(np.float32)
        y = tvm.runtime.empty((m, res.n), "float32", tvm.cpu())
        f_res(tvm.runtime.tensor(a), wp_res, tvm.runtime.tensor(r), y)
        want = aq @ quantized(w_res, dtype).T + r
        np.testing.assert_allclose(y.numpy(), want, rtol=2e-4, atol=2e-3, err_msg=f"m={m}")


@pytest.mark.parametrize(("isa", "dtype"), HALF_CASES + [(isa, "float32") for isa in ALL_ISAS])
def test_split_k_threads_left_without_a_kc_block(isa, dtype):
    """Split-K over more threads than KC blocks leaves the last threads none (KC counts bf16
    pairs on the pair kernels: k = 200 is 100 of them): they add nothing. Their partial sums,
    never written, were once added in (found running the Arm kernels under emulation)."""
    require_runnable(isa)
    if ISAS[isa].tile_rows:
        pytest.skip("these are vector tiles; AMX grids share the split-K store and sum they test")
    shape = GemmShape(3 * ISAS[isa].lanes + 5, 200, dtype)
    buckets = [Bucket(4, sch(isa, dtype, 2, 2, 4, 4, 256, pm=1, pn=1, pk=2)),  # one block, 2 threads
               Bucket(1 << 62, sch(isa, dtype, 4, 2, 8, 4, 48, pm=1, pn=1, pk=4))]  # 3 or 5 blocks, 4 threads
    fn = build(shape, buckets)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((shape.n, shape.k)).astype(np.float32)
    wp = tvm.runtime.tensor(WeightLayout(isa, dtype).pack(w))
    wq = quantized(w, dtype) if dtype != "float32" else w
    for m in (1, 3, 4, 5, 9, 17):
        a = rng.standard_normal((m, shape.k)).astype(np.float32)
        y = tvm.runtime.empty((m, shape.n), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), wp, y)
        want = expected_a(a, isa).astype(np.float64) @ wq.T.astype(np.float64)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4 * np.sqrt(shape.k), err_msg=f"m={m}")


@pytest.mark.parametrize(("isa", "dtype"), HALF_CASES + [(isa, "float32") for isa in ALL_ISAS])
def test_packed_a_is_exact(isa, dtype):
    """With W = I the GEMM returns A as the kernel packed it: exactly A (fp32, widening kernels)
    or A rounded to bf16 to nearest even, ties included (pair kernels). k is even and has whole
    vector blocks of the pack plus a tail, and m leaves partial row panels."""
    require_runnable(isa)
    lanes = ISAS[isa].lanes
    k = 2 * lanes * 3 + 6
    shape = GemmShape(k, k, dtype)
    fn = build(shape, buckets_with_every_path(isa, dtype) if dtype != "float32" else [
        Bucket(1 << 62, sch(isa, dtype, 3, 2, 6, 4, 16))])
    wp = tvm.runtime.tensor(WeightLayout(isa, dtype).pack(np.eye(k, dtype=np.float32)))
    rng = np.random.default_rng(3)
    for m in (1, 2, 3, 5, 8, 13, 41, 85):
        a = rng.standard_normal((m, k)).astype(np.float32)
        ties = to_bfloat16(a).astype(np.float32).view(np.uint32) + np.uint32(0x8000)
        a = np.where(rng.random(a.shape) < 0.5, ties.view(np.float32), a)  # half halfway between two bf16
        y = tvm.runtime.empty((m, k), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), wp, y)
        np.testing.assert_array_equal(y.numpy(), expected_a(a, isa), err_msg=f"m={m}")


# The instruction that shows each kernel computes as intended (Arm's widening kernels: its
# vector registers).
SIGNATURE = {("avx512bf16", "bfloat16"): "vdpbf16ps", ("neonbf16", "bfloat16"): "bfdot",
             ("amx", "bfloat16"): "tdpbf16ps",
             ("avx512", "bfloat16"): "vpslld",
             ("avx2", "bfloat16"): "vpslld", ("avx512", "float16"): "vcvtph2ps",
             ("avx2", "float16"): "vcvtph2ps"}


@half_cases
def test_built_for_its_isa_everywhere(isa, dtype):
    """Built (not run) on any host: the default kernel uses the ISA's registers and instruction."""
    shape = GemmShape(200, 96, dtype)
    func = linear_primfunc(shape, default_buckets(shape, 2, None, isa))
    asm = assembly(tvm.compile(tvm.IRModule({"linear": func}), target=isa_target(isa, 2)))
    assert VECTOR_REGISTER[isa] in asm
    if (isa, dtype) in SIGNATURE:
        assert SIGNATURE[(isa, dtype)] in asm
    if "avx512bf16" not in (isa, *ISAS[isa].extends):
        assert "vdpbf16ps" not in asm
    if isa != "amx":
        assert "tdpbf16ps" not in asm
    if isa != "neonbf16":
        assert "bfdot" not in asm


@pytest.mark.parametrize(("isa", "dtype", "interleave"),
                         [(i, d, il) for i, d in HALF_CASES for il in (False, True)])
def test_packing_round_trips(isa, dtype, interleave):
    lanes = ISAS[isa].lanes
    n, k = 2 * 3 * lanes, 37
    w = np.random.default_rng(2).standard_normal((n, k)).astype(np.float32)
    layout = WeightLayout(isa, dtype, interleave)
    wp = layout.pack(w)
    assert wp.shape == layout.shape(n, k) and wp.dtype == numpy_dtype(layout.storage)
    np.testing.assert_array_equal(layout.unpack(wp, n, k), quantized(w, dtype))


def test_dtype_choice_follows_the_cpu_flags():
    assert kernel_isa("avx512", "bfloat16", {"avx512f", "avx512_bf16"}) == "avx512bf16"
    assert kernel_isa("avx512", "bfloat16", {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}) == "amx"
    assert kernel_isa("avx512", "float16", {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}) == "avx512"
    assert kernel_isa("avx512", "bfloat16", {"avx512f"}) == "avx512"
    assert kernel_isa("avx512", "float16", {"avx512f", "avx512_bf16"}) == "avx512"
    assert kernel_isa("avx2", "bfloat16", {"avx2", "fma"}) == "avx2"
    assert kernel_isa("neon", "bfloat16", {"asimd", "bf16"}) == "neonbf16"  # Armv8.6 BFDOT
    assert kernel_isa("neon", "bfloat16", {"asimd"}) == "neon"
    assert kernel_isa("neon", "float16", {"asimd", "bf16"}) == "neon"
    dtype, why = resolve_dtype("auto", frozenset({"asimd", "bf16"}))
    assert dtype == "bfloat16" and "bfdot" in why
    assert resolve_dtype("auto", frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))[0] == "bfloat16"
    amx_flags = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    dtype, why = resolve_dtype("auto", amx_flags)
    assert dtype == "bfloat16" and "AMX" in why
    dtype, why = resolve_dtype("auto", frozenset({"avx2", "fma"}))
    assert dtype == "bfloat16" and "widened" in why
    assert resolve_dtype("float16")[0] == "float16"
    with pytest.raises(ValueError, match="not supported"):
        resolve_dtype("int4")


def test_bad_16bit_schedules_are_refused():
    with pytest.raises(KernelError, match="computes bfloat16 weights, not float32"):
        linear_primfunc(GemmShape(64, 64), [Bucket(1, sch("avx512bf16", "bfloat16", 1, 1, 1, 1, 16))])
    with pytest.raises(KernelError, match="do not compute float16"):
        bad = sch("avx512bf16", "float16", 1, 1, 1, 1, 16)
        linear_primfunc(GemmShape(64, 64, "float16"), [Bucket(1, bad)])
    with pytest.raises(KernelError, match="do not read float32"):
        WeightLayout("avx512bf16", "float32")
    assert not microkernels("avx512bf16", "float32")
    assert to_bfloat16(np.array([1.00390625], np.float32)).astype(np.float32)[0] == 1.0  # ties to even


def test_amx_kernel_configures_its_tiles_in_every_thread():
    """Tile state is per thread: each parallel task loads the configuration before its first
    tile instruction and releases it after; built for AMX on any host, its assembly inspected."""
    shape = GemmShape(96, 80, "bfloat16")
    buckets = [Bucket(1 << 62, sch("amx", "bfloat16", 32, 2, 32, 2, 32))]
    src = linear_source(shape, buckets)
    thread = src.index("for t in T.parallel(")
    assert thread < src.index("llvm.x86.ldtilecfg") < src.index("llvm.x86.tdpbf16ps")
    assert src.rindex("llvm.x86.tdpbf16ps") < src.index("llvm.x86.tilerelease")
    exe = tvm.compile(tvm.IRModule({"linear": linear_primfunc(shape, buckets)}), target=isa_target("amx", 2))
    asm = assembly(exe)
    for instruction in ("ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored", "tilerelease",
                        "prefetcht0"):  # the weight's next B tiles, PREFETCH k steps ahead
        assert instruction in asm, instruction
    with pytest.raises(KernelError, match="whole number of 16-pair AMX tiles"):
        linear_primfunc(shape, [Bucket(1 << 62, sch("amx", "bfloat16", 16, 1, 16, 1, 24))])


def test_amx_permission_is_asked_once_per_process():
    if "amx_tile" not in cpu_flags():
        assert not enable_amx()
        pytest.skip("this CPU has no AMX: nothing to ask the kernel for")
    assert enable_amx() and enable_amx()  # granted, and asking again is harmless
