#!/usr/bin/env bash
# The first training step's cost, cold and warm: `mtrain extend` of the demo model at 16K, dense and sparse side by
# side on two GPUs, each run twice on one fresh Triton + Inductor cache (cold: nothing compiled or tuned yet; warm:
# the second run of the same shapes). Writes $OUT/first_step.json and .md.
# The device image lacks `datasets`: carry .whl/ (see bench/run_train_gpu.sh).
# Usage (repo root, on a device with 2+ GPUs): OUT=/tmp/out [FIRST_STEP_GPUS="2 3"] bash bench/first_step.sh
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 WANDB_MODE=disabled
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:src
fi
runs=/tmp/first_step
rm -rf "$runs"
one_mode() {  # mode gpu
  local mode=$1 cache="$runs/cache_$1"
  for pass in cold warm; do
    CUDA_VISIBLE_DEVICES=$2 TRITON_CACHE_DIR="$cache/triton" TORCHINDUCTOR_CACHE_DIR="$cache/inductor" \
      timeout 240 python3 -m mtrain_cli extend --output-dir "$runs/$mode-$pass" --set run.name=run \
      --set data.seq_len=16384 --set context.factor=64 --set train.num_steps=4 --set train.warmup_steps=0 \
      --set attention.mode="$mode" --set checkpoint.export=false >"$runs/$mode-$pass.log" 2>&1
  done
}
mkdir -p "$runs"
gpus=(${FIRST_STEP_GPUS:-0 1})  # two GPUs: dense on the first, sparse on the second
one_mode dense "${gpus[0]}" & one_mode sparse "${gpus[1]}" & wait
python3 - "$runs" "$OUT" <<'EOF'
import json, sys
from pathlib import Path

import torch, triton

runs, out = Path(sys.argv[1]), Path(sys.argv[2])
rows = []
for mode in ("dense", "sparse"):
    for cache in ("cold", "warm"):
        run = next((runs / f"{mode}-{cache}").glob("run*"), None)
        steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()] if run else []
        steps = [s for s in steps if "loss" in s]
        rows.append({"mode": mode, "cache": cache, "step_s": [round(s["step_s"], 3) for s in steps]})
result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
          "command": "OUT=... bash bench/first_step.sh", "rows": rows}
(out / "first_step.json").write_text(json.dumps(result, indent=1))
lines = ["| mode | cache | first step s | later steps s | first - later |", "|---|---|---|---|---|"]
for r in rows:
    s = r["step_s"]
    if len(s) < 2:
        lines.append(f"| {r['mode']} | {r['cache']} | failed: see the log | | |")
        continue
    later = sorted(s[1:])[len(s[1:]) // 2]
    lines.append(f"| {r['mode']} | {r['cache']} | {s[0]:.2f} | {later:.3f} | {s[0] - later:.2f} |")
(out / "first_step.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
for f in "$runs"/*.log; do echo "== $f"; tail -3 "$f"; done
