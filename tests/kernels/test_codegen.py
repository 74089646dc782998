"""Generated kernels against numpy, for m from 1 to 300 (every tail: ``TAIL_MS``) and odd n and
k, on every ISA this CPU runs; every ISA's kernel is also built and its assembly checked for
that ISA's registers."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.kernels.codegen import Bucket, KernelError, linear_primfunc, pack_weight
from sandwich_tvm.kernels.defaults import default_buckets
from sandwich_tvm.kernels.microkernel import ISAS, MicroKernel
from sandwich_tvm.kernels.schedule import GemmSchedule, GemmShape, Polymerization, Slice
from sandwich_tvm.model.config import load_config
from sandwich_tvm.tvm_compat import host_target, isa_target, tvm

from ..isas import TAIL_MS, VECTOR_REGISTER, assembly, every_isa, require_runnable

pytestmark = pytest.mark.compile


def sch(isa, mr, vectors, mc, nc_vectors, kc, pm=1, pn=2, pk=1) -> GemmSchedule:
    """MR x (vectors of the ISA) tile; NC counted in vectors too, so one table serves every ISA."""
    lanes = ISAS[isa].lanes
    return GemmSchedule(MicroKernel(isa, mr, vectors * lanes), Slice(mc, nc_vectors * lanes, kc),
                        Polymerization(pm, pn, pk))


def split_tile(isa, kc=48, **poly) -> GemmSchedule:
    """A 4-vector tile whose accumulator exceeds 1 KB: one buffer per vector column."""
    mr = 256 // (4 * ISAS[isa].lanes)
    return sch(isa, mr, 4, 2 * mr, 8, kc, **poly)


def build(shape: GemmShape, buckets):
    func = linear_primfunc(shape, buckets)
    return tvm.compile(tvm.IRModule({"linear": func}), target=host_target(2)).mod["linear"]


def check(fn, shape: GemmShape, ms, rng, isa):
    w = rng.standard_normal((shape.n, shape.k)).astype("float32")
    wp = tvm.runtime.tensor(pack_weight(w, isa))
    for m in ms:
        a = rng.standard_normal((m, shape.k)).astype("float32")
        y = tvm.runtime.empty((m, shape.n), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), wp, y)
        tol = 2e-4 * np.sqrt(shape.k)
        np.testing.assert_allclose(y.numpy(), a @ w.T, rtol=2e-4, atol=tol, err_msg=f"m={m}")


@every_isa
def test_every_m_with_tails_and_split_k(isa):
    require_runnable(isa)
    # n = 200: not a multiple of 2 or 3 vectors; k = 100: not a multiple of KC = 48
    shape = GemmShape(200, 100)
    buckets = [
        Bucket(1, sch(isa, 1, 2, 1, 4, 48)),
        Bucket(5, sch(isa, 2, 3, 4, 6, 32, pk=1, pn=1, pm=2)),
        Bucket(40, sch(isa, 4, 3, 8, 6, 48, pm=1, pn=1, pk=2)),  # split-K
        Bucket(80, split_tile(isa)),
        Bucket(1 << 62, sch(isa, 6, 2, 12, 8, 48, pm=2, pn=1)),
    ]
    check(build(shape, buckets), shape, TAIL_MS, np.random.default_rng(0), isa)


@pytest.mark.parametrize("preset", ["llama-160m", "tinyllama-1.1b"])
@every_isa
def test_model_shapes_random_m(preset, isa):
    require_runnable(isa)
    cfg = load_config(preset)
    rng = np.random.default_rng(1)
    h, d = cfg.hidden_size, cfg.head_dim
    shape = GemmShape((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d, h)  # fused qkv
    buckets = [Bucket(3, sch(isa, 3, 2, 3, 8, 256)),
               Bucket(1 << 62, sch(isa, 6, 2, 24, 16, 512, pk=2, pn=1))]
    fn = build(shape, buckets)
    check(fn, shape, [1, 2, 3, 4, 7, *rng.integers(8, 700, size=3).tolist()], rng, isa)


@every_isa
def test_default_kernel_builds_with_the_isas_vector_registers(isa):
    """Built (not run) for every ISA: the assembly uses that ISA's full-width registers."""
    shape = GemmShape(200, 96)
    func = linear_primfunc(shape, default_buckets(shape, 2, None, isa))
    asm = assembly(tvm.compile(tvm.IRModule({"linear": func}), target=isa_target(isa, 2)))
    assert VECTOR_REGISTER[isa] in asm
    if isa == "avx2":
        assert "%zmm" not in asm  # no AVX-512 in AVX2 code, whatever this host has


