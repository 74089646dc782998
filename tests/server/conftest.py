"""A tiny random checkpoint served on a free port by the real app (uvicorn in a thread)."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandwich_tvm.model.config import load_config
from sandwich_tvm.model.tokenizer import load_model_tokenizer, placeholder_tokenizer
from sandwich_tvm.model.weights import load_params
from sandwich_tvm.runtime.async_engine import AsyncEngine
from sandwich_tvm.runtime.batch import BatchEngine
from sandwich_tvm.runtime.engine import Engine
from sandwich_tvm.runtime.metrics import ServingMetrics
from sandwich_tvm.runtime.scheduler import SchedulerPolicy
from sandwich_tvm.spec import RunSpec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import host_isa

from ..model.hf_models import write_hf_model
from ..precompile import warm_up

MODEL = "tiny"
CONTEXT = 1024  # the tool prompt is ~600 byte-level tokens
POLICY = SchedulerPolicy(max_batch=8, prefill_budget=64, chunk=32, max_queue=4)


@dataclass
class Served:
    url: str
    model_dir: Path
    hf: object
    engine: Engine
    batch: BatchEngine
    async_engine: AsyncEngine
    tok: object


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(app):
    """Serve ``app`` with uvicorn in a thread on a free port: (its URL, a function stopping it)."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


def write_checkpoint(out: Path):
    """The GQA/tied/Llama-3 test model with a tokenizer covering its whole vocabulary, an EOS id
    and a chat template."""
    hf = write_hf_model("gqa-tied-llama3", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = CONTEXT  # room for a tool list in byte-level tokens
    (out / "config.json").write_text(json.dumps(cfg))
    placeholder_tokenizer(cfg["vocab_size"]).save(str(out / "tokenizer.json"))
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    return hf


def _checkpoint(base: Path) -> Path:
    """Where the served checkpoint is, a fixed place in the session (its build can start ahead)."""
    return base / "server" / "served"


def _written(base: Path) -> Path:
    if not (_checkpoint(base) / "tokenizer_config.json").is_file():
        write_checkpoint(_checkpoint(base))
    return _checkpoint(base)


def _spec(model_dir: Path) -> RunSpec:
    cfg = load_config(model_dir)
    return RunSpec(cfg.name, cfg, ExecPlan.all_cpus(), max_batch=POLICY.max_batch, kv_dtype="float32")


warm_up(__name__.rpartition(".")[0], "served", lambda base: [_spec(_written(base))])


@pytest.fixture(scope="package")
def served(tmp_path_factory, precompiler):
    from sandwich_tvm.server.app import Server, create_app

    out = _checkpoint(tmp_path_factory.getbasetemp())
    hf = write_checkpoint(out)
    spec = _spec(out)
    cfg, plan = spec.config, spec.plan
    compiled = precompiler.build(spec)
    params = load_params(out, cfg, compiled.params, host_isa())
    engine = Engine(compiled, params, plan, context=CONTEXT, max_batch=POLICY.max_batch,
                    prefill_chunk=POLICY.prefill_budget)
    tok = load_model_tokenizer(out)
    metrics = ServingMetrics(MODEL)
    batch = BatchEngine(engine, POLICY, eos_ids=tok.eos_ids, metrics=metrics)
    async_engine = AsyncEngine(batch).start()
    url, stop = start_app(create_app(Server(async_engine, tok, MODEL, metrics)))
    yield Served(url, out, hf, engine, batch, async_engine, tok)
    stop()
    async_engine.shutdown()
