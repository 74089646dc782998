"""Quantized weights (q8_0, q4_0, q4_1) in the compiled Llama: an HF checkpoint quantized at load
by gguf's reference code runs as HF transformers runs the same weights dequantized (fp32
activations: the weights dequantized in registers), and, with int8 activations on a VNNI CPU,
as HF runs them on activations quantized per row and block of 32 before every Linear; the
lm_head and an untied embedding table are held in q8_0 under 4-bit weights; a model whose
widths are not whole blocks is refused before anything is built."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.host import cpu_flags
from sandwich_tvm.kernels.microkernel import ISAS, kernel_isa
from sandwich_tvm.kernels.quant import QTYPES, head_dtype
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.spec import RunSpec, SpecError, resolve_activations, resolve_run_spec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS, host_isa

from ..precompile import warm_up
from .hf_models import hf_checkpoint, write_hf_model

torch = pytest.importorskip("torch")

CPUS = tuple(sorted(PROCESS_CPUS))
PLAN = ExecPlan(CPUS, CPUS[:1], "test: decode on one core")


def _dequantized(w: torch.Tensor, dtype: str) -> torch.Tensor:
    q = QTYPES[dtype]
    return torch.from_numpy(q.dequantize(q.quantize(w.detach().numpy())).reshape(w.shape))


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized per row and block of 32 as the int8 kernels quantize their A, dequantized."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)
    return (torch.round(blocks * inv) * (amax / 127)).reshape(x.shape)


def _checkpoint(base: Path) -> Path:
    """gqa-small (hidden 64, FFN 128: whole blocks) with its own seed, at a fixed place."""
    return hf_checkpoint(base, "gqa-small", seed=5)


def _spec(model_dir: Path, dtype: str, int8: bool) -> RunSpec:
    # the engine runs one sequence: no decode buckets for m = 2..8
    return RunSpec(str(model_dir), load_config(model_dir), PLAN, weight_dtype=dtype, kv_dtype="float32",
                   int8_activations=int8, max_batch=1)


def _runs_int8(dtype: str) -> bool:
    return ISAS[kernel_isa(host_isa(), dtype, cpu_flags())].quantized_unit


warm_up(__name__, "test_quantized_model_matches_hf_on_the_dequantized_weights",
        lambda base: [_spec(_checkpoint(base), d, int8) for d in ("q8_0", "q4_0", "q4_1")
                      for int8 in (False, True) if not int8 or _runs_int8(d)])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    import transformers

    out = _checkpoint(tmp_path_factory.getbasetemp())
    return out, transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.compile
@pytest.mark.parametrize("int8", [False, True], ids=["fp32-activations", "int8-activations"])
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1"])
def test_quantized_model_matches_hf_on_the_dequantized_weights(small, dtype, int8, precompiler):
    unit = kernel_isa(host_isa(), dtype, cpu_flags())  # the CPU's unit for quantized weights
    if int8 and not ISAS[unit].quantized_unit:
        pytest.skip(f"this CPU ({host_isa()}) has no int8 dot product: quantized weights meet fp32 inputs")
    model_dir, hf = small
    cfg = load_config(model_dir)
    compiled = precompiler.build(_spec(model_dir, dtype, int8))
    assert compiled.meta["kernel_isa"] == (unit if int8 else host_isa())
    params = load_params(model_dir, cfg, compiled.params, host_isa(), dtype=dtype, layouts=compiled.layouts)
    assert compiled.layouts["model.embed_tokens.weight"].dtype == head_dtype(dtype)  # not an fp32 table
    engine = Engine(compiled, params, PLAN)
    # AMX CPUs run m >= 32 on bf16 tiles (amxdq), not int8 ones: the reference below quantizes
    # every input to int8, so there the prompt stays under 32 rows
    length = 20 if int8 and ISAS[unit].tile_rows else 37
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, cfg.vocab_size, length)]
    logits: list[np.ndarray] = []
    gen = engine.generate(prompt, 17, logits_out=logits)
    ours = np.stack(logits)

    ref_model = type(hf)(hf.config).eval()
    ref_model.load_state_dict(hf.state_dict())
    hooks = []
    with torch.no_grad():
        assert not hf.config.tie_word_embeddings  # the embedding is a table of its own, in the head's type
        emb = ref_model.model.embed_tokens.weight
        emb.copy_(_dequantized(emb, head_dtype(dtype)))
        for name, mod in ref_model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(_dequantized(mod.weight, head_dtype(dtype) if name == "lm_head" else dtype))
                if int8:
                    hooks.append(mod.register_forward_pre_hook(lambda _m, args: (_int8_rows(args[0]),)))
        ids = torch.tensor([prompt + gen.tokens[:-1]])
        ref = ref_model(ids).logits[0].numpy()[len(prompt) - 1:]
        fp32 = hf(ids).logits[0].numpy()[len(prompt) - 1:]
    scale = float(np.abs(ref).max())
    # int8: a value on a rounding edge may round the other way after fp32 sums in another order
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=(2e-3 if int8 else 1e-4) * scale)
    assert gen.tokens == [int(t) for t in ref.argmax(-1)]
    assert np.abs(ours - fp32).max() > 1e-3 * scale  # the weights really were quantized


def test_widths_not_in_blocks_are_refused(tmp_path):
    write_hf_model("mha-untied", tmp_path)  # FFN 176: not whole blocks of 32
    for dtype in ("q8_0", "q4_0", "q4_1"):
        with pytest.raises(SpecError, match="intermediate_size is 176") as err:
            resolve_run_spec(tmp_path, dtype=dtype)
        assert "\n" not in str(err.value)
    assert resolve_run_spec(tmp_path, dtype="bfloat16").weight_dtype == "bfloat16"


def test_activation_modes():
    vnni = frozenset({"avx512f", "avx2", "fma", "avx512_vnni"})
    plain = frozenset({"avx512f", "avx2", "fma"})
    assert resolve_activations("auto", "q8_0", vnni) and not resolve_activations("auto", "q8_0", plain)
    assert not resolve_activations("float32", "q4_1", vnni) and resolve_activations("int8", "q4_0", vnni)
    assert not resolve_activations("auto", "bfloat16", vnni)
    avx2 = frozenset({"avx2", "fma"})  # AVX2 alone: vpmaddubsw + vpmaddwd, as llama.cpp's AVX2 kernels
    assert kernel_isa("avx2", "q8_0", avx2) == "avx2dot" and resolve_activations("auto", "q4_1", avx2)
    assert kernel_isa("avx2", "q8_0", avx2 | {"avx_vnni"}) == "avxvnni"
    skylake = plain | {"avx512bw"}  # AVX-512 without VNNI: avx2dot's multiply-adds in 16 lanes
    assert kernel_isa("avx512", "q4_0", skylake) == "avx512dot"
    assert resolve_activations("auto", "q8_0", skylake)
    assert kernel_isa("avx512", "q4_0", skylake | {"avx512_vnni"}) == "avx512vnni"
    with pytest.raises(SpecError, match="VNNI"):
        resolve_activations("int8", "q8_0", plain)
    with pytest.raises(SpecError, match="quantized weights"):
        resolve_activations("int8", "bfloat16", vnni)


def test_auto_keeps_a_gguf_s_own_blocks():
    from tests.conftest import smollm2_path

    smollm2_path()
    spec = resolve_run_spec("smollm2-135m")
    assert spec.weight_dtype == "q4_1" and "GGUF" in spec.dtype_note
    assert spec.int8_activations == ISAS[kernel_isa(host_isa(), "q4_1", cpu_flags())].quantized_unit
    assert resolve_run_spec("smollm2-135m", dtype="q8_0").weight_dtype == "q8_0"
    assert resolve_run_spec("llama-160m").weight_dtype == "bfloat16"


@pytest.mark.parametrize("kind", ["Q5_1", "Q5_0"])
def test_auto_rounds_a_gguf_without_kernels_to_q8_0(tmp_path, kind):
    """A GGUF whose layers hold a type without kernels (Q5_1, like most K-quants) runs as q8_0
    under --dtype auto, not widened to 16 bits: its weights load as q8_0 blocks of the dequantized
    values. Q5_0's blocks are q8_0 blocks already (d the same, the values q - 16): they load as
    they are, every value exact."""
    from sandwich_tvm.compiler.artifact import export_module
    from sandwich_tvm.kernels.packing import WeightLayout
    from sandwich_tvm.model.checkpoint import random_checkpoint, read_checkpoint
    from sandwich_tvm.model.linear import KernelSet

    from .gguf_models import quantized, tiny_config, tiny_tokenizer, write_gguf

    tok = tiny_tokenizer()
    cfg = tiny_config(tok.get_vocab_size())
    state = random_checkpoint(cfg, 2)
    path = write_gguf(tmp_path / "q5.gguf", cfg, state, qtype=kind, tokenizer=tok)
    spec = resolve_run_spec(path)
    how = ("Q5_1 blocks have no kernels" if kind == "Q5_1"
           else "Q5_0 blocks run as q8_0 blocks (every value exactly")
    assert spec.weight_dtype == "q8_0" and how in spec.dtype_note
    assert resolve_run_spec(path, dtype="bfloat16").weight_dtype == "bfloat16"  # asked: as asked
    params = export_module(cfg, KernelSet(2, 1, isa="avx2", dtype="q8_0", int8_activations=False))[1]
    arrays = load_params(path, cfg, params, "avx2", dtype="q8_0")
    name = "model.layers.1.mlp.down_proj.weight"
    values = np.asarray(read_checkpoint(path)[name])  # the file's blocks dequantized
    np.testing.assert_array_equal(values, quantized(state[name], kind))
    got = WeightLayout("avx2", "q8_0").unpack(arrays[[n for n, _ in params].index(name)], *values.shape)
    q8 = QTYPES["q8_0"]
    np.testing.assert_array_equal(got, values if kind == "Q5_0" else q8.dequantize(q8.quantize(values)))
    if kind == "Q5_1":
        assert not np.array_equal(got, values)  # re-rounded: the Q5_0 case's equality says something


def test_a_tensor_parallel_share_not_in_blocks_is_refused(tmp_path):
    """The FFN width 96 is 3 blocks, but two processes would hold 48 of it each: refused before
    compiling, naming the plan; one process, or bf16, is fine."""
    from pathlib import Path

    from sandwich_tvm.model.checkpoint import random_checkpoint

    from .gguf_models import tiny_config, tiny_tokenizer, write_gguf

    tok = tiny_tokenizer()
    cfg = tiny_config(tok.get_vocab_size())
    path = write_gguf(tmp_path / "f32.gguf", cfg, random_checkpoint(cfg, 2), tokenizer=tok)
    tp2 = Path(__file__).parents[2] / "examples" / "plans" / "two-cpus-tp2.json"
    with pytest.raises(SpecError, match="2 tensor-parallel processes would hold 48 of intermediate") as err:
        resolve_run_spec(path, dtype="q4_0", plan=tp2)
    assert "\n" not in str(err.value)
    assert resolve_run_spec(path, dtype="q4_0").weight_dtype == "q4_0"
    assert resolve_run_spec(path, dtype="bfloat16", plan=tp2).plan.tp == 2


def test_wider_linears_add_their_shapes_and_bytes():
    """Linears held wider than the model's type (a Q4_K_M's Q6_K ones, in q8_0) are one more
    shape each for tuning and the build key, with their Linear's epilogue, and their bytes count;
    the run spec carries them through JSON (tensor-parallel ranks, pipeline hosts)."""
    from sandwich_tvm.model.shapes import linear_shapes
    from sandwich_tvm.spec import RunSpec, weights_bytes

    cfg = load_config("llama-3.2-1b")
    wider = ((0, "down", "q8_0"), (0, "qkv", "q8_0"), (3, "down", "q8_0"))
    plain = linear_shapes(cfg, "q4_1", 1, "avx512")
    mixed = linear_shapes(cfg, "q4_1", 1, "avx512", wider=wider)
    assert set(mixed) - set(plain) == {"down q8_0", "qkv q8_0"}
    assert mixed["down q8_0"] == type(plain["down"])(plain["down"].n, plain["down"].k, "q8_0",
                                                      plain["down"].epilogue)
    per_weight = (34 - 20) / 32  # q8_0 against q4_1 bytes a weight
    down, qkv = cfg.hidden_size * cfg.intermediate_size, plain["qkv"].n * plain["qkv"].k
    extra = weights_bytes(cfg, "q4_1", wider) - weights_bytes(cfg, "q4_1")
    assert extra == pytest.approx((2 * down + qkv) * per_weight, rel=1e-6)
    spec = replace(resolve_run_spec("llama-3.2-1b", dtype="q4_1"), wider_linears=wider)
    assert RunSpec.from_json(spec.to_json()).wider_linears == wider


def test_weights_that_do_not_fit_are_refused_before_compiling():
    """Llama-3-8B's shapes (untied: an embedding table besides the head, both 0.5 GiB in q8_0):
    fp32 weights ~30 GiB, bf16 ~15, q8_0 ~7.9, q4_0 ~4.7; refused against 6 GiB of memory with
    a one-line error that names a smaller type, accepted against enough."""
    from sandwich_tvm.spec import check_weights_fit, weights_bytes

    cfg = load_config("llama-3-8b")
    gib = {d: weights_bytes(cfg, d) / 2**30 for d in ("float32", "bfloat16", "q8_0", "q4_0")}
    assert 29 < gib["float32"] < 31 and 14.5 < gib["bfloat16"] < 15.5
    assert 7.5 < gib["q8_0"] < 8.2 and 4.4 < gib["q4_0"] < 5.0
    spec = resolve_run_spec("llama-3-8b", dtype="bfloat16", context=512)
    with pytest.raises(SpecError, match=r"bfloat16 weights take 15\.\d GiB .* --dtype \(q8_0, q4_0\)") as err:
        check_weights_fit(spec, available=8 << 30)
    assert "\n" not in str(err.value)
    check_weights_fit(spec, available=16 << 30)
