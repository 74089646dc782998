"""Disco process groups: a ``ProcessSession`` of P ranks (rank 0 a thread of this process, ranks
1..P-1 worker processes that run an entrypoint module), the state each rank keeps between
calls, and the processes behind it: found, watched, killed, shut down (also at exit).

The calling convention, both sides of it:

- A rank's state is a Python object (a ``RankState``) that an init function returns; Disco
  holds it in a DRef, and every rank function takes it as its first argument.
- A rank function (``rank_function``) never raises -- an exception in a Disco worker aborts
  the process -- but returns a ``Failure`` naming the rank, after telling its peers
  (``RankState.abort``) so that they stop waiting for it.
- ``DiscoGroup.call`` runs one on every rank, in order with the calls before, and returns rank
  0's value (read in-process). A ``Failure`` there, or a worker that is gone, raises
  ``DiscoError`` with every rank's own error, the first to fail first.

Traps of this Disco (TVM 0.27) that the code here avoids: only rank 0's values are read back
(a Python object or None read from another worker crashes it); arguments are plain values and
shapes, not tensors; a DRef freed after a worker died writes to its closed pipe inside a
destructor (fatal), so this process keeps a read end of every command pipe; the session's
destructor joins rank 0's thread with the GIL held, so that thread is synced first.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import tvm_ffi

from ..topology.hosts import Host

LAST_ERROR = "sandwich.disco.last_error"  # (state) -> "monotonic time\tmessage" of its last failure, or ""


class DiscoError(RuntimeError):
    """A rank failed or a worker process is gone; the message names the ranks."""


@dataclass(frozen=True)
class Failure:
    """What a rank function returns instead of raising."""

    rank: int
    message: str
    at: float = field(default_factory=time.monotonic)  # one clock for every process of the host

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.message}"


class RankState:
    """A rank's state between calls: its rank and its last failure."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failure: Failure | None = None

    def abort(self) -> None:
        """Tell the peers that this rank failed (a subclass's group: their waits end now)."""

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or the ``Failure`` it raised: printed, kept, and the peers told."""
        self.failure = None
        try:
            return fn(*args)
        except BaseException as err:  # noqa: BLE001 -- Disco would abort the process
            self.failure = Failure(self.rank, f"{type(err).__name__}: {err}")
            print(f"sandwich rank {self.rank} failed:", file=sys.stderr)
            traceback.print_exc()
            self.abort()
            return self.failure


S = TypeVar("S", bound=RankState)
F = TypeVar("F", bound=Callable[..., Any])


def rank_function(name: str) -> Callable[[F], F]:
    """Register ``fn(state, *args)`` as the Disco function ``name``, run under ``state.run``."""

    def register(fn: F) -> F:
        def guarded(state: RankState, *args: Any) -> Any:
            return state.run(fn, state, *args)

        tvm_ffi.register_global_func(name, guarded, override=True)
        return fn

    return register


def start_rank(state: S, setup: Callable[..., Any], *args: Any) -> S | Failure:
    """What an init function returns: ``state`` once ``setup(*args)`` ran on it, else the failure."""
    failed = state.run(setup, *args)
    return failed if isinstance(failed, Failure) else state


@tvm_ffi.register_global_func(LAST_ERROR, override=True)
def _last_error(state: RankState | Failure) -> str:
    """A string: Disco's sockets carry strings and bytes, not tuples."""
    failure = state if isinstance(state, Failure) else state.failure
    return f"{failure.at!r}\t{failure.message}" if failure is not None else ""


def _parse_error(rank: int, text: str) -> Failure | None:
    at, _, message = str(text).partition("\t")
    return Failure(rank, message, float(at)) if message else None


class Closable(Protocol):
    def close(self) -> None: ...


_AT_EXIT: weakref.WeakSet = weakref.WeakSet()  # what to close at exit (Ctrl-C of a server)


def close_at_exit(obj: Closable) -> None:
    """Close ``obj`` when the interpreter exits, if it is still alive then."""
    _AT_EXIT.add(obj)


