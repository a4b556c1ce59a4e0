#!/usr/bin/env bash
# One device call: GPU tests of the sparse kernels, then the kernel benchmark. Output under $OUT.
# Usage (on the GPU machine, repo root): OUT=/tmp/out bash bench/run_kernels_gpu.sh [profile args...]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_sparse_kernels.py 2>&1 | tail -30 | tee "$OUT/tests.txt"
python3 -m mtrain_cli profile kernels --out "$OUT/kernels.json" "$@" 2>&1 | tee "$OUT/profile.log"
