"""Tile-config sweep of the sparse kernels at one length, and the plan's cost inside a pipelined step.

    PYTHONPATH=src python3 bench/sweep_sparse_configs.py --length 128k --out $OUT/sweep.json

For each kernel (forward, dQ, dK/dV) and each config of its list, the autotuner is given that one config and
the kernel's CUDA time is read from torch.profiler (median-free: mean of --repeats calls) on the planted
128K inputs of `mtrain profile kernels`. Cold compiles are the slow part on a fresh machine, so every config
is first compiled in parallel worker processes (same shapes, so the same Triton cache entries), each under
a time limit; a config whose compile runs past it is reported, not timed.

Then the plan's cost where it matters, in a step: `layers` × (plan + forward + backward) enqueued back to back
against `layers` × (forward + backward) on the same layout. The plan issues no device sync, so its host time
overlaps the kernels of the layer before; the difference is what it adds to a step. The isolated plan time
(host-bound: nothing else queued) is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

from mtrain_cli.attention.sparse import kernels_bwd, kernels_fwd, kernels_vertical
from mtrain_cli.attention.sparse.kernels_bwd import sparse_backward
from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.sparse.ops import SparseAttentionFunction, plan_sparse
from mtrain_cli.attention.sparse.plan_graph import PlanGraph
from mtrain_cli.lengths import parse_lengths
from mtrain_cli.profile.kernels import cuda_time_ms, kernel_table, plan_cost_in_step
from mtrain_cli.profile.synthetic import PlantedCase, planted_case

# (tiles, warps, stages) per kernel; the first of each list is the baseline.
def _cfgs(tiles: list[dict[str, int]], warps_stages: list[tuple[int, int]]) -> list[tuple[dict[str, int], int, int]]:
    return [(t, w, st) for t in tiles for w, st in warps_stages]


# For the default layout block (64): one warpgroup per program (kernels.prune_tiles drops other warp counts).
SWEEP = {
    "forward": ("_forward_kernel", kernels_fwd._forward_kernel, _cfgs([{"SUB_N": 64}], [(4, 3), (4, 4), (4, 2)])),
    "dq": ("_dq_kernel", kernels_bwd._dq_kernel, _cfgs([{"SUB_N": 64}, {"SUB_N": 32}], [(4, 2), (4, 3)])),
    "dkdv": ("_dkdv_kernel", kernels_bwd._dkdv_kernel, _cfgs([{"SUB_M": 64}, {"SUB_M": 32}], [(4, 2), (4, 3)])),
}
VERTICAL_CONFIG = ({"SUB_M": 32}, 4, 2)


def set_config(kernel, cfg: tuple[dict[str, int], int, int]) -> None:
    tiles, warps, stages = cfg
    kernel.configs = [triton.Config(tiles, num_warps=warps, num_stages=stages)]
    kernel.cache = {}


def run_once(case: PlantedCase, backward: bool = True) -> None:
    layout, doc = case.plan.layout, case.doc_BS
    out, lse = sparse_forward(case.q, case.k, case.v, layout, doc, doc, case.scale)
    if backward:
        sparse_backward(case.q, case.k, case.v, out, lse, case.dout, layout, doc, doc, case.scale)


def compiled_stats(kernel) -> dict | str:
    """Registers, spills and shared memory of the kernel's most recently compiled variant."""
    try:
        entries = [ck for cache in kernel.fn.device_caches.values() for ck in cache[0].values()]
        ck = entries[-1]
        if hasattr(ck, "_init_handles"):
            ck._init_handles()
        return {"regs": ck.n_regs, "spills": ck.n_spills, "shared": ck.metadata.shared}
    except Exception as exc:  # a Triton version with other internals: recorded, not fatal
        return f"unavailable: {exc!r}"[:200]


def fix_vertical() -> None:
    """The vertical-partials launch (about 1% of the step) keeps one config here instead of its autotune list."""
    set_config(kernels_vertical._vertical_kernel, VERTICAL_CONFIG)


def warm(args) -> None:
    """Worker: compile one config of one kernel (the others keep their first config)."""
    kernel_name, index = args.warm.split(":")
    fix_vertical()
    for name, (_, kernel, cfgs) in SWEEP.items():
        set_config(kernel, cfgs[int(index)] if name == kernel_name else cfgs[0])
    run_once(planted_case(parse_lengths(args.length)[0], torch.device("cuda")), backward=kernel_name != "forward")
    torch.cuda.synchronize()


