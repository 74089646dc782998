"""Which kernel each Linear calls: tuned records when present, defaults otherwise, per phase."""

from __future__ import annotations

from sandwich_tvm.kernels.database import KernelRecord, save_record
from sandwich_tvm.kernels.defaults import default_buckets
from sandwich_tvm.kernels.microkernel import REGISTRY
from sandwich_tvm.kernels.schedule import GemmSchedule, GemmShape, Polymerization, Slice
from sandwich_tvm.kernels.search import Tuned
from sandwich_tvm.model.linear import KernelSet
from sandwich_tvm.tvm_compat import host_isa


def _sched(mr: int, nr: int, threads: int) -> GemmSchedule:
    mk = next(m for m in REGISTRY["avx2"] if (m.mr, m.nr) == (mr, nr))
    return GemmSchedule(mk, Slice(mr, nr, 64), Polymerization(1, threads, 1))


def test_tuned_record_is_used_for_its_thread_count_only(tmp_path):
    from sandwich_tvm.kernels.database import host_cpu_model

    shape = GemmShape(64, 32)
    tuned = [Tuned(1, _sched(1, 16, 2), 10.0, True), Tuned(4, _sched(4, 8, 2), 20.0, True),
             Tuned(64, _sched(6, 16, 2), 30.0, True)]
    save_record(KernelRecord(shape, 2, host_cpu_model(), host_isa(), tuned), tmp_path)
    ks = KernelSet(prefill_threads=2, decode_threads=1, max_batch=2, root=tmp_path, isa="avx2")
    prefill = ks.buckets(shape, "prefill")
    assert [b.schedule.mk.mr for b in prefill] == [1, 4, 6, 6]  # tuned to m=64, then the default
    assert [b.m_max for b in prefill[:3]] == [3, 63, 64] and prefill[-1].m_max > 1 << 40
    assert prefill[-1].schedule == default_buckets(shape, 2, None, "avx2")[-1].schedule
    assert ks.sources[("prefill", shape.name)] == "tuned"
    decode = ks.buckets(shape, "decode")  # no record for 1 thread: defaults, only m <= 2
    assert ks.sources[("decode", shape.name)] == "default"
    assert decode == default_buckets(shape, 1, 2, "avx2") and decode[-1].m_max > 1 << 40
    assert all(b.schedule.poly.threads == 1 for b in decode)


def test_decode_keeps_only_reachable_buckets(tmp_path):
    from sandwich_tvm.kernels.database import host_cpu_model

    shape = GemmShape(64, 32)
    tuned = [Tuned(1, _sched(1, 16, 1), 1.0, True), Tuned(2, _sched(2, 16, 1), 1.0, True),
             Tuned(16, _sched(6, 16, 1), 1.0, True)]
    save_record(KernelRecord(shape, 1, host_cpu_model(), host_isa(), tuned), tmp_path)
    ks = KernelSet(1, 1, max_batch=1, root=tmp_path, isa="avx2")
    assert [b.schedule.mk.mr for b in ks.buckets(shape, "decode")] == [1]
    prefill = ks.buckets(shape, "prefill")
    assert [b.schedule.mk.mr for b in prefill] == [1, 2, 6, 6]
    assert prefill[2].schedule.poly.threads == 1 and prefill[2].m_max == 16


def test_untuned_large_m_gets_the_default_schedule(tmp_path):
    from sandwich_tvm.kernels.database import host_cpu_model

    shape = GemmShape(64, 32)
    tuned = [Tuned(1, _sched(1, 16, 2), 1.0, True), Tuned(2, _sched(2, 16, 2), 1.0, True)]
    save_record(KernelRecord(shape, 2, host_cpu_model(), host_isa(), tuned), tmp_path)
    buckets = KernelSet(2, 2, root=tmp_path, isa="avx2").buckets(shape, "prefill")
    assert [b.m_max for b in buckets[:2]] == [1, 2]
    defaults = default_buckets(shape, 2, None, "avx2")
    assert buckets[2:] == [b for b in defaults if b.m_max > 2]
