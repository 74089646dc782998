"""The main job's table (``cli/chain.py``) states each build's weight and KV-cache dtypes, in its
rows and its JSON, as the builds were compiled."""

from __future__ import annotations

import argparse
import io
import json
from types import SimpleNamespace

from rich.console import Console

from sandwich_tvm.cli import chain
from sandwich_tvm.model.config import PRESETS
from sandwich_tvm.runtime.engine import Generation
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan


class FakeEngine:
    def __init__(self, ms: float):
        self.ms = ms

    def generate(self, prompt, new_tokens, stop=None):
        return Generation(len(prompt), [1] * new_tokens, self.ms, [self.ms / 10] * (new_tokens - 1))

    def close(self) -> None:
        pass


def test_rows_and_json_state_each_builds_dtypes(tmp_path, monkeypatch):
    built = []

    def open_engine(run: RunSpec, log):
        built.append(run)
        meta = {"kernels": "stock" if run.stock else "tuned", "dtype": run.weight_dtype,
                "kv_dtype": run.kv_dtype}
        return FakeEngine(100.0 if run.stock else 10.0), SimpleNamespace(meta=meta)

    monkeypatch.setattr(chain, "open_engine", open_engine)
    spec = RunSpec(model="llama-160m", config=PRESETS["llama-160m"], plan=ExecPlan.all_cpus(),
                   weight_dtype="bfloat16", kv_dtype="float16")
    args = argparse.Namespace(prompt_len=8, max_new_tokens=4, no_stock=False, out=tmp_path)
    out = io.StringIO()
    assert chain.compare_with_stock(args, spec, Console(file=out, width=200)) == 0
    assert [r.stock for r in built] == [False, True]
    results = json.loads((tmp_path / "chain.json").read_text())["results"]
    assert {k: (r["weight_dtype"], r["kv_dtype"]) for k, r in results.items()} == {
        "sandwich": ("bfloat16", "float16"), "tvm-stock": ("float32", "float32")}
    assert all(r["act_dtype"] for r in results.values())
    table = out.getvalue()
    assert "weights" in table and "KV cache" in table
    assert "sandwich (bfloat16 weights, float16 KV cache): TTFT" in table
    cells = [[c.strip() for c in line.split("│") if c.strip()] for line in table.splitlines() if "│" in line]
    rows = [c for c in cells if c[:1] in (["sandwich"], ["tvm-stock"])]
    assert [r[:3] for r in rows] == [["sandwich", "bfloat16", "float16"], ["tvm-stock", "float32", "float32"]]


def test_dtypes_come_from_what_was_compiled():
    spec = RunSpec(model="llama-160m", config=PRESETS["llama-160m"], plan=ExecPlan.all_cpus(),
                   weight_dtype="bfloat16", kv_dtype="float16")
    assert chain.build_dtypes(spec, {"dtype": "float32", "kv_dtype": "float32"})["weight_dtype"] == "float32"
    assert chain.build_dtypes(spec, {})["kv_dtype"] == "float16"  # an older artifact: the spec's


def test_the_main_job_asks_a_real_model_a_question_and_prints_its_answer(tmp_path, monkeypatch):
    """A model with a tokenizer gets ``--prompt`` as a chat turn, stops at its EOS ids and its
    answer is printed and stored; a random-weight preset gets synthetic ids."""
    from sandwich_tvm.model.tokenizer import ModelTokenizer, placeholder_tokenizer

    tok = ModelTokenizer(placeholder_tokenizer(300), frozenset({2}), source="test")
    monkeypatch.setattr(chain, "load_model_tokenizer", lambda _m: tok)
    cfg = PRESETS["llama-160m"]
    real = RunSpec(model="some-checkpoint", config=cfg, plan=ExecPlan.all_cpus())
    args = argparse.Namespace(prompt="Hi?", prompt_len=8, max_new_tokens=4, no_stock=True, out=tmp_path)
    prompt, got = chain.chain_prompt(args, real)
    assert got is tok and prompt == tok.encode(tok.render_chat([{"role": "user", "content": "Hi?"}]))
    preset, none = chain.chain_prompt(args, RunSpec(model="llama-160m", config=cfg, plan=ExecPlan.all_cpus()))
    assert none is None and len(preset) == 8

    stops = []

    class Answering(FakeEngine):
        def generate(self, prompt, new_tokens, stop=None):
            stops.append(stop)
            return Generation(len(prompt), [3 + ord(c) for c in "ok"], 1.0, [0.1])

    meta = {"kernels": "tuned", "dtype": "bfloat16", "kv_dtype": "float16"}
    monkeypatch.setattr(chain, "open_engine", lambda run, log: (Answering(1.0), SimpleNamespace(meta=meta)))
    out = io.StringIO()
    assert chain.compare_with_stock(args, real, Console(file=out, width=200), prompt, tok) == 0
    assert stops[-1] == {2}
    assert json.loads((tmp_path / "chain.json").read_text())["results"]["sandwich"]["text"] == "ok"
    assert "sandwich answers: 'ok'" in out.getvalue()
