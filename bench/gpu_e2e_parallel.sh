#!/usr/bin/env bash
# bench/gpu_e2e.sh's flows in one device call on a machine of several GPUs: four parts side by side, one a GPU (the
# pretrained base and what uses it; fresh extends and the profiles; the Llama-3.x family; the Qwen3 family),
# merged into one report, $OUT/gpu_e2e_<gpu>.{json,md} and $OUT/gpu_e2e_logs.tar.gz. With fewer GPUs than parts,
# parts share a GPU (their timings then share it too: the report names the GPU each part ran on).
# Usage (repo root, on the device, carry [".whl"]): OUT=/tmp/out bash bench/gpu_e2e_parallel.sh [gpu_e2e options]
set -uo pipefail
export E2E_START=$(date +%s) PYTHONPATH=src PYTHONUNBUFFERED=1 WANDB_MODE=disabled
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:src || echo "gpu_e2e_parallel.sh: installing .whl/*.whl failed" >&2
fi
PARTS=("pretrain,resume-*,export-check,eval-*,extend-model-*" "extend-fresh-*,profile-*" "llama3-*" "qwen3-*")
NGPU=$(nvidia-smi -L | wc -l)
WORK=/tmp/gpu_e2e_parts
rm -rf "$WORK" && mkdir -p "$WORK"
for i in "${!PARTS[@]}"; do
  CUDA_VISIBLE_DEVICES=$((i % NGPU)) python3 -m bench.gpu_e2e --out "$WORK/out$i" --work "$WORK/work$i" \
    --flows "${PARTS[$i]}" "$@" > "$WORK/part$i.log" 2>&1 &
done
wait
python3 -m bench.gpu_e2e --out "${OUT:?set OUT}" --side-by-side --merge "$WORK"/out*/gpu_e2e_*.json
tar -czf "$OUT/gpu_e2e_logs.tar.gz" -C "$WORK" $(cd "$WORK" && ls -d part*.log out*/*_logs.tar.gz 2>/dev/null)
