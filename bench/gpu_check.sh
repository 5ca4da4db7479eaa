#!/usr/bin/env bash
# One call on a GPU, in under 8 minutes (bench/gpu_check.py says what each part measures):
#   1. serve: `localllm serve` on the GPU answers chat, streamed chat and embeddings over HTTP;
#   2. the GPU tests compiled on CUDA: tests/test_triton_kernels.py (every token of the
#      batch-invariance tests, sliding window and soft-cap included) and tests/test_gpu_path.py,
#      without the dry run of this script;
#   3. decode matmuls and attention: the batch-invariant default beside fast-math (fixed configs);
#   4. end-to-end decode tokens/s at batch 1 and 32, default beside fast-math.
#
#   bench/gpu_check.sh [MODEL.gguf] [--synthetic] [--dry-run]
#
# --dry-run: the same script on the CPU through the Triton interpreter, tiny shapes (a smoke test).
# Exit status: 0 only when every part ran and passed; a part skipped for time fails the run.
set -uo pipefail
cd "$(dirname "$0")/.."

MODEL=""
EXTRA=()
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --synthetic) EXTRA+=(--synthetic) ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) MODEL="$arg" ;;
  esac
done
if [[ -n "$MODEL" ]]; then EXTRA+=(--model "$MODEL"); fi
PY="${PYTHON:-python}"
START=$(date +%s)

if [[ "$DRY" == 1 ]]; then
  export TRITON_INTERPRET=1
  exec timeout 300 "$PY" bench/gpu_check.py --dry-run "${EXTRA[@]}"
fi

export TRITON_INTERPRET=0 LOCALLLM_TRITON_AUTOTUNE=0
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__, "| device", torch.cuda.get_device_name(0))' || exit 1

# Everything has to end within 450 s of START (GPU_CHECK_BUDGET_S: another budget, whole seconds).
DEADLINE=$(( START + ${GPU_CHECK_BUDGET_S:-450} ))

echo
echo "## serve (first)"
timeout 180 "$PY" bench/gpu_check.py --only serve "${EXTRA[@]}"
SERVE=$?

echo
echo "## GPU tests (compiled on CUDA; one fixed config per kernel, no autotuning)"
LOCALLLM_TEST_DEVICE=cuda timeout 200 \
  "$PY" -m pytest tests/test_triton_kernels.py tests/test_gpu_path.py -q -rfEs -p no:cacheprovider --durations=5 \
  -k "not dry_run"
TESTS=$?
echo "(GPU tests: exit $TESTS, $(( $(date +%s) - START )) s so far)"

timeout $(( DEADLINE - $(date +%s) + 20 )) "$PY" bench/gpu_check.py --skip serve --deadline "$DEADLINE" "${EXTRA[@]}"
BENCH=$?
echo
echo "gpu_check: serve exit $SERVE, GPU tests exit $TESTS, benchmarks exit $BENCH, $(( $(date +%s) - START )) s in all"
[[ "$SERVE" == 0 && "$TESTS" == 0 && "$BENCH" == 0 ]]
