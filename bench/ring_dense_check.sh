#!/usr/bin/env bash
# One device call on 2 or 4 GPUs: the dense ring's library path (zigzag chunk pairs inside one document run
# cuDNN, pairs cut by a document boundary run our Triton kernels).
# 1. Right: tests/test_ring_plain_pairs.py -m cuda (NCCL, bf16, packed two-row batch, 16 q / 2 kv heads × 128):
#    cuDNN pairs + our cut pairs against every pair on our kernels, both against fp32 attention of the same bf16
#    inputs; relative errors out < 1e-2, dQ/dK/dV < 2e-2, the library no worse than 2 × ours + 2e-3.
# 2. Fast: `mtrain profile ring`, dense-zigzag against PyTorch's context_parallel with cuDNN on the same shape;
#    the table's `vs torch CP cuDNN` is torch's fwd+bwd time / ours (above 1: ours is faster).
# Keep the machine's NCCL_NVLS_ENABLE=0 / TORCH_SYMM_MEM_DISABLE_MULTICAST=1 settings.
# Usage (repo root, on the device): OUT=/tmp/out bash bench/ring_dense_check.sh [lengths...]
#   default lengths: 256k and 512k on 4 or more GPUs, 128k on 2
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'cudnn', torch.backends.cudnn.version())" | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -s -x -p no:cacheprovider -m cuda tests/test_ring_plain_pairs.py 2>&1 \
    | tail -20 | tee "$OUT/check.txt"
if [ "$#" -gt 0 ]; then LENGTHS="$*"; elif [ "$NGPU" -ge 4 ]; then LENGTHS="256k 512k"; else LENGTHS="128k"; fi
for LEN in $LENGTHS; do
  timeout 280 python3 -m torch.distributed.run --nproc-per-node "$NGPU" -m mtrain_cli profile ring \
      --seq-len "$LEN" --node-size $((NGPU / 2)) --modes dense-zigzag,torch-cp-cudnn \
      --out "$OUT/ring_dense_${NGPU}gpu_${LEN}.json" 2>&1 | tail -8 | tee -a "$OUT/profile.log"
done
