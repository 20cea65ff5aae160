#!/usr/bin/env bash
# Set up (if needed), lint and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/pytest ] || bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/pytest "$@"
