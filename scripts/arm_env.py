"""An emulated Arm (aarch64) Python beside the checkout, to *run* the Arm kernels on an x86 host.

The kernels of every ISA are built and inspected on any machine; those of Arm (``neon``,
``neondot``, ``neonbf16``) can only be run on Arm. This puts, in ``.arm64/`` at the repo root
(about 750 MB, nothing installed system-wide):

- ``qemu-aarch64-static`` (user-mode emulation, ``-cpu max``: NEON, dotprod, BF16, I8MM, SVE),
  from Debian's ``qemu-user-static`` package;
- Debian bookworm's arm64 Python 3.11 and the libraries it loads;
- the aarch64 wheels of numpy and TVM, at the versions ``.venv`` holds (TVM's runtime loads the
  kernels; numpy checks them);
- ``.arm64/python``, which runs that Python with the checkout importable::

    .venv/bin/python scripts/arm_env.py
    .venv/bin/python -m sandwich_tvm.bench crosscheck build --isas neon,neondot,neonbf16 \\
        --dtypes float32,bfloat16,float16,q8_0,q4_0,q4_1 --no-timing --out out/arm
    .arm64/python -m sandwich_tvm.bench.crosscheck run out/arm

Emulation checks what the code computes, not how fast: never time under it. Each step is
skipped when its output is there, and written whole (a stopped run resumes).
"""

from __future__ import annotations

import importlib.metadata
import lzma
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
# What the emulated Python needs; their dependencies are added from the package index.
ARM64_ROOTS = ("python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "libgomp1")
# Packages a Debian system always has that the Python runtime never loads.
NOT_NEEDED = {"debconf", "debconf-2.0", "perl-base", "dpkg", "tzdata", "media-types", "netbase"}
WHEELS = ("numpy", "ml_dtypes", "apache-tvm", "apache-tvm-ffi", "typing_extensions")
PYTHON_VERSION = "3.11"


def say(msg: str) -> None:
    print(f"[arm_env] {msg}", file=sys.stderr, flush=True)


def package_index(arch: str) -> dict[str, dict[str, str]]:
    """Debian's package index of ``arch``: name -> its fields."""
    url = f"{MIRROR}/dists/{SUITE}/main/binary-{arch}/Packages.xz"
    say(f"reading {url}")
    with urllib.request.urlopen(url, timeout=120) as resp:
        text = lzma.decompress(resp.read()).decode()
    index = {}
    for stanza in text.split("\n\n"):
        fields = dict(re.findall(r"^([\w-]+): (.*)$", stanza, re.M))
        if "Package" in fields:
            index[fields["Package"]] = fields
    return index


def closure(index: dict[str, dict[str, str]], roots: tuple[str, ...]) -> list[str]:
    """``roots`` and everything they depend on (first alternative; virtual names to a provider)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in NOT_NEEDED or name in seen:
            continue
        if name not in index:
            providers = sorted(p for p, f in index.items()
                               if name in re.split(r"\s*,\s*|\s+\(", f.get("Provides", "")))
            if not providers:
                raise SystemExit(f"error: {name} is in no {SUITE} arm64 package; the suite changed?")
            name = providers[0]
        seen.add(name)
        fields = index[name]
        for dep in f"{fields.get('Pre-Depends', '')},{fields.get('Depends', '')}".split(","):
            first = dep.split("|")[0].strip()
            if first:
                todo.append(re.split(r"[\s:(]", first)[0])
    return sorted(seen)


def download(url: str, dest: Path) -> Path:
    """``url`` into ``dest`` (kept when already there), written whole."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(url, timeout=300) as resp, tempfile.NamedTemporaryFile(
            dir=dest.parent, delete=False) as tmp:
        shutil.copyfileobj(resp, tmp)
    os.replace(tmp.name, dest)
    return dest


