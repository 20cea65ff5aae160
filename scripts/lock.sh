#!/usr/bin/env bash
# Write the lock files from the environments the tests just passed in: constraints/tested.txt from .venv
# (newest releases) and constraints/floor.txt from .venv-floor (oldest supported transformers). Run after
# `bash scripts/setup.sh --latest && bash scripts/setup.sh --floor --latest && bash scripts/test.sh &&
# bash scripts/test.sh --floor`, and commit the result: `bash scripts/setup.sh` then reproduces it.
set -euo pipefail
cd "$(dirname "$0")/.."
for pair in ".venv:constraints/tested.txt" ".venv-floor:constraints/floor.txt"; do
  venv=${pair%%:*} lock=${pair#*:}
  {
    echo "# Exact releases of a passing test run, written by scripts/lock.sh ($(date -u +%Y-%m-%d))."
    "$venv/bin/pip" --disable-pip-version-check freeze --exclude-editable | grep -v "^priortr"
  } > "$lock"
  echo "wrote $lock ($(grep -c == "$lock") packages)"
done