def precompile(args, log) -> dict[str, str]:
    jobs = [f"{name}:{i}" for name, (*_, cfgs) in SWEEP.items() for i in range(len(cfgs))
            if name in args.only.split(",")]
    status, running = {}, []
    t0 = time.perf_counter()
    while jobs or running:
        while jobs and len(running) < args.workers:
            job = jobs.pop(0)
            cmd = [sys.executable, __file__, "--length", args.length, "--only", args.only, "--warm", job]
            running.append((job, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
                            time.perf_counter()))
        time.sleep(1.0)
        for item in list(running):
            job, proc, started = item
            if proc.poll() is not None:
                status[job] = "ok" if proc.returncode == 0 else "failed: " + proc.stderr.read().decode()[-300:]
                running.remove(item)
            elif time.perf_counter() - started > args.compile_limit:
                proc.kill()
                status[job] = f"compile past {args.compile_limit} s"
                running.remove(item)
    log(f"precompiled {len(status)} configs in {time.perf_counter() - t0:.0f} s: "
        f"{sum(s == 'ok' for s in status.values())} ok")
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", default="128k")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--compile-limit", type=float, default=240.0)
    parser.add_argument("--only", default="forward,dq,dkdv", help="kernels to sweep (the others keep their first config)")
    parser.add_argument("--warm", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.warm:
        return warm(args)

    def log(msg: str) -> None:
        print(msg, flush=True)

    fix_vertical()
    status = precompile(args, log)
    case = planted_case(parse_lengths(args.length)[0], torch.device("cuda"))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "seq_len": parse_lengths(args.length)[0],
              "density": float(case.plan.density), "command": " ".join(sys.argv), "compile": status,
              "vertical_config": VERTICAL_CONFIG, "kernels": {}}
    log(f"density {result['density']:.4f}")
    best = {}
    for name, (kname, kernel, cfgs) in SWEEP.items():
        if name not in args.only.split(","):
            best[name] = cfgs[0]
            continue
        for other, (_, k2, c2) in SWEEP.items():
            if other != name:
                set_config(k2, best.get(other, c2[0]))
        rows = []
        for i, cfg in enumerate(cfgs):
            if status.get(f"{name}:{i}") != "ok":
                rows.append({"config": cfg, "status": status.get(f"{name}:{i}")})
                log(f"  {name} {cfg}: {status.get(f'{name}:{i}')}")
                continue
            set_config(kernel, cfg)
            ms = sum(r["cuda_ms"] for r in kernel_table(lambda: run_once(case), args.repeats)
                     if r["name"].startswith(kname))
            stats = compiled_stats(kernel)
            rows.append({"config": cfg, "ms": ms, "compiled": stats})
            log(f"  {name} {cfg[0]} warps {cfg[1]} stages {cfg[2]}: {ms:.2f} ms ({stats})")
        timed = [r for r in rows if "ms" in r]
        best[name] = min(timed, key=lambda r: r["ms"])["config"]
        result["kernels"][name] = {"rows": rows, "best": best[name]}
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    for name, (_, kernel, _) in SWEEP.items():
        set_config(kernel, best[name])

    q, k, v, doc, scale, settings, plan, dout = (case.q, case.k, case.v, case.doc_BS, case.scale, case.settings,
                                                 case.plan, case.dout)
    ready_ms, planned_ms = plan_cost_in_step(q, k, v, doc, scale, settings, plan.layout, dout, args.layers,
                                             args.repeats)
    cache, graph = BatchCache(), PlanGraph()
    plan_alone_ms = cuda_time_ms(lambda: plan_sparse(q, k, doc, scale, settings, cache, graph), repeats=args.repeats)
    result["step"] = {"layers": args.layers, "fwd_bwd_ms": ready_ms, "plan_fwd_bwd_ms": planned_ms,
                      "plan_in_step_ms": planned_ms - ready_ms, "plan_share_in_step": 1 - ready_ms / planned_ms,
                      "plan_alone_ms": plan_alone_ms}
    log(f"per layer: fwd+bwd {ready_ms:.2f} ms, with plan {planned_ms:.2f} ms (plan adds {planned_ms - ready_ms:.2f} "
        f"ms, {100 * result['step']['plan_share_in_step']:.1f}%); plan alone {plan_alone_ms:.2f} ms")

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def layer() -> None:
        for t in leaves:
            t.grad = None
        layout = plan_sparse(q, k, doc, scale, settings, cache, graph).layout
        SparseAttentionFunction.apply(*leaves, layout, doc, scale, cache).backward(dout)

    rows = kernel_table(layer, repeats=1)
    result["layer_kernels"] = rows
    log(f"one layer (plan + fwd + bwd): {sum(r['cuda_ms'] for r in rows):.2f} ms CUDA in "
        f"{sum(r['calls'] for r in rows)} launches")
    for r in rows[:15]:
        log(f"  {r['cuda_ms']:8.3f} ms x{r['calls']:<4d} {r['name']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
