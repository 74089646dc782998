"""The whole model built for Arm (cross-compiled here: ``SANDWICH_CPU``, ``zig cc``) runs on an
emulated aarch64 (``scripts/arm_env.py``: qemu-user ``-cpu max``) as HF transformers runs the
same weights: our Relax pipeline and every kernel (NEON GEMMs, BF16 ``bfdot`` and int8 ``sdot``
micro-kernels, attention over fp32, fp16 and int8 KV caches, RoPE with Llama-3 scaling, norms,
the tied head)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.host import host_isa
from sandwich_tvm.kernels.quant import QTYPES
from sandwich_tvm.tvm_compat import cross_linker

from .hf_models import hf_checkpoint

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.compile

REPO = Path(__file__).resolve().parents[2]
ARM_PYTHON = REPO / ".arm64" / "python"
PROMPT = [5, 17, 42, 99, 3, 250, 7, 1, 8, 13, 21, 60, 2, 77, 31, 90, 4, 11, 64, 35]  # 20 tokens
STEPS = 8
# name: (checkpoint, weight dtype, KV cache dtype, int8 activations)
CASES = {
    "fp32": ("gqa-tied-llama3", "float32", "float32", False),
    "bf16-bfdot": ("gqa-tied-llama3", "bfloat16", "float16", False),
    "q4_1-sdot": ("gqa-small", "q4_1", "int8", True),  # whole blocks of 32
}


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized per row and block of 32 as the int8 kernels quantize their A, dequantized."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)
    return (torch.round(blocks * inv) * (amax / 127)).reshape(x.shape)


def _reference(model_dir: Path, dtype: str, int8: bool, tokens: list[int]) -> np.ndarray:
    """HF's logits on the weights the build runs (rounded to bf16, or quantized and dequantized)
    and the Linear inputs its micro-kernels see (bf16 pairs for bfdot, int8 rows for sdot)."""
    import transformers

    from sandwich_tvm.kernels.quant import head_dtype

    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Embedding | torch.nn.Linear):
                kind = head_dtype(dtype) if name in ("lm_head", "model.embed_tokens") else dtype
                if kind == "bfloat16":
                    mod.weight.copy_(_bf16(mod.weight))
                elif kind in QTYPES:
                    q = QTYPES[kind]
                    w = mod.weight.numpy()
                    mod.weight.copy_(torch.from_numpy(q.dequantize(q.quantize(w)).reshape(w.shape)))
            if isinstance(mod, torch.nn.Linear) and (dtype == "bfloat16" or int8):
                rounding = _int8_rows if int8 else _bf16
                mod.register_forward_pre_hook(lambda _m, args, r=rounding: (r(args[0]),))
        return hf(torch.tensor([tokens])).logits[0].numpy()


@pytest.fixture(scope="module")
def arm_runs(tmp_path_factory):
    """Every case built here for the emulated CPU, then run in one emulated process."""
    if host_isa() == "neon":
        pytest.skip("an Arm host runs the model in the model tests themselves")
    if not ARM_PYTHON.exists():
        pytest.skip(f"no emulated Arm Python at {ARM_PYTHON}: run `.venv/bin/python scripts/arm_env.py`")
    if cross_linker("aarch64-linux-gnu") is None:
        pytest.skip("no linker for aarch64 here: pip install ziglang")
    base = tmp_path_factory.mktemp("arm")
    describe = subprocess.run([str(ARM_PYTHON), "-m", "sandwich_tvm.host", "--describe"], capture_output=True,
                              text=True, timeout=300, check=True)
    cpu = json.loads(describe.stdout)
    assert cpu["machine"] == "aarch64" and {"asimd", "asimddp", "bf16"} <= set(cpu["flags"])
    assert "emulated" in cpu["cpuinfo"]["model name"]  # never mistaken for an Arm CPU's own
    (base / "cpu.json").write_text(describe.stdout)
    env = {**os.environ, "SANDWICH_CPU": str(base / "cpu.json"), "SANDWICH_CACHE": str(base / "cache")}
    bundles = []
    for name, (ckpt, dtype, kv, int8) in CASES.items():
        model_dir = hf_checkpoint(tmp_path_factory.getbasetemp(), ckpt)
        cmd = [sys.executable, "-m", "sandwich_tvm.bench.crossmodel", "build", "--model", str(model_dir),
               "--out", str(base / name), "--dtype", dtype, "--kv-dtype", kv, *["--int8-activations"] * int8]
        built = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
        bundles.append(str(base / name))
    prompt = ",".join(map(str, PROMPT))
    ran = subprocess.run([str(ARM_PYTHON), "-m", "sandwich_tvm.bench.crossmodel", "run", *bundles, "--prompt",
                          prompt, "--steps", str(STEPS), "--out", str(base / "out")],
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    return base


@pytest.mark.parametrize("case", sorted(CASES))
def test_arm_build_matches_hf_under_emulation(arm_runs, case):
    ckpt, dtype, kv, int8 = CASES[case]
    manifest = json.loads((arm_runs / case / "manifest.json").read_text())
    unit = {"float32": "neon", "bfloat16": "neonbf16", "q4_1": "neondot"}[dtype]
    assert (manifest["machine"], manifest["isa"], manifest["kernel_isa"]) == ("aarch64", "neon", unit)
    out = np.load(arm_runs / "out" / f"{case}.npz")
    info = json.loads(str(out["info"]))
    assert info["machine"] == "aarch64" and info["emulated"]
    tokens, ours = [int(t) for t in out["tokens"]], out["logits"]
    model_dir = arm_runs.parent / "hf" / ckpt
    ref = _reference(model_dir, dtype, int8, PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    assert ours.shape == ref.shape == (STEPS + 1, manifest["vocab"])
    scale = float(np.abs(ref).max())
    # fp32: sums in another order; 16-bit and int8 KV caches round what the reference keeps in fp32
    atol = {"float32": 1e-5, "float16": 3e-3, "int8": 2e-2}[kv] * scale
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=atol)
    if dtype != "float32":  # the weights and inputs really were rounded as the reference rounds them
        fp32 = _reference(model_dir, "float32", False, PROMPT + tokens[:-1])[len(PROMPT) - 1:]
        assert np.abs(ours - ref).max() < np.abs(ours - fp32).max()
    # the greedy token is HF's wherever HF's best two are further apart than that tolerance
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * (atol + 1e-4 * np.abs(top2).max(-1))
    assert clear.sum() >= STEPS // 2
    best = ref.argmax(-1)
    assert np.array_equal(np.asarray(tokens)[clear], best[clear])
    if kv == "float32":
        assert tokens == [int(t) for t in ref.argmax(-1)]
