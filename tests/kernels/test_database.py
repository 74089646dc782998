"""The tuning database is keyed by a CPU signature; foreign or damaged records get clear errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sandwich_tvm.host import CpuSignature, host_signature, llvm_mattr
from sandwich_tvm.kernels.database import (
    KernelRecord,
    ScheduleDbError,
    find_record,
    load_record,
    record_path,
    save_record,
)
from sandwich_tvm.kernels.defaults import default_schedule
from sandwich_tvm.kernels.schedule import GemmShape
from sandwich_tvm.kernels.search import Tuned
from sandwich_tvm.kernels.tuner import tune_gemm

SHAPE = GemmShape(96, 64)


def _record(cpu: CpuSignature, threads: int = 2) -> KernelRecord:
    sch = default_schedule(SHAPE, 1, threads, cpu.isa)
    return KernelRecord(SHAPE, threads, cpu, [Tuned(1, sch, 10.0, True)])


def test_host_signature_survives_a_masked_model_name():
    here = host_signature()
    masked = replace(here, model_name="Intel(R) Xeon(R) Processor")
    assert not here.differences(masked) and masked.slug == masked.slug
    assert here.isa in here.slug and here.features is not None
    assert CpuSignature.from_json(json.loads(json.dumps(here.to_json()))) == here


def test_record_from_another_cpu_signature_is_refused(tmp_path):
    here = host_signature()
    other = replace(here, stepping=(here.stepping or 0) + 1, l2_kib=(here.l2_kib or 0) + 512)
    path = save_record(_record(other), tmp_path)
    doctored = record_path(SHAPE, 2, tmp_path)  # copied into this CPU's directory
    doctored.parent.mkdir(parents=True)
    doctored.write_text(path.read_text())
    with pytest.raises(ScheduleDbError, match=r"stepping.*l2_kib.*re-tune with `python -m sandwich_tvm"):
        find_record(SHAPE, 2, tmp_path)
    with pytest.raises(ScheduleDbError, match="tuned on"):
        load_record(path)
    assert load_record(path, check_host=False).cpu == other


def test_partial_signature_matches_where_both_know(tmp_path):
    here = host_signature()
    partial = replace(here, model=None, stepping=None, features=None, l1d_kib=None)
    save_record(_record(partial), tmp_path)
    assert find_record(SHAPE, 2, tmp_path).cpu == partial
    foreign = replace(partial, family=(here.family or 0) + 1)
    assert find_record(SHAPE, 2, tmp_path, foreign) is None


@pytest.mark.parametrize("damage", ["truncated", "not json", "zero slice", "wrong isa", "old format"])
def test_damaged_records_name_the_file(tmp_path, damage):
    path = save_record(_record(host_signature()), tmp_path)
    d = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:100])
    elif damage == "not json":
        path.write_bytes(b"\x00\xff binary")
    elif damage == "zero slice":
        d["tuned"][0]["schedule"]["slice"] = [0, 0, 0]
        path.write_text(json.dumps(d))
    elif damage == "wrong isa":
        d["tuned"][0]["schedule"]["mk"]["isa"] = "neon" if host_signature().isa != "neon" else "avx2"
        path.write_text(json.dumps(d))
    else:
        d["format"], d["cpu"] = 1, "AMD EPYC"
        path.write_text(json.dumps(d))
    with pytest.raises(ScheduleDbError, match=rf"{path.name}.*not a usable.*delete it"):
        find_record(SHAPE, 2, tmp_path)


def test_tune_sets_an_unusable_record_aside_and_starts_afresh(tmp_path):
    path = record_path(SHAPE, 2, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{truncated")
    logs = []
    rec = tune_gemm(SHAPE.n, SHAPE.k, threads=2, max_m=1, root=tmp_path, log=logs.append,
                    search_one=lambda p, mks, top: (default_schedule(SHAPE, p.m, 2), 5.0))
    assert [t.m for t in rec.tuned] == [1] and load_record(path).tuned[0].gflops == 5.0
    aside = list(path.parent.glob("*.unusable-*.json"))
    assert len(aside) == 1 and aside[0].read_text() == "{truncated"
    assert "set it aside" in logs[0]


@pytest.mark.parametrize("bad", [{"max_m": 0}, {"max_m": -4}, {"window": 0}, {"threads": -1}])
def test_tune_rejects_nonsense_arguments(tmp_path, bad):
    kwargs = {"threads": 2, "max_m": 4, "window": 16, **bad}
    with pytest.raises(ValueError, match="must all be positive"):
        tune_gemm(SHAPE.n, SHAPE.k, root=tmp_path, search_one=lambda *a: None, **kwargs)
    assert not any(tmp_path.iterdir())


def test_llvm_mattr_follows_the_flags_not_the_cpu_name():
    xeon = {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"}
    mattr = llvm_mattr(xeon)
    assert {"+amx-tile", "+amx-bf16", "+avx512bf16", "+avx512fp16"} <= set(mattr)
    zen3 = llvm_mattr({"avx2", "fma", "f16c"})
    assert "+avx2" in zen3 and {"-avx512f", "-amx-tile"} <= set(zen3)
    arm = llvm_mattr({"asimd", "asimddp", "sve", "sve2"})  # SVE off whatever the CPU name (TVM 0.27)
    assert "+dotprod" in arm and {a for a in arm if a.startswith("-")} == {"-sve", "-sve2"}


def test_target_isa_reads_the_target_not_the_host():
    from sandwich_tvm.tvm_compat import host_isa, host_target, isa_target, target_isa, tvm

    assert target_isa(host_target(2)) == host_isa()
    assert [target_isa(isa_target(i)) for i in ("avx2", "avx512", "neon")] == ["avx2", "avx512", "neon"]
    zen3 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": llvm_mattr({"avx2", "fma"}),
                              "num-cores": 2})
    assert target_isa(zen3) == "avx2"  # LLVM's name says AVX-512, the flags do not


def test_a_record_tuned_on_the_base_isa_before_its_unit_existed_is_used_as_missing(tmp_path, capsys):
    """An AVX-VNNI CPU's q8_0 record from before the avxvnni unit (tuned on AVX2 tiles): not an
    error that stops the model, a note and the defaults (``tune kernels`` re-tunes it)."""
    from sandwich_tvm.kernels.database import StaleRecordError, read_record
    from sandwich_tvm.kernels.microkernel import ISAS, kernel_isa

    here = host_signature()
    flags = {*(here.features or ()), "avx2", "fma", "avx_vnni"}
    vnni = replace(here, isa="avx2", features=tuple(sorted(flags)))
    shape = GemmShape(96, 64, "q8_0")
    assert kernel_isa("avx2", "q8_0", flags) == "avxvnni" and "avx2" not in ISAS["avxvnni"].extends
    old = KernelRecord(shape, 2, vnni, [Tuned(1, default_schedule(shape, 1, 2, "avx2"), 10.0, True)])
    path = save_record(old, tmp_path)
    with pytest.raises(StaleRecordError, match="earlier version.*avx2 tile.*avxvnni tiles"):
        read_record(path)
    assert find_record(shape, 2, tmp_path, vnni) is None
    assert find_record(shape, 2, tmp_path, vnni) is None  # said once
    assert capsys.readouterr().err.count("is from an earlier version") == 1
    # another CPU's record in this CPU's folder is named as such, stale or not
    other = replace(vnni, family=(vnni.family or 0) + 1)
    doctored = KernelRecord(shape, 2, other, old.tuned)
    path.write_text(json.dumps(doctored.to_json()))
    with pytest.raises(ScheduleDbError, match="tuned on"):
        find_record(shape, 2, tmp_path, vnni)


def test_an_amx_int8_record_from_before_amxdq_is_used_as_missing(tmp_path):
    """AMX CPUs ran q8_0 on AMX-INT8 tiles before amxdq (AMX-BF16 tiles on dequantized slices)
    became their unit; a record of those tiles is out of date, not damaged; a record with a tile
    no unit of the CPU has stays damaged."""
    from sandwich_tvm.kernels.database import StaleRecordError, read_record
    from sandwich_tvm.kernels.microkernel import kernel_isa, microkernels

    flags = {"avx512f", "avx2", "fma", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
    amx = replace(host_signature(), isa="avx512", features=tuple(sorted(flags)))
    shape = GemmShape(96, 64, "q8_0")
    assert kernel_isa("avx512", "q8_0", flags) == "amxdq"
    tile = next(mk for mk in microkernels("amxint8", "q8_0") if mk not in microkernels("amxdq", "q8_0"))
    sch = default_schedule(shape, 32, 2, "amxint8")
    sch = replace(sch, mk=tile, slice=replace(sch.slice, mc=32, nc=32, kc=64))  # whole 16x16 tiles
    path = save_record(KernelRecord(shape, 2, amx, [Tuned(32, sch, 10.0, True)]), tmp_path)
    with pytest.raises(StaleRecordError, match="amxint8 tile"):
        read_record(path)
    neon = replace(sch, mk=microkernels("neon", "q8_0")[0])
    path.write_text(json.dumps(KernelRecord(shape, 2, amx, [Tuned(32, neon, 10.0, True)]).to_json()))
    with pytest.raises(ScheduleDbError, match="not a usable") as err:
        read_record(path)
    assert not isinstance(err.value, StaleRecordError)
