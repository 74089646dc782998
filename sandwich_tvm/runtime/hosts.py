"""Ranks on other hosts, through TVM Disco's ``SocketSession``.

Each host runs a worker daemon (``python -m sandwich_tvm.worker --listen HOST:PORT``). A
controller given ``--hosts`` listens on a free port of the address that routes to the hosts,
invites each worker (one JSON line over TCP: the controller's address), and each worker starts
a node process (``runtime.hosts`` as ``node_main``) that registers the rank functions and
joins the session through Disco's ``RemoteSocketSession``; rank 0 stays a thread of the
controller, rank i runs on host i. Every command and every answer then crosses Disco's
sockets (the pipeline's activations too: ``runtime.relay``).

What this module adds to Disco's sockets (TVM 0.27 sets neither option): ``TCP_NODELAY`` on
both ends (a command and its reply request are two small writes; with Nagle's algorithm each
round trip waited ~40 ms for a delayed ACK), and send and receive timeouts on the
controller's end, so that a hung host fails the call (``would block``) instead of hanging it.
When the group closes or fails, the controller's sockets are swapped for a socket pair that
nobody reads (``cut_off``): Disco frees its registers and shuts down by writing to them,
which on a dead connection would throw inside a destructor and abort the controller; the
nodes take the closed connection for a shutdown.

A worker runs whatever compiled model a controller names, so it belongs on a trusted network;
with ``SANDWICH_WORKER_TOKEN`` set on both sides, it takes only invitations that carry it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import sys
import threading
import time
from typing import Any

from ..topology.hosts import Host, HostError, parse_hosts

__all__ = ["Host", "HostError", "SocketGroupSession", "node_main", "parse_hosts"]

INVITE_TIMEOUT_S = 30.0
TOKEN_ENV = "SANDWICH_WORKER_TOKEN"


def route_address(host: Host) -> str:
    """This machine's address on the route to ``host`` (where its node connects back to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host.host, host.port))
        except OSError as err:
            raise HostError(f"no route to the worker {host}: {err}") from None
        return s.getsockname()[0]


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def invite(worker: Host, controller: Host, workers: int = 1, timeout_s: float = INVITE_TIMEOUT_S) -> int:
    """Ask the worker daemon at ``worker`` to join the controller's session with ``workers``
    ranks; returns the pid of its node process (on that host)."""
    request = {"controller": [controller.host, controller.port], "workers": workers, "pid": os.getpid(),
               "token": os.environ.get(TOKEN_ENV, "")}
    try:
        with socket.create_connection((worker.host, worker.port), timeout=timeout_s) as s:
            s.sendall(json.dumps(request).encode() + b"\n")
            line = s.makefile("rb").readline(65536)
    except OSError as err:
        raise HostError(f"the worker {worker} cannot be reached ({err}); start it there with "
                        f"`python -m sandwich_tvm.worker --listen {worker}`") from None
    try:
        reply = json.loads(line)
        if "error" in reply:
            raise HostError(f"the worker {worker} refused: {reply['error']}")
        return int(reply["pid"])
    except (ValueError, KeyError, TypeError):
        raise HostError(f"{worker} answered {line[:80]!r}, not as a sandwich_tvm worker does") from None


def _connections(port: int, listening: bool = False) -> list[Any]:
    """This process's TCP sockets on local ``port``: the listening one, or every other."""
    import psutil

    return [c for c in psutil.Process().net_connections(kind="tcp")
            if c.laddr and c.laddr.port == port and (c.status == "LISTEN") == listening]


def _set_options(fd: int, nodelay: bool = True, timeout_s: float | None = None) -> None:
    s = socket.socket(fileno=os.dup(fd))
    try:
        if nodelay:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if timeout_s is not None:
            sec = int(timeout_s)
            value = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)  # a full buffer to a stopped host
    finally:
        s.close()  # the duplicate: the session's socket stays open


