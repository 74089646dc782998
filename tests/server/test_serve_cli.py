"""`python -m sandwich_tvm.serve` refuses bad input before loading anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandwich_tvm.cli import serve

PLANS = Path(__file__).resolve().parents[2] / "examples" / "plans"


@pytest.mark.parametrize("argv, needle", [
    (["--model", "no-such-model"], "neither a preset"),
    (["--context", "100000000"], "exceeds the model's context"),
    (["--kv-cache-tokens", str(10**10)], "memory is available"),
])
def test_bad_options_are_one_line_errors(argv, needle, capsys):
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["--draft-model", "llama-160m"], "a draft model must share the model's tokenizer"),
    (["--draft-model", "smollm2-135m", "--num-speculative-tokens", "0"], "give 1 or more"),
    (["--draft-model", "smollm2-135m", "--plan", str(PLANS / "two-cpus-pp2.json")], "one-process plan"),
    (["--model", "llama-160m", "--draft-model", "tinyllama-1.1b", "--context", "2048"], None),
])
def test_a_bad_draft_model_is_refused_before_anything_compiles(argv, needle, capsys, monkeypatch):
    from sandwich_tvm.runtime import loader

    def no_compile(*_a, **_k):
        raise AssertionError("compiled")

    monkeypatch.setattr(loader, "open_engine", no_compile)
    if needle is None:  # presets share the placeholder tokenizer: accepted, up to the compile
        with pytest.raises(AssertionError, match="compiled"):
            serve.main(argv)
        return
    assert serve.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and needle in err[-1] and not any("Traceback" in e for e in err)


@pytest.mark.parametrize("argv", [["--max-batch", "0"], ["--kv-dtype", "int4"], ["--priority", "fifo"]])
def test_bad_values_are_refused_by_argparse(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
