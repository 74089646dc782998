"""Which kernel each Linear calls: tuned records when present, defaults otherwise, per phase and ISA."""

from __future__ import annotations

import pytest

from sandwich_tvm.host import CpuSignature
from sandwich_tvm.kernels.database import KernelRecord, save_record
from sandwich_tvm.kernels.defaults import default_buckets
from sandwich_tvm.kernels.microkernel import ISAS, MicroKernel
from sandwich_tvm.kernels.schedule import GemmSchedule, GemmShape, Polymerization, Slice
from sandwich_tvm.kernels.search import Tuned
from sandwich_tvm.model.linear import KernelSet

from ..isas import ALL_ISAS as VECTOR_ISAS

ALL_ISAS = pytest.mark.parametrize("isa", VECTOR_ISAS)


def fake_cpu(isa: str) -> CpuSignature:
    return CpuSignature("TestVendor", "test cpu", 6, 143, 8, isa, ("fma",), 48, 2048, 491520)


def _sched(isa: str, mr: int, vectors: int, threads: int) -> GemmSchedule:
    mk = MicroKernel(isa, mr, vectors * ISAS[isa].lanes)
    return GemmSchedule(mk, Slice(mr, mk.nr, 64), Polymerization(1, threads, 1))


@ALL_ISAS
def test_tuned_record_is_used_for_its_thread_count_only(tmp_path, isa):
    shape, cpu = GemmShape(64, 32), fake_cpu(isa)
    tuned = [Tuned(1, _sched(isa, 1, 2, 2), 10.0, True), Tuned(4, _sched(isa, 4, 1, 2), 20.0, True),
             Tuned(64, _sched(isa, 6, 2, 2), 30.0, True)]
    save_record(KernelRecord(shape, 2, cpu, tuned), tmp_path)
    ks = KernelSet(prefill_threads=2, decode_threads=1, max_batch=2, root=tmp_path, isa=isa, cpu=cpu)
    prefill = ks.buckets(shape, "prefill")
    default_large = default_buckets(shape, 2, None, isa)[-1].schedule
    assert [b.schedule.mk.mr for b in prefill[:3]] == [1, 4, 6]  # tuned to m=64, then the default
    assert [b.m_max for b in prefill[:3]] == [3, 63, 64] and prefill[-1].m_max > 1 << 40
    assert prefill[-1].schedule == default_large
    assert ks.sources[("prefill", shape.name)] == "tuned"
    decode = ks.buckets(shape, "decode")  # no record for 1 thread: defaults, only m <= 2
    assert ks.sources[("decode", shape.name)] == "default"
    assert decode == default_buckets(shape, 1, 2, isa) and decode[-1].m_max > 1 << 40
    assert all(b.schedule.poly.threads == 1 for b in decode)


@ALL_ISAS
def test_records_of_another_isa_are_not_used(tmp_path, isa):
    shape, cpu = GemmShape(64, 32), fake_cpu(isa)
    save_record(KernelRecord(shape, 2, cpu, [Tuned(1, _sched(isa, 1, 2, 2), 1.0, True)]), tmp_path)
    other = next(i for i in VECTOR_ISAS if i != isa)
    ks = KernelSet(2, 2, root=tmp_path, isa=other, cpu=cpu)
    assert ks.buckets(shape, "prefill") == default_buckets(shape, 2, None, other)
    assert all(b.schedule.mk.isa == other for b in ks.buckets(shape, "prefill"))


@ALL_ISAS
def test_decode_keeps_only_reachable_buckets(tmp_path, isa):
    shape, cpu = GemmShape(64, 32), fake_cpu(isa)
    tuned = [Tuned(1, _sched(isa, 1, 2, 1), 1.0, True), Tuned(2, _sched(isa, 2, 2, 1), 1.0, True),
             Tuned(16, _sched(isa, 6, 2, 1), 1.0, True)]
    save_record(KernelRecord(shape, 1, cpu, tuned), tmp_path)
    ks = KernelSet(1, 1, max_batch=1, root=tmp_path, isa=isa, cpu=cpu)
    assert [b.schedule.mk.mr for b in ks.buckets(shape, "decode")] == [1]
    prefill = ks.buckets(shape, "prefill")
    assert [b.schedule.mk.mr for b in prefill[:3]] == [1, 2, 6]
    assert prefill[2].schedule.poly.threads == 1 and prefill[2].m_max == 16


