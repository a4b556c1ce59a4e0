"""What limits the sparse kernels: Nsight Compute counters of one forward and one backward on the planted
inputs of `mtrain profile kernels` (Qwen2.5-3B attention shape, one document, layout block 64).

Run the workload under ncu (the profiled range is one forward + one backward, after a warm-up that compiles):

    PYTHONPATH=src ncu --clock-control none --profile-from-start off \
        -k regex:"_forward_kernel|_dq_kernel|_dkdv_kernel" --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section LaunchStats --section Occupancy -o $OUT/sparse \
        python3 bench/ncu_sparse_kernels.py --length 128k
    ncu -i $OUT/sparse.ncu-rep --page raw --csv > $OUT/sparse_raw.csv
    python3 bench/ncu_sparse_kernels.py --summarize $OUT/sparse_raw.csv --out $OUT/ncu_summary.json

The summary keeps, per kernel: duration, tensor-pipe and L2 utilisation, issue-slot use (SchedulerStats),
registers, spills, and the warp stall reasons (cycles per issued instruction) that explain the rest; metrics
of sections not collected are left out.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

METRICS = {
    "duration_ms": "gpu__time_duration.sum",
    "tensor_pipe_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "l2_throughput_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "l1_throughput_pct": "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "mufu_pct": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "shared_kb": "launch__shared_mem_per_block_dynamic",
    "spill_requests": "derived__local_spilling_requests",
    "warps_active_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
}
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def summarize(raw_csv: Path) -> dict:
    rows = list(csv.reader(raw_csv.open()))
    header, data = rows[0], rows[2:]  # row 1 holds the units

    def value(row: list[str], name: str) -> float:
        return float(row[header.index(name)].replace(",", ""))

    kernels = {}
    for row in data:
        name = row[header.index("Kernel Name")]
        entry = {key: value(row, metric) for key, metric in METRICS.items() if metric in header}
        stalls = {h[len(STALL_PREFIX):-len(STALL_SUFFIX)]: value(row, h) for h in header
                  if h.startswith(STALL_PREFIX) and h.endswith(STALL_SUFFIX)}
        entry["stall_cycles_per_issue"] = {k: round(v, 3) for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])
                                           if v >= 0.05}
        kernels[name] = entry
    return kernels


def run_workload(length: str) -> None:
    import torch

    from mtrain_cli.attention.sparse.kernels_bwd import attention_delta, sparse_backward
    from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
    from mtrain_cli.lengths import parse_lengths
    from mtrain_cli.profile.synthetic import planted_case

    case = planted_case(parse_lengths(length)[0], torch.device("cuda"))
    layout, doc = case.plan.layout, case.doc_BS

    def step() -> None:
        out, lse = sparse_forward(case.q, case.k, case.v, layout, doc, doc, case.scale)
        delta = attention_delta(out, case.dout)
        sparse_backward(case.q, case.k, case.v, out, lse, case.dout, layout, doc, doc, case.scale, delta_BHS=delta)

    step()  # compiles and autotunes outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", default="128k")
    parser.add_argument("--summarize", type=Path, help="ncu raw CSV (--page raw --csv) to summarise")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.summarize is None:
        run_workload(args.length)
        return
    summary = summarize(args.summarize)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
