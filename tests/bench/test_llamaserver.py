"""The llama-server baseline: its command line, finding the binary, the server-process launcher
(against a dummy HTTP server) and, when the binary is built, a greedy completion from it."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from sandwich_tvm.bench.baselines import llamaserver
from sandwich_tvm.bench.baselines.llamaserver import find_llama_server, llama_server_command, unavailable
from sandwich_tvm.bench.baselines.server_process import ServerProcess, ServerStartError, free_port

# A dummy server: /health answers 503 for DELAY s, then 200; it may start a grandchild (a sleep
# in the same process group) and write its pid to a file, to check that nothing outlives stop().
DUMMY = textwrap.dedent("""
    import http.server, subprocess, sys, time
    port, delay, child_pid_file = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    if child_pid_file != "-":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open(child_pid_file, "w").write(str(child.pid))
    ready_at = time.monotonic() + delay
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path != "/health" or time.monotonic() >= ready_at
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"loading")
        def log_message(self, *args):
            pass
    print("dummy server listening", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def dummy_cmd(port: int, delay: float = 0.5, child_pid_file: Path | None = None) -> list[str]:
    return [sys.executable, "-c", DUMMY, str(port), str(delay), str(child_pid_file or "-")]


def gone(pid: int) -> bool:
    """No such process, or only a zombie awaiting its (re)parent's wait()."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- the command line -----------------------------------------------------------------------------


def test_command_fixes_threads_slots_and_splits_context():
    cmd = llama_server_command("/bin/llama-server", Path("/m/x.gguf"), threads=6, slots=4,
                               context_per_slot=1024, port=8123)
    assert cmd[0] == "/bin/llama-server"
    args = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert args == {"-m": "/m/x.gguf", "-t": "6", "-tb": "6", "-np": "4", "-c": "4096",
                    "--host": "127.0.0.1", "--port": "8123"}


def test_locked_command_adds_mlock_and_no_mmap_only():
    kw = {"threads": 2, "slots": 1, "context_per_slot": 64, "port": 1}
    plain = llama_server_command("llama-server", "x.gguf", **kw)
    locked = llama_server_command("llama-server", "x.gguf", locked=True, **kw)
    assert "--mlock" not in plain and "--no-mmap" not in plain
    assert locked == [*plain, "--mlock", "--no-mmap"]


def test_command_rejects_empty_shapes():
    with pytest.raises(ValueError, match="slots"):
        llama_server_command("llama-server", "x.gguf", threads=2, slots=0, context_per_slot=64, port=1)


# --- finding the binary ---------------------------------------------------------------------------


def fake_binary(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_not_found_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setattr(llamaserver.sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_llama_server() is None
    why = unavailable()
    assert why is not None and "llama-server not found" in why
    assert "scripts/build_llama_server.sh" in why


def test_env_var_wins_and_a_bad_one_is_reported(monkeypatch, tmp_path):
    binary = fake_binary(tmp_path / "my-llama-server")
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    assert find_llama_server() == binary and unavailable() is None
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    assert find_llama_server() is None
    assert "LLAMA_SERVER=" in unavailable()


def test_found_next_to_the_interpreter_then_on_path(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    (tmp_path / "venv").mkdir()
    (tmp_path / "path").mkdir()
    monkeypatch.setattr(llamaserver.sys, "executable", str(tmp_path / "venv" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    on_path = fake_binary(tmp_path / "path" / "llama-server")
    assert find_llama_server() == on_path
    local = fake_binary(tmp_path / "venv" / "llama-server")
    assert find_llama_server() == local


# --- the launcher ---------------------------------------------------------------------------------


def test_server_process_waits_for_health_and_stops_the_group(tmp_path):
    port = free_port()
    pid_file = tmp_path / "child.pid"
    srv = ServerProcess("dummy", dummy_cmd(port, 0.5, pid_file), port, log_path=tmp_path / "dummy.log",
                        ready_timeout_s=30)
    t0 = time.monotonic()
    with srv:
        assert time.monotonic() - t0 >= 0.4  # it waited out the 503s
        assert srv.base_url == f"http://127.0.0.1:{port}"
        assert httpx.get(srv.base_url + "/health").status_code == 200
        leader, child = srv.pid, int(pid_file.read_text())
        assert not gone(leader) and not gone(child)
    assert wait_gone(leader) and wait_gone(child)
    assert "dummy server listening" in (tmp_path / "dummy.log").read_text()


def test_exit_before_ready_raises_with_the_log(tmp_path):
    cmd = [sys.executable, "-c", "print('error: unknown flag --bogus'); raise SystemExit(3)"]
    with pytest.raises(ServerStartError, match="unknown flag --bogus") as err, \
            ServerProcess("broken", cmd, free_port(), log_path=tmp_path / "broken.log", ready_timeout_s=30):
        pass
    assert "status 3" in str(err.value)


def test_timeout_kills_the_server(tmp_path):
    port = free_port()
    srv = ServerProcess("slow", dummy_cmd(port, delay=3600), port, log_path=tmp_path / "slow.log",
                        ready_timeout_s=1.0)
    with pytest.raises(ServerStartError, match="did not answer"):
        srv.__enter__()
    assert srv.pid is None  # stopped
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)


# --- the real binary ------------------------------------------------------------------------------


def stream_completion(base_url: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed ``/v1/completions`` (``[DONE]`` checked and dropped)."""
    with httpx.stream("POST", base_url + "/v1/completions", json=body | {"stream": True}, timeout=30) as r:
        r.raise_for_status()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.compile
def test_llama_server_streams_greedy_hf_tokens_one_per_chunk(tmp_path):
    binary = find_llama_server()
    if binary is None:
        pytest.skip(unavailable())
    pytest.importorskip("gguf")
    torch = pytest.importorskip("torch")
    from sandwich_tvm.bench.baselines.llamacpp import write_gguf
    from sandwich_tvm.model.checkpoint import read_checkpoint
    from sandwich_tvm.model.config import load_config

    from ..model.hf_models import write_hf_model

    hf = write_hf_model("mha-untied", tmp_path / "hf")
    cfg = load_config(tmp_path / "hf")
    gguf = write_gguf(cfg, read_checkpoint(tmp_path / "hf"), tmp_path / "model.gguf")
    port = free_port()
    cmd = llama_server_command(binary, gguf, threads=2, slots=2, context_per_slot=128, port=port)
    prompt, new = [5, 17, 99, 250, 42, 7, 300, 3, 160, 200], 24
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
    extras = {"logprobs": 1, "stream_options": {"include_usage": True}}  # ids per chunk, usage
    with ServerProcess("llama-server", cmd, port, log_path=tmp_path / "llama-server.log",
                       ready_timeout_s=60) as srv:
        chunks = stream_completion(srv.base_url, body | extras)
        plain = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=30).json()
    *tokens, last = chunks
    assert len(tokens) == new  # one chunk per token: the GGUF's placeholder vocabulary is ASCII
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens)
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["text"] == ""
    assert last["usage"]["prompt_tokens"] == len(prompt) and last["usage"]["completion_tokens"] == new
    ids = [c["choices"][0]["logprobs"]["content"][0]["id"] for c in tokens]
    assert plain["usage"]["completion_tokens"] == new
    assert plain["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c in tokens)
    with torch.no_grad():  # HF's greedy choice after each of the same prefixes
        ref = hf(torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1:].argmax(-1).tolist()
    assert ids == ref
