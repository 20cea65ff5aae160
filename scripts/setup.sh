#!/usr/bin/env bash
# Create .venv with priortr and its test tools. torch is pinned first so that pip takes the local
# CPU wheel on the project's machines instead of pulling CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[dev]"
