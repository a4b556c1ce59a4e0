#!/usr/bin/env bash
# One device call: `profile kernels` at 128K on planted inputs of three densities (16, 8 and 4 planted slashes per
# KV head), with the dense and Flex anchors, then the per-kernel breakdown of the 8-slash one. Output under $OUT.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m mtrain_cli profile kernels --lengths 128k --patterns planted --block-sizes 64 \
  --flex-lengths 128k --repeats 5 --out "$OUT/kernels.json" 2>&1 | tee "$OUT/profile.log"
python3 bench/breakdown_sparse.py --length 128k --planted-slashes 8 --top 8 --out "$OUT/breakdown.json" 2>&1 \
  | tail -40 | tee "$OUT/breakdown.log"
