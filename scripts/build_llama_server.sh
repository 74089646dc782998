#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the serving benchmark's baseline) and `llama-perplexity`,
# `llama-quantize`, `llama-imatrix` (the perplexity benchmark's) from source and install them
# in .venv/bin/. The source is the llama.cpp that the llama-cpp-python sdist on PyPI
# vendors (tools/server included), so the build needs PyPI only, never GitHub.
#   bash scripts/build_llama_server.sh           # skip the tools already in .venv/bin
#   bash scripts/build_llama_server.sh --force   # rebuild anyway
# Release, -DGGML_NATIVE=ON (tuned for this CPU: build it on the machine that benchmarks),
# static libraries, no network features (CURL, OpenSSL, the web UI download). Minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36  # llama-cpp-python sdist; its vendor/llama.cpp is what gets built
ROOT=$PWD
TOOLS=(llama-server llama-perplexity llama-quantize llama-imatrix)
WORK=${LLAMA_SERVER_BUILD_DIR:-$ROOT/.venv/build/llama-server}
SDIST=$WORK/llama_cpp_python-$VERSION.tar.gz
SRC=$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp

log() { echo "[build_llama_server] $*"; }
die() { echo "[build_llama_server] error: $*" >&2; exit 1; }

FORCE=0
for arg in "$@"; do
  case $arg in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $arg (use --force or --help)" ;;
  esac
done

MISSING=()
for tool in "${TOOLS[@]}"; do
  if [ "$FORCE" = 1 ] || [ ! -x "$ROOT/.venv/bin/$tool" ]; then MISSING+=("$tool"); fi
done
if [ ${#MISSING[@]} = 0 ]; then
  log "${TOOLS[*]} are in .venv/bin; nothing to do (--force rebuilds)"
  exit 0
fi
[ -x .venv/bin/python ] || die ".venv/bin/python not found: run 'bash scripts/setup.sh' first"

# Toolchain: a C++17 compiler and cmake >= 3.18 (pip's cmake wheel when the system has none).
CXX=${CXX:-$(command -v c++ || command -v g++ || command -v clang++ || true)}
[ -n "$CXX" ] || die "no C++ compiler found (install g++ or clang++, e.g. 'apt-get install build-essential')"
CC=${CC:-$(command -v cc || command -v gcc || command -v clang || true)}
[ -n "$CC" ] || die "no C compiler found (install gcc or clang)"
CMAKE=$(command -v cmake || true)
if [ -z "$CMAKE" ] && [ -x .venv/bin/cmake ]; then CMAKE=$ROOT/.venv/bin/cmake; fi
if [ -z "$CMAKE" ]; then
  log "cmake not on PATH: installing it into .venv with pip"
  .venv/bin/python -m pip install -q cmake || die "cmake is missing and 'pip install cmake' failed"
  CMAKE=$ROOT/.venv/bin/cmake
fi
GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
log "compilers: $CC, $CXX; $("$CMAKE" --version | head -1)"

mkdir -p "$WORK"
if [ ! -f "$SDIST" ]; then
  log "downloading the llama-cpp-python $VERSION sdist from PyPI"
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: --dest "$WORK" \
    "llama-cpp-python==$VERSION" || die "pip download of llama-cpp-python==$VERSION failed"
fi
if [ ! -f "$SRC/tools/server/CMakeLists.txt" ]; then
  log "unpacking $SDIST"
  tar -xzf "$SDIST" -C "$WORK" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
[ -f "$SRC/tools/server/CMakeLists.txt" ] || die "$SRC has no tools/server: not the expected sdist"

# The build asks git for a version; keep it from finding an enclosing repository (ours).
export GIT_CEILING_DIRECTORIES=$WORK
JOBS=$(nproc)
START=$(date +%s)
log "configuring (Release, GGML_NATIVE=ON) in $WORK/build"
"$CMAKE" -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  || die "cmake configure failed (see the output above)"
log "building ${MISSING[*]} with $JOBS jobs (minutes)"
"$CMAKE" --build "$WORK/build" --target "${MISSING[@]}" -j "$JOBS" || die "build failed (see the output above)"

for tool in "${MISSING[@]}"; do
  BUILT=$(find "$WORK/build" -type f -name "$tool" -perm -u+x | head -1)
  [ -n "$BUILT" ] || die "the build finished but produced no $tool binary"
  BIN=$ROOT/.venv/bin/$tool
  install -m 755 "$BUILT" "$BIN"
  # llama-quantize has no --version: its usage text (exit 1) shows that it runs
  if ! "$BIN" --version >/dev/null 2>&1; then
    USAGE=$("$BIN" 2>&1 || true)
    grep -q "^usage:" <<<"$USAGE" || die "$BIN does not run"
  fi
  log "installed $BIN ($(( $(date +%s) - START )) s): $("$BIN" --version 2>&1 | grep -m1 version || true)"
done
