"""The benchmark driver end to end against fake servers, and the CLI's bad-input errors."""

from __future__ import annotations

import contextlib
import json

import pytest

from sandwich_tvm.bench import cli as bench
from sandwich_tvm.bench.baselines.server_process import ServerStartError
from sandwich_tvm.bench.serving import runner
from sandwich_tvm.bench.serving.runner import ServeBenchConfig, pinned, run_benchmark
from sandwich_tvm.model.config import PRESETS

from .fake_server import FakeServer, FakeState

MODEL = PRESETS["llama-160m"]


def fake_launcher(state: FakeState, started: list[str], fail: tuple[str, ...] = ()):
    @contextlib.contextmanager
    def launch(system, cmd, port, env, log_path):
        started.append(system)
        if system in fail:
            raise ServerStartError(f"{system} exited with status 1 before it was ready")
        assert env["TVM_NUM_THREADS"] == "1"
        with FakeServer(state) as url:
            yield url

    return launch


def config(tmp_path, **kw) -> ServeBenchConfig:
    base = {"model": "llama-160m", "systems": ("sandwich",), "mode": "poisson", "rates": (5.0, 40.0),
            "num_prompts": 6, "lengths": ((8, 4), (16, 3)), "context": 64, "cpus": (0,), "out": tmp_path,
            "slo_scales": (0.5, 1, 4), "rounds": 1}
    return ServeBenchConfig(**(base | kw))


def test_poisson_sweep_saves_report_and_plot(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    state, started, lines = FakeState(first_s=0.02, gap_s=0.01), [], []
    cfg = config(tmp_path, systems=("llamacpp", "sandwich"))
    doc = run_benchmark(cfg, MODEL, lines.append, launcher=fake_launcher(state, started))
    assert started == ["sandwich"]  # llamacpp skipped: no binary
    assert doc["systems"]["llamacpp"]["status"] == "skipped"
    assert "llama-server not found" in doc["systems"]["llamacpp"]["reason"]
    s = doc["systems"]["sandwich"]
    assert s["status"] == "ok" and [r["rate"] for r in s["runs"]] == [5.0, 40.0]
    assert all(r["ok"] == 6 and r["failed"] == 0 for r in s["runs"])
    assert s["goodput"] == 40.0  # fake latencies are far inside the 160M SLOs
    assert set(doc["goodput"]["sandwich"]) == {"0.5", "1", "4"}
    # 7 completions per rate: the warm-up first, then the 6 requests, all with token-id prompts
    prompts = [b["prompt"] for b in state.bodies]
    assert len(prompts) == 13 and all(isinstance(p, list) for p in prompts)
    assert sorted(len(p) for p in prompts[1:7]) == [8, 8, 8, 16, 16, 16]
    saved = json.loads((tmp_path / "serve_llama-160m_poisson.json").read_text())
    assert saved["systems"]["sandwich"]["runs"][1]["requests"][0]["ok"] is True
    assert (tmp_path / "serve_llama-160m_poisson.png").read_bytes().startswith(b"\x89PNG")
    assert any("6/6 requests done" in line for line in lines)


def test_a_failing_server_does_not_stop_the_others(tmp_path, monkeypatch):
    state, started, lines = FakeState(first_s=0.0, gap_s=0.0), [], []
    cfg = config(tmp_path, systems=("sandwich", "llamacpp"), mode="single")
    real = runner.server_command
    monkeypatch.setattr(runner, "server_command", lambda system, *a, **k: (
        (["llama-server"], {"TVM_NUM_THREADS": "1"}) if system == "llamacpp" else real(system, *a, **k)))
    doc = run_benchmark(cfg, MODEL, lines.append, launcher=fake_launcher(state, started, fail=("sandwich",)))
    assert started == ["sandwich", "llamacpp"]
    assert doc["systems"]["sandwich"]["status"] == "failed"
    assert "exited with status 1" in doc["systems"]["sandwich"]["reason"]
    runs = doc["systems"]["llamacpp"]["runs"]
    assert doc["systems"]["llamacpp"]["status"] == "ok" and len(runs) == 1 and runs[0]["rate"] is None
    assert runs[0]["attainment"] == 1.0 and state.max_in_flight == 1


def test_pinned_command_runs_on_the_cpus():
    import os
    import subprocess
    import sys

    cpu = min(os.sched_getaffinity(0))
    cmd = pinned([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], (cpu,))
    assert subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip() == f"[{cpu}]"


@pytest.mark.parametrize("argv, message", [
    (["--systems", "sandwich,vllm"], "unknown system vllm"),
    (["--rates", "1,0"], "every value must be positive"),
    (["--rates", "fast"], "comma-separated numbers"),
    (["--lengths", ""], "names no PROMPT:OUTPUT pair"),
    (["--slo-scales", ""], "names no value"),
    (["--model", "no-such-model"], "neither a preset"),
    (["--context", "99999"], "exceeds the 8192 positions of smollm2-135m"),  # the default model
])
def test_bad_input_is_one_line(capsys, argv, message):
    assert bench.main(["serve", *argv]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("error: ") and message in out and "\n" not in out


def test_drafting_systems_report_acceptance_and_tokens_per_step_per_run(tmp_path):
    """sandwich-spec runs the server with prompt-lookup drafts; each run's counters are the
    server's since the previous run (4 drafted, 3 accepted per request here)."""
    state, started = FakeState(first_s=0.0, gap_s=0.0, drafts=True), []
    doc = run_benchmark(config(tmp_path, systems=("sandwich-spec",)), MODEL, lambda _m: None,
                        launcher=fake_launcher(state, started))
    runs = doc["systems"]["sandwich-spec"]["runs"]
    assert [r["speculative"]["drafted"] for r in runs] == [24.0, 24.0]  # 6 requests per rate, no warm-up
    assert all(r["speculative"]["acceptance_rate"] == 0.75 and r["speculative"]["tokens_per_step"] == 4.0
               for r in runs)
    assert "--num-speculative-tokens" in doc["systems"]["sandwich-spec"]["command"]


def test_the_draft_system_needs_a_draft_model(tmp_path):
    cmd, _env = runner.server_command("sandwich-draft", config(tmp_path, draft_model="tiny-draft"), MODEL,
                                      8000, lambda _m: None)
    assert cmd[cmd.index("--draft-model") + 1] == "tiny-draft" and "--num-speculative-tokens" in cmd
    with pytest.raises(runner.SystemUnavailable, match="give --draft-model"):
        runner.server_command("sandwich-draft", config(tmp_path), MODEL, 8000, lambda _m: None)
    assert bench.main(["serve", "--systems", "sandwich-draft"]) == 2
