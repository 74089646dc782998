"""`python -m sandwich_tvm.worker --listen HOST:PORT`: the daemon a host runs so that a
controller (``generate``/``serve`` with ``--hosts HOST:PORT,...``) can place ranks on it.

For each controller that invites it, the worker starts a node process that joins the
controller's Disco ``SocketSession`` (``runtime.hosts``), and reaps it when the session ends.
The controller sends the model's and the compiled stages' paths: this host must see them at
the same paths (a shared or copied directory). A worker loads and runs whatever compiled model
a controller names: run it on a trusted network, and set ``SANDWICH_WORKER_TOKEN`` (here and
on the controller) so that it takes only invitations that carry the same token.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import threading

from ..host import require_own_cpu
from ..runtime.hosts import TOKEN_ENV, HostError, parse_hosts

NODE_MODULE = "sandwich_tvm.runtime.hosts"
RANK_MODULE = "sandwich_tvm.runtime.tp_worker"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sandwich_tvm.worker", description=__doc__)
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="the address controllers invite this worker at (their --hosts entry)")
    p.add_argument("--once", action="store_true", help="exit when the first session ends")
    p.add_argument("--rank-module", default=RANK_MODULE, metavar="MODULE",
                   help=f"the module the ranks run, which registers their functions (default {RANK_MODULE})")
    return p


class Worker:
    """Accepts invitations; one node process per controller session."""

    def __init__(self, host: str, port: int, rank_module: str = RANK_MODULE, token: str = "") -> None:
        self.rank_module, self.token = rank_module, token
        self.server = socket.create_server((host, port), reuse_port=False)
        self.nodes: dict[int, subprocess.Popen] = {}
        self.lock = threading.Lock()

    def serve(self, once: bool = False) -> None:
        while True:
            conn, peer = self.server.accept()
            with conn:
                try:
                    node = self._answer(conn, peer)
                except OSError as err:  # a node that cannot start: say so, keep serving
                    self._reply(conn, {"error": f"the node process did not start: {err}"})
                    print(f"worker: {peer[0]}: the node process did not start: {err}", file=sys.stderr,
                          flush=True)
                    node = None
            if node is not None and once:
                node.wait()
                return

    def _answer(self, conn: socket.socket, peer: tuple) -> subprocess.Popen | None:
        conn.settimeout(10)
        try:
            request = json.loads(conn.makefile("rb").readline(65536))
            host, port = request["controller"]
            workers = int(request["workers"])
            if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"the controller's address {request['controller']!r} is not [HOST, PORT]")
            if workers != 1:
                raise ValueError(f"this worker runs one rank per host, not {workers}")
        except (OSError, ValueError, KeyError, TypeError) as err:
            self._reply(conn, {"error": f"not an invitation from a sandwich_tvm controller: {err}"})
            print(f"worker: refused {peer[0]}: {err}", file=sys.stderr, flush=True)
            return None
        if self.token and not hmac.compare_digest(str(request.get("token", "")), self.token):
            self._reply(conn, {"error": f"the invitation does not carry this worker's token (set {TOKEN_ENV} "
                                        "on the controller as on the worker)"})
            print(f"worker: refused {peer[0]}: wrong token", file=sys.stderr, flush=True)
            return None
        cmd = [sys.executable, "-m", NODE_MODULE, str(host), str(int(port)), str(workers), self.rank_module]
        node = subprocess.Popen(cmd)
        with self.lock:
            self.nodes[node.pid] = node
        threading.Thread(target=self._reap, args=(node, f"{host}:{port}"), daemon=True).start()
        print(f"worker: node pid {node.pid} joins the session of {host}:{port}", file=sys.stderr, flush=True)
        self._reply(conn, {"pid": node.pid})
        return node

    @staticmethod
    def _reply(conn: socket.socket, reply: dict) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(reply).encode() + b"\n")

    def _reap(self, node: subprocess.Popen, controller: str) -> None:
        rc = node.wait()
        with self.lock:
            self.nodes.pop(node.pid, None)
        print(f"worker: node pid {node.pid} ({controller}) exited with status {rc}", file=sys.stderr,
              flush=True)

    def stop(self) -> None:
        with self.lock:
            nodes = list(self.nodes.values())
        for node in nodes:
            node.kill()
            node.wait()
        self.server.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_own_cpu("worker")  # it runs code here, not for the CPU SANDWICH_CPU describes
    try:
        (listen,) = parse_hosts(args.listen)
        worker = Worker(listen.host, listen.port, args.rank_module, os.environ.get(TOKEN_ENV, ""))
    except (HostError, ValueError) as err:
        print(f"error: --listen: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: cannot listen on {args.listen}: {err}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"worker: listening on {listen} (pid {os.getpid()})", file=sys.stderr, flush=True)
    if not os.environ.get(TOKEN_ENV):
        print(f"worker: {TOKEN_ENV} is not set: any controller that reaches {listen} can run a model here",
              file=sys.stderr, flush=True)
    try:
        worker.serve(args.once)
    except KeyboardInterrupt:
        return 130
    finally:
        worker.stop()
    return 0
