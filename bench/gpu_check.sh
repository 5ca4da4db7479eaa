#!/usr/bin/env bash
# One-GPU check of the Triton path, in under 8 minutes:
#   1. every kernel test (tests/test_triton_kernels.py) compiled on CUDA;
#   2. achieved memory bandwidth of decode GEMV (batch 1, 16) and attention decode (batch 1, 32, 4k);
#   3. end-to-end decode tokens/s at batch 1 and 32 (MODEL, else a synthetic 8B-shaped Q4_K model).
#
#   bench/gpu_check.sh [MODEL.gguf] [--synthetic] [--dry-run]
#
# --dry-run: the same script on the CPU through the Triton interpreter, tiny shapes (a smoke test).
# Exit status: 0 when every part passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

MODEL=""
EXTRA=()
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --synthetic) EXTRA+=(--synthetic) ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
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

export TRITON_INTERPRET=0
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__, "| device", torch.cuda.get_device_name(0))' || exit 1

echo
echo "## kernel tests on CUDA (one fixed config per kernel, no autotuning)"
LOCALLLM_TEST_DEVICE=cuda LOCALLLM_TRITON_AUTOTUNE=0 timeout 200 \
  "$PY" -m pytest tests/test_triton_kernels.py -q -rfEs -p no:cacheprovider --durations=5
TESTS=$?
echo "(kernel tests: exit $TESTS, $(( $(date +%s) - START )) s so far)"

# Everything has to end within 8 minutes of START; the bench skips what would run past it.
DEADLINE=$(( START + 450 ))
timeout $(( DEADLINE - $(date +%s) + 20 )) "$PY" bench/gpu_check.py --deadline "$DEADLINE" "${EXTRA[@]}"
BENCH=$?
echo
echo "gpu_check: kernel tests exit $TESTS, benchmarks exit $BENCH, $(( $(date +%s) - START )) s in all"
[[ "$TESTS" == 0 && "$BENCH" == 0 ]]
