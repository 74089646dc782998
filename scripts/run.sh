#!/usr/bin/env bash
# One command: install into .venv, then run the main job on the embedded default model preset.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m sandwich_tvm.tune "$@"
