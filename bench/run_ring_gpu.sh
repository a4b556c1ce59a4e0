#!/usr/bin/env bash
# One device call on a multi-GPU kind: the ring tests (gloo, CPU engine), then `mtrain profile ring` under
# torchrun with NCCL. Keep the machine's NCCL_NVLS_ENABLE=0 / TORCH_SYMM_MEM_DISABLE_MULTICAST=1 settings.
# Usage (repo root, on the device): OUT=/tmp/out bash bench/run_ring_gpu.sh 256k [extra profile args...]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L | wc -l)
LEN=${1:-256k}; shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_ring_distributed.py -k torch 2>&1 | tail -5 | tee "$OUT/tests.txt"
python3 -m torch.distributed.run --nproc-per-node "$NGPU" -m mtrain_cli profile ring --seq-len "$LEN" \
    --node-size $((NGPU / 2)) --out "$OUT/ring_${NGPU}gpu_${LEN}.json" "$@" 2>&1 | tee "$OUT/profile.log"
