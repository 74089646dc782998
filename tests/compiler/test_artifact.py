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
                "kernels/codegen.py", "kernels/attention.py", "compiler/pipeline.py"):
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
    args = ["--model", str(model_dir), "--plan", str(model_dir / "plans.json"), "--out", str(model_dir),
            "--dtype", "float32"]  # what is kept does not depend on the dtype; fp32 builds faster
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


@pytest.mark.parametrize("damage", ["truncated", "other cpu"])
def test_a_bad_schedules_database_is_a_clear_error(model_dir, tmp_path, capsys, damage):
    from dataclasses import replace

    from sandwich_tvm.cli import generate as generate_cli
    from sandwich_tvm.host import host_signature
    from sandwich_tvm.kernels.database import KernelRecord, record_path, save_record
    from sandwich_tvm.kernels.defaults import default_schedule
    from sandwich_tvm.kernels.schedule import GemmShape
    from sandwich_tvm.kernels.search import Tuned
    from sandwich_tvm.model.config import load_config

    cfg = load_config(model_dir)
    shape = GemmShape(3 * cfg.hidden_size, cfg.hidden_size)  # the fused qkv of this MHA model
    threads = len(PROCESS_CPUS)
    path = record_path(shape, threads, tmp_path)
    if damage == "truncated":
        path.parent.mkdir(parents=True)
        path.write_text('{"format": 2, "cpu": {')
    else:  # a record of another CPU copied into this CPU's directory
        other = replace(host_signature(), family=(host_signature().family or 0) + 1)
        rec = KernelRecord(shape, threads, other, [Tuned(1, default_schedule(shape, 1, threads), 1.0, True)])
        path.parent.mkdir(parents=True)
        path.write_text(save_record(rec, tmp_path / "elsewhere").read_text())
    common = ["--model", str(model_dir), "--plan", str(model_dir / "plans.json"),
              "--schedules", str(tmp_path), "--dtype", "float32"]  # the damaged record's dtype
    assert compile_cli.main([*common, "--out", str(tmp_path / "artifact")]) == 2
    out = capsys.readouterr().out
    assert path.name in out and ("delete it" in out or "re-tune" in out) and "Traceback" not in out
    assert generate_cli.main([*common, "--prompt-len", "4", "--max-new-tokens", "1"]) == 2
    assert path.name in capsys.readouterr().err
