"""Checkpoint loading: sharded indexes, the conversion cache, packing, and bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.compiler.artifact import export_module
from sandwich_tvm.kernels.codegen import pack_weight
from sandwich_tvm.memory import aligned_empty
from sandwich_tvm.model.checkpoint import ModelLoadError, read_checkpoint
from sandwich_tvm.model.config import ModelConfigError, load_config
from sandwich_tvm.model.linear import KernelSet
from sandwich_tvm.model.weights import load_params

from ..isas import ALL_ISAS as VECTOR_ISAS
from .hf_models import write_hf_model

pytest.importorskip("torch")

ISA = "avx2"  # packing runs in numpy, so any ISA works on any host: fix one for the bad-input tests
ALL_ISAS = pytest.mark.parametrize("isa", VECTOR_ISAS)
_PARAMS: dict[tuple[str, str], list] = {}


def params_for(cfg, isa: str) -> list[tuple[str, tuple[int, ...]]]:
    """The compiled model's parameter list (names, packed shapes) built for ``isa``."""
    key = (str(cfg), isa)
    if key not in _PARAMS:
        _PARAMS[key] = export_module(cfg, KernelSet(2, 1, isa=isa))[1]
    return _PARAMS[key]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("gqa")
    write_hf_model("gqa-tied-llama3", out)
    cfg = load_config(out)
    return out, cfg, params_for(cfg, ISA)


def test_config_reads_transformers5_rope_parameters(ckpt):
    _, cfg, _ = ckpt
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.tie_word_embeddings and cfg.num_key_value_heads == 2


