"""Pipeline stages on other hosts: a worker daemon per host (``python -m sandwich_tvm.worker``),
the controller reaching it through Disco's ``SocketSession``, activations relayed by the
controller; against HF transformers, and with workers that die, hang or lie."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.bench.baselines.server_process import free_port
from sandwich_tvm.model.config import load_config
from sandwich_tvm.runtime import relay
from sandwich_tvm.runtime.engine import EngineError
from sandwich_tvm.runtime.loader import open_engine
from sandwich_tvm.spec import SpecError, resolve_run_spec
from sandwich_tvm.topology.plan import ExecPlan
from sandwich_tvm.tvm_compat import PROCESS_CPUS

from ..precompile import warm_up
from .test_pipeline_parallel import (
    KillAfter,
    _hf_greedy,
    _pp2_spec,
    _reference,
    _tokens_alone_and_batched,
    pp2_specs,
)

torch = pytest.importorskip("torch")

CPUS = sorted(PROCESS_CPUS)
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="a two-stage plan here runs one core per stage")
ROOT = Path(__file__).resolve().parents[2]


def _pp2() -> ExecPlan:
    return ExecPlan.of_ranks([((CPUS[0],), (CPUS[0],)), ((CPUS[1],), (CPUS[1],))], "test: PP-2", pp=2)


class WorkerDaemon:
    """``python -m sandwich_tvm.worker --listen ADDRESS`` (in a network namespace with ``netns``)."""

    def __init__(self, address: str, netns: str | None = None, rank_module: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.address = address
        cmd = [sys.executable, "-m", "sandwich_tvm.worker", "--listen", address]
        if rank_module:
            cmd += ["--rank-module", rank_module]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        env = dict(os.environ, PYTHONPATH=path, **(env or {}))
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stderr.readline()
        assert "listening on" in line, line + self.proc.stderr.read()
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # its log: never blocks it

    def nodes(self) -> list[int]:
        """The worker's node processes now (one that exits while being listed is not one)."""
        import psutil

        pids = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "sandwich_tvm.runtime.hosts" in " ".join(child.cmdline()):
                    pids.append(child.pid)
            except psutil.NoSuchProcess:
                pass
        return pids

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def worker():
    daemon = WorkerDaemon(f"127.0.0.1:{free_port()}")
    yield daemon
    daemon.close()


warm_up(__name__, "test_a_stage_on_another_host_matches_hf_and_a_killed_host_ends_cleanly", pp2_specs)


def _spec(model_dir: Path, hosts: str, **kw):
    return resolve_run_spec(model_dir, plan=_pp2(), context=256, max_batch=8, kv_dtype="float32",
                            dtype="float32", hosts=hosts, **kw)


@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_hosts_must_match_the_plans_stages(hf_case):
    model_dir, _ = hf_case
    with pytest.raises(SpecError, match="--hosts takes HOST:PORT"):
        _spec(model_dir, "localhost")
    with pytest.raises(SpecError, match="the plan must have 3 pipeline stages"):
        _spec(model_dir, "10.0.0.2:7000,10.0.0.3:7000")
    spec = _spec(model_dir, "10.0.0.2:7000")
    assert spec.hosts == ("10.0.0.2:7000",)
    assert type(spec).from_json(spec.to_json()).hosts == spec.hosts


def test_the_relay_checks_what_the_ranks_answer():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    op, arrays = relay.unpack_all([relay.pack(relay.GATHER, a), relay.pack(relay.GATHER, a + 1),
                                   relay.pack(relay.GATHER, 0 * a)])
    assert len(relay.pack(relay.GATHER, 0 * a)) < a.nbytes  # zeros travel as their shape
    # side by side, but the last stage's (it hands nothing on)
    assert op == relay.GATHER and np.array_equal(relay.combine(op, arrays), np.hstack([a, a + 1]))
    assert np.array_equal(relay.combine(relay.REDUCE, [a, a]), 2 * a)
    with pytest.raises(relay.RelayError, match="rank 1 answered reduce"):
        relay.unpack_all([relay.pack(relay.GATHER, a), relay.pack(relay.REDUCE, a)])
    with pytest.raises(relay.RelayError, match="rank 1 answered 5 bytes"):
        relay.unpack_all([relay.pack(relay.GATHER, a), b"hello"])
    with pytest.raises(relay.RelayError, match="rank 1: boom"):
        relay.unpack_all([relay.pack(relay.GATHER, a), relay.pack_error("boom")])


def _ask(address: str, line: bytes) -> dict:
    import socket

    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(line + b"\n")
        return json.loads(s.makefile("rb").readline())


@pytest.mark.parametrize("line", [b"GET / HTTP/1.0\r\n", b'{"controller": ["127.0.0.1", "x"], "workers": 1}',
                                  b'{"controller": "ab", "workers": 1}',
                                  b'{"controller": ["h", 1], "workers": 2}', b"[1, 2]"])
