"""The package installs as a wheel and runs outside the checkout: build it, install it into a
fresh venv (its dependencies are this venv's, so nothing is downloaded), and from a directory
with no checkout in sight run ``generate`` on a small preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    (path,) = out.glob("sandwich_tvm-*.whl")
    return path


def test_the_wheel_holds_every_package_and_its_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "sandwich_tvm").rglob("*.py")}
    missing = sorted(p for p in packages if f"{p}/__init__.py" not in names)
    assert not missing, f"subpackages left out of the wheel: {missing}"
    assert "sandwich_tvm/collective/shm_allreduce.cc" in names
    assert any(n.startswith("sandwich_tvm/topology/profiles/") and n.endswith(".json") for n in names)
    shipped = {str(p.relative_to(ROOT)) for pattern in ("*.json", "*.jsonl")
               for p in (ROOT / "sandwich_tvm" / "records").rglob(pattern)}
    assert shipped and shipped <= names


@pytest.mark.compile
def test_generate_runs_from_the_installed_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    # without pip of its own (ensurepip takes seconds): this venv's pip installs into it below
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"

    def site_packages(py: str | Path) -> Path:
        probe = [str(py), "-c", "import site; print(site.getsitepackages()[0])"]
        return Path(subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip())

    # this venv's dependencies (TVM, numpy, ...) without a download; a path in a .pth file is
    # appended to sys.path without running that directory's own .pth files (the editable install)
    (site_packages(python) / "deps.pth").write_text(str(site_packages(sys.executable)))
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", "--force-reinstall", str(wheel)], capture_output=True, text=True,
                             timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"SANDWICH_CACHE": str(tmp_path / "cache"), "PYTHONSAFEPATH": "1"}
    where = subprocess.run([str(python), "-c", "import sandwich_tvm; print(sandwich_tvm.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    assert not Path(where.stdout.strip()).is_relative_to(ROOT), "imported the checkout, not the wheel"
    # a small preset: the build and run come from the installed wheel's files either way, and
    # SmolLM2's own build is the other tests' (it would take a minute more here)
    cmd = [str(python), "-m", "sandwich_tvm.generate", "--model", "llama-34m", "--prompt-len", "8",
           "--max-new-tokens", "3", "--json"]
    run = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["prompt_tokens"] == 8 and out["output_tokens"] == 3
