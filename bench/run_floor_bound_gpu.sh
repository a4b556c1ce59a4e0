#!/usr/bin/env bash
# One device call (nvidia-h100-x1, ~3 min): the three Gluon probes (forward, dQ, dK/dV) at 128K on the planted
# cases that bracket MTraining's 14% density (6 and 4 slashes), JSON only under $OUT; then, on any machine,
# bench/floor_bound.py --probes <those files> turns them into the bounds table.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
for n in 6 4; do
  timeout 200 python3 bench/gluon_fwd_probe.py --length 128k --planted-slashes "$n" --stages 5 --out "$OUT/fwd_$n.json" \
    > /dev/null; echo "forward $n: rc=$?"
  timeout 200 python3 bench/gluon_dq_probe.py --length 128k --planted-slashes "$n" --stages 4 --out "$OUT/dq_$n.json" \
    > /dev/null; echo "dq $n: rc=$?"
  timeout 200 python3 bench/gluon_dkdv_probe.py --length 128k --planted-slashes "$n" --out "$OUT/dkdv_$n.json" \
    > /dev/null; echo "dkdv $n: rc=$?"
done
