#!/usr/bin/env bash
# Every check that needs an accelerator, in one call of under 10 minutes, from a plain checkout on the
# lent accelerator machines (their image: torch 2.11, transformers 5.17, Python 3.12; no network and no
# install of ours: priortr runs from src/ on PYTHONPATH, with only packages the image has).
#
#   bash scripts/gpu-check.sh                      on the accelerator; results under $OUT
#   PYTHON=.venv-floor/bin/python bash scripts/gpu-check.sh --device cpu --tiny
#                                                  the same steps on a CPU, small: proves the script
#
# 1. env.txt: python, torch, transformers, the device.
# 2. tests.log / tests.xml: every family pruned on the device in float64, float32, bfloat16 and float16
#    against the masked reference (tests/engine/test_device_precision.py).
# 3. bench.{json,md,png,jsonl}: `priortr bench` on the LLaVA-1.5-7B shape (random weights): vanilla, FastV and
#    PriorTR at K = 192/128/64, batch 1/8/32, prefill and decode, with the roofline (--tiny: K = 64, batch 1).
# 4. fast.{md,jsonl}: benchmarks/fast_path.py (issue 47): the batch-1 prefill eager and compiled (model.compile(),
#    30 repeats, wall and host-enqueue ms, graphs and breaks), the compiled static-cache decode step at batch
#    1/8/32, and the syncs of a prefill and a decode step as CUDA reports them beside the CPU counter's
#    prediction (--tiny: batch 1). Cut at FAST_TIMEOUT seconds (default 300); the rows finished by then
#    stay in fast.jsonl.
# 5. scripts/check_gpu_check.py: fails (exit 1) when a file or row of the grid above is missing.
# --tiny changes sizes only (the model's depth and width: scripts/tiny_model.py; budgets, batch sizes,
# repeats, tokens), never the steps, methods or scored layer: CI runs it on CPU in the image's packages
# (scripts/device-dry-run.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda tiny=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --tiny) tiny=1; shift ;;
    *) echo "usage: bash scripts/gpu-check.sh [--device cuda|cpu] [--tiny]" >&2; exit 2 ;;
  esac
done
python=${PYTHON:-python3}
out=${OUT:-gpu-check-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PRIORTR_TEST_DEVICE=$device
status=0

{
  date -u
  "$python" -c "import sys, torch, transformers; print('python', sys.version.split()[0]); print('torch', torch.__version__); print('transformers', transformers.__version__)"
  "$python" -c "import torch; print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

echo "== equivalence on $device (float64, float32, bfloat16, float16) (at ${SECONDS}s)"
"$python" -m pytest -p no:cacheprovider tests/engine/test_device_precision.py \
  --junitxml="$out/tests.xml" > "$out/tests.log" 2>&1 || status=1
tail -3 "$out/tests.log"

echo "== bench on $device (at ${SECONDS}s)"
# --tiny changes these sizes only: the model (scripts/tiny_model.py: the same LLaVA, 4 layers, narrower),
# budgets, batch sizes, repeats, tokens and dtype
methods=(vanilla fastv priortr) fast_budget=64 model=llava-1.5-7b
if [ "$tiny" = 1 ]; then
  model=$(mktemp -d)
  "$python" scripts/tiny_model.py "$model" || status=1
  budgets=(64) batches=(1)
  grid=(--warmup 1 --repeats 2 --decode-repeats 1 --new-tokens 2 --text-tokens 8 --dtype float32)
  fast_sizes=(--repeats 3 --new-tokens 3)
else
  budgets=(192 128 64) batches=(1 8 32)
  grid=(--warmup 3 --repeats 7 --decode-repeats 2 --new-tokens 16 --dtype bfloat16)
  fast_sizes=()
fi
"$python" -m priortr.cli bench --model "$model" --device "$device" --methods "${methods[@]}" \
  --budgets "${budgets[@]}" --batch-sizes "${batches[@]}" "${grid[@]}" --out "$out/bench" \
  > "$out/bench.log" 2>&1 || status=1
for f in bench.json bench.md bench.png bench.jsonl; do [ -f "$out/bench/$f" ] && cp "$out/bench/$f" "$out/$f"; done
rm -rf "$out/bench"
tail -25 "$out/bench.log"

echo "== fast path on $device (batch 1, compiled prefill, compiled static decode, syncs) (at ${SECONDS}s)"
fast=(--device "$device" --model "$model" --out "$out" --budget "$fast_budget" --batch-sizes "${batches[@]}")
timeout "${FAST_TIMEOUT:-300}" "$python" benchmarks/fast_path.py "${fast[@]}" "${fast_sizes[@]}" \
  > "$out/fast.log" 2>&1 || status=1
[ "$tiny" = 1 ] && rm -rf "$model"
tail -40 "$out/fast.log"

echo "== every file and row (at ${SECONDS}s)"
"$python" scripts/check_gpu_check.py "$out" --device "$device" --methods "${methods[@]}" \
  --budgets "${budgets[@]}" --batch-sizes "${batches[@]}" --fast-budget "$fast_budget" || status=1
echo "== done in ${SECONDS}s, exit status $status"
exit $status
