"""``bench crosscheck``: kernels built into a bundle are checked against numpy by the run side
(which needs only numpy and TVM's runtime), an ISA this CPU lacks is skipped with the reason,
and a kernel that disagrees fails the run."""

from __future__ import annotations

import json

import numpy as np
import pytest

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


def test_kernels_of_another_architecture_are_refused_before_building(tmp_path):
    other = "neondot" if host_isa() != "neon" else "avx512vnni"
    with pytest.raises(SystemExit, match="cannot link them"):
        crosscheck.build([other], tmp_path / "b", ["q8_0"], time_shapes=())
    assert not list((tmp_path / "b").glob("*.so"))


def test_a_bundle_of_another_format_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 0}))
    with pytest.raises(SystemExit, match="rebuild it"):
        crosscheck.run(tmp_path, rounds=1)
