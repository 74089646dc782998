"""The compiled-model cache: keyed by every code-shaping source, verified, and never deleting."""

from __future__ import annotations

import json

import pytest

from sandwich_tvm.cli import compile as compile_cli
from sandwich_tvm.compiler.artifact import CompiledModel, CompileError, source_files
from sandwich_tvm.tvm_compat import PROCESS_CPUS

from ..model.hf_models import write_hf_model


def test_key_covers_every_source_that_shapes_generated_code():
    names = {f"{f.parent.name}/{f.name}" for f in source_files()}
    for src in ("kernels/microkernel.py", "kernels/schedule.py", "kernels/search.py",
                "kernels/codegen.py", "model/attention.py", "compiler/pipeline.py"):
        assert src in names
    assert {"sandwich_tvm/tvm_compat.py", "sandwich_tvm/host.py"} <= {
        f"{f.parent.name}/{f.name}" for f in source_files()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("ckpt")
    write_hf_model("mha-untied", out)
    cpus = sorted(PROCESS_CPUS)
    (out / "plans.json").write_text(json.dumps(
        {"plans": [{"tp": 1, "prefill_cpus": [cpus], "decode_cpus": [cpus[:1]]}]}))
    return out


@pytest.mark.compile
def test_out_dir_keeps_what_it_holds_and_a_damaged_library_is_rebuilt(model_dir, capsys):
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    args = ["--model", str(model_dir), "--plan", str(model_dir / "plans.json"), "--out", str(model_dir)]
    assert compile_cli.main(args) == 0  # --out is the checkpoint's own directory
    for name, data in before.items():  # the checkpoint, its config and the plan survive
        assert (model_dir / name).read_bytes() == data
    assert {p.name for p in model_dir.iterdir()} == set(before) | {"model.so", "meta.json"}
    capsys.readouterr()
    assert compile_cli.main(args) == 0
    assert "reusing" in capsys.readouterr().out

    lib = model_dir / "model.so"
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])  # truncated: a bus error if loaded
    with pytest.raises(CompileError, match="model.so is damaged"):
        CompiledModel.load(model_dir)
    assert compile_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and "rebuilding" in out
    assert CompiledModel.load(model_dir).meta["sha256"]

    lib.write_bytes(b"")  # empty
    with pytest.raises(CompileError, match="damaged"):
        CompiledModel.load(model_dir)


def test_a_foreign_library_is_not_overwritten(model_dir, tmp_path, capsys):
    (tmp_path / "model.so").write_bytes(b"someone else's library")
    args = ["--model", str(model_dir), "--plan", str(model_dir / "plans.json"), "--out", str(tmp_path)]
    assert compile_cli.main(args) == 2
    assert "did not write" in capsys.readouterr().out
    assert (tmp_path / "model.so").read_bytes() == b"someone else's library"
