#!/usr/bin/env bash
# Set up .venv-vllm (if needed) and run the vLLM plug-in's tests in it (tests/vllm: tiny random-weight
# models on the CPU, the HTTP server on 127.0.0.1 included), one pytest-xdist worker per core, each test
# module (and its engine) on one worker; every engine runs on one thread (tests/vllm/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-vllm/bin/vllm ] || bash scripts/setup-vllm.sh
.venv-vllm/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
.venv-vllm/bin/pytest -n auto --dist loadscope tests/vllm -p no:cacheprovider "$@"