def extract_debs(index: dict[str, dict[str, str]], names: list[str], into: Path, cache: Path) -> None:
    """Unpack each package of ``names`` into ``into`` (a directory written whole)."""
    if into.exists():
        return
    part = into.with_name(into.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    for i, name in enumerate(names, 1):
        filename = index[name]["Filename"]
        deb = download(f"{MIRROR}/{filename}", cache / filename.rsplit("/", 1)[1])
        subprocess.run(["dpkg-deb", "-x", str(deb), str(part)], check=True)
        say(f"  {i}/{len(names)} {name}")
    part.rename(into)


def install_wheels(site: Path, cache: Path) -> None:
    """The aarch64 wheels of ``WHEELS`` at .venv's versions, unpacked into ``site`` (again when
    .venv's versions changed: ``site/PINS`` names those it holds)."""
    pins = [f"{w}=={importlib.metadata.version(w)}" for w in WHEELS]
    stamp = site / "PINS"
    if stamp.is_file() and stamp.read_text().split() == pins:
        return
    say(f"downloading aarch64 wheels: {' '.join(pins)}")
    platforms = [a for p in ("manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64")
                 for a in ("--platform", p)]
    shutil.rmtree(cache, ignore_errors=True)  # only these pins' wheels
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON_VERSION, *platforms, "-d", str(cache), *pins], check=True)
    part = site.with_name(site.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    for wheel in sorted(cache.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(part)
        for info in zipfile.ZipFile(wheel).infolist():  # zipfile drops the executable bits
            mode = info.external_attr >> 16
            if mode & 0o111:
                os.chmod(part / info.filename, mode & 0o777)
    (part / "PINS").write_text("\n".join(pins) + "\n")
    shutil.rmtree(site, ignore_errors=True)
    part.rename(site)


WRAPPER = """#!/bin/sh
# The emulated aarch64 Python of scripts/arm_env.py, with the checkout importable.
here=$(dirname "$(readlink -f "$0")")
exec "$here/qemu/usr/bin/qemu-aarch64-static" -cpu max -L "$here/root" \\
  -E PYTHONPATH="$here/site:$(dirname "$here")" -E PYTHONDONTWRITEBYTECODE=1 -E SANDWICH_EMULATED=1 \\
  "$here/root/usr/bin/python{version}" "$@"
"""


def main() -> int:
    repo = Path(__file__).resolve().parent.parent
    env = repo / ".arm64"
    if platform.machine() == "aarch64":
        say("this machine is Arm: its own .venv runs the Arm kernels; nothing to emulate")
        return 0
    if platform.machine() != "x86_64" or shutil.which("dpkg-deb") is None:
        raise SystemExit("error: the emulated Arm Python is set up on x86-64 Linux with dpkg-deb "
                         f"(Debian, Ubuntu); this is {platform.machine()}"
                         + ("" if shutil.which("dpkg-deb") else " without dpkg-deb"))
    cache = env / "cache"
    if not (env / "qemu").exists():
        amd64 = package_index("amd64")
        say("qemu-aarch64-static from qemu-user-static")
        extract_debs(amd64, ["qemu-user-static"], env / "qemu", cache / "debs")
    if not (env / "root").exists():
        arm64 = package_index("arm64")
        names = closure(arm64, ARM64_ROOTS)
        say(f"Debian arm64 Python {PYTHON_VERSION}: {len(names)} packages")
        extract_debs(arm64, names, env / "root", cache / "debs")
    install_wheels(env / "site", cache / "wheels")
    wrapper, part = env / "python", env / "python.part"  # named python only once it has run
    part.write_text(WRAPPER.format(version=PYTHON_VERSION))
    part.chmod(0o755)
    try:
        probe = subprocess.run([str(part), "-c", "import platform, numpy, tvm; "
                                "from sandwich_tvm.host import cpu_flags, host_isa; "
                                "print(platform.machine(), host_isa(), numpy.__version__, tvm.__version__, "
                                "' '.join(sorted(cpu_flags())))"],
                               capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as err:
        raise SystemExit("error: the emulated Python did not start within 300 s") from err
    if probe.returncode != 0:
        raise SystemExit(f"error: the emulated Python does not start:\n{probe.stderr[-2000:]}")
    part.replace(wrapper)
    shutil.rmtree(cache, ignore_errors=True)  # all of it is unpacked
    say(f"ready: {wrapper} ({probe.stdout.strip()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
