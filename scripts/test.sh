#!/usr/bin/env bash
# Set up (if needed), lint and run the whole test suite on CPU, on the newest tested releases (.venv).
#   bash scripts/test.sh [PYTEST ARGS]   the whole suite (or what the arguments select)
#   bash scripts/test.sh --floor         the engine, families and methods suites on the oldest supported
#                                        transformers (.venv-floor; set up with scripts/setup.sh --floor)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--floor" ]; then
  shift
  [ -x .venv-floor/bin/pytest ] || bash scripts/setup.sh --floor
  .venv-floor/bin/python -c "import transformers; print('transformers', transformers.__version__)"
  exec .venv-floor/bin/pytest tests/engine tests/families tests/methods "$@"
fi
[ -x .venv/bin/pytest ] || bash scripts/setup.sh
.venv/bin/python -c "import transformers; print('transformers', transformers.__version__)"
.venv/bin/ruff check src tests benchmarks scripts
.venv/bin/ruff format --check src tests benchmarks scripts
.venv/bin/pytest "$@"
