#!/usr/bin/env bash
# The first sparse steps on a fresh machine (bench/cold_start.py): `mtrain extend` at 64K and 128K on one GPU, dense,
# sparse and sparse without the kernel prebuild, each from empty Triton and Inductor caches; about 6 minutes on one
# H200. Writes $OUT/cold_start.json, .md and each case's log.
# The device image lacks `datasets`: carry .whl/ (see bench/run_train_gpu.sh).
# Usage (repo root, on the device): OUT=/tmp/out bash bench/cold_start.sh [--lengths 65536,131072] [--budget 530]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 WANDB_MODE=disabled
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:src
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
exec python3 -m bench.cold_start --out "${OUT:?set OUT}" "$@"
