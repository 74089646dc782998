"""``bench crosscheck``: kernels built into a bundle are checked against numpy by the run side
(which needs only numpy and TVM's runtime), an ISA this CPU lacks is skipped with the reason,
and a kernel that disagrees fails the run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sandwich_tvm import host, tvm_compat
from sandwich_tvm.bench import crosscheck
from sandwich_tvm.host import INT8_UNITS, can_run, host_isa


def _runnable_int8_isa() -> str:
    isa = next((i for i in INT8_UNITS.get(host_isa(), ()) if can_run(i)), None)
    if isa is None:
        pytest.skip(f"this CPU ({host_isa()}) has no int8 dot-product unit the kernels use")
    return isa


def test_bundle_checks_here_skips_what_this_cpu_lacks_and_fails_a_wrong_kernel(tmp_path):
    isa = _runnable_int8_isa()
    # an int8 ISA of this architecture that this CPU cannot run (none on an AMX Xeon)
    same_arch = INT8_UNITS.get(host_isa(), ()) + (INT8_UNITS["avx2"] if host_isa() != "neon" else ())
    foreign = [i for i in same_arch if not can_run(i)][:1]
    bundle = tmp_path / "b"
    manifest = crosscheck.build([isa, *foreign], bundle, ["q4_1"], time_shapes=())
    assert {c["isa"] for c in manifest["cases"]} == {isa, *foreign}
    assert all((bundle / c["lib"]).is_file() for c in manifest["cases"])

    report = crosscheck.run(bundle, rounds=1)
    ran = [c for c in report["checks"] if c["isa"] == isa]
    assert [c["epilogue"] for c in ran] == ["none", "residual", "silu_mul"]
    assert all(c["ok"] is True for c in ran)
    skipped = [c for c in report["checks"] if c["isa"] != isa]
    assert len(skipped) == 3 * len(foreign)
    assert all(c["ok"] is None and c["isa"] in c["skipped"] for c in skipped)

    # a weight that is not the kernel's: the run says so and exits 1
    data = dict(np.load(bundle / "data.npz"))
    data[f"{isa}_q4_1_w"] = data[f"{isa}_q4_1_w"] * 1.01
    np.savez(bundle / "data.npz", **data)
    args = type("A", (), {"verb": "run", "bundle": bundle, "rounds": 1, "isas": isa,
                          "json": tmp_path / "r.json"})()
    assert crosscheck.main_crosscheck(args) == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert [c["ok"] for c in report["checks"]][:2] == [False, False]


def test_kernels_of_another_architecture_without_a_cross_linker_are_refused_before_building(
        tmp_path, monkeypatch):
    other = "neondot" if host_isa() != "neon" else "avx512vnni"
    monkeypatch.setattr(tvm_compat, "cross_linker", lambda triple: None)  # no ziglang
    with pytest.raises(SystemExit, match="pip install ziglang"):
        crosscheck.build([host_isa(), other], tmp_path / "b", ["q8_0"], time_shapes=())
    assert not list((tmp_path / "b").glob("*.so"))


def test_an_isa_without_the_asked_types_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="neonbf16 computes none of q8_0"):
        crosscheck.build(["neonbf16"], tmp_path / "b", ["q8_0"], time_shapes=())
    with pytest.raises(SystemExit, match="not a micro-kernel ISA"):
        crosscheck.build(["sve"], tmp_path / "b", ["q8_0"], time_shapes=())


@pytest.mark.compile
def test_arm_kernels_agree_with_numpy_under_emulation(arm_runs):
    """Every Arm (ISA, weight type) kernel, linked here by zig cc, runs on an emulated aarch64
    (qemu-user ``-cpu max``: NEON, dotprod, BF16) against numpy: fp32, widened bf16/f16 and
    dequantized q8_0/q4_0/q4_1 on NEON, int8 ``sdot`` on dotprod, ``bfdot`` pairs on BF16."""
    from sandwich_tvm.kernels.microkernel import ISAS

    from ..arm import ARM_ISAS

    manifest = json.loads((arm_runs.kernels / "manifest.json").read_text())
    pairs = {(c["isa"], c["dtype"]) for c in manifest["cases"]}
    assert pairs == {(isa, d) for isa in ARM_ISAS for d in ISAS[isa].dtypes}
    report = arm_runs.kernel_report
    assert report["cpu"]["machine"] == "aarch64" and report["cpu"]["isa"] == "neon"
    assert report["cpu"]["emulated"] and "emulated on" in report["cpu"]["model"]  # never an Arm CPU's result
    assert {"asimd", "asimddp", "bf16"} <= set(report["cpu"]["flags"])
    assert len(report["checks"]) == 3 * len(pairs)
    assert all(c["ok"] is True for c in report["checks"]), report["checks"]
    assert f"{len(report['checks'])} of {len(report['checks'])} kernels agree" in arm_runs.kernel_log


def test_an_emulated_run_refuses_to_time(tmp_path, monkeypatch):
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": crosscheck.FORMAT, "cases": [], "timings": [{"isa": "neondot"}]}))
    np.savez(tmp_path / "data.npz", x=np.zeros(1))
    monkeypatch.setattr(host, "emulated", lambda: True)
    with pytest.raises(SystemExit, match="--no-timing"):
        crosscheck.run(tmp_path, rounds=1)


def test_a_bundle_of_another_format_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 0}))
    with pytest.raises(SystemExit, match="rebuild it"):
        crosscheck.run(tmp_path, rounds=1)