@atexit.register
def _close_all() -> None:
    for obj in list(_AT_EXIT):
        with contextlib.suppress(Exception):
            obj.close()


class DiscoGroup:
    """``world`` ranks on Disco: rank 0 a thread of this process, ranks 1.. processes running
    ``python -m entrypoint`` (which registers the rank functions, then Disco's worker loop).
    The workers start with ``cpus`` allowed (and pin themselves to their own). With ``hosts``,
    rank i runs on host i instead (``runtime.hosts``: a ``SocketSession``), and a host that
    does not answer within ``timeout_s`` fails the call."""

    def __init__(self, world: int, entrypoint: str, cpus: Iterable[int] = (), hosts: tuple[Host, ...] = (),
                 timeout_s: float = 60.0) -> None:
        import tvm.runtime.disco as di

        tvm_ffi.init_ffi_api("runtime.disco", "tvm.runtime.disco._ffi_api")
        self.world, self.entrypoint, self.hosts = world, entrypoint, tuple(hosts)
        self.session: Any = None
        self.pids: list[int] = [os.getpid()]  # by rank
        self._readers: list[int] = []  # a read end of every worker's command pipe (see _hold_pipes)
        self._funcs: dict[str, Any] = {}
        self._state: Any = None  # a DRef: every rank's state
        self._failed = False
        self.remote: Any = None  # hosts.SocketGroupSession
        close_at_exit(self)
        if self.hosts:
            from .hosts import HostError, SocketGroupSession

            if world != 1 + len(self.hosts):
                raise DiscoError(f"{world} ranks need {world - 1} hosts besides this one, "
                                 f"not {len(self.hosts)}")
            try:
                self.remote = SocketGroupSession(self.hosts, entrypoint, timeout_s)
            except HostError as err:
                raise DiscoError(str(err)) from None
            self.session = self.remote.session
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, set(cpus) | before)  # workers inherit it
        earlier = _children()  # another group's workers are not ours
        try:
            self.session = di.ProcessSession(num_workers=world, entrypoint=entrypoint)
        finally:
            os.sched_setaffinity(0, before)
        workers = _await_workers(entrypoint, earlier, world - 1)
        self._readers = _hold_pipes([fd for _, fd in workers.values()])
        if sorted(workers) != list(range(1, world)):
            self._failed = True
            lost = _unmatched(earlier, {pid for pid, _ in workers.values()})
            self.close()
            raise DiscoError(f"started {len(workers)} of {world - 1} worker processes{lost}")
        self.pids += [workers[r][0] for r in range(1, world)]

    # ------------------------------------------------------------------ calls
    def start(self, init: str, *args: Any) -> Any:
        """Run the init function ``init(*args)`` on every rank and keep what each returns as its
        state for ``call``; returns rank 0's."""
        return self._run(init, args, keep=True)

    def call(self, name: str, *args: Any) -> Any:
        """The rank function ``name(state, *args)`` on every rank; returns rank 0's value."""
        if self._state is None and self.session is not None:
            raise DiscoError("the group's ranks have no state: start() them first")
        return self._run(name, args)

    def local_state(self) -> Any:
        """Rank 0's state: a Python object of this process (rank 0 is a thread of it)."""
        if self._state is None:
            raise DiscoError("the group's ranks have no state: start() them first")
        return self._state.debug_get_from_remote(0)

    def failed(self, message: str) -> DiscoError:
        """The group is broken (a rank answered what it must not): the error to raise."""
        self._failed = True
        if self.remote is not None:
            self.remote.cut_off()
        return DiscoError(message)

    def _func(self, name: str) -> Any:
        if name not in self._funcs:
            self._funcs[name] = self.session.get_global_func(name)
        return self._funcs[name]

    def gather(self, name: str, *args: Any) -> list[Any]:
        """The rank function ``name(state, *args)`` on every rank; every rank's value (the
        others' must be plain values, strings or bytes: what Disco carries back)."""
        return self._run(name, args, every=True)

    def _run(self, name: str, args: tuple, keep: bool = False, every: bool = False) -> Any:
        # No DRef may stay in a frame that a traceback keeps: it would keep the session alive.
        if self.session is None:
            raise DiscoError("the process group is shut down")
        ref, rank = None, None  # rank: whose answer is awaited (None: sending to every rank)
        try:
            ref = self._func(name)(*args) if keep else self._func(name)(self._state, *args)
            rank = 0
            value = ref.debug_get_from_remote(0)
            values = [value]
            for rank in range(1, self.world if every else 1):
                values.append(ref.debug_get_from_remote(rank))
            if self.hosts and not every:  # a rank on another host cannot abort rank 0's wait
                rank = None
                errors = self._func(LAST_ERROR)(ref if keep else self._state)
                for rank in range(1, self.world):
                    failure = _parse_error(rank, errors.debug_get_from_remote(rank))
                    if failure is not None and not isinstance(value, Failure):
                        value = failure
                errors = None
        except Exception as err:  # the command did not reach every worker
            ref = errors = None
            raise self._lost(name, rank, err) from None
        if keep:
            self._state = ref
        ref = None
        if isinstance(value, Failure):
            self._failed = True
            raise DiscoError(self._report(value))
        return values if every else value

    def _lost(self, name: str, rank: int | None, err: Exception) -> DiscoError:
        """The group is broken (a worker gone, a host silent or gone): the error naming it. A
        remote session's sockets are cut off at once (see ``hosts.SocketGroupSession.cut_off``)."""
        self._failed = True
        line = next((s for s in str(err).splitlines() if s.strip()), type(err).__name__)
        if not self.hosts:
            dead = self.dead()
            gone = f"{', '.join(dead)} exited" if dead else f"{name} could not reach every worker"
            return DiscoError(f"{gone} ({line})")
        self.remote.cut_off()
        silent = "would block" in line or "timed out" in line.lower()
        what = f"no answer (within {self.remote.timeout_s:g} s)" if silent else f"connection lost ({line})"
        rank = 1 if rank is None and len(self.hosts) == 1 else rank
        where = (f"rank {rank} on {self.hosts[rank - 1]}" if rank else
                 f"a host of {', '.join(str(h) for h in self.hosts)}")
        return DiscoError(f"{where}: {what}")

    def _report(self, first: Failure) -> str:
        """Every rank's error, the first to fail first (its peers then failed waiting for it)."""
        dead = self.dead()
        if dead:  # a dead worker takes no more commands
            return "; ".join([f"{d} exited" for d in dead] + [str(first)])
        failures = [first]
        for rank in range(1, self.world):
            with contextlib.suppress(Exception):
                failure = _parse_error(rank, self._func(LAST_ERROR)(self._state).debug_get_from_remote(rank))
                if failure is not None and failure.rank != first.rank:
                    failures.append(failure)
        if self.hosts:  # another host's clock: in rank order
            return "; ".join(str(f) for f in sorted(failures, key=lambda f: f.rank))
        return "; ".join(str(f) for f in sorted(failures, key=lambda f: f.at))

    # ------------------------------------------------------------------ processes
    def dead(self) -> list[str]:
        """``rank r (pid p)`` for every worker process that has exited."""
        return [f"rank {r} (pid {p})" for r, p in enumerate(self.pids) if r and not _alive(p)]

    def close(self) -> None:
        """Stop the workers (idempotent). Disco's own shutdown stops a healthy group (every worker
        gets the shutdown command, the processes are reaped); in a broken one (a rank failed or
        died) every worker is killed first.

        Rank 0's thread is synced before the shutdown: it frees the ranks' Python state (which
        takes the GIL), and the session's destructor joins it while holding the GIL."""
        session, self.session = self.session, None
        if session is None:
            return
        workers = self.pids[1:]
        if self._failed or self.dead():
            for pid in workers:
                _kill(pid)
        if self.remote is not None:  # a host may have died unseen: nothing is sent to it again; the
            self.remote.cut_off()  # nodes take the closed connection for a shutdown
        self._state = None
        self._funcs.clear()
        with contextlib.suppress(Exception):
            session._sync_worker(0)
        session.shutdown()
        del session
        for pid in workers:  # reaped by Disco; anything left is killed
            _kill(pid)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter teardown
            self.close()


