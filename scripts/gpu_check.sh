#!/usr/bin/env bash
# GPU check of the Triton attention kernels, on a CUDA machine (`pip install -e .` done):
#   1. tests/test_kernels.py compiled on the GPU (no interpreter),
#   2. bench/kernels.py: decode GB/s against the measured copy bandwidth and prefill TFLOP/s
#      against a measured bf16 GEMM, written to bench/results/kernels_<device>.{json,md}.
# Takes well under 5 minutes on one H200 (mostly Triton compiles). Extra arguments go to the
# benchmark (e.g. --quick, --out-dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # compiled kernels on the device, never the interpreter

python3 - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch")
print(f"gpu_check: {torch.cuda.get_device_name()} (torch {torch.__version__})")
PY

echo "== tests/test_kernels.py on CUDA"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py

echo "== bench/kernels.py"
timeout 150 python3 bench/kernels.py "$@"
