"""`python -m sandwich_tvm.serve` refuses bad input before loading anything."""

from __future__ import annotations

import pytest

from sandwich_tvm.cli import serve


@pytest.mark.parametrize("argv, needle", [
    (["--model", "no-such-model"], "neither a preset"),
    (["--context", "100000000"], "exceeds the model's context"),
    (["--kv-cache-tokens", str(10**10)], "memory is available"),
])
def test_bad_options_are_one_line_errors(argv, needle, capsys):
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--max-batch", "0"], ["--kv-dtype", "int4"], ["--priority", "fifo"]])
def test_bad_values_are_refused_by_argparse(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
