"""The generate and compile CLIs on a tiny checkpoint with a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandwich_tvm.cli import compile as compile_cli
from sandwich_tvm.cli import generate as generate_cli
from sandwich_tvm.tvm_compat import PROCESS_CPUS

from ..precompile import generate_spec, selected, warm_up
from .hf_models import CONFIGS, write_hf_model

pytest.importorskip("torch")
pytestmark = pytest.mark.compile


def _two_process_argv(model_dir: Path, plan: Path) -> list[str]:
    return ["--model", str(model_dir), "--plan", str(plan), "--prompt-len", "20", "--max-new-tokens", "8",
            "--dtype", "float32", "--kv-dtype", "float32", "--json"]


def _write_two_process_plan(path: Path) -> Path:
    cpus = sorted(PROCESS_CPUS)
    path.write_text(json.dumps({"plans": [{"tp": 2, "prefill_cpus": [[cpus[0]], [cpus[1]]],
                                           "decode_cpus": [[cpus[0]], [cpus[1]]]}]}))
    return path


def _write_model(base: Path) -> Path:
    """The MHA checkpoint with a word-level tokenizer and a plan (prefill on every CPU, decode on
    one), at a fixed place in the session (its compiled models can be built ahead)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = base / "cli" / "mha"
    if (out / "plans.json").is_file():
        return out
    write_hf_model("mha-untied", out)
    vocab = {f"w{i}": i for i in range(CONFIGS["mha-untied"]["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    cpus = sorted(PROCESS_CPUS)
    plan = {"plans": [{"tp": 1, "prefill_cpus": [cpus], "decode_cpus": [cpus[:1]]}]}
    (out / "plans.json").write_text(json.dumps(plan))
    return out


def _default_spec(model_dir: Path):
    """generate's spec with the module's plan and no dtype options (also bench e2e's bf16 run)."""
    return generate_spec(["--model", str(model_dir), "--plan", str(model_dir / "plans.json"),
                          "--prompt-len", "4"])


def _e2e_spec(model_dir: Path):
    """bench e2e's main run (``--dtype float32``)."""
    return generate_spec(["--model", str(model_dir), "--plan", str(model_dir / "plans.json"),
                          "--dtype", "float32", "--prompt-len", "8"])


def _two_process_specs(base: Path) -> list:
    model_dir = _write_model(base)
    return [generate_spec(_two_process_argv(model_dir, plan))
            for plan in (model_dir / "plans.json", _write_two_process_plan(base / "cli" / "two.json"))]


for _test in ("test_generate_json", "test_generate_streams_text_through_the_tokenizer",
              "test_generate_samples_reproducibly_with_a_seed"):
    warm_up(__name__, _test, lambda base: [_default_spec(_write_model(base))])
if len(PROCESS_CPUS) >= 2:
    warm_up(__name__, "test_generate_runs_a_two_process_plan", _two_process_specs)
warm_up(__name__, "test_bench_e2e_reports_measured_and_predicted",
        lambda base: [_e2e_spec(_write_model(base)), _default_spec(_write_model(base))])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, precompiler, request):
    base = tmp_path_factory.getbasetemp()
    out = _write_model(base)
    # The artifacts that only the two-process and bench tests open are built on the other core
    # while the first tests build the default one here (when the session has not started them
    # all already: ``warm_up``).
    if len(PROCESS_CPUS) >= 2 and selected(request, "test_generate_runs_a_two_process_plan"):
        precompiler.submit(_two_process_specs(base)[1])
    if selected(request, "test_bench_e2e_reports_measured_and_predicted"):
        precompiler.submit(_e2e_spec(out))
    return out


def test_generate_json(model_dir, capsys, precompiler):
    precompiler.ready(_default_spec(model_dir))
    code = generate_cli.main(["--model", str(model_dir), "--plan", str(model_dir / "plans.json"),
                              "--prompt-len", "20", "--max-new-tokens", "5", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 20 and out["output_tokens"] == 5 and len(out["tokens"]) == 5
    assert out["ttft_ms"] > 0 and out["tpot_ms"] > 0


@pytest.mark.skipif(len(PROCESS_CPUS) < 2, reason="a two-process plan needs two CPUs")
def test_generate_runs_a_two_process_plan(model_dir, tmp_path, capsys, precompiler):
    """A plans.json of two processes runs as two tensor-parallel ranks, with one process's tokens."""
    two = _write_two_process_plan(tmp_path / "two.json")
    tokens = {}
    for name, plan in (("one", model_dir / "plans.json"), ("two", two)):
        precompiler.ready(generate_spec(_two_process_argv(model_dir, plan)))
        code = generate_cli.main(_two_process_argv(model_dir, plan))
        assert code == 0
        tokens[name] = json.loads(capsys.readouterr().out)["tokens"]
    assert tokens["two"] == tokens["one"] and len(tokens["one"]) == 8


def test_generate_streams_text_through_the_tokenizer(model_dir, capsys, precompiler):
    precompiler.ready(_default_spec(model_dir))
    code = generate_cli.main(["--model", str(model_dir), "--plan", str(model_dir / "plans.json"),
                              "--prompt", "w5 w17 w200 w3", "--max-new-tokens", "4"])
    assert code == 0
    words = capsys.readouterr().out.split()
    assert len(words) == 4 and all(w.startswith("w") for w in words)


def test_errors_are_reported_not_raised(model_dir, tmp_path, capsys):
    assert generate_cli.main(["--model", str(tmp_path / "missing"), "--prompt-len", "4"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    bad_plan = tmp_path / "plans.json"
    bad_plan.write_text(json.dumps({"plans": [{"tp": 1, "prefill_cpus": [[4096]], "decode_cpus": [[4096]]}]}))
    assert compile_cli.main(["--model", str(model_dir), "--plan", str(bad_plan)]) == 2
    assert "not available to this process" in capsys.readouterr().out
    assert generate_cli.main(["--model", str(model_dir), "--plan", str(model_dir / "plans.json"),
                              "--prompt-len", "250", "--max-new-tokens", "10"]) == 2
    assert "exceeds the context of 256 tokens" in capsys.readouterr().err


def test_bench_e2e_reports_measured_and_predicted(model_dir, tmp_path, capsys, precompiler):
    from sandwich_tvm.bench import cli as bench_cli

    precompiler.ready(_e2e_spec(model_dir))
    precompiler.ready(_default_spec(model_dir))  # the --also-dtype bfloat16 run
    plot = tmp_path / "e2e.png"
    (tmp_path / "records").mkdir()
    with pytest.raises(SystemExit, match="no such directory of kernel records"):
        bench_cli.main(["e2e", "--model", str(model_dir), "--plan", str(model_dir / "plans.json"),
                        "--systems", "sandwich", "--also-records", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="--also-records runs against Sandwich's main run"):
        bench_cli.main(["e2e", "--model", str(model_dir), "--systems", "torch", "--also-records",
                        str(tmp_path / "records")])
    code = bench_cli.main(["e2e", "--model", str(model_dir), "--plan", str(model_dir / "plans.json"),
                           "--prompts", "8,24", "--new-tokens", "4", "--systems", "sandwich", "--json",
                           "--repeat", "2", "--cached-profile", "--dtype", "float32",
                           "--also-dtype", "bfloat16", "--also-records", str(tmp_path / "records"),
                           "--plot", str(plot)])
    assert code == 0 and plot.stat().st_size > 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert len(out["bandwidth_samples_gbs"]) == 8  # before and after each of 2 x 2 requests
    assert all(r["decode_bandwidth_gbs"] > 0 for r in rows)  # sampled per prompt length
    assert [(r["prompt"], r["system"], r["weights"]) for r in rows] == [
        (p, system, dtype) for p in (8, 24) for system, dtype in (
            ("sandwich", "float32"), ("sandwich bfloat16", "bfloat16"), ("sandwich records", "float32"))]
    for r in rows:  # the --also-dtype and --also-records rows, interleaved and paired with the main run's
        if r["system"] != "sandwich":
            assert r["tpot_ratio_vs_sandwich"] > 0 and r["predicted_tpot_ms"] > 0
            assert len(r["tpot_runs_ms"]) == 2
        if r["system"] == "sandwich records":  # an empty records folder: the same default kernels
            assert r["same_tokens_as_sandwich"] is True
    assert out["also_records"] == str(tmp_path / "records")
    for r in rows:
        assert r["output_tokens"] == 4
        assert r["ttft_ms"] > 0 and r["predicted_ttft_ms"] > 0 and r["predicted_tpot_ms"] > 0
        runs = r["tpot_runs_ms"]
        assert len(runs) == 2 and min(runs) <= r["tpot_ms"] <= max(runs)


def test_generate_samples_reproducibly_with_a_seed(model_dir, capsys, precompiler):
    precompiler.ready(_default_spec(model_dir))

    def run(seed: str) -> list[int]:
        code = generate_cli.main(["--model", str(model_dir), "--plan", str(model_dir / "plans.json"),
                                  "--prompt-len", "12", "--max-new-tokens", "12", "--json",
                                  "--temperature", "1.5", "--sampling-seed", seed])
        assert code == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    assert run("7") == run("7")
    assert run("7") != run("8")  # 12 tokens drawn at temperature 1.5 from 301: distinct seeds differ


def test_generate_refuses_bad_sampling_values(model_dir, capsys):
    code = generate_cli.main(["--model", str(model_dir), "--prompt-len", "4", "--temperature", "-1"])
    assert code == 2 and "temperature" in capsys.readouterr().err
