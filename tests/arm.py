"""Arm code run on an emulated aarch64 (``scripts/arm_env.py``: qemu-user ``-cpu max``, NEON,
dotprod, BF16): every Arm GEMM micro-kernel (``bench crosscheck``) and the whole model built
for Arm (``bench.crossmodel``), built here and run there.

One session fixture (``arm_runs`` in ``conftest.py``) does all of it, two processes at a time
on the two cores: the kernel bundle and the model bundles build side by side, then the two
emulated runs go side by side (TVM's import alone takes ten seconds under emulation). The
tests then read what came back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARM_PYTHON = REPO / ".arm64" / "python"
ARM_ISAS = ["neon", "neondot", "neonbf16"]  # every Arm micro-kernel ISA
PROMPT = [5, 17, 42, 99, 3, 250, 7, 1, 8, 13, 21, 60, 2, 77, 31, 90, 4, 11, 64, 35]  # 20 tokens
STEPS = 8
# model case: (checkpoint, weight dtype, KV cache dtype, int8 activations)
MODEL_CASES = {
    "fp32": ("gqa-tied-llama3", "float32", "float32", False),
    "bf16-bfdot": ("gqa-tied-llama3", "bfloat16", "float16", False),
    "q4_1-sdot": ("gqa-small", "q4_1", "int8", True),  # whole blocks of 32
}


@dataclass
class ArmRuns:
    kernels: Path  # the crosscheck bundle
    kernel_report: dict  # the emulated run's JSON report
    kernel_stdout: str
    models: Path  # a bundle per model case; their outputs in models / "out" / CASE.npz
    cpu: dict  # the emulated CPU's description (``python -m sandwich_tvm.host --describe``)


def skip_reason() -> str | None:
    """Why the Arm code cannot run here, or None."""
    from sandwich_tvm.host import host_isa
    from sandwich_tvm.tvm_compat import cross_linker

    if host_isa() == "neon":
        return "an Arm host runs the Arm code in the kernel and model tests themselves"
    if not ARM_PYTHON.exists():
        return f"no emulated Arm Python at {ARM_PYTHON}: run `.venv/bin/python scripts/arm_env.py`"
    if cross_linker("aarch64-linux-gnu") is None:
        return "no linker for aarch64 here: pip install ziglang"
    return None


def _finish(proc: subprocess.Popen, what: str, codes: tuple[int, ...] = (0,)) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode in codes, f"{what} failed:\n{out[-2000:]}\n{err[-3000:]}"
    return out


def build_and_run(base: Path, hf_base: Path) -> ArmRuns:
    from sandwich_tvm.kernels.microkernel import ISAS

    from .model.hf_models import hf_checkpoint

    describe = subprocess.run([str(ARM_PYTHON), "-m", "sandwich_tvm.host", "--describe"], capture_output=True,
                              text=True, timeout=300, check=True)
    cpu = json.loads(describe.stdout)
    (base / "cpu.json").write_text(describe.stdout)
    dtypes = sorted({d for isa in ARM_ISAS for d in ISAS[isa].dtypes})
    kernels, models = base / "kernels", base / "models"
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    here, there = [sys.executable, "-m"], [str(ARM_PYTHON), "-m"]
    build_kernels = subprocess.Popen([*here, "sandwich_tvm.bench", "crosscheck", "build", "--isas",
                                      ",".join(ARM_ISAS), "--dtypes", ",".join(dtypes), "--no-timing",
                                      "--out", str(kernels)], **pipe)
    env = {**os.environ, "SANDWICH_CPU": str(base / "cpu.json"), "SANDWICH_CACHE": str(base / "cache")}
    for name, (ckpt, dtype, kv, int8) in MODEL_CASES.items():  # one after the other, beside the kernels
        model_dir = hf_checkpoint(hf_base, ckpt)
        cmd = [*here, "sandwich_tvm.bench.crossmodel", "build", "--model", str(model_dir), "--out",
               str(models / name), "--dtype", dtype, "--kv-dtype", kv, *["--int8-activations"] * int8]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    _finish(build_kernels, "building the Arm kernels")
    run_kernels = subprocess.Popen([*there, "sandwich_tvm.bench.crosscheck", "run", str(kernels),
                                    "--json", str(base / "kernels.json")], **pipe)
    run_models = subprocess.Popen([*there, "sandwich_tvm.bench.crossmodel", "run",
                                   *[str(models / name) for name in MODEL_CASES], "--prompt",
                                   ",".join(map(str, PROMPT)), "--steps", str(STEPS), "--out",
                                   str(models / "out")], **pipe)
    kernel_stdout = _finish(run_kernels, "the emulated kernel run", (0, 1))  # 1: a kernel disagrees
    _finish(run_models, "the emulated model run")
    return ArmRuns(kernels, json.loads((base / "kernels.json").read_text()), kernel_stdout, models, cpu)