def test_a_worker_refuses_what_is_not_an_invitation_and_keeps_serving(worker, line):
    assert "not an invitation" in _ask(worker.address, line)["error"]
    assert worker.proc.poll() is None and worker.nodes() == []


def test_the_controller_names_a_worker_it_cannot_reach_or_that_refuses(worker, monkeypatch):
    from sandwich_tvm.runtime.hosts import SocketGroupSession, parse_hosts
    from sandwich_tvm.runtime.tp_worker import ENTRYPOINT
    from sandwich_tvm.topology.hosts import HostError

    with pytest.raises(HostError, match="IPv6"):
        parse_hosts("[::1]:7000")
    closed = f"127.0.0.1:{free_port()}"
    with pytest.raises(HostError, match=f"the worker {closed} cannot be reached.*sandwich_tvm.worker"):
        SocketGroupSession(parse_hosts(closed), ENTRYPOINT, 5.0)
    worker.close()  # a worker that wants a token
    guarded = WorkerDaemon(worker.address, env={"SANDWICH_WORKER_TOKEN": "s3cret"})
    try:
        monkeypatch.setenv("SANDWICH_WORKER_TOKEN", "wrong")
        with pytest.raises(HostError, match="refused: the invitation does not carry this worker's token"):
            SocketGroupSession(parse_hosts(guarded.address), ENTRYPOINT, 5.0)
        assert guarded.nodes() == []
    finally:
        guarded.close()


# A host that dies after joining, while the group is idle or mid-call: the controller's process
# must survive (TVM would abort it writing to the dead connection inside a destructor).
_SURVIVES = """
import os, signal, sys, time
from sandwich_tvm.runtime.disco_group import DiscoError, DiscoGroup
from sandwich_tvm.runtime.hosts import parse_hosts
from sandwich_tvm.runtime.tp_worker import ENTRYPOINT, HOP_ECHO, HOP_INIT
group = DiscoGroup(2, ENTRYPOINT, hosts=parse_hosts(sys.argv[1]), timeout_s=5.0)
group.start(HOP_INIT)
assert len(bytes(group.gather(HOP_ECHO, b"x" * 100, 100)[1])) == 100
os.kill(group.remote.node_pids[0], signal.SIGKILL)
time.sleep(0.5)
if sys.argv[2] == "call":
    try:
        group.gather(HOP_ECHO, b"x" * 100, 100)
        sys.exit("the call succeeded")
    except DiscoError as err:
        print("error:", err, flush=True)
group.close()
print("survived", flush=True)
"""


