"""A server as a child process: start it, wait until its health endpoint answers, stop it.

Used for every system the serving benchmark talks to over HTTP (ours and llama-server), so
each starts, logs and stops the same way. The child runs in its own process group, which
``__exit__`` terminates whole: a server's worker processes never outlive the benchmark.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import TracebackType

import httpx

POLL_S = 0.2  # between health checks
PROGRESS_S = 10.0  # between "still waiting" lines
STOP_S = 10.0  # SIGTERM grace before SIGKILL
LOG_TAIL_LINES = 20


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message ends with the tail of its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ("" when it is missing)."""
    try:
        with open(path, errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines))
    except OSError:
        return ""


class ServerProcess:
    """``with ServerProcess(name, cmd, port, log_path=...) as srv:`` runs ``cmd`` until the block
    ends; on entry it returns once ``GET {srv.base_url}{health_path}`` answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, *, log_path: Path,
                 ready_timeout_s: float = 600.0, env: dict[str, str] | None = None,
                 health_path: str = "/health"):
        self.name, self.cmd, self.port = name, list(cmd), port
        self.log_path = Path(log_path)
        self.ready_timeout_s = ready_timeout_s
        self.env = env
        self.health_path = health_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # The child keeps its own copy of the descriptor; ours can close now.
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _fail(self, why: str) -> ServerStartError:
        tail = log_tail(self.log_path).rstrip()
        return ServerStartError(f"{self.name} {why}; last lines of {self.log_path}:\n{tail or '(empty log)'}")

    def _wait_ready(self) -> None:
        assert self.proc is not None
        url = self.base_url + self.health_path
        t0 = time.monotonic()
        next_note = t0 + PROGRESS_S
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise self._fail(f"exited with status {code} before it was ready")
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet, or busy loading
                now = time.monotonic()
                if now - t0 > self.ready_timeout_s:
                    raise self._fail(f"did not answer {url} within {self.ready_timeout_s:.0f} s")
                if now >= next_note:
                    print(f"[{self.name}] waiting for {url}: {now - t0:.0f} s (log: {self.log_path})",
                          file=sys.stderr, flush=True)
                    next_note += PROGRESS_S
                time.sleep(POLL_S)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after ``STOP_S``; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        # The leader is gone; children that ignored SIGTERM may remain in its group.
        _signal_group(proc.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
