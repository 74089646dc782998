"""``bench serve`` in rounds: the systems take turns (A B C, C B A), each round's runs pair up,
the JSON records the run order; llama-server's second row runs with its weights locked."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest
from rich.console import Console

from sandwich_tvm.bench.baselines import llamaserver
from sandwich_tvm.bench.baselines.server_process import ServerStartError
from sandwich_tvm.bench.serving import runner
from sandwich_tvm.bench.serving.report import render
from sandwich_tvm.bench.serving.runner import SYSTEMS, ServeBenchConfig, run_benchmark, turn_order
from sandwich_tvm.model.config import PRESETS

from .fake_server import FakeServer, FakeState

MODEL = PRESETS["llama-160m"]
ALL = ("sandwich", "llamacpp", "llamacpp-mlock")


def config(tmp_path, **kw) -> ServeBenchConfig:
    base = {"model": "llama-160m", "systems": ALL, "mode": "poisson", "rates": (20.0, 40.0),
            "num_prompts": 3, "lengths": ((8, 3), (16, 2)), "context": 64, "cpus": (0,), "out": tmp_path,
            "slo_scales": (1,), "rounds": 2}
    return ServeBenchConfig(**(base | kw))


def launcher(turns: list[tuple[str, FakeState]], fail_on: tuple[str, int] | None = None):
    """Each start gets its own fake server; ``fail_on = (system, n)``: its n-th start fails."""

    @contextlib.contextmanager
    def launch(system, cmd, port, env, log_path):
        state = FakeState(first_s=0.0, gap_s=0.0)
        turns.append((system, state))
        if fail_on and fail_on[0] == system and sum(s == system for s, _ in turns) == fail_on[1]:
            raise ServerStartError(f"{system} exited with status 1 before it was ready")
        with FakeServer(state) as url:
            yield url

    return launch


@pytest.fixture
def any_command(monkeypatch):
    monkeypatch.setattr(runner, "server_command", lambda system, *a, **k: ([system], {}))


def test_turn_order_reverses_every_other_round():
    assert turn_order(("a", "b"), 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert turn_order(("a",), 2) == [(0, "a"), (1, "a")]
    assert SYSTEMS == ALL  # both llama-server rows run by default


def test_systems_take_turns_and_runs_pair_up(tmp_path, any_command):
    turns: list[tuple[str, FakeState]] = []
    doc = run_benchmark(config(tmp_path), MODEL, lambda _m: None, launcher=launcher(turns))
    assert [s for s, _ in turns] == [*ALL, *ALL[::-1]]  # one server per (round, system)
    order = [(o["round"], o["system"], o["rate"]) for o in doc["order"]]
    assert order == [(r, s, rate) for r, s in turn_order(ALL, 2) for rate in (20.0, 40.0)]
    assert [(t["round"], t["system"]) for t in doc["turns"]] == turn_order(ALL, 2)
    assert doc["rounds"] == 2 and "reversed every other round" in doc["interleaving"]
    # every system got the same requests in a round, other requests in the other round
    sent = {(s, i): [b["prompt"] for b in st.bodies[1:]] for i, (s, st) in enumerate(turns)}
    by_round = [[p for (s, i), p in sent.items() if i // 3 == r] for r in range(2)]
    assert all(p == by_round[r][0] for r in range(2) for p in by_round[r])
    assert by_round[0][0] != by_round[1][0] and len(by_round[0][0]) == 6  # 3 per rate
    for name in ALL:
        s = doc["systems"][name]
        assert s["status"] == "ok" and [r["rate"] for r in s["runs"]] == [20.0, 40.0]
        for r in s["runs"]:  # one row per rate over both rounds, each round listed
            assert r["ok"] == 6 and [x["round"] for x in r["rounds"]] == [0, 1]
            assert all(x["ok"] == 3 for x in r["rounds"])
            assert sorted({q["round"] for q in r["requests"]}) == [0, 1]
    paired = doc["paired"]
    assert paired["base"] == "sandwich" and set(paired["systems"]) == {"llamacpp", "llamacpp-mlock"}
    for rows in paired["systems"].values():
        assert [r["rate"] for r in rows] == [20.0, 40.0]
        assert all(r["rounds"] == [0, 1] and len(r["p90_ttft_ratio_by_round"]) == 2 for r in rows)
    saved = json.loads((tmp_path / "serve_llama-160m_poisson.json").read_text())
    assert saved["order"] == doc["order"]
    out = io.StringIO()
    render(doc, Console(file=out, width=200))
    assert "llamacpp-mlock / sandwich at 40: P90 TTFT" in out.getvalue()
    assert "median over 2 paired rounds" in out.getvalue()


def test_the_command_line_takes_rounds_and_runs_both_llama_server_rows_by_default():
    from sandwich_tvm.bench import cli
    from sandwich_tvm.bench.serve_cmd import config_from_args

    cfg = config_from_args(cli.build_parser().parse_args(["serve", "--lengths", "8:4"]))
    assert cfg.systems == ALL and cfg.rounds == 2
    cfg = config_from_args(cli.build_parser().parse_args(["serve", "--lengths", "8:4", "--rounds", "3",
                                                          "--systems", "llamacpp-mlock,sandwich"]))
    assert cfg.systems == ("llamacpp-mlock", "sandwich") and cfg.rounds == 3


def test_a_failure_in_a_later_round_ends_that_systems_rounds(tmp_path, any_command):
    turns: list[tuple[str, FakeState]] = []
    cfg = config(tmp_path, systems=("sandwich", "llamacpp"), rounds=3, mode="single")
    doc = run_benchmark(cfg, MODEL, lambda _m: None, launcher=launcher(turns, fail_on=("llamacpp", 2)))
    assert [s for s, _ in turns] == ["sandwich", "llamacpp", "llamacpp", "sandwich", "sandwich"]
    failed = doc["systems"]["llamacpp"]
    assert failed["status"] == "failed" and failed["reason"].startswith("round 2: ")
    assert [x["round"] for x in failed["runs"][0]["rounds"]] == [0]  # its first round is kept
    assert [x["round"] for x in doc["systems"]["sandwich"]["runs"][0]["rounds"]] == [0, 1, 2]
    assert doc["paired"]["systems"]["llamacpp"][0]["rounds"] == [0]  # only the rounds both ran


@pytest.mark.parametrize("system, locked", [("llamacpp", False), ("llamacpp-mlock", True)])
def test_llama_server_commands(tmp_path, monkeypatch, system, locked):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    monkeypatch.setattr(llamaserver, "gguf_for", lambda *a, **k: tmp_path / "m.gguf")
    cfg = config(tmp_path, cpus=tuple(sorted(runner_cpus())))
    cmd, _ = runner.server_command(system, cfg, MODEL, 8123, lambda _m: None)
    start = cmd.index(str(binary))
    args = cmd[start:]
    assert args[:3] == [str(binary), "-m", str(tmp_path / "m.gguf")]
    assert ("--mlock" in args, "--no-mmap" in args) == (locked, locked)  # otherwise its defaults
    # the locked row raises its locked-memory limit first (else --mlock fails with a warning)
    assert cmd[:start] == ([sys.executable, "-c", runner._MEMLOCK] if locked else [])


def runner_cpus() -> frozenset[int]:
    from sandwich_tvm.host import PROCESS_CPUS

    return PROCESS_CPUS


def test_memlock_wrapper_raises_the_soft_limit():
    import resource
    import subprocess

    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    probe = [sys.executable, "-c", "import resource; print(resource.getrlimit(resource.RLIMIT_MEMLOCK)[0])"]
    out = subprocess.run(runner.with_memlock_limit(probe), capture_output=True, text=True, check=True)
    assert int(out.stdout) == hard
