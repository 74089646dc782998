"""`bench perplexity`: windows of real text, teacher-forced NLL, and the fp32 model's perplexity
equal to HF transformers' on the same weights and tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.bench.perplexity import Config, _nll, engine_nll, perplexity_specs, sharegpt_text, windows

from ..precompile import warm_up


def test_config_and_windows():
    assert Config.parse("q8_0/int8/float16") == Config("q8_0", "int8", "float16")
    assert Config.parse("bfloat16") == Config("bfloat16", "float32", "float32")
    with pytest.raises(ValueError, match="DTYPE"):
        Config.parse("q8_0//x")
    assert windows(range(10), 9, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token tail scores nothing
    assert windows(range(10), 10, 4)[-1] == [8, 9]
    text = sharegpt_text(2000)
    assert len(text) == 2000 and text == sharegpt_text(2000)  # a fixed slice


def test_nll_is_the_log_softmax():
    logits = np.array([1.0, 3.0, -2.0, 0.5], np.float32)
    want = -math.log(math.exp(3.0) / sum(math.exp(x) for x in logits))
    assert _nll(logits, 1) == pytest.approx(want, rel=1e-12)


class _Bigram:
    """A fake engine whose logits depend on the last token it read: teacher forcing must feed
    the true tokens in order, one window per sequence."""

    def __init__(self, vocab: int):
        self.table = np.random.default_rng(0).standard_normal((vocab, vocab)).astype(np.float32)
        self.calls: list[tuple[str, int]] = []

    def start(self, seq):
        self.calls.append(("start", seq))

    def stop(self, seq):
        self.calls.append(("stop", seq))

    def prefill(self, ids, seq):
        assert len(ids) == 1
        return self.table[ids[-1]]

    def decode(self, token, seq):
        return self.table[token]


def test_engine_nll_teacher_forces_every_window():
    eng = _Bigram(7)
    chunks = [[1, 2, 3, 4], [5, 6, 0]]
    got = engine_nll(eng, chunks)
    want = [_nll(eng.table[a], b) for c in chunks for a, b in zip(c, c[1:], strict=False)]
    assert got == want and len(got) == 5
    assert eng.calls == [("start", 0), ("stop", 0)] * 2


def _ppl_model(base: Path) -> Path:
    """A random gqa-small with a byte-level tokenizer, written once a session."""
    from ..model.hf_models import byte_level_tokenizer, write_hf_model

    out = base / "ppl-gqa-small"
    if not (out / "tokenizer.json").is_file():
        write_hf_model("gqa-small", out, seed=1)
        byte_level_tokenizer().save(str(out / "tokenizer.json"))
    return out


def _ppl_specs(base: Path) -> list:
    """What the fp32 test builds: the float32 and q8_0 rows' models."""
    return [s for _, s in perplexity_specs(str(_ppl_model(base)), [Config("float32"), Config("q8_0")], 48)[1]]


warm_up(__name__, "test_fp32_perplexity_equals_transformers", _ppl_specs)


@pytest.mark.compile
def test_fp32_perplexity_equals_transformers(precompiler, tmp_path_factory, capsys):
    pytest.importorskip("torch")
    from sandwich_tvm.bench.cli import main

    base = tmp_path_factory.getbasetemp()
    for spec in _ppl_specs(base):
        precompiler.ready(spec)
    rc = main(["perplexity", "--model", str(_ppl_model(base)), "--configs", "float32,q8_0", "--tokens", "96",
               "--window", "48", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert out["tokens"] == 94
    assert set(rows) == {"float32, float32 KV", "q8_0, float32 KV", "transformers float32"}
    ours, hf = rows["float32, float32 KV"], rows["transformers float32"]
    assert ours["ppl"] == pytest.approx(hf["ppl"], rel=1e-4)
    assert rows["q8_0, float32 KV"]["ppl"] != ours["ppl"]
    assert "perplexity" in out["command"] and out["cpu"]


def test_int8_kv_rows_are_compared_with_the_16_bit_kv_of_the_same_weights():
    from sandwich_tvm.bench.perplexity import vs_16bit_kv

    rows = {"a": {"ppl": 8.0, "dtype": "float32", "activations": "float32", "kv_dtype": "float16"},
            "b": {"ppl": 8.04, "dtype": "float32", "activations": "float32", "kv_dtype": "int8"},
            "c": {"ppl": 9.0, "dtype": "q8_0", "activations": "float32", "kv_dtype": "int8"}}
    vs_16bit_kv(rows)
    assert rows["b"]["vs_16bit_kv"] == pytest.approx(1.005) and rows["c"]["vs_16bit_kv"] is None
    assert "vs_16bit_kv" not in rows["a"]