@ALL_ISAS
def test_untuned_large_m_gets_the_default_schedule(tmp_path, isa):
    shape, cpu = GemmShape(64, 32), fake_cpu(isa)
    tuned = [Tuned(1, _sched(isa, 1, 2, 2), 1.0, True), Tuned(2, _sched(isa, 2, 2, 2), 1.0, True)]
    save_record(KernelRecord(shape, 2, cpu, tuned), tmp_path)
    buckets = KernelSet(2, 2, root=tmp_path, isa=isa, cpu=cpu).buckets(shape, "prefill")
    assert [b.m_max for b in buckets[:2]] == [1, 2]
    defaults = default_buckets(shape, 2, None, isa)
    assert buckets[2:] == [b for b in defaults if b.m_max > 2]


@ALL_ISAS
def test_default_tiles_fit_the_register_file_and_use_its_lanes(isa):
    spec = ISAS[isa]
    for bucket in default_buckets(GemmShape(2048, 2048), 2, None, isa):
        mk = bucket.schedule.mk
        assert mk.isa == isa and mk.nr % spec.lanes == 0
        assert mk.registers_used <= spec.registers


@ALL_ISAS
def test_the_default_gemv_reads_one_panel_at_a_time(isa):
    """At m = 1 a block holds one panel of columns (a thread reads each panel whole, as the
    shipped records chose); larger m keep blocks of up to 16 panels."""
    first, *rest = default_buckets(GemmShape(4096, 2048), 2, None, isa)
    assert first.m_max == 1 and first.schedule.slice.nc == first.schedule.mk.nr
    assert all(b.schedule.slice.nc > b.schedule.mk.nr for b in rest)


def test_bf16_kernels_use_bf16_records_only(tmp_path):
    """A bf16 record serves bf16 weights (on vdpbf16ps where the CPU has it), never fp32 ones."""
    cpu = CpuSignature("TestVendor", "test cpu", 6, 143, 8, "avx512", ("avx512_bf16", "avx512f"), 48, 2048,
                       491520)
    shape = GemmShape(64, 32, "bfloat16")
    mk = MicroKernel("avx512bf16", 2, 32, "bfloat16")
    rec = KernelRecord(shape, 2, cpu, [Tuned(8, GemmSchedule(mk, Slice(2, 32, 16), Polymerization(1, 2, 1)),
                                             1.0, True)])
    assert rec.kernel_isa == "avx512bf16"
    save_record(rec, tmp_path)
    bf16 = KernelSet(2, 2, root=tmp_path, isa="avx512", cpu=cpu, dtype="bfloat16")
    assert bf16.kernel_isa == "avx512bf16"
    assert mk in [b.schedule.mk for b in bf16.buckets(shape, "prefill")]
    assert bf16.sources[("prefill", shape.name)] == "tuned"
    fp32 = KernelSet(2, 2, root=tmp_path, isa="avx512", cpu=cpu)
    assert fp32.buckets(GemmShape(64, 32), "prefill") == default_buckets(GemmShape(64, 32), 2, None, "avx512")
    assert fp32.sources[("prefill", "n64_k32_float32")] == "default"


def test_wider_linears_land_on_their_layers_in_every_pipeline_stage(tmp_path):
    """A Linear held wider (``KernelSet.wider``, keyed by the whole model's layer index) is packed
    and called in its type in the stage that runs its layer, and the other layers keep the
    model's type: a stage counts its layers from its first one."""
    from sandwich_tvm.compiler.artifact import export_with_layouts
    from sandwich_tvm.model.stages import split_layers

    from .gguf_models import tiny_config

    cfg = tiny_config(300)
    kernels = KernelSet(2, 1, root=tmp_path, isa="avx2", dtype="q4_1", wider={(1, "down"): "q8_0"})
    seen = {}
    for stage in split_layers(cfg.num_hidden_layers, 2):
        _, _, hints = export_with_layouts(cfg, kernels, stage=stage)
        seen |= {name: layout.dtype for name, layout in hints["layout"].items() if ".layers." in name}
    assert seen["model.layers.1.mlp.down_proj.weight"] == "q8_0"
    assert seen["model.layers.0.mlp.down_proj.weight"] == "q4_1"
    assert {d for name, d in seen.items() if "down_proj" not in name} == {"q4_1"}
    assert any(shape.dtype == "q8_0" and shape.n == cfg.hidden_size for shape, *_ in kernels.calls.values())
