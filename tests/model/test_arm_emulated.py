"""The whole model built for Arm (cross-compiled here: ``SANDWICH_CPU``, ``zig cc``) runs on an
emulated aarch64 (``scripts/arm_env.py``: qemu-user ``-cpu max``) as HF transformers runs the
same weights: our Relax pipeline and every kernel (NEON GEMMs, BF16 ``bfdot`` and int8 ``sdot``
micro-kernels, attention over fp32, fp16 and int8 KV caches, RoPE with Llama-3 scaling, norms,
the tied head)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.bench.crosscheck import bf16_rounded, quantized_a
from sandwich_tvm.kernels.quant import QTYPES

from ..arm import MODEL_CASES, PROMPT, STEPS
from .hf_models import hf_checkpoint

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.compile


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
                    mod.weight.copy_(torch.from_numpy(bf16_rounded(mod.weight.numpy())))
                elif kind in QTYPES:
                    q = QTYPES[kind]
                    w = mod.weight.numpy()
                    mod.weight.copy_(torch.from_numpy(q.dequantize(q.quantize(w)).reshape(w.shape)))
            if isinstance(mod, torch.nn.Linear) and (dtype == "bfloat16" or int8):
                rounding = quantized_a if int8 else bf16_rounded  # as the kernels see their inputs
                mod.register_forward_pre_hook(lambda _m, a, r=rounding: (torch.from_numpy(r(a[0].numpy())),))
        return hf(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_arm_build_matches_hf_under_emulation(arm_runs, case, tmp_path_factory):
    ckpt, dtype, kv, int8 = MODEL_CASES[case]
    manifest = json.loads((arm_runs.models / case / "manifest.json").read_text())
    unit = {"float32": "neon", "bfloat16": "neonbf16", "q4_1": "neondot"}[dtype]
    assert (manifest["machine"], manifest["isa"], manifest["kernel_isa"]) == ("aarch64", "neon", unit)
    out = np.load(arm_runs.models / "out" / f"{case}.npz")
    info = json.loads(str(out["info"]))
    assert info["machine"] == "aarch64" and info["emulated"]
    tokens, ours = [int(t) for t in out["tokens"]], out["logits"]
    model_dir = hf_checkpoint(tmp_path_factory.getbasetemp(), ckpt)
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
