#!/usr/bin/env bash
# Every mtrain user flow through the real CLI in one device call (about 9 minutes on one H100): extend (fresh and
# --model, dense and sparse, 16K and 64K), Ctrl-C + --resume + export, eval (4 suites, dense and sparse), profile
# step and profile kernels. Results: $OUT/gpu_e2e_<gpu>.json, .md and _logs.tar.gz (`python3 -m bench.gpu_e2e
# --help` says more).
# The device image lacks `datasets` (and dill, multiprocess): carry .whl/ (see bench/run_train_gpu.sh).
# Usage (repo root, on the device, carry [".whl"]): OUT=/tmp/out bash bench/gpu_e2e.sh [options]
#   e.g. --flows 'extend-fresh-*,profile-*' to run a part (prerequisites are added), --budget 540
set -uo pipefail
export E2E_START=$(date +%s) PYTHONPATH=src PYTHONUNBUFFERED=1 WANDB_MODE=disabled
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:src || echo "gpu_e2e.sh: installing .whl/*.whl failed" >&2
fi
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 1 ]; then  # one process, one GPU: the others would sit idle
  echo "gpu_e2e.sh: $(nvidia-smi -L | wc -l) GPUs here and the flows run on one; bench/gpu_e2e_parallel.sh runs them" \
    "side by side, one part a GPU" >&2
fi
# one line here; bench/gpu_e2e/environment.py checks each import apart and reports any missing one in the results
python3 -c 'import mtrain_cli.cli, datasets, matplotlib, wandb, yaml' 2>&1 | tail -1 | sed 's/^/gpu_e2e.sh: imports: /'
exec python3 -m bench.gpu_e2e --out "${OUT:?set OUT}" "$@"
