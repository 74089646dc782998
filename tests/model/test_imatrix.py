"""Importance matrices (llama.cpp's imatrix GGUF files): read for a model's Linears, refused with
one line when they do not fit, and followed when 4-bit weights are quantized at load."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from sandwich_tvm.compiler.artifact import export_module
from sandwich_tvm.kernels.packing import WeightLayout
from sandwich_tvm.model.checkpoint import random_checkpoint
from sandwich_tvm.model.imatrix import ImatrixError, importance_of, read_imatrix
from sandwich_tvm.model.linear import KernelSet
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.spec import RunSpec, SpecError, resolve_run_spec

from .gguf_models import gguf_name, tiny_config, tiny_tokenizer, write_gguf, write_imatrix

ISA = "avx2"  # packing runs in numpy: any ISA on any host


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("imatrix")
    tok = tiny_tokenizer()
    cfg = tiny_config(tok.get_vocab_size())
    path = write_gguf(out / "tiny.gguf", cfg, random_checkpoint(cfg, 1), tokenizer=tok)
    return path, cfg, write_imatrix(out / "imatrix.gguf", cfg)


def test_reads_the_mean_square_per_input(model):
    path, cfg, imat = model
    import gguf

    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(imat)).tensors}
    table = read_imatrix(imat, cfg)
    assert len(table) == 7 * cfg.num_hidden_layers and "lm_head.weight" not in table
    q = table["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_allclose(q, raw["blk.1.attn_q.weight.in_sum2"] / 64.0, rtol=1e-6)
    assert table["model.layers.0.mlp.down_proj.weight"].shape == (cfg.intermediate_size,)
    # our fused Linears read their first part's vector (the same input)
    assert importance_of(table, "model.layers.1.self_attn.qkv_proj.weight") is q
    gate = importance_of(table, "model.layers.0.mlp.gate_up_proj.weight")
    assert gate is table["model.layers.0.mlp.gate_proj.weight"]
    assert importance_of(None, "model.layers.0.mlp.gate_up_proj.weight") is None


@pytest.mark.parametrize(("case", "match"), [
    ("missing", "no such file"),
    ("garbage", "not a GGUF importance matrix"),
    ("other-model", "made for another model"),
    ("no-layers", "no importance of a layer"),
    ("zero-counts", "no positive .counts"),
    ("more-layers", "past tiny's 2 layers"),
])
def test_bad_files_are_one_line_errors(model, tmp_path, case, match):
    _, cfg, _ = model
    path = tmp_path / "imatrix.gguf"
    if case == "garbage":
        path.write_bytes(b"GGUF" + bytes(range(200)))
    elif case == "other-model":
        write_imatrix(path, cfg, k_of=lambda name, k: k * 2 if "ffn_down" in name else k)
    elif case == "no-layers":
        path = write_imatrix(path, cfg, skip=tuple(gguf_name(n) for n in random_checkpoint(cfg, 0)))
    elif case == "zero-counts":
        write_imatrix(path, cfg, counts=0.0)
    elif case == "more-layers":  # a deeper model of the same widths
        write_imatrix(path, replace(cfg, num_hidden_layers=cfg.num_hidden_layers + 1))
    with pytest.raises(ImatrixError, match=match) as err:
        read_imatrix(path, cfg)
    assert "\n" not in str(err.value)


def test_spec_takes_an_imatrix_for_4_bit_weights_only(model):
    path, cfg, imat = model
    spec = resolve_run_spec(path, dtype="q4_0", imatrix=imat)
    assert spec.imatrix == imat.resolve() and "imatrix imatrix.gguf" in spec.describe()
    again = RunSpec.from_json(spec.to_json())
    assert again.imatrix == spec.imatrix and json.loads(spec.to_json())["imatrix"] == str(imat.resolve())
    for dtype in ("float32", "q8_0"):
        with pytest.raises(SpecError, match="4-bit weights"):
            resolve_run_spec(path, dtype=dtype, imatrix=imat)
    with pytest.raises(ImatrixError, match="no such file"):
        resolve_run_spec(path, dtype="q4_0", imatrix=imat.with_name("absent.gguf"))


def test_a_gguf_s_own_4_bit_blocks_refuse_an_imatrix(model, tmp_path):
    """Blocks that load as they are would ignore it: refused, naming the type that would not."""
    _, cfg, imat = model
    q4 = write_gguf(tmp_path / "q4.gguf", cfg, random_checkpoint(cfg, 1), qtype="Q4_0",
                    tokenizer=tiny_tokenizer())
    for dtype in ("auto", "q4_0"):
        with pytest.raises(SpecError, match=r"own q4_0 blocks load as they are.*--dtype q4_1") as err:
            resolve_run_spec(q4, dtype=dtype, imatrix=imat)
        assert "\n" not in str(err.value)
    assert resolve_run_spec(q4, dtype="q4_1", imatrix=imat).imatrix == imat.resolve()


def test_load_quantizes_4_bit_weights_by_the_imatrix(model, tmp_path, monkeypatch):
    """Layer Linears quantized at load follow the importance matrix (packed exactly as the
    layout packs them given it); the head (q8_0), norms and the embedding do not change; the
    conversion cache keeps the two apart."""
    monkeypatch.setenv("SANDWICH_CACHE", str(tmp_path))
    path, cfg, imat = model
    params = export_module(cfg, KernelSet(2, 1, isa=ISA, dtype="q4_0", int8_activations=False))[1]
    plain = load_params(path, cfg, params, ISA, dtype="q4_0")
    weighted = load_params(path, cfg, params, ISA, dtype="q4_0", imatrix=imat)
    assert len(list((tmp_path / "weights").glob("tiny*.safetensors"))) == 2
    table, state = read_imatrix(imat, cfg), random_checkpoint(cfg, 1)
    changed = {name for (name, _), a, b in zip(params, plain, weighted, strict=True)
               if not np.array_equal(a, b)}
    assert changed == {n for n, s in params if len(s) == 3 and n.startswith("model.layers.")}
    at = {n: j for j, (n, _) in enumerate(params)}
    name = "model.layers.1.self_attn.o_proj.weight"
    expected = WeightLayout(ISA, "q4_0").pack(state[name], importance=table[name])
    np.testing.assert_array_equal(weighted[at[name]], expected)
    # q|k|v read q's vector (their shared input), not k's
    attn = "model.layers.1.self_attn."
    qkv = np.concatenate([state[attn + p] for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")])
    expected = WeightLayout(ISA, "q4_0").pack(qkv, importance=table[attn + "q_proj.weight"])
    np.testing.assert_array_equal(weighted[at[attn + "qkv_proj.weight"]], expected)
    assert not np.array_equal(table[attn + "q_proj.weight"], table[attn + "k_proj.weight"])
    cached = load_params(path, cfg, params, ISA, dtype="q4_0", imatrix=imat)
    assert all(np.array_equal(a, b) for a, b in zip(cached, weighted, strict=True))
    other = write_imatrix(tmp_path / "other.gguf", cfg, seed=5)  # another file: converted anew
    again = load_params(path, cfg, params, ISA, dtype="q4_0", imatrix=other)
    assert len(list((tmp_path / "weights").glob("tiny*.safetensors"))) == 3
    assert not np.array_equal(again[at[name]], weighted[at[name]])
    from sandwich_tvm.model import weights  # a changed rounding is never read from an older cache

    monkeypatch.setattr(weights, "WEIGHTED_FORMAT", weights.WEIGHTED_FORMAT + 1)
    load_params(path, cfg, params, ISA, dtype="q4_0", imatrix=other)
    assert len(list((tmp_path / "weights").glob("tiny*.safetensors"))) == 4


def test_row_parallel_shards_round_as_one_process(model):
    """A rank's columns of a row-parallel weight (k split) round with the whole rows' statistics:
    its blocks are exactly the single process's blocks of those columns."""
    from sandwich_tvm.kernels.quant import QTYPES
    from sandwich_tvm.model.parallel import Shard
    from sandwich_tvm.model.weights import convert

    path, cfg, imat = model
    table, state = read_imatrix(imat, cfg), random_checkpoint(cfg, 1)
    name = "model.layers.0.self_attn.o_proj.weight"  # k = 64: a block of 32 on each rank
    n, k = state[name].shape
    layout = WeightLayout(ISA, "q4_0")
    params = [(name, layout.shape(n, k // 2))]
    q = QTYPES["q4_0"]
    whole = q.quantize(state[name], table[name])
    for rank in range(2):
        packed = convert(cfg, state, params, ISA, dtype="q4_0", shards={name: Shard(1, (k,))}, rank=rank,
                         tp=2, importance=table)[0]
        got = q.from_panels(packed, n, quads=layout.quads, signed=layout.signed)
        half = k // 2 // 32 * q.block_bytes
        np.testing.assert_array_equal(got, whole[:, rank * half:(rank + 1) * half])



def test_tensor_parallel_shards_keep_a_gguf_s_blocks(model):
    """A GGUF's 4-bit blocks rounded by an importance matrix are not what the reference rounding
    of their values gives; a rank's share keeps them bit for bit, split by rows or (between
    blocks) by k, never dequantized and rounded again."""
    from sandwich_tvm.kernels.quant import QTYPES, QuantBlocks, weighted_blocks
    from sandwich_tvm.model.parallel import Shard
    from sandwich_tvm.model.weights import convert

    _, cfg, imat = model
    q, table, state = QTYPES["q4_0"], read_imatrix(imat, cfg), random_checkpoint(cfg, 1)
    cases = {"model.layers.0.self_attn.o_proj.weight": Shard(1, (cfg.hidden_size,)),  # k: 32 a rank
             "model.layers.0.mlp.up_proj.weight": Shard(0, (cfg.intermediate_size,))}  # rows
    layout = WeightLayout(ISA, "q4_0")
    for name, shard in cases.items():
        w = state[name]
        raw = weighted_blocks(w, table.get(name, np.ones(w.shape[1], np.float32)), q)
        assert not np.array_equal(q.quantize(q.dequantize(raw)), raw)  # re-rounding would move values
        blocks = QuantBlocks(raw, q, w.shape[1])
        for rank in range(2):
            want = shard.take_blocks(blocks, rank, 2)
            n, k = shard.take(w, rank, 2).shape
            packed = convert(cfg, state | {name: blocks}, [(name, layout.shape(n, k))], ISA, dtype="q4_0",
                             shards={name: shard}, rank=rank, tp=2)[0]
            got = q.from_panels(packed, n, quads=layout.quads, signed=layout.signed)
            np.testing.assert_array_equal(got, want.raw)
            if shard.dim == 0:
                np.testing.assert_array_equal(want.raw, raw[rank * n:(rank + 1) * n])
            else:
                cut = k // 32 * q.block_bytes
                np.testing.assert_array_equal(want.raw, raw[:, rank * cut:(rank + 1) * cut])
    # a cut inside a block (96 = 3 blocks over 2 ranks): no blocks, the caller dequantizes
    down = QuantBlocks(q.quantize(state["model.layers.0.mlp.down_proj.weight"]), q, cfg.intermediate_size)
    assert Shard(1, (cfg.intermediate_size,)).take_blocks(down, 0, 2) is None
