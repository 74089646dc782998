"""The package's layers import downward only: host facts, then kernels, the model and topology,
the run spec, the compiler, the runtime and the front-ends; the benchmark harness sits beside
the product, which never imports it. An import back up a layer is a seam the next feature would
have to cut, so this test names it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .precompile import selected

PACKAGE = Path(__file__).resolve().parents[1] / "sandwich_tvm"

FRONT = {"server", "cli", "bench"}
# layer -> the sandwich_tvm packages it must never import ("host": the host-fact modules)
FORBIDDEN = {
    "host": {"kernels", "collective", "topology", "model", "spec", "compiler", "runtime"} | FRONT,
    "kernels": {"collective", "topology", "model", "spec", "compiler", "runtime"} | FRONT,
    "collective": {"kernels", "topology", "model", "spec", "compiler", "runtime"} | FRONT,
    "model": {"topology", "spec", "compiler", "runtime"} | FRONT,
    # topology may read model/ (LlamaConfig, the attention kernel it times): the one exception
    "topology": {"spec", "compiler", "runtime"} | FRONT,
    "spec": {"compiler", "runtime"} | FRONT,
    "compiler": {"runtime"} | FRONT,
    "runtime": FRONT,
    "server": {"cli", "bench"},
    # the product's front-end never imports the harness; the harness may use the product
    "cli": {"bench"},
}
HOST_MODULES = ("host.py", "tvm_compat.py", "memory.py", "interrupts.py")


def _imported_packages(source: str, rel: Path) -> set[str]:
    """The top-level sandwich_tvm packages the module at ``rel`` (inside the package) imports,
    relatively or absolutely."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # resolve ``from ..x import`` against the module's package
                base = list(rel.parent.parts)[: len(rel.parent.parts) - (node.level - 1)]
                parts = [*base, *(node.module or "").split(".")] if node.module else base
                if not parts and node.level:  # ``from .. import x``: the names are the packages
                    out |= {a.name for a in node.names}
                    continue
            elif node.module == "sandwich_tvm":  # ``from sandwich_tvm import model``
                out |= {a.name for a in node.names}
                continue
            elif node.module and node.module.startswith("sandwich_tvm."):
                parts = node.module.split(".")[1:]
            else:
                continue
            if parts:
                out.add(parts[0])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("sandwich_tvm.")}
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_import_runs_back_up_the_layers(layer):
    if layer == "host":
        files = [PACKAGE / name for name in HOST_MODULES]
    elif layer == "spec":
        files = [PACKAGE / "spec.py"]
    else:
        files = sorted((PACKAGE / layer).rglob("*.py"))
    upward = {f"{path.relative_to(PACKAGE)} imports {pkg}"
              for path in files
              for pkg in _imported_packages(path.read_text(), path.relative_to(PACKAGE)) & FORBIDDEN[layer]}
    assert not upward, sorted(upward)


def test_the_checker_sees_relative_and_absolute_imports():
    source = ("from ..model.config import LlamaConfig\nimport sandwich_tvm.runtime.engine\n"
              "from .. import compiler\nfrom .schedule import GemmShape\n"
              "from sandwich_tvm import server\nfrom sandwich_tvm.cli.args import positive_int\n")
    assert _imported_packages(source, Path("kernels/probe.py")) == {
        "model", "runtime", "compiler", "kernels", "server", "cli"}


PRODUCT = ["sandwich_tvm.serve", "sandwich_tvm.generate", "sandwich_tvm.compile", "sandwich_tvm.tune",
           "sandwich_tvm.cli.serve", "sandwich_tvm.cli.generate", "sandwich_tvm.cli.compile",
           "sandwich_tvm.cli.tune", "sandwich_tvm.runtime.loader", "sandwich_tvm.runtime.tp",
           "sandwich_tvm.runtime.batch", "sandwich_tvm.server.app"]


def _probe(module: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``module`` imported in a fresh interpreter, run from a pool thread. ``env`` is explicit:
    with none, the child's exec reads the process's ``environ`` array, which the main thread's
    next test reallocates (``monkeypatch.setenv``) while CPython's vfork child still reads it
    ("OSError: [Errno 14] Bad address", twice in CI)."""
    probe = (f"import importlib, sys; importlib.import_module({module!r}); "
             "print(sorted(m for m in sys.modules if m.startswith('sandwich_tvm.bench')))")
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture(scope="module")
def probes(request):
    """The fresh interpreters of the selected modules, one per CPU at a time (each spends
    seconds importing TVM on one core); a test waits for its own."""
    modules = [p["module"] for p in selected(request, "test_the_product_loads_no_benchmark_module")]
    env = dict(os.environ)  # copied here, in the main thread
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        yield {module: pool.submit(_probe, module, env) for module in modules}


@pytest.mark.parametrize("module", PRODUCT)
def test_the_product_loads_no_benchmark_module(module, probes):
    """What the user runs imports nothing of ``sandwich_tvm.bench`` (checked in a fresh
    interpreter, so an import inside a function body that runs at import time counts too)."""
    out = probes[module].result()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_auto_dtype_and_the_context_are_resolved_in_one_place():
    """``--dtype auto`` is turned into a dtype only by ``spec.resolve_weight_dtype``, and the
    context is checked only by ``spec.check_context``: no other module defines either."""
    defs = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "name", "")
            if isinstance(node, ast.FunctionDef) and (
                    "dtype" in name and "resolve" in name or "context" in name and "check" in name):
                defs.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    assert defs == {"resolve_weight_dtype": ["spec.py"], "check_context": ["spec.py"]}, defs
