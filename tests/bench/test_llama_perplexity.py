"""llama.cpp's ``llama-perplexity`` as the perplexity baseline: its protocol (chunks, BOS, the
second half of each window), its logits file's token ids, its failures, and (where it is built)
our q4_1 model against it on SmolLM2's GGUF."""

from __future__ import annotations

import json
import math
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.bench.baselines import llama_perplexity as lp
from sandwich_tvm.bench.baselines.llama_quantize import LlamaToolError, make_imatrix, requantize
from sandwich_tvm.bench.perplexity import llamacpp_reference
from sandwich_tvm.model.tokenizer import load_model_tokenizer

from ..conftest import smollm2_path


def test_chunks_and_second_half_follow_its_protocol():
    ids = list(range(10, 21))  # 11 ids: two chunks of 5, the tail dropped
    assert lp.llama_chunks(ids, 5, None) == [[10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    assert lp.llama_chunks(ids, 5, 1) == [[1, 11, 12, 13, 14], [1, 16, 17, 18, 19]]
    chunks = [[0] * 6, [0] * 5]
    nlls = [float(i) for i in range(5 + 4)]  # positions 1..5 of the first chunk, 1..4 of the second
    # n = 6: first = 3, positions 4 and 5 (NLLs 3, 4); n = 5: first = 2, positions 3 and 4 (NLLs 7, 8)
    assert lp.second_half(nlls, chunks) == [3.0, 4.0, 7.0, 8.0]
    with pytest.raises(ValueError, match="NLLs"):
        lp.second_half(nlls[:-1], chunks)


def _logits_file(path: Path, n_ctx: int, ids: list[int], magic: bytes = b"_logits_") -> Path:
    n_chunk = len(ids) // n_ctx
    path.write_bytes(magic + np.array([n_ctx, 100, n_chunk], np.int32).tobytes()
                     + np.array(ids, np.int32).tobytes() + b"\0" * 64)
    return path


def test_reads_the_token_ids_and_refuses_other_files(tmp_path):
    assert lp.read_tokens(_logits_file(tmp_path / "a", 4, list(range(8)))) == (4, list(range(8)))
    with pytest.raises(lp.LlamaPerplexityError, match="not a llama-perplexity logits file"):
        lp.read_tokens(_logits_file(tmp_path / "b", 4, list(range(8)), magic=b"garbage!"))
    bad = tmp_path / "c"
    bad.write_bytes(b"_logits_" + np.array([4, 100, 3], np.int32).tobytes() + b"\0" * 8)
    with pytest.raises(lp.LlamaPerplexityError, match="truncated"):
        lp.read_tokens(bad)
    bad.write_bytes(b"_logits_" + b"\0" * 5)
    with pytest.raises(lp.LlamaPerplexityError, match="truncated"):
        lp.read_tokens(bad)
    with pytest.raises(lp.LlamaPerplexityError, match="cannot be read"):
        lp.read_tokens(tmp_path / "missing")


FAKE = """#!{python}
# A stand-in llama-perplexity: the text's token ids come from {ids} (SmolLM2's tokenizer, computed by
# the test; {shift} added to every id, BOS id {bos} first unless None, at most {most} chunks); it
# writes the --kl-divergence-base header and prints the final estimate, or fails ({fail}) as
# perplexity() does, its error before the perf lines.
import json, sys
import numpy as np
a = sys.argv
if {fail}:
    print("perplexity: you need at least 512 tokens to evaluate perplexity", file=sys.stderr)
    for i in range(8):
        print(f"llama_perf_context_print: line {{i}}", file=sys.stderr)
    sys.exit(0)
n_ctx, n_chunk = int(a[a.index("-c") + 1]), min(int(a[a.index("--chunks") + 1]), {most})
ids = json.load(open("{ids}"))[open(a[a.index("-f") + 1]).read()]
ids = ([{bos}] if {bos} is not None else []) + [(i + {shift}) % 49152 for i in ids]
ids = ids[:n_ctx * n_chunk]
with open(a[a.index("--kl-divergence-base") + 1], "wb") as f:
    f.write(b"_logits_" + np.array([n_ctx, 49152, n_chunk], np.int32).tobytes())
    f.write(np.array(ids, np.int32).tobytes())
print("[1]7.1,[2]6.5,")
print("0.02.6 I Final estimate: PPL = 6.4563 +/- 0.65309", file=sys.stderr)
"""

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def _fake(tmp_path: Path, monkeypatch, shift: int = 0, fail: bool = False, bos: int | None = None,
          most: int = 1000) -> Path:
    tok = load_model_tokenizer("smollm2-135m")
    ids = tmp_path / "ids.json"  # stands for llama.cpp's tokenizer: ours (agreement is tested below)
    ids.write_text(json.dumps({t: tok.encode(t, add_special_tokens=True) for t in (TEXT, "text " * 100)}))
    path = tmp_path / "llama-perplexity"
    path.write_text(FAKE.format(python=sys.executable, shift=shift, fail=fail, bos=bos, most=most, ids=ids))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("LLAMA_PERPLEXITY", str(path))
    return path


def test_reference_scores_its_own_token_ids(tmp_path, monkeypatch):
    smollm2_path()
    tok, text = load_model_tokenizer("smollm2-135m"), TEXT
    _fake(tmp_path, monkeypatch)
    run, chunks, same = llamacpp_reference("smollm2-135m", tok, text, tokens=100, window=32, threads=2,
                                           log=lambda _m: None)
    assert same and (run.ppl, run.plus_minus, run.n_ctx) == (6.4563, 0.65309, 32)
    assert len(chunks) == 3 and all(len(c) == 32 for c in chunks) and run.scored == 3 * 15
    assert chunks[1] == tok.encode(text)[32:64]  # SmolLM2 adds no BOS: chunks start as tokenized
    assert run.command[:2] == ["llama-perplexity", "-m"] and "TEXT" in run.command
    _fake(tmp_path, monkeypatch, shift=1)  # another tokenizer: its ids are what everyone scores
    run, chunks, same = llamacpp_reference("smollm2-135m", tok, text, tokens=64, window=32, threads=2,
                                           log=lambda _m: None)
    assert not same and chunks[0] == [(i + 1) % 49152 for i in tok.encode(text)[:32]]
    # a vocabulary that adds BOS: llama.cpp's ids start with it, and so does every chunk it scores
    bos = tok.token_to_id(tok.bos_token)
    _fake(tmp_path, monkeypatch, bos=bos)
    run, chunks, same = llamacpp_reference("smollm2-135m", tok, text, tokens=96, window=32, threads=2,
                                           log=lambda _m: None)
    plain = tok.encode(text)
    assert run.tokens[:3] == [bos, *plain[:2]] and [c[0] for c in chunks] == [bos] * 3
    assert chunks[1][1:] == plain[32:63] and not same  # ours adds none: told, and its ids scored


def test_reference_failures_are_clear(tmp_path, monkeypatch):
    smollm2_path()
    tok = load_model_tokenizer("smollm2-135m")
    _fake(tmp_path, monkeypatch, fail=True)  # its error line, not only the perf lines after it
    with pytest.raises(lp.LlamaPerplexityError, match=r"exit 0(.|\n)*need at least 512 tokens"):
        llamacpp_reference("smollm2-135m", tok, "text " * 100, tokens=64, window=32, threads=2,
                           log=lambda _m: None)
    _fake(tmp_path, monkeypatch, most=1)  # fewer chunks than asked: refused, not scored short
    with pytest.raises(lp.LlamaPerplexityError, match="1 chunks of 32 tokens, not the 2"):
        llamacpp_reference("smollm2-135m", tok, "text " * 100, tokens=64, window=32, threads=2,
                           log=lambda _m: None)
    with pytest.raises(ValueError, match="at least 4 tokens"):
        llamacpp_reference("smollm2-135m", tok, "text", tokens=64, window=3, threads=2, log=print)
    with pytest.raises(ValueError, match="--tokens 16"):
        llamacpp_reference("smollm2-135m", tok, "text", tokens=16, window=32, threads=2, log=print)
    monkeypatch.setenv("LLAMA_PERPLEXITY", str(tmp_path / "missing"))
    with pytest.raises(lp.LlamaPerplexityError, match="LLAMA_PERPLEXITY=.*build_llama_server.sh"):
        llamacpp_reference("smollm2-135m", tok, "text", tokens=64, window=32, threads=2, log=print)
    with pytest.raises(ValueError, match="not a .gguf"):
        llamacpp_reference(str(tmp_path), tok, "text", tokens=64, window=32, threads=2, log=print)


def test_bench_refuses_a_model_that_is_not_a_gguf(tmp_path, capsys):
    from sandwich_tvm.bench.cli import main

    assert main(["perplexity", "--model", "llama-34m", "--configs", "float32", "--llamacpp", "--json"]) == 2
    assert "not a .gguf" in capsys.readouterr().err


@pytest.mark.compile
def test_q4_1_model_against_llama_perplexity(capsys):
    """On SmolLM2's Q4_1 GGUF, our q4_1 model with int8 activations and an f16 KV cache (what
    llama.cpp runs) scores llama-perplexity's tokens within 3% of its estimate."""
    smollm2_path()
    if lp.unavailable():
        pytest.skip(lp.unavailable())
    from sandwich_tvm.bench.cli import main

    rc = main(["perplexity", "--model", "smollm2-135m", "--configs", "q4_1/int8/float16", "--tokens", "512",
               "--window", "128", "--llamacpp", "--no-torch", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    llama, ours = out["rows"]["llama.cpp llama-perplexity"], out["rows"]["q4_1, int8 activations, float16 KV"]
    assert llama["same_token_ids"] and out["second_half_tokens"] == 4 * 63 == llama["tokens"]
    assert math.isfinite(ours["ppl_second_half"]) and abs(ours["vs_llamacpp"] - 1) < 0.03


QUANTIZE = """#!/bin/sh
# A stand-in llama-quantize: records its arguments; copies SRC to DST (the two paths before TYPE)
echo "$@" >> {log}
[ {fail} = 1 ] && {{ echo "llama_model_quantize: failed to quantize: bad type" >&2; exit 1; }}
while [ $# -gt 4 ]; do shift; done
cp "$1" "$2"
"""
IMATRIX = """#!/bin/sh
# A stand-in llama-imatrix: writes its -o file unless told to write nothing
echo "$@" >> {log}
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
[ {write} = 1 ] && echo imatrix > "$out"
exit 0
"""


def _script(tmp_path: Path, monkeypatch, name: str, env: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(env, str(path))
    return path


def test_requantized_rows_name_llama_quantize_and_its_imatrix(tmp_path, monkeypatch):
    """Each 4-bit type is made by llama-quantize from the model's GGUF (once more with the
    importance matrix) and scored by llama-perplexity on the same text and chunks."""
    from sandwich_tvm.bench.perplexity import llamacpp_requantized

    smollm2_path()
    _fake(tmp_path, monkeypatch)
    log = tmp_path / "quantize.log"
    _script(tmp_path, monkeypatch, "llama-quantize", "LLAMA_QUANTIZE", QUANTIZE.format(log=log, fail=0))
    imat = tmp_path / "imatrix.gguf"
    rows = llamacpp_requantized("smollm2-135m", TEXT, ["q4_0"], imatrix=imat, window=32, chunks=2, threads=2,
                                log=lambda _m: None)
    assert list(rows) == ["llama.cpp q4_0 (llama-quantize)", "llama.cpp q4_0 (llama-quantize --imatrix)"]
    calls = log.read_text().splitlines()
    assert calls[0].startswith("--allow-requantize ") and calls[0].endswith("q4_0.gguf Q4_0 2")
    assert f"--imatrix {imat} " in calls[1]
    run, command = rows["llama.cpp q4_0 (llama-quantize --imatrix)"]
    assert run.ppl == 6.4563 and len(run.tokens) == 2 * 32
    assert command[-3:] == ["q4_0.gguf", "Q4_0", "2"] and "q4_0.gguf" in run.command  # no temporary paths
    _script(tmp_path, monkeypatch, "llama-quantize", "LLAMA_QUANTIZE", QUANTIZE.format(log=log, fail=1))
    with pytest.raises(LlamaToolError, match=r"llama-quantize failed \(exit 1\)(.|\n)*bad type"):
        llamacpp_requantized("smollm2-135m", TEXT, ["q4_0"], imatrix=None, window=32, chunks=2, threads=2,
                             log=lambda _m: None)
    monkeypatch.setenv("LLAMA_QUANTIZE", str(tmp_path / "missing"))
    with pytest.raises(LlamaToolError, match="LLAMA_QUANTIZE=.*build_llama_server.sh"):
        requantize(tmp_path / "a.gguf", tmp_path / "b.gguf", "q4_0", threads=2)


def test_make_imatrix_writes_its_file_or_nothing(tmp_path, monkeypatch):
    log, out = tmp_path / "imatrix.log", tmp_path / "out" / "m.gguf"
    _script(tmp_path, monkeypatch, "llama-imatrix", "LLAMA_IMATRIX", IMATRIX.format(log=log, write=0))
    with pytest.raises(LlamaToolError, match="wrote no imatrix.gguf"):
        make_imatrix(tmp_path / "model.gguf", "some text", out, n_ctx=32, chunks=4, threads=2)
    assert not out.exists()
    _script(tmp_path, monkeypatch, "llama-imatrix", "LLAMA_IMATRIX", IMATRIX.format(log=log, write=1))
    command, _ = make_imatrix(tmp_path / "model.gguf", "some text", out, n_ctx=32, chunks=4, threads=2)
    assert out.read_text() == "imatrix\n" and not list(out.parent.glob("*.tmp"))
    assert command[0] == "llama-imatrix" and command[3:5] == ["-f", "TEXT"]
    assert command[-2:] == ["-o", str(out)]
    assert "-c 32 --chunks 4 -t 2" in log.read_text().splitlines()[-1]
