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
    kernel_log: str  # the emulated run's output
    models: Path  # a bundle per model case; their outputs in models / "out" / CASE.npz
    cpu: dict  # the emulated CPU's description (``python -m sandwich_tvm.host --describe``)


def skip_reason() -> str | None:
    """Why the Arm code cannot run here, or None."""
    import importlib.metadata
    import platform

    from sandwich_tvm.tvm_compat import cross_linker

    if platform.machine() == "aarch64":
        return "an Arm host runs the Arm code in the kernel and model tests themselves"
    if not ARM_PYTHON.exists():
        return f"no emulated Arm Python at {ARM_PYTHON}: run `.venv/bin/python scripts/arm_env.py`"
    pins = ARM_PYTHON.parent / "site" / "PINS"
    tvm = f"apache-tvm=={importlib.metadata.version('apache-tvm')}"
    if not pins.is_file() or tvm not in pins.read_text().split():
        return f"the emulated Arm Python holds another TVM than .venv's ({tvm}): run scripts/arm_env.py"
    if cross_linker("aarch64-linux-gnu") is None:
        return "no linker for aarch64 here: pip install ziglang"
    return None


class _Jobs:
    """Child processes whose output goes to files under ``base``; any still running when the
    ``with`` block leaves (a failed step) is killed, so none goes on into the later tests."""

    def __init__(self, base: Path) -> None:
        self.base, self.procs = base, []

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
        out = open(self.base / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
        self.procs.append((proc, out))
        return proc, name

    def finish(self, job: tuple[subprocess.Popen, str], codes: tuple[int, ...] = (0,)) -> str:
        proc, name = job
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        text = (self.base / f"{name}.log").read_text()
        assert proc.returncode in codes, f"{name} failed (exit {proc.returncode}):\n{text[-4000:]}"
        return text

    def __enter__(self) -> _Jobs:
        return self

    def __exit__(self, *exc) -> None:
        for proc, out in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()


def build_and_run(base: Path, hf_base: Path) -> ArmRuns:
    from sandwich_tvm.kernels.microkernel import ISAS

    from .model.hf_models import hf_checkpoint

    dtypes = sorted({d for isa in ARM_ISAS for d in ISAS[isa].dtypes})
    kernels, models = base / "kernels", base / "models"
    here, there = [sys.executable, "-m"], [str(ARM_PYTHON), "-m"]
    env = {**os.environ, "SANDWICH_CPU": str(base / "cpu.json"), "SANDWICH_CACHE": str(base / "cache")}
    with _Jobs(base) as jobs:
        build_kernels = jobs.start("build-kernels", [
            *here, "sandwich_tvm.bench", "crosscheck", "build", "--isas", ",".join(ARM_ISAS), "--dtypes",
            ",".join(dtypes), "--no-timing", "--out", str(kernels)])
        # the emulated CPU described (TVM's import alone takes ten seconds there), beside the build
        describe = subprocess.run([*there, "sandwich_tvm.host", "--describe"], capture_output=True, text=True,
                                  timeout=300, check=True)
        cpu = json.loads(describe.stdout)
        (base / "cpu.json").write_text(describe.stdout)
        for name, (ckpt, dtype, kv, int8) in MODEL_CASES.items():  # one after the other, beside the kernels
            model, out = str(hf_checkpoint(hf_base, ckpt)), str(models / name)
            cmd = [*here, "sandwich_tvm.bench.crossmodel", "build", "--model", model, "--out", out,
                   "--dtype", dtype, "--kv-dtype", kv, *["--int8-activations"] * int8]
            jobs.finish(jobs.start(f"build-{name}", cmd, env))
        jobs.finish(build_kernels)
        run_kernels = jobs.start("run-kernels", [*there, "sandwich_tvm.bench.crosscheck", "run", str(kernels),
                                                 "--json", str(base / "kernels.json")])
        run_models = jobs.start("run-models", [*there, "sandwich_tvm.bench.crossmodel", "run",
                                               *[str(models / name) for name in MODEL_CASES], "--prompt",
                                               ",".join(map(str, PROMPT)), "--steps", str(STEPS), "--out",
                                               str(models / "out")])
        kernel_log = jobs.finish(run_kernels, (0, 1))  # 1: a kernel disagrees (the test says which)
        jobs.finish(run_models)
    return ArmRuns(kernels, json.loads((base / "kernels.json").read_text()), kernel_log, models, cpu)