def test_bad_schedule_is_refused():
    with pytest.raises(KernelError, match="whole number"):
        linear_primfunc(GemmShape(64, 64), [Bucket(1, sch("avx2", 6, 2, 8, 2, 64))])
    with pytest.raises(KernelError, match="float32"):
        linear_primfunc(GemmShape(64, 64, "float16"), [Bucket(1, sch("avx2", 6, 2, 6, 2, 64))])


@every_isa
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
@every_isa
def test_fused_epilogues(epilogue, isa):
    """The epilogue is added once, on the first store, under split-K and several KC blocks too."""
    require_runnable(isa)
    shape = GemmShape(200, 100)
    buckets = [
        Bucket(2, sch(isa, 1, 2, 1, 4, 32)),  # 4 KC blocks per thread: stores accumulate
        Bucket(20, sch(isa, 4, 3, 8, 6, 48, pm=1, pn=1, pk=2)),  # split-K
        Bucket(40, split_tile(isa, kc=32)),  # accumulator split by vector column, 4 KC blocks
        Bucket(1 << 62, sch(isa, 6, 2, 12, 8, 128, pm=2, pn=1)),
    ]
    func = linear_primfunc(shape, buckets, epilogue=epilogue)
    fn = tvm.compile(tvm.IRModule({"linear": func}), target=host_target(2)).mod["linear"]
    rng = np.random.default_rng(2)
    w = rng.standard_normal((shape.n, shape.k)).astype("float32")
    wp = tvm.runtime.tensor(pack_weight(w, isa))
    for m in (1, 2, 3, 17, 20, 33, 61):
        a = rng.standard_normal((m, shape.k)).astype("float32")
        extra = rng.standard_normal((m, shape.n) if epilogue == "residual" else (shape.n,)).astype("float32")
        y = tvm.runtime.empty((m, shape.n), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), wp, tvm.runtime.tensor(extra), y)
        np.testing.assert_allclose(y.numpy(), a @ w.T + extra, rtol=2e-4, atol=2e-3, err_msg=f"m={m}")
    with pytest.raises(KernelError, match="unknown epilogue"):
        linear_primfunc(shape, buckets, epilogue="gelu")


@every_isa
def test_silu_mul_epilogue_on_the_interleaved_gate_up(isa):
    """silu(gate) * up for tiles of even (in registers, one or several KC blocks) and odd vector
    counts, split-K, and n not a multiple of the tile."""
    from sandwich_tvm.kernels.packing import interleave_gate_up

    require_runnable(isa)
    lanes = ISAS[isa].lanes
    inter, k = 13 * lanes, 100  # 2 x 13 vectors of columns: not a multiple of 3 or 4 vectors
    shape = GemmShape(2 * inter, k)
    buckets = [
        Bucket(1, sch(isa, 1, 2, 1, 4, 128)),  # 2 vectors, KC covers k: pairs straight from registers
        Bucket(3, sch(isa, 3, 2, 3, 4, 32)),  # 2 vectors, 4 KC blocks: pairs on the last block
        Bucket(5, sch(isa, 2, 3, 4, 6, 64, pm=2, pn=1)),  # 3 vectors: scratch, then a pass
        Bucket(20, sch(isa, 4, 2, 8, 4, 48, pm=1, pn=1, pk=2)),  # split-K
        Bucket(28, split_tile(isa, kc=32)),  # split accumulator, pairs over 4 KC blocks
        Bucket(1 << 62, split_tile(isa, kc=256)),  # split accumulator, pairs from registers
    ]
    func = linear_primfunc(shape, buckets, epilogue="silu_mul")
    fn = tvm.compile(tvm.IRModule({"linear": func}), target=host_target(2)).mod["linear"]
    rng = np.random.default_rng(3)
    w = rng.standard_normal((shape.n, k)).astype("float32") * 0.3
    wp = tvm.runtime.tensor(pack_weight(interleave_gate_up(w, lanes), isa))
    for m in (1, 2, 3, 4, 5, 9, 20, 25, 33):
        a = rng.standard_normal((m, k)).astype("float32")
        g, u = np.split(a.astype(np.float64) @ w.T.astype(np.float64), 2, axis=1)
        want = g / (1 + np.exp(-g)) * u
        y = tvm.runtime.empty((m, inter), "float32", tvm.cpu())
        fn(tvm.runtime.tensor(a), wp, y)
        np.testing.assert_allclose(y.numpy(), want, rtol=2e-4, atol=2e-3, err_msg=f"m={m}")
    with pytest.raises(KernelError, match=rf"multiple of {2 * lanes}"):
        linear_primfunc(GemmShape(200, k), buckets, epilogue="silu_mul")