class SocketGroupSession:
    """A ``SocketSession`` of rank 0 here and one rank on each host; its sockets as above."""

    def __init__(self, hosts: tuple[Host, ...], entrypoint: str, timeout_s: float,
                 invite_timeout_s: float = INVITE_TIMEOUT_S) -> None:
        """``timeout_s``: how long a host may take to answer a call (``set_timeout`` changes it)."""
        import tvm.runtime.disco as di

        self.hosts, self.timeout_s = hosts, timeout_s
        address = route_address(hosts[0])
        self.port = free_port(address)
        controller = Host(address, self.port)
        _use_entrypoint(entrypoint)
        self.node_pids = [invite(h, controller, 1, invite_timeout_s) for h in hosts]
        done = threading.Event()
        watchdog = threading.Thread(target=self._give_up_listening, args=(done, invite_timeout_s),
                                    daemon=True)
        watchdog.start()
        try:
            self.session = di.SocketSession(1 + len(hosts), 1, 1, address, self.port)
        except Exception as err:
            self._close_port()  # TVM's sockets are not closed with the failed session
            raise HostError(f"not every host joined within {invite_timeout_s:.0f} s ({err}); check that "
                            f"each can reach this machine at {controller}") from None
        finally:
            done.set()
        self._held: list[socket.socket] = []
        self.sockets = [c.fd for c in _connections(self.port)]
        if len(self.sockets) != len(hosts):
            self.cut_off()
            raise HostError(f"{len(hosts)} hosts joined but {len(self.sockets)} connections are open: a host "
                            "left at once")
        self.set_timeout(timeout_s)

    def set_timeout(self, timeout_s: float) -> None:
        """How long a host may take to take or answer a call from now on."""
        self.timeout_s = timeout_s
        for fd in self.sockets:
            _set_options(fd, nodelay=True, timeout_s=timeout_s)

    def _close_port(self) -> None:
        for c in _connections(self.port) + _connections(self.port, listening=True):
            with contextlib.suppress(OSError):
                s = socket.socket(fileno=os.dup(c.fd))
                s.shutdown(socket.SHUT_RDWR)
                s.close()
                os.close(c.fd)

    def _give_up_listening(self, done: threading.Event, timeout_s: float) -> None:
        """Wake the session's blocked ``accept`` (it has no timeout) once ``timeout_s`` passed."""
        if done.wait(timeout_s):
            return
        for c in _connections(self.port, listening=True):
            with contextlib.suppress(OSError):
                s = socket.socket(fileno=os.dup(c.fd))
                s.shutdown(socket.SHUT_RDWR)
                s.close()

    def cut_off(self) -> None:
        """Swap every remote connection for one end of a socket pair nobody reads: the session's
        later writes (freeing registers, shutting down) land there, and the hosts see their
        connection closed."""
        for fd in self.sockets:
            a, b = socket.socketpair()
            self._held.append(b)
            os.dup2(a.fileno(), fd)
            a.close()
        self.sockets = []


def _use_entrypoint(entrypoint: str) -> None:
    """Disco makes each node's local ranks with ``runtime.disco.create_socket_session_local_workers``
    (TVM's own worker module); ours run ``entrypoint``, which registers the rank functions."""
    import tvm.runtime.disco as di
    import tvm_ffi

    def local_workers(num_workers: int) -> Any:
        return di.ProcessSession(num_workers, entrypoint=entrypoint)

    tvm_ffi.register_global_func("runtime.disco.create_socket_session_local_workers", local_workers,
                                 override=True)


def node_main(argv: list[str] | None = None) -> int:
    """A host's node process: ``python -m sandwich_tvm.runtime.hosts CONTROLLER_HOST PORT WORKERS
    ENTRYPOINT``. Registers the rank functions (imports ``ENTRYPOINT``) and serves the
    controller's session until it shuts down or goes away."""
    import importlib

    import tvm
    import tvm.runtime.disco  # noqa: F401 -- registers the session constructors
    import tvm_ffi

    from ..host import enable_amx

    host, port, workers, entrypoint = argv if argv is not None else sys.argv[1:5]
    tvm_ffi.init_ffi_api("runtime.disco", "tvm.runtime.disco._ffi_api")
    importlib.import_module(entrypoint)
    _use_entrypoint(entrypoint)
    enable_amx()
    controller = Host(host, int(port))
    threading.Thread(target=_nodelay_when_connected, args=(controller,), daemon=True).start()
    join = tvm.get_global_func("runtime.disco.RemoteSocketSession")
    deadline, wait = time.monotonic() + INVITE_TIMEOUT_S, 0.05
    while True:  # the controller listens once every host has been invited
        try:
            join(controller.host, controller.port, int(workers))
            return 0
        except Exception as err:  # noqa: BLE001 -- TVM's error types
            if "Failed to connect" not in str(err) or time.monotonic() > deadline:
                print(f"sandwich node: the session with {controller} ended: {err}", file=sys.stderr)
                return 1
            time.sleep(wait)  # (each failed try leaves TVM's socket open: back off)
            wait = min(2 * wait, 1.0)


def _nodelay_when_connected(controller: Host, timeout_s: float = INVITE_TIMEOUT_S) -> None:
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for c in psutil.Process().net_connections(kind="tcp"):
            if c.raddr and (c.raddr.ip, c.raddr.port) == (controller.host, controller.port) \
                    and c.status == "ESTABLISHED":
                _set_options(c.fd)
                return
        time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(node_main())