@pytest.mark.parametrize("when", ["idle", "call"])
def test_the_controller_survives_a_host_that_dies(worker, when):
    run = subprocess.run([sys.executable, "-c", _SURVIVES, worker.address, when], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0 and "survived" in run.stdout, run.stdout + run.stderr
    if when == "call":
        assert f"error: rank 1 on {worker.address}: connection lost" in run.stdout
    deadline = time.monotonic() + 10
    while worker.nodes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker.nodes() == [] and worker.proc.poll() is None


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_a_stage_on_another_host_matches_hf_and_a_killed_host_ends_cleanly(hf_case, worker, precompiler):
    """Stage 1 in a worker's node process, reached over TCP: HF's logits and greedy tokens,
    batched requests as alone; the node killed mid-request fails it, and the worker serves the
    next controller."""
    model_dir, hf = hf_case
    cfg = load_config(model_dir)
    precompiler.ready(_pp2_spec(model_dir))
    address = worker.address
    engine, _ = open_engine(_spec(model_dir, address))
    try:
        assert engine.relayed and engine.group is None
        prompt = [int(t) for t in np.random.default_rng(1).integers(0, cfg.vocab_size, 45)]
        logits: list[np.ndarray] = []
        gen = engine.generate(prompt, 13, logits_out=logits)
        ref = _reference(hf, prompt + gen.tokens[:-1])[len(prompt) - 1:]
        np.testing.assert_allclose(np.stack(logits), ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
        assert gen.tokens == [int(t) for t in ref.argmax(-1)]

        rng = np.random.default_rng(2)
        prompts = {"a": prompt, "b": prompt[:32] + [int(t) for t in rng.integers(0, cfg.vocab_size, 9)],
                   "c": [int(t) for t in rng.integers(0, cfg.vocab_size, 70)]}
        alone, batched = _tokens_alone_and_batched(engine, prompts, 8)
        assert batched == alone

        (node,) = worker.nodes()
        killer = KillAfter(node, 3)
        with pytest.raises(EngineError, match=f"rank 1 on {address}: connection lost"):
            engine.generate(prompt, 100, on_token=killer)
        assert killer.seconds_since() < 20 and engine.disco is None
    finally:
        engine.shutdown()
        os.sched_setaffinity(0, set(CPUS))
    assert worker.nodes() == [] and worker.proc.poll() is None

    engine, _ = open_engine(_spec(model_dir, address))  # the worker takes the next controller
    try:
        assert engine.generate(prompt, 4).tokens == gen.tokens[:4]
    finally:
        engine.shutdown()
        os.sched_setaffinity(0, set(CPUS))
    deadline = time.monotonic() + 10
    while worker.nodes() and time.monotonic() < deadline:  # its node leaves with the session
        time.sleep(0.1)
    assert worker.nodes() == []


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_a_hung_host_fails_the_request_within_the_timeout(hf_case, worker):
    model_dir, _ = hf_case
    engine, _ = open_engine(_spec(model_dir, worker.address, host_timeout_s=3.0))
    node = None
    try:
        (node,) = worker.nodes()
        assert len(engine.generate([5, 6, 7], 2).tokens) == 2
        os.kill(node, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineError, match="no answer \\(within 3 s\\)"):
            engine.generate([5, 6, 7, 8], 4)
        assert 2.5 < time.monotonic() - start < 15 and engine.disco is None
    finally:
        engine.shutdown()
        if node is not None:
            os.kill(node, signal.SIGKILL)
        os.sched_setaffinity(0, set(CPUS))


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_a_lying_host_fails_the_request(hf_case):
    """A rank whose exchanges are out of step (``tests/model/lying_rank.py``)."""
    model_dir, _ = hf_case
    daemon = WorkerDaemon(f"127.0.0.1:{free_port()}", rank_module="tests.model.lying_rank")
    try:
        engine, _ = open_engine(_spec(model_dir, daemon.address))
        try:
            with pytest.raises(EngineError, match="rank 1 answered .* the ranks are out of step"):
                engine.generate([5, 6, 7], 4)
            assert engine.disco is None
        finally:
            engine.shutdown()
            os.sched_setaffinity(0, set(CPUS))
        deadline = time.monotonic() + 10
        while daemon.nodes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert daemon.nodes() == []
    finally:
        daemon.close()


@pytest.mark.compile
@two_cpus
@pytest.mark.parametrize("hf_case", ["gqa-tied-llama3"], indirect=True)
def test_two_stages_across_network_namespaces_match_hf_under_the_server(hf_case, tmp_path):
    """Stage 1's worker in its own network namespace, joined to this one by a veth pair:
    `generate --hosts` gives HF's greedy tokens, and `serve --hosts` answers eight concurrent
    requests with HF's tokens."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from sandwich_tvm.bench.baselines.server_process import ServerProcess
    from sandwich_tvm.cli.options import synthetic_prompt
    from sandwich_tvm.model.tokenizer import load_model_tokenizer, placeholder_tokenizer

    from ..netns import veth_namespace

    src, hf = hf_case
    with veth_namespace() as (ns, here, there):
        daemon = WorkerDaemon(f"{there}:{free_port()}", netns=ns)
        try:
            plan = tmp_path / "plans.json"
            plan.write_text(json.dumps({"plans": [{"processes": 2, "tp": 1, "pp": 2,
                                                   "prefill_cpus": [[CPUS[0]], [CPUS[1]]],
                                                   "decode_cpus": [[CPUS[0]], [CPUS[1]]]}]}))
            common = ["--plan", str(plan), "--hosts", daemon.address, "--dtype", "float32",
                      "--kv-dtype", "float32"]
            run = subprocess.run([sys.executable, "-m", "sandwich_tvm.generate", "--model", str(src), *common,
                                  "--prompt-len", "20", "--max-new-tokens", "6", "--json"],
                                 capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, run.stderr
            out = json.loads(run.stdout)
            assert out["hosts"] == [daemon.address] and f"Remote node {there}:" in run.stderr
            prompt = synthetic_prompt(20, load_config(src).vocab_size)
            assert out["tokens"] == _hf_greedy(hf, prompt, 6)

            model_dir = tmp_path / src.name  # the same name: the same compiled stages
            shutil.copytree(src, model_dir)
            cfg = load_config(model_dir)
            placeholder_tokenizer(cfg.vocab_size).save(str(model_dir / "tokenizer.json"))
            tok = load_model_tokenizer(model_dir)
            port = free_port()
            cmd = [sys.executable, "-m", "sandwich_tvm.serve", "--model", str(model_dir), *common,
                   "--max-batch", "8", "--context", "128", "--prefill-budget", "64", "--port", str(port),
                   "--served-model-name", "tiny"]
            rng = np.random.default_rng(3)
            prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, int(n))]
                       for n in rng.integers(5, 40, 8)]

            def complete(url: str, p: list[int]) -> str:
                body = {"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            with ServerProcess("sandwich pp2 hosts", cmd, port, log_path=tmp_path / "serve.log",
                               ready_timeout_s=600) as srv, ThreadPoolExecutor(8) as pool:
                texts = list(pool.map(lambda p: complete(srv.base_url, p), prompts))
            assert texts == [tok.decode(_hf_greedy(hf, p, 8)) for p in prompts]
        finally:
            daemon.close()
