#!/usr/bin/env bash
# One command: install into .venv with the test extras, lint, then run the whole test suite.
#   bash scripts/test.sh              # everything
#   bash scripts/test.sh -m "not compile"   # fast tier only (pure Python, seconds)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check sandwich_tvm tests examples scripts
exec .venv/bin/python -m pytest --durations=40 "$@"
