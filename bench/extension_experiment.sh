#!/usr/bin/env bash
# Issue 22's context-extension experiment (dense vs sparse, on a code model pretrained here), run on the device by
# `python3 -m bench.extension`. By default one call of at most 10 minutes on one H100 (corpus, pretraining, two
# extensions, evaluation, report): $OUT/extension_experiment_<gpu>.json, .md, _ppl.png, _niah.png, _training.png,
# _layers.png, _logs.tar.gz. The larger scale spans calls (--phase base, then extend; `python3 -m bench.extension
# --help` says more):
#   call 1, carry [".whl"]:
#     OUT=/tmp/out bash bench/extension_experiment.sh --phase base
#   call 2, carry [".whl", ".exp/base/base_parts"] (call 1's $OUT/base_parts, copied there):
#     OUT=/tmp/out bash bench/extension_experiment.sh --phase extend --base-parts .exp/base/base_parts
# --scale 256k: every GPU present (4), 4K -> 256K, four calls of at most 9 minutes on the same kind of machine
# (nvidia-h100-x4 or nvidia-h200-x4); after each, copy what it returned as said (`python3 -m bench.extension
# --help` says why):
#   call 1, carry [".whl"]:
#     OUT=/tmp/out bash bench/extension_experiment.sh --scale 256k --phase base
#     ($OUT/base_parts -> .exp/base_parts)
#   call 2, carry [".whl", ".exp/base_parts"]:
#     OUT=/tmp/out bash bench/extension_experiment.sh --scale 256k --phase dense --base-parts .exp/base_parts
#     ($OUT/dense_parts/logs.tar.gz -> .exp/logs.tar.gz)
#   call 3, carry [".whl", ".exp/base_parts", ".exp/logs.tar.gz"]:
#     OUT=/tmp/out bash bench/extension_experiment.sh --scale 256k --phase sparse --base-parts .exp/base_parts \
#       --resume .exp/logs.tar.gz
#     ($OUT/sparse_parts/logs.tar.gz -> .exp/logs.tar.gz, replacing the dense one)
#   call 4, carry [".whl", ".exp/base_parts", ".exp/logs.tar.gz"]:
#     OUT=/tmp/out bash bench/extension_experiment.sh --scale 256k --phase eval --base-parts .exp/base_parts \
#       --resume .exp/logs.tar.gz
#     (the report of all four jobs: $OUT/extension_experiment_4gpu_256k.*)
# --scale 128k: the same four calls on 2 GPUs (nvidia-h100-x2 or nvidia-h200-x2), 4K -> 128K.
# The device image lacks `datasets` (and dill, multiprocess): carry .whl/ (see bench/run_train_gpu.sh).
# Usage (repo root, on the device): OUT=/tmp/out bash bench/extension_experiment.sh [options]
#   e.g. --budget 540, --extend-steps 200; on CPU: .venv/bin/python -m bench.extension --out DIR --smoke
#   [--scale 256k --phase base|dense|sparse|eval ...]
set -uo pipefail
export EXP_START=$(date +%s) PYTHONPATH=src PYTHONUNBUFFERED=1 WANDB_MODE=disabled
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:src || echo "extension_experiment.sh: installing .whl/*.whl failed" >&2
fi
exec python3 -m bench.extension --out "${OUT:?set OUT}" "$@"
