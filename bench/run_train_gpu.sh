#!/usr/bin/env bash
# One device call on 4 or 8 GPUs: `mtrain profile step` of a training step with the
# Qwen2.5-3B shape (random init; the shipped 512-token tokenizer, so the embedding and LM head are small),
# 64K tokens per GPU (512K on 8, 256K on 4), one sequence per step over a cp ring of every GPU:
# sparse stripe ring vs dense zigzag ring, same data, same launch. Results and tables under $OUT.
# The device image lacks `datasets` (and its dill, multiprocess): carry them as wheels in .whl/ (git-ignored),
# fetched here once with
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# and pass carry [".whl"] to the device call.
# Usage (repo root, on the device): OUT=/tmp/out bash bench/run_train_gpu.sh [extra --set overrides...]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 WANDB_MODE=disabled
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:src
fi
NGPU=$(nvidia-smi -L | wc -l)
LEN=$((65536 * NGPU))
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 bench/make_long_docs.py --chars $((LEN * 7 / 2)) --num-docs 4 --out /tmp/long.jsonl
for mode in sparse dense; do
  layout=$([ "$mode" = sparse ] && echo stripe || echo zigzag)
  timeout 280 python3 -m torch.distributed.run --nproc-per-node "$NGPU" -m mtrain_cli profile step \
    --recipe qwen2.5-3b-512k --data /tmp/long.jsonl --warmup 1 --steps 2 --out "$OUT/step_${mode}_${NGPU}gpu.json" \
    --set data.seq_len=$LEN --set data.num_val_rows=0 --set parallel.cp=$NGPU --set parallel.dp=1 \
    --set attention.mode=$mode --set parallel.layout=$layout --set run.output_dir=/tmp/runs "$@" \
    2>&1 | tail -25 | tee "$OUT/step_${mode}.log"
done
