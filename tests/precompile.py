"""Models compiled in a second process while the tests go on.

TVM builds a model on one core, and the CI machine has two. A module that compiles several
artifacts hands some of them to the session's ``Precompiler`` (one child process) up front; a
test calls ``ready(spec)`` before it compiles or opens that spec, and ``compile_model`` then
finds the artifact in the session's cache under the same key: what the test runs is exactly
what it would have built itself. A compile that fails in the child is not reported here: the
test builds the spec itself and meets the error as before.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing TVM takes seconds: only the tests that compile pay for it
    from sandwich_tvm.spec import RunSpec

CHILD = r"""
import os, pickle, sys
os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})  # not the parent's pinned core
# Only a core nothing else wants: a test's engine or torch threads spin at barriers and slow down
# many times over when a build holds one of their cores; a test waiting in ``ready`` frees both.
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
done = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # anything printed while compiling stays off the answers
import queue, threading
from sandwich_tvm.compiler.artifact import compile_model
todo = queue.Queue()  # read as soon as written: the parent never blocks on a full pipe


def read():
    while True:
        try:
            todo.put(pickle.load(sys.stdin.buffer))
        except EOFError:
            todo.put(None)
            return


threading.Thread(target=read, daemon=True).start()
while (item := todo.get()) is not None:
    ticket, spec = item
    try:
        for part in (range(spec.plan.parts) if spec.plan.parts else [None]):  # stages or sides: each
            compile_model(spec, stage=part)
        done.write(f"{ticket} ok\n")
    except Exception as err:
        done.write(f"{ticket} failed {type(err).__name__}\n")
"""


def _artifact(spec: RunSpec) -> tuple[str, bool, str]:
    """Which artifact ``spec`` builds (its directory in the cache): specs that differ in what
    does not shape the code (a plan's source file, the context) share it."""
    from sandwich_tvm.compiler.artifact import build_key, model_part

    return spec.config.name, spec.stock, build_key(spec, model_part(spec, 0))


def generate_spec(argv: list[str]) -> RunSpec:
    """The spec ``generate`` resolves from ``argv``: the artifact it opens."""
    from sandwich_tvm.cli import generate
    from sandwich_tvm.cli.options import spec_from_args

    return spec_from_args(generate.build_parser().parse_args(argv), lambda _m: None)


def selected(request, test: str) -> list[dict]:
    """The parameters of every item of ``test`` (in the requesting module) this session runs."""
    return [i.callspec.params if hasattr(i, "callspec") else {} for i in request.session.items
            if i.module is request.module and i.originalname == test]


# What later tests build, for ``Precompiler.warm_up``: (module, test or fixture) -> specs(the
# session's base directory), in the order their modules were collected
_WARM_UP: list[tuple[str, str, Callable[[Path], list[RunSpec]]]] = []


def warm_up(module: str, test: str, specs: Callable[[Path], list[RunSpec]]) -> None:
    """Register ``specs(base)`` as the artifacts that ``test`` of ``module`` (a test function or
    a fixture its tests use; ``module`` may be a package) builds from inputs at fixed places
    under the session's base directory (``specs`` writes them if missing): the session starts
    them early, in the second process, when such a test is selected."""
    _WARM_UP.append((module, test, specs))


def _wanted(item, module: str, test: str) -> bool:
    """Whether ``item`` is ``test`` (or uses that fixture) in ``module`` (or a module of that package)."""
    name = getattr(getattr(item, "module", None), "__name__", "")
    return (name == module or name.startswith(module + ".")) and (
        item.originalname == test or test in getattr(item, "fixturenames", ()))


def _process_cpus() -> frozenset[int]:
    from sandwich_tvm.tvm_compat import PROCESS_CPUS

    return PROCESS_CPUS


def _env_key() -> dict[str, str]:
    """What the child must share with the test for the same build keys (the cache is passed)."""
    return {k: v for k, v in os.environ.items() if k.startswith("SANDWICH_") and k != "SANDWICH_CACHE"}


class Precompiler:
    """One child process that compiles the specs it is given, in order, into ``cache``."""

    def __init__(self, cache: Path):
        self.cache = cache
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._specs: list[tuple[tuple, int]] = []  # (artifact, ticket) submitted, not yet seen done
        self._done: set[tuple] = set()  # artifacts the child has finished (built, or failed)
        self._next = 0
        self._warmed = False
        self._paused = False

    def warm_up(self, session, base: Path) -> None:
        """Once a session: submit the registered artifacts (``warm_up``) of its selected tests."""
        if self._warmed:
            return
        self._warmed = True
        self.submit(*[spec for module, test, specs in _WARM_UP
                      if any(_wanted(i, module, test) for i in session.items) for spec in specs(base)])

    def build(self, spec: RunSpec):
        """``compile_model(spec)`` once the child is done with it: the same artifact either way."""
        from sandwich_tvm.compiler.artifact import compile_model

        self.ready(spec)
        return compile_model(spec)

    def submit(self, *specs: RunSpec) -> None:
        """Start compiling ``specs`` (in this order) in the child; returns at once."""
        if not specs:
            return
        if self._proc is not None and self._env != _env_key():
            self.close()
        if self._proc is None:
            cpus = sorted(_process_cpus())
            self._env = _env_key()
            env = {**os.environ, "SANDWICH_CACHE": str(self.cache)}
            self._proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, ",".join(map(str, cpus))], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for spec in specs:
            artifact = _artifact(spec)  # hashes the package's sources: once a spec
            if artifact in self._done or any(a == artifact for a, _ in self._specs):
                continue  # in the cache already, or on its way: not again at the back of the queue
            self._specs.append((artifact, self._next))
            pickle.dump((self._next, spec), self._proc.stdin)
            self._next += 1
        self._proc.stdin.flush()

    def pause(self) -> None:
        """Stop the child where it is (a test that times memory traffic runs alone) until ``resume``."""
        if self._proc is not None and not self._paused:
            os.kill(self._proc.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        if self._proc is not None and self._paused:
            os.kill(self._proc.pid, signal.SIGCONT)
        self._paused = False

    def ready(self, spec: RunSpec) -> None:
        """Wait until the child is done with ``spec`` (at once if it was never submitted)."""
        tickets = [t for a, t in self._specs if a == _artifact(spec)]
        if not tickets or self._proc is None:
            return
        self.resume()
        while True:
            line = self._proc.stdout.readline()
            if not line:  # the child is gone: the test compiles whatever is left itself
                self._specs.clear()
                return
            ticket = int(line.split()[0])
            self._done |= {a for a, t in self._specs if t == ticket}
            self._specs = [(a, t) for a, t in self._specs if t != ticket]
            if ticket == tickets[0]:
                return

    def close(self, finish: bool = True) -> None:
        """End the child: after what it was given (``finish``), or now (the session is over)."""
        if self._proc is None:
            return
        self.resume()
        if not finish:
            self._proc.kill()
        self._proc.stdin.close()
        self._proc.stdout.read()
        self._proc.wait()
        self._proc, self._specs, self._done = None, [], set()
