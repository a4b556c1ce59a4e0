"""Where a sparse attention step spends its GPU time: per-kernel CUDA time of the plan (pattern estimation +
block layout), the forward and the backward launches, from torch.profiler, on the planted inputs of
`mtrain profile kernels` (Qwen2.5-3B attention shape, one document).

    PYTHONPATH=src python3 bench/breakdown_sparse.py --length 128k --out $OUT/breakdown.json

Prints, per phase, the top kernels by CUDA time (median-free: the sum over --repeats calls, divided by
--repeats) and the phase's wall time (CUDA events, median). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import triton

from mtrain_cli.attention.sparse.kernels import tile_mask_bounds
from mtrain_cli.attention.sparse.kernels_bwd import attention_delta, sparse_backward
from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.sparse.ops import plan_sparse
from mtrain_cli.attention.sparse.plan_graph import PlanGraph
from mtrain_cli.lengths import parse_lengths
from mtrain_cli.profile.kernels import cuda_time_ms, kernel_table
from mtrain_cli.profile.synthetic import planted_case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", default="128k")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--planted-slashes", type=int, default=16, help="far slashes planted per KV head")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    seq_len = parse_lengths(args.length)[0]
    case = planted_case(seq_len, torch.device("cuda"), num_slash=args.planted_slashes)
    q, k, v, doc, scale, settings, plan, dout = (case.q, case.k, case.v, case.doc_BS, case.scale, case.settings,
                                                 case.plan, case.dout)
    layout = plan.layout
    bounds = tile_mask_bounds(doc, doc, layout.block, layout.mask_shift)  # per batch, as in a model
    out, lse = sparse_forward(q, k, v, layout, doc, doc, scale, mask_bounds=bounds)
    delta = attention_delta(out, dout)
    cache, graph = BatchCache(), PlanGraph()

    phases = {
        "plan": lambda: plan_sparse(q, k, doc, scale, settings, cache, graph),
        "forward": lambda: sparse_forward(q, k, v, layout, doc, doc, scale, mask_bounds=bounds),
        "backward": lambda: sparse_backward(q, k, v, out, lse, dout, layout, doc, doc, scale, delta_BHS=delta,
                                            mask_bounds=bounds),
    }
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "seq_len": seq_len, "planted_slashes": args.planted_slashes,
              "density": float(plan.density),
              "recall": float(plan.recall_BH.mean()), "phases": {}}
    print(f"{seq_len // 1024}K planted: density {result['density']:.3f}, recall {result['recall']:.3f}")
    for name, fn in phases.items():
        wall_ms = cuda_time_ms(fn, repeats=5)
        kernels = kernel_table(fn, args.repeats)[:args.top]
        result["phases"][name] = {"wall_ms": wall_ms, "kernels": kernels}
        print(f"\n== {name}: {wall_ms:.2f} ms (CUDA events, median of 5)")
        for r in kernels:
            print(f"  {r['cuda_ms']:8.3f} ms  x{r['calls']:<3d} {r['name']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
