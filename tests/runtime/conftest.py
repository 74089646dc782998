"""The runtime tests' compiled tiny model (the MHA checkpoint test_batch_engine builds too)."""

from __future__ import annotations

import pytest

from sandwich_tvm.compiler.artifact import compile_model
from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import host_isa

from ..model.hf_models import hf_checkpoint


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = hf_checkpoint(tmp_path_factory.getbasetemp(), "mha-untied")  # test_batch_engine's build
    cfg = load_config(out)
    spec = RunSpec(cfg.name, cfg, ExecPlan.all_cpus(), max_batch=8, kv_dtype="float32")
    compiled = compile_model(spec)
    return out, compiled, load_params(out, cfg, compiled.params, host_isa()), spec.plan
