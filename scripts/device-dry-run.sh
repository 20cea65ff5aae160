#!/usr/bin/env bash
# The accelerator call rehearsed on this CPU: `scripts/gpu-check.sh --device cpu --tiny` as the lent machine
# will run it, from the working tree as it reaches that machine (the files git tracks or does not ignore:
# no venv, no egg-info, no install of priortr, which runs from src/ on PYTHONPATH), on only the packages its
# image is assumed to hold: torch 2.11.0, transformers 5.17.0, numpy, safetensors, pytest and what they
# require (scripts/image_extras.py). A missing import, a wrong layer or a missing row then fails here, in
# CI, instead of costing a device call; gpu-check.sh's own check (scripts/check_gpu_check.py) fails it when
# a file or row is missing.
#
#   bash scripts/device-dry-run.sh    after `bash scripts/test.sh --torch-floor` (.ci/run)
#
# It consumes .venv-torch-floor (set up if absent) instead of downloading torch 2.11's CUDA wheels a
# second time: renamed .venv-device, transformers pinned to the image's 5.17.0 (no cache), everything
# outside the image's set uninstalled. .venv-device and the copy of the tree are removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD venv=$PWD/.venv-device
[ -x .venv-torch-floor/bin/python ] || bash scripts/setup.sh --torch-floor
rm -rf "$venv"
mv .venv-torch-floor "$venv"
work=$(mktemp -d)
trap 'rm -rf "$venv" "$work"' EXIT
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --no-cache-dir "transformers==5.17.0"
mapfile -t extras < <("$venv/bin/python" scripts/image_extras.py)
"${pip[@]}" uninstall -y "${extras[@]}"
echo "the image's packages: $("$venv/bin/python" -m pip --disable-pip-version-check list --format=freeze | tr '\n' ' ')"
git ls-files -z --cached --others --exclude-standard |
  tar --null --ignore-failed-read -T - -cf - | tar -xf - -C "$work"
cd "$work"
start=$SECONDS
# FAST_TIMEOUT: the GPU run's 300 s cut, loosened for a CPU shared with other jobs (a timeout, not a step)
env -u PYTHONPATH PYTHON="$venv/bin/python" OUT="$work/gpu-check-out" FAST_TIMEOUT="${FAST_TIMEOUT:-900}" \
  bash scripts/gpu-check.sh --device cpu --tiny
echo "device dry run: gpu-check.sh --device cpu --tiny took $((SECONDS - start)) s (tree copied from $root)"
