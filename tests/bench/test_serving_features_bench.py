"""`bench prefix-cache` and `bench speculative` on tiny models: the cached request shares the
prefix's whole pages and gives the cold request's token; drafts keep fp32 greedy tokens; the
reports carry every round."""

from __future__ import annotations

import json

import pytest


@pytest.mark.compile
def test_prefix_cache_bench_reports_shared_pages_and_equal_tokens(tmp_path, capsys):
    from sandwich_tvm.bench.cli import main

    from ..model.hf_models import byte_level_tokenizer, write_hf_model

    model = tmp_path / "gqa-small"  # named as test_pool's: the compile cache builds it once
    write_hf_model("gqa-small", model, seed=1)
    byte_level_tokenizer().save(str(model / "tokenizer.json"))
    rc = main(["prefix-cache", "--model", str(model), "--dtype", "float32", "--prefix-tokens", "70",
               "--question-tokens", "6", "--rounds", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rounds"]) == 2 and out["same_tokens"]
    assert all(r["cached_tokens"] == 64 for r in out["rounds"])  # 70 tokens: 4 whole pages of 16
    assert set(out["median_ms"]) == {"first", "cached", "uncached"} and out["cached_vs_first"] > 0
    assert "prefix-cache" in out["command"] and out["cpu"]


@pytest.mark.compile
def test_speculative_bench_pairs_the_runs_and_keeps_greedy_tokens(tmp_path, capsys):
    from sandwich_tvm.bench.cli import main

    from ..model.hf_models import byte_level_tokenizer, write_hf_model

    model = tmp_path / "mha-untied"  # one name for both speculative tests: one build
    write_hf_model("mha-untied", model, seed=2)
    byte_level_tokenizer().save(str(model / "tokenizer.json"))
    rc = main(["speculative", "--model", str(model), "--dtype", "float32", "--passage-chars", "60",
               "--max-tokens", "24", "--rounds", "2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rounds"]) == 2 and out["same_tokens"]  # fp32: greedy tokens equal with drafts
    assert all(r["output_tokens"] == 24 and r["speedup"] > 0 for r in out["rounds"])
    assert 0 <= out["acceptance_rate"] <= 1 and "speculative" in out["command"]


@pytest.mark.compile
def test_structured_bench_times_the_grammars_and_keeps_the_plain_requests_tokens(tmp_path, capsys):
    from sandwich_tvm.bench.cli import main

    from ..model.hf_models import byte_level_tokenizer, write_hf_model

    write_hf_model("mha-untied", tmp_path, seed=3)
    byte_level_tokenizer().save(str(tmp_path / "tokenizer.json"))
    argv = ["structured", "--model", str(tmp_path), "--dtype", "float32", "--batch", "4", "--rounds", "2"]
    assert main([*argv, "--prompt-chars", "400"]) == 2  # past the model's context: said, not run
    said = capsys.readouterr()
    assert "exceeds the model's context of 256" in said.out + said.err
    rc = main([*argv, "--max-tokens", "12", "--prompt-chars", "30", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rounds"]) == 2 and out["plain_requests_same_tokens"] and out["companions"] == 2
    assert all(r["steps"] > 0 and r["grammar_ms_per_step"] > 0 for r in out["rounds"])
    assert all(r["companion_sample"].startswith('{"title":"') for r in out["rounds"])  # the schema's JSON
    assert "structured" in out["command"] and out["cpu"]


@pytest.mark.compile
def test_speculative_bench_with_a_draft_model_on_chat_messages(tmp_path, capsys):
    """The model drafting for itself (fp32 both): nearly every draft accepted, the tokens equal."""
    from sandwich_tvm.bench.cli import main

    from ..model.hf_models import byte_level_tokenizer, write_hf_model

    model = tmp_path / "mha-untied"
    write_hf_model("mha-untied", model, seed=2)
    byte_level_tokenizer().save(str(model / "tokenizer.json"))
    rc = main(["speculative", "--model", str(model), "--dtype", "float32", "--draft-model",
               str(model), "--draft-dtype", "float32", "--workload", "chat", "--passage-chars", "120",
               "--max-tokens", "12", "--rounds", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drafts"].startswith("draft model") and out["same_tokens"] and out["acceptance_rate"] > 0.9
    assert out["median_tokens_per_step"] > 2 and out["draft_seconds"] > 0
    assert "ShareGPT first" in out["workload"]


def test_where_speculative_tokens_part_the_plain_runs_logits_there_are_reported():
    import numpy as np

    from sandwich_tvm.bench.speculative import _parting

    class Plain:
        def generate(self, prompt, n, *, logits_out):
            rows = [np.array([0.0, 5.0, 1.0]), np.array([3.0, 2.98, -1.0])]  # a near-tie at position 1
            logits_out.extend(rows[:n])
            return type("G", (), {"tokens": [1, 0][:n]})()

    got = _parting(Plain(), [7, 7], plain=[1, 0, 2], spec=[1, 1, 2])
    assert got["position"] == 1 and got["plain_token"] == 0 and got["speculative_token"] == 1
    assert got["plain_top2_gap"] == pytest.approx(0.02)
    assert got["speculative_token_below_max"] == pytest.approx(0.02)
    assert got["plain_again"] is True