@ALL_ISAS
def test_packed_params_and_cache(ckpt, isa):
    model_dir, cfg, _ = ckpt
    params = params_for(cfg, isa)
    state = read_checkpoint(model_dir)
    first = load_params(model_dir, cfg, params, isa)
    names = [n for n, _ in params]
    qkv = first[names.index("model.layers.1.self_attn.qkv_proj.weight")]
    p = "model.layers.1.self_attn."
    fused = np.concatenate([state[p + f"{x}_proj.weight"] for x in "qkv"])
    np.testing.assert_array_equal(qkv, pack_weight(fused, isa))
    # Tied: the embedding is stored once, packed, and read by both the gather and the lm_head.
    assert "lm_head.weight" not in names
    emb = first[names.index("model.embed_tokens.weight")]
    np.testing.assert_array_equal(emb, pack_weight(state["model.embed_tokens.weight"], isa))
    assert all(a.ctypes.data % 64 == 0 for a in first)
    assert list(Path(os.environ["SANDWICH_CACHE"]).glob("weights/*.safetensors")), "conversion cached"
    again = load_params(model_dir, cfg, params, isa)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_mistral_checkpoint_loads_as_a_llama(tmp_path):
    """transformers' MistralForCausalLM (Mistral-Nemo's kind: heads wider than the hidden states,
    a sliding window) loads as the Llama it is, with its window beside its whole context."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=64, max_position_embeddings=256, sliding_window=128))
    hf.save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    assert (cfg.head_dim, cfg.max_position_embeddings, cfg.num_key_value_heads) == (16, 256, 2)
    assert cfg.sliding_window == 128
    params = params_for(cfg, ISA)
    names = [n for n, _ in params]
    loaded = load_params(tmp_path, cfg, params, ISA)
    attn = hf.model.layers[0].self_attn
    fused = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach().numpy()
    assert fused.shape == (4 * 16 + 2 * 2 * 16, 48)
    np.testing.assert_array_equal(loaded[names.index("model.layers.0.self_attn.qkv_proj.weight")],
                                  pack_weight(fused, ISA))


def test_conversion_cache_is_per_isa(ckpt, monkeypatch, tmp_path):
    model_dir, cfg, _ = ckpt
    monkeypatch.setenv("SANDWICH_CACHE", str(tmp_path / "cache"))
    for isa in VECTOR_ISAS:
        load_params(model_dir, cfg, params_for(cfg, isa), isa)
    assert len(list((tmp_path / "cache" / "weights").glob("*.safetensors"))) == len(VECTOR_ISAS)
    # A cached conversion is served only to its own ISA (shapes differ, so would the panels).
    for isa in VECTOR_ISAS:
        arrays = load_params(model_dir, cfg, params_for(cfg, isa), isa)
        assert [a.shape for a in arrays] == [s for _, s in params_for(cfg, isa)]


def test_params_built_for_another_isa_are_refused(ckpt):
    model_dir, cfg, _ = ckpt
    with pytest.raises(ModelLoadError, match="same ISA"):
        load_params(model_dir, cfg, params_for(cfg, "avx512"), "avx2")


def _same_name_size_mtime(tmp_path: Path) -> tuple[Path, Path]:
    """Two different checkpoints in directories of the same name, files of equal size and mtime."""
    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    write_hf_model("gqa-tied-llama3", a, seed=0)
    write_hf_model("gqa-tied-llama3", b, seed=1)
    for f in ("model.safetensors", "config.json"):
        assert (a / f).stat().st_size == (b / f).stat().st_size
        os.utime(a / f, ns=(1_700_000_000 * 10**9,) * 2)
        os.utime(b / f, ns=(1_700_000_000 * 10**9,) * 2)
    return a, b


@pytest.mark.parametrize("sampled", [False, True], ids=["whole-file", "sampled"])
def test_conversion_cache_is_keyed_by_content(tmp_path, monkeypatch, sampled):
    from sandwich_tvm.model import weights

    if sampled:  # the large-file path: header + start/middle/end of every tensor
        monkeypatch.setattr(weights, "FULL_HASH_BYTES", 0)
    a, b = _same_name_size_mtime(tmp_path)
    cfg = load_config(a)
    params = params_for(cfg, ISA)
    first = load_params(a, cfg, params, ISA)
    second = load_params(b, cfg, params, ISA)
    assert any(not np.array_equal(x, y) for x, y in zip(first, second, strict=True))
    fresh = weights.convert(cfg, read_checkpoint(b), params, ISA)
    for x, y in zip(second, fresh, strict=True):
        np.testing.assert_array_equal(x, y)
    assert len(list(Path(os.environ["SANDWICH_CACHE"]).glob("weights/model-*.safetensors"))) >= 2


def test_sharded_checkpoint_equals_single_file(ckpt, tmp_path):
    import transformers

    model_dir, cfg, params = ckpt
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a = read_checkpoint(model_dir)
    b = read_checkpoint(tmp_path)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_truncated_safetensors_names_the_file(ckpt, tmp_path):
    model_dir, cfg, params = ckpt
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    data = (model_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model.safetensors.*re-download"):
        load_params(tmp_path, cfg, params, ISA)


def test_shape_mismatch_and_missing_tensor(ckpt, tmp_path):
    from safetensors.numpy import save_file

    model_dir, cfg, params = ckpt
    state = read_checkpoint(model_dir)
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"][:, :10]
    del state["model.layers.1.input_layernorm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj.weight has shape"):
        load_params(tmp_path, cfg, params, ISA)
    state["model.layers.0.mlp.down_proj.weight"] = np.zeros((96, 200), np.float32)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="input_layernorm.weight' is missing"):
        load_params(tmp_path, cfg, params, ISA)


def test_bad_model_directories(tmp_path):
    with pytest.raises(ModelConfigError, match="neither a preset"):
        load_config(tmp_path / "nope")
    with pytest.raises(ModelConfigError, match="has no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ModelConfigError, match="not supported"):
        load_config(tmp_path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_params(tmp_path, None, [], ISA)


def test_large_arrays_are_huge_page_aligned():
    a = aligned_empty((1024, 1024))
    assert a.ctypes.data % (2 << 20) == 0 and a.flags.writeable


@pytest.mark.parametrize("isa", ["avx2", "avx512bf16"])  # widened panels; vdpbf16ps k-pairs
def test_bf16_checkpoint_reaches_bf16_panels_bit_exact(tmp_path, isa):
    """A bf16 checkpoint is memory-mapped in bf16 (no fp32 copy) and packed without rounding."""
    import torch
    import transformers

    from sandwich_tvm.kernels.packing import WeightLayout, numpy_dtype

    hf = write_hf_model("gqa-small", tmp_path / "fp32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "bf16").torch_dtype == torch.bfloat16
    state = read_checkpoint(tmp_path / "bf16")
    assert {a.dtype for a in state.values()} == {numpy_dtype("bfloat16")}
    assert all(isinstance(a.base, np.memmap) or isinstance(a, np.memmap) for a in state.values())
    cfg = load_config(tmp_path / "bf16")
    params = export_module(cfg, KernelSet(2, 1, isa=isa, dtype="bfloat16"))[1]  # any host builds either
    arrays = load_params(tmp_path / "bf16", cfg, params, isa, dtype="bfloat16")
    name = "model.layers.1.self_attn.o_proj.weight"
    i = next(j for j, (n, _) in enumerate(params) if n == name)
    w = state[name]
    got = WeightLayout(isa, "bfloat16").unpack(arrays[i], *w.shape)
    np.testing.assert_array_equal(got, w.astype(np.float32))
    norm = next(j for j, (n, _) in enumerate(params) if n.endswith("norm.weight"))
    assert arrays[norm].dtype == np.float32  # 1-D weights stay fp32


def test_long_conversions_log_their_progress(monkeypatch):
    from sandwich_tvm.model import weights

    clock = iter([0.0, 1.0, 6.0, 7.0, 13.0, 14.0])
    monkeypatch.setattr("time.monotonic", lambda: next(clock))
    said: list[str] = []
    report = weights.conversion_progress(said.append)
    for done in range(1, 6):
        report(done, 5)
    assert said == ["converting: 2/5 tensors, 6 s", "converting: 4/5 tensors, 13 s",
                    "converting: 5/5 tensors, 14 s"]


def test_a_failed_cache_save_is_logged_and_leaves_nothing(tmp_path, monkeypatch):
    """A full disk while caching converted weights: the load goes on with the arrays in hand,
    says so, and leaves neither a cache file nor a temporary one."""
    import safetensors.numpy

    from sandwich_tvm.model.weights import save_converted

    def full(tensors, filename):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    said: list[str] = []
    target = tmp_path / "weights" / "model-abc.safetensors"
    save_converted(target, [("w", (2,))], [np.zeros(2, np.float32)], said.append)
    assert said and "not cached" in said[0] and "No space left" in said[0]
    assert list(target.parent.iterdir()) == []


def test_the_conversion_cache_is_an_ordinary_file(tmp_path):
    """Saved under a temporary name of its own, then renamed, with the umask's mode (a cache
    shared between users stays readable), no temporary file left."""
    from sandwich_tvm.model.weights import save_converted

    target = tmp_path / "weights" / "model-abc.safetensors"
    save_converted(target, [("w", (2,))], [np.ones(2, np.float32)])
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in target.parent.iterdir()] == [target.name]
