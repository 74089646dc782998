"""Records are tuned with the epilogue the model fuses: the workload carries it, the runner
feeds its operands, the record is kept per epilogue, and the model falls back to the plain
record where no fused one was tuned."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sandwich_tvm.host import host_signature
from sandwich_tvm.kernels.codegen import Bucket, linear_primfunc
from sandwich_tvm.kernels.database import KernelRecord, find_record, record_path, save_record
from sandwich_tvm.kernels.defaults import default_schedule
from sandwich_tvm.kernels.metaschedule import linear_workload, workload_shape
from sandwich_tvm.kernels.microkernel import kernel_isa
from sandwich_tvm.kernels.packing import WeightLayout
from sandwich_tvm.kernels.schedule import GemmShape
from sandwich_tvm.kernels.search import Tuned
from sandwich_tvm.kernels.tuner import tune_gemm
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.linear import KernelSet
from sandwich_tvm.model.shapes import linear_shapes
from sandwich_tvm.tvm_compat import host_isa, host_target, tvm

pytestmark = pytest.mark.usefixtures("small_rotation")


def _silu(x):
    return x / (1 + np.exp(-x))


@pytest.mark.compile
@pytest.mark.parametrize("epilogue", ["none", "residual", "bias", "silu_mul"])
def test_workload_computes_the_epilogue_the_kernel_fuses(epilogue):
    """The tuning workload (what MetaSchedule schedules and the runner feeds) and the generated
    kernel compute the same thing, and the workload names its shape and epilogue."""
    n, k, m, isa = 64, 24, 3, host_isa()
    lanes = WeightLayout(isa).lanes
    n = max(n, 4 * lanes)
    mod = linear_workload(m, n, k, isa, "float32", epilogue)
    assert workload_shape(mod) == (m, GemmShape(n, k, "float32", epilogue))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((n, k), np.float32)
    y = x @ w.T
    extra, want = [], y
    if epilogue in ("residual", "bias"):
        extra = [rng.standard_normal((m, n) if epilogue == "residual" else n, np.float32)]
        want = y + extra[0]
    elif epilogue == "silu_mul":  # gate_up = cat(gate, up) rows; the packing interleaves them
        want = _silu(y[:, : n // 2]) * y[:, n // 2:]
    layout = WeightLayout(isa, "float32", interleave=epilogue == "silu_mul")
    n_out = n // 2 if epilogue == "silu_mul" else n
    shape = GemmShape(n, k, "float32", epilogue)
    kernel = linear_primfunc(shape, [Bucket(1 << 62, default_schedule(shape, m, 2, isa))], "main")
    for func in (mod["main"], kernel):
        out = tvm.runtime.empty((m, n_out), "float32", tvm.cpu())
        args = [tvm.runtime.tensor(a) for a in (x, layout.pack(w), *extra)]
        tvm.compile(tvm.IRModule({"main": func}), target=host_target(2))["main"](*args, out)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.compile
def test_tune_with_the_residual_keeps_its_own_record(tmp_path):
    rec = tune_gemm(96, 64, threads=2, max_m=2, root=tmp_path, epilogue="residual")
    assert rec.shape == GemmShape(96, 64, "float32", "residual") and all(t.gflops > 0 for t in rec.tuned)
    path = record_path(rec.shape, 2, tmp_path)
    assert path.name == "linear_n96_k64_float32_residual.json" and path.is_file()
    assert not record_path(GemmShape(96, 64), 2, tmp_path).exists()
    assert find_record(GemmShape(96, 64, "float32", "residual"), 2, tmp_path).shape.epilogue == "residual"


def _record(shape: GemmShape, mr: int, root, ms=(1,)) -> KernelRecord:
    """A record whose schedules have ``mr``-row, one-vector tiles (the defaults never do),
    tuned at ``ms``."""
    isa = kernel_isa(host_isa(), shape.dtype)
    sch = default_schedule(shape, 1, 2, isa)
    lanes = sch.mk.lanes
    sch = replace(sch, mk=replace(sch.mk, mr=mr, nr=lanes), slice=replace(sch.slice, mc=mr, nc=lanes))
    rec = KernelRecord(shape, 2, host_signature(), [Tuned(m, sch, 1.0, True) for m in ms])
    save_record(rec, root)
    return rec


def _tiles(buckets: list[Bucket]) -> list[tuple[int, int]]:
    return [(b.m_max, b.schedule.mk.mr if b.schedule.mk.nr == b.schedule.mk.lanes else 0) for b in buckets]


def test_the_model_takes_the_fused_record_and_falls_back_to_the_plain_one(tmp_path):
    plain, fused = GemmShape(128, 64), GemmShape(128, 64, "float32", "residual")
    _record(plain, 3, tmp_path)
    kernels = KernelSet(prefill_threads=2, decode_threads=2, root=tmp_path)
    # no residual record yet: the plain GEMM's schedule serves the fused kernel
    assert find_record(fused, 2, tmp_path).shape == plain
    assert kernels.buckets(plain, "prefill", "residual")[0].schedule.mk.mr == 3
    assert kernels.sources[("prefill", plain.name)] == "tuned"
    _record(fused, 2, tmp_path)
    assert find_record(fused, 2, tmp_path).shape == fused
    assert kernels.buckets(plain, "prefill", "residual")[0].schedule.mk.mr == 2
    assert kernels.buckets(plain, "prefill", "none")[0].schedule.mk.mr == 3


def test_a_fused_record_tuned_to_smaller_m_hands_over_to_the_plain_one(tmp_path):
    """Decode-only epilogue records (m <= 2) must not put prefill back on default schedules
    where the plain record was tuned further (m <= 8); beyond both, the defaults."""
    plain = GemmShape(128, 64)
    _record(plain, 3, tmp_path, ms=(1, 8))
    _record(GemmShape(128, 64, "float32", "residual"), 2, tmp_path, ms=(1, 2))
    prefill = KernelSet(prefill_threads=2, decode_threads=2, root=tmp_path)
    buckets = prefill.buckets(plain, "prefill", "residual")
    assert _tiles(buckets)[:2] == [(2, 2), (8, 3)]
    assert buckets[-1].m_max == 1 << 62 and _tiles(buckets)[-1][1] == 0  # a default tile
    decode = KernelSet(prefill_threads=2, decode_threads=2, max_batch=2, root=tmp_path)
    assert _tiles(decode.buckets(plain, "decode", "residual")) == [(1 << 62, 2)]


def test_model_shapes_carry_the_epilogues_the_model_fuses():
    cfg = load_config("llama-160m")
    one = linear_shapes(cfg, "float32", 1, "avx2")
    assert {name: s.epilogue for name, s in one.items()} == {
        "qkv": "none", "o": "residual", "gate_up": "silu_mul", "down": "residual", "lm_head": "none"}
    two = linear_shapes(cfg, "float32", 2, "avx2")  # split: the all-reduce adds the residual
    assert two["o"].epilogue == two["down"].epilogue == "none" and two["gate_up"].epilogue == "silu_mul"
    with pytest.raises(ValueError, match="unknown epilogue"):
        GemmShape(8, 8, "float32", "gelu")