def test_a_kernel_parsed_once_serves_every_module_it_goes_into(monkeypatch, tmp_path):
    """The same generated source is parsed once (``tvm_compat.parse_tvmscript``): later builds
    get the same PrimFunc, which compiles into two modules and computes the product in each;
    another process loads it from the cache instead of parsing it. Another source, a checked
    request of an unchecked parse, the tuner's unkept candidates, a kernel pushed out of the
    bounded store and a damaged cache file are parsed again."""
    from collections import OrderedDict

    from sandwich_tvm import tvm_compat
    from sandwich_tvm.kernels.codegen import linear_source

    monkeypatch.setenv("SANDWICH_CACHE", str(tmp_path))
    parsed = []
    real = tvm.script.from_source
    monkeypatch.setattr(tvm.script, "from_source",
                        lambda src, **kw: parsed.append(kw["check_well_formed"]) or real(src, **kw))
    monkeypatch.setattr(tvm_compat, "_parsed", OrderedDict())
    shape = GemmShape(40, 72)
    buckets = default_buckets(shape, 2)
    first = linear_primfunc(shape, buckets)
    assert linear_primfunc(shape, buckets) is first and parsed == [True]
    other = linear_primfunc(shape, buckets, name="other")
    assert other is not first and parsed == [True, True]
    rng, isa = np.random.default_rng(3), tvm_compat.host_isa()
    alone = tvm.compile(tvm.IRModule({"linear": first}), target=host_target(2)).mod
    both = tvm.compile(tvm.IRModule({"linear": first, "other": other}), target=host_target(2)).mod
    for fn in (alone["linear"], both["linear"], both["other"]):
        check(fn, shape, [1, 3, 37], rng, isa)

    # another process: nothing parsed in memory, the cache holds the checked kernel
    stored = tvm_compat.parsed_path(linear_source(shape, buckets, "linear", None))
    assert stored.is_file()  # under the TVM build that parsed it: LLVM's intrinsic ids are in its JSON
    assert f"-llvm{tvm.target.codegen.llvm_version_major()}-" in stored.parent.name
    monkeypatch.setattr(tvm_compat, "_parsed", OrderedDict())
    loaded = linear_primfunc(shape, buckets)
    assert len(parsed) == 2 and loaded is not first
    tvm.ir.assert_structural_equal(loaded, first)
    check(tvm.compile(tvm.IRModule({"linear": loaded}), target=host_target(2)).mod["linear"], shape, [5],
          rng, isa)
    stored.write_bytes(stored.read_bytes()[:100])  # damaged: parsed again, and the file replaced
    monkeypatch.setattr(tvm_compat, "_parsed", OrderedDict())
    tvm.ir.assert_structural_equal(linear_primfunc(shape, buckets), first)
    assert len(parsed) == 3 and tvm_compat._load_parsed(stored) is not None

    unchecked = GemmShape(48, 72)
    linear_primfunc(unchecked, buckets, check_well_formed=False)
    assert linear_primfunc(unchecked, buckets, check_well_formed=False) is not None
    assert not tvm_compat.parsed_path(linear_source(unchecked, buckets, "linear", None)).exists()
    linear_primfunc(unchecked, buckets)  # now asked with the check: parsed again, checked
    assert parsed[3:] == [False, True]
    tuned = GemmShape(56, 72)
    for _ in range(2):  # the tuner's candidates: parsed every time, never kept
        linear_primfunc(tuned, buckets, check_well_formed=False, reuse=False)
    assert parsed[5:] == [False, False] and len(tvm_compat._parsed) == 2
    assert not tvm_compat.parsed_path(linear_source(tuned, buckets, "linear", None)).exists()

    monkeypatch.setattr(tvm_compat, "PARSED_SOURCE_BYTES", max(s for _, _, s in tvm_compat._parsed.values()))
    linear_primfunc(shape, buckets, name="last")  # the store now holds one kernel: this one
    assert len(tvm_compat._parsed) == 1
    stored.unlink()
    assert linear_primfunc(shape, buckets) is not first and parsed[-1] is True
