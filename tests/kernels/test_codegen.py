"""Generated kernels against numpy, for every m in 1..300 and odd n and k."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.kernels.codegen import Bucket, KernelError, linear_primfunc, pack_weight
from sandwich_tvm.kernels.microkernel import MicroKernel
from sandwich_tvm.kernels.schedule import GemmSchedule, GemmShape, Polymerization, Slice
from sandwich_tvm.model.config import load_config
from sandwich_tvm.tvm_compat import host_target, tvm

pytestmark = pytest.mark.compile


def sch(mr, nr, mc, nc, kc, pm=1, pn=2, pk=1) -> GemmSchedule:
    return GemmSchedule(MicroKernel("avx2", mr, nr), Slice(mc, nc, kc), Polymerization(pm, pn, pk))


def build(shape: GemmShape, buckets):
    func = linear_primfunc(shape, buckets)
    return tvm.compile(tvm.IRModule({"linear": func}), target=host_target(2)).mod["linear"]


def check(fn, shape: GemmShape, ms, rng):
    w = rng.standard_normal((shape.n, shape.k)).astype("float32")
    wp = tvm.runtime.tensor(pack_weight(w, "avx2"))
    for m in ms:
        a = rng.standard_normal((m, shape.k)).astype("float32")
        y = tvm.runtime.empty((m, shape.n), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), wp, y)
        tol = 2e-4 * np.sqrt(shape.k)
        np.testing.assert_allclose(y.numpy(), a @ w.T, rtol=2e-4, atol=tol, err_msg=f"m={m}")


def test_every_m_with_tails_and_split_k():
    # n = 200: not a multiple of 16 or 24; k = 100: not a multiple of KC = 48
    shape = GemmShape(200, 100)
    buckets = [
        Bucket(1, sch(1, 16, 1, 32, 48)),
        Bucket(5, sch(2, 24, 4, 48, 32, pk=1, pn=1, pm=2)),
        Bucket(40, sch(4, 24, 8, 48, 48, pm=1, pn=1, pk=2)),  # split-K
        Bucket(1 << 62, sch(6, 16, 12, 64, 48, pm=2, pn=1)),
    ]
    check(build(shape, buckets), shape, range(1, 301), np.random.default_rng(0))


@pytest.mark.parametrize("preset", ["llama-160m", "tinyllama-1.1b"])
def test_model_shapes_random_m(preset):
    cfg = load_config(preset)
    rng = np.random.default_rng(1)
    h, d = cfg.hidden_size, cfg.head_dim
    shape = GemmShape((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h)  # fused qkv
    buckets = [Bucket(3, sch(3, 16, 3, 64, 256)), Bucket(1 << 62, sch(6, 16, 24, 128, 512, pk=2, pn=1))]
    fn = build(shape, buckets)
    check(fn, shape, [1, 2, 3, 4, 7, *rng.integers(8, 700, size=3).tolist()], rng)


def test_bad_schedule_is_refused():
    with pytest.raises(KernelError, match="whole number"):
        linear_primfunc(GemmShape(64, 64), [Bucket(1, sch(6, 16, 8, 16, 64))])
    with pytest.raises(KernelError, match="float32"):
        linear_primfunc(GemmShape(64, 64, "float16"), [Bucket(1, sch(6, 16, 6, 16, 64))])


@pytest.mark.parametrize("isa", ["avx2", "avx512", "neon"])
def test_packed_weight_covers_the_last_tile_of_every_width(isa):
    from sandwich_tvm.kernels.codegen import packed_panels
    from sandwich_tvm.kernels.microkernel import ISAS, REGISTRY
    from sandwich_tvm.kernels.schedule import cdiv

    lanes = ISAS[isa].lanes
    for n in (1, 7, 8, 200, 2048, 3072, 32000, 128256):
        panels = packed_panels(n, isa)
        for mk in REGISTRY[isa]:
            last_tile_end = cdiv(n, mk.nr) * mk.nr  # columns the last NR tile reads
            assert last_tile_end <= panels * lanes, (n, mk.name)


@pytest.mark.parametrize("epilogue", ["residual", "bias"])
def test_fused_epilogues(epilogue):
    """The epilogue is added once, on the first store, under split-K and several KC blocks too."""
    shape = GemmShape(200, 100)
    buckets = [
        Bucket(2, sch(1, 16, 1, 32, 32)),  # 4 KC blocks per thread: stores accumulate
        Bucket(20, sch(4, 24, 8, 48, 48, pm=1, pn=1, pk=2)),  # split-K
        Bucket(1 << 62, sch(6, 16, 12, 64, 128, pm=2, pn=1)),
    ]
    func = linear_primfunc(shape, buckets, epilogue=epilogue)
    fn = tvm.compile(tvm.IRModule({"linear": func}), target=host_target(2)).mod["linear"]
    rng = np.random.default_rng(2)
    w = rng.standard_normal((shape.n, shape.k)).astype("float32")
    wp = tvm.runtime.tensor(pack_weight(w, "avx2"))
    for m in (1, 2, 3, 17, 20, 61):
        a = rng.standard_normal((m, shape.k)).astype("float32")
        extra = rng.standard_normal((m, shape.n) if epilogue == "residual" else (shape.n,)).astype("float32")
        y = tvm.runtime.empty((m, shape.n), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), wp, tvm.runtime.tensor(extra), y)
        np.testing.assert_allclose(y.numpy(), a @ w.T + extra, rtol=2e-4, atol=2e-3, err_msg=f"m={m}")
    with pytest.raises(KernelError, match="unknown epilogue"):
        linear_primfunc(shape, buckets, epilogue="gelu")


def test_silu_mul_epilogue_on_the_interleaved_gate_up():
    """silu(gate) * up for tiles of even (in registers, one or several KC blocks) and odd vector
    counts, split-K, and n not a multiple of the tile."""
    from sandwich_tvm.kernels.codegen import interleave_gate_up

    inter, k = 104, 100  # 2 x 104 = 208 columns: 13 x 16, not a multiple of 24 or 32
    shape = GemmShape(2 * inter, k)
    buckets = [
        Bucket(1, sch(1, 16, 1, 32, 128)),  # 2 vectors, KC covers k: pairs straight from registers
        Bucket(3, sch(3, 16, 3, 32, 32)),  # 2 vectors, 4 KC blocks: pairs on the last block
        Bucket(5, sch(2, 24, 4, 48, 64, pm=2, pn=1)),  # 3 vectors: scratch, then a pass
        Bucket(20, sch(4, 16, 8, 32, 48, pm=1, pn=1, pk=2)),  # split-K
        Bucket(1 << 62, sch(4, 32, 8, 64, 256)),
    ]
    func = linear_primfunc(shape, buckets, epilogue="silu_mul")
    fn = tvm.compile(tvm.IRModule({"linear": func}), target=host_target(2)).mod["linear"]
    rng = np.random.default_rng(3)
    w = rng.standard_normal((shape.n, k)).astype("float32") * 0.3
    wp = tvm.runtime.tensor(pack_weight(interleave_gate_up(w, 8), "avx2"))
    for m in (1, 2, 3, 4, 5, 9, 20, 33):
        a = rng.standard_normal((m, k)).astype("float32")
        g, u = np.split(a.astype(np.float64) @ w.T.astype(np.float64), 2, axis=1)
        want = g / (1 + np.exp(-g)) * u
        y = tvm.runtime.empty((m, inter), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), wp, y)
        np.testing.assert_allclose(y.numpy(), want, rtol=2e-4, atol=2e-3, err_msg=f"m={m}")
    with pytest.raises(KernelError, match="multiple of 16"):
        linear_primfunc(GemmShape(200, k), buckets, epilogue="silu_mul")
