#!/usr/bin/env bash
# Set up (if needed), lint and run the whole test suite on CPU, on the newest tested releases (.venv).
#   bash scripts/test.sh [PYTEST ARGS]   the whole suite (or what the arguments select)
#   bash scripts/test.sh --floor         the engine, families and methods suites on the oldest supported
#                                        transformers (.venv-floor; set up with scripts/setup.sh --floor)
#   bash scripts/test.sh --torch-floor   the same suites on the oldest supported torch (.venv-torch-floor)
#   bash scripts/test.sh --torch-newest  the same suites on the newest torch tested (.venv-torch-newest)
# pytest-xdist runs one worker per core, each test module on one worker (its module-scoped tiny models
# are built once), the long modules first (tests/conftest.py, LONG_MODULES), then in collection order;
# tests/conftest.py gives each worker its share of torch's threads; the 15 slowest tests are printed.
# `-n 0` runs one process. Each run first prints `priortr families`: which image-text classes of the
# release under test priortr supports.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  --floor | --torch-floor | --torch-newest)
    option="$1"
    shift
    venv=".venv${option#-}"
    [ "$option" = --floor ] && venv=.venv-floor
    [ -x "$venv/bin/pytest" ] || bash scripts/setup.sh "$option"
    "$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    "$venv/bin/priortr" families
    exec "$venv/bin/pytest" -n auto --dist loadscope --no-loadscope-reorder --durations=15 tests/engine tests/families tests/methods "$@"
    ;;
esac
[ -x .venv/bin/pytest ] || bash scripts/setup.sh
.venv/bin/python -c "import transformers; print('transformers', transformers.__version__)"
.venv/bin/priortr families
.venv/bin/ruff check src tests benchmarks scripts
.venv/bin/ruff format --check src tests benchmarks scripts
.venv/bin/pytest -n auto --dist loadscope --no-loadscope-reorder --durations=15 "$@"