def _children() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children()}


def _await_workers(entrypoint: str, exclude: set[int], count: int,
                   wait_s: float = 5.0) -> dict[int, tuple[int, int]]:
    """``_workers`` once all ``count`` are found, a worker has exited, or ``wait_s`` has passed
    (a worker process is in /proc with its command line once ``ProcessSession`` returns, but
    a busy machine has been seen to need a second look)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = _workers(entrypoint, exclude)
        pids = _children() - exclude
        if len(found) >= count or time.monotonic() > deadline or not all(map(_alive, pids)):
            return found
        time.sleep(0.05)


def _unmatched(exclude: set[int], matched: set[int]) -> str:
    """What the new children that are not matched workers are: pid, command line and state
    (with an exit status where one is known), for a start that found too few workers."""
    import psutil

    told = []
    for child in psutil.Process().children():
        if child.pid in exclude | matched:
            continue
        try:
            what = f"{' '.join(child.cmdline()[-6:])!r}, {child.status()}"
        except psutil.ZombieProcess:
            what = "exited"
        except psutil.Error as err:
            what = type(err).__name__
        with contextlib.suppress(ChildProcessError, OSError):
            info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                what += f", exit status {info.si_status}"
        told.append(f"pid {child.pid} ({what})")
    return f"; new child processes not matched: {', '.join(told)}" if told else "; no new child process"


def _workers(entrypoint: str, exclude: set[int]) -> dict[int, tuple[int, int]]:
    """Rank -> (pid, our write end of its command pipe) for this process's live Disco workers
    (children not in ``exclude``). A worker runs ``python -m entrypoint rank world groups read_fd
    write_fd``; its ``read_fd`` is the pipe's read end, ours the write-only one on that pipe."""
    import psutil

    found = {}
    for child in psutil.Process().children():
        if child.pid in exclude:
            continue
        try:
            cmd = child.cmdline()
            if entrypoint not in cmd or child.status() == psutil.STATUS_ZOMBIE:
                continue
            rank, read_fd = int(cmd[cmd.index(entrypoint) + 1]), int(cmd[-2])
            found[rank] = (child.pid, os.readlink(f"/proc/{child.pid}/fd/{read_fd}"))
        except (psutil.Error, OSError, ValueError, IndexError):
            continue
    ours: dict[str, list[int]] = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ours.setdefault(os.readlink(f"/proc/self/fd/{fd}"), []).append(int(fd))
    out = {}
    for rank, (pid, pipe) in found.items():
        for fd in ours.get(pipe, []) if pipe.startswith("pipe:") else []:
            with open(f"/proc/self/fdinfo/{fd}") as info:
                flags = int(info.read().split("flags:")[1].split()[0], 8)
            if flags & 3 == os.O_WRONLY:
                out[rank] = (pid, fd)
    return out


def _hold_pipes(fds: list[int]) -> list[int]:
    """A read end of each pipe whose write end is in ``fds``, never read and never closed (a few
    file descriptors per group): a command sent to a dead worker then lands in its pipe (a few
    bytes; a pipe holds 64 KB) instead of failing, which inside a DRef's destructor -- every
    freed DRef sends every worker a command -- aborts the process."""
    return [os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC) for fd in fds]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not exited, not a zombie); a syscall for our children."""
    with contextlib.suppress(ChildProcessError):  # not our child, or reaped: ask /proc
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _kill(pid: int, grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; reaped when it is our child."""
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.01)
        if not _alive(pid):
            break
        deadline = time.monotonic() + grace_s
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
