"""`scripts/tuning_in_minutes.py --holdout cpu`: the world holds nothing this CPU would read."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import sandwich_tvm.host as host
import sandwich_tvm.kernels.database as database

SCRIPT = Path(__file__).parents[2] / "scripts" / "tuning_in_minutes.py"


def _script():
    spec = importlib.util.spec_from_file_location("tuning_in_minutes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(root: Path, cpu: host.CpuSignature, measured: bool = False) -> Path:
    """One record (or measurement file) of a 64 x 32 fp32 GEMM tuned on ``cpu``."""
    folder = root / cpu.slug / "t2" / ("measured" if measured else "")
    folder.mkdir(parents=True, exist_ok=True)
    head = {"cpu": cpu.to_json(), "n": 64, "k": 32, "dtype": "float32"}
    path = folder / ("linear_n64_k32_float32" + (".jsonl" if measured else ".json"))
    path.write_text(json.dumps(head) + ("\n" if measured else ""))
    return path


def test_holding_the_cpu_out_drops_every_folder_it_would_read(tmp_path, monkeypatch):
    here = host.CpuSignature("AuthenticAMD", "AMD EPYC", 25, 1, 1, "avx2", ("avx2", "fma"), 32, 512, 32768)
    older = dataclasses.replace(here, model=None, stepping=None, features=None, l1d_kib=None, l2_kib=None)
    other = dataclasses.replace(here, family=26, isa="avx512", features=("avx2", "avx512f", "fma"))
    shipped = tmp_path / "shipped"
    _write(shipped, here)
    _write(shipped, here, measured=True)
    _write(shipped, older)  # a partial signature that agrees with this CPU
    kept = [_write(shipped, other), _write(shipped, other, measured=True)]
    monkeypatch.setattr(database, "SHIPPED_DIR", shipped)
    monkeypatch.setattr(host, "host_signature", lambda: here)

    world = tmp_path / "world"
    info = _script().build_world(world, "llama-3.2-1b", "cpu", None)

    assert info["files"] == 2 and info["without_cpu"] == here.slug
    assert sorted(world.rglob("linear_*")) == sorted(world / p.relative_to(shipped) for p in kept)
