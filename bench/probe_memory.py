"""The per-layer plan's memory and time by probe rows at 128K on one GPU, the probe buffer's heads estimated in
groups that fit `PROBE_BUFFER_BYTES` (attention/sparse). Shapes: Llama-3.1-8B attention (32 heads, 8 KV heads of
128), or the quality study's strong128k (8 heads, 2 KV heads of 64), whose plan time is what more probe rows cost
its training steps.

Each case plans one packed 131,072-token row of 1 or 8 equal long documents with `mtrain`'s own `plan_sparse`
(the graphed plan a training layer runs: probe scoring, selection, recall, block layout), on random bf16 q/k
(the memory and the work do not depend on the values). Probe rows: every document gets 16 windows of
min(last_q, max_probe_rows / docs) / 16 rows, so `last_q 512, max_probe_rows 2048` over 8 documents gives 2,048
rows, the most it allows. Peak: the most memory allocated during the first plan (warm-up and graph capture: what a
training step adds at its first layer) above what was allocated before it; time: the median of `--repeats`
replays, after two untimed; the probe kernels' time: their CUDA time in a profile of three plans (torch.profiler).

    PYTHONPATH=src python3 -m bench.probe_memory --out $OUT [--shape strong128k]   # ~1 min on an H200
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from datetime import date
from pathlib import Path

import torch
import triton

from mtrain_cli.attention import AttentionConfig, BatchCache
from mtrain_cli.attention.sparse import PROBE_BUFFER_BYTES, PlanGraph, batch_geometry, head_group, plan_sparse
from mtrain_cli.profile import cuda_time_ms, kernel_table

SEQ_LEN = 131072
SHAPES = {"llama3-8b": (32, 8, 128), "strong128k": (8, 2, 64)}  # heads, KV heads, head dim
TITLES = {"llama3-8b": "Llama-3.1-8B attention", "strong128k": "the quality study's strong128k attention"}
# (last_q, max_probe_rows, documents): the defaults and the study's last_q 512, one and eight long documents
CASES = [(64, 256, 1), (64, 256, 8), (512, 2048, 1), (512, 2048, 8)]


def plan_case(settings: AttentionConfig, shape: str, num_docs: int, repeats: int) -> dict:
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, num_heads, SEQ_LEN, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, num_kv_heads, SEQ_LEN, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    doc_BS = torch.arange(num_docs, device="cuda").repeat_interleave(SEQ_LEN // num_docs)[None]
    cache, graph = BatchCache(), PlanGraph()

    def replan():
        return plan_sparse(q, k, doc_BS, head_dim**-0.5, settings, cache, graph)

    rows = batch_geometry(doc_BS, 1, SEQ_LEN, q.device, settings, cache).rows
    num_rows, width = int(rows.pos_BQ.shape[1]), rows.keys.width
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    plan = replan()
    torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
    ms = cuda_time_ms(replan, repeats)
    kernels = kernel_table(replan, 3)
    heads = head_group(num_heads, num_kv_heads, num_rows * width * 4)
    return {
        "last_q": settings.last_q,
        "max_probe_rows": settings.max_probe_rows,
        "docs": num_docs,
        "probe_rows": num_rows,
        "heads_at_once": heads,
        "buffer_gib": heads * num_rows * width * 4 / 2**30,
        "all_heads_buffer_gib": num_heads * num_rows * width * 4 / 2**30,
        "peak_gib": round(peak_gib, 2),
        "plan_ms": round(ms, 2),
        "probe_kernels_ms": round(sum(r["cuda_ms"] for r in kernels if "_probe_" in r["name"]), 2),
        "kernels": [{"name": r["name"], "ms": round(r["cuda_ms"], 3)} for r in kernels[:8]],
        "density": round(float(plan.layout.density()), 4),
        "recall": round(float(plan.recall_BH.mean()), 4),
    }


def markdown(meta: dict, results: list[dict]) -> str:
    heads, kv_heads, head_dim = SHAPES[meta["shape"]]
    lines = [
        f"# The plan's probe buffer: {TITLES[meta['shape']]} at 128K, one GPU",
        "",
        f"1 × {meta['device']}, torch {meta['torch']}, Triton {meta['triton']}; {meta['date']}; "
        f"commit {meta['commit']}. One packed row of 131,072 tokens, {heads} heads on {kv_heads} KV heads of "
        f"{head_dim}, bf16; heads estimated in groups whose probe buffer fits `PROBE_BUFFER_BYTES`",
        f"({meta['buffer_budget_gib']:g} GiB, attention/sparse/pattern.py). What a case is: bench/probe_memory.py's "
        "docstring.",
        "",
        "```",
        meta["command"],
        "```",
        "",
        "| last_q / max rows | documents | probe rows | all heads' buffer GiB | heads at once | buffer GiB | peak GiB "
        "| plan ms | probe kernels ms | density / recall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['last_q']} / {r['max_probe_rows']} | {r['docs']} | {r['probe_rows']:,} "
            f"| {r['all_heads_buffer_gib']:.2f} | {r['heads_at_once']} | {r['buffer_gib']:.2f} | {r['peak_gib']:.2f} "
            f"| {r['plan_ms']:.2f} | {r['probe_kernels_ms']:.2f} | {r['density']:.3f} / {r['recall']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    args = parser.parse_args()
    results = []
    for last_q, max_probe_rows, num_docs in CASES:
        settings = AttentionConfig(mode="sparse", last_q=last_q, max_probe_rows=max_probe_rows)
        results.append(plan_case(settings, args.shape, num_docs, args.repeats))
        print(json.dumps(results[-1]), flush=True)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": date.today().isoformat(),
        "commit": commit or "unknown",
        "command": f"PYTHONPATH=src python3 -m bench.probe_memory --out $OUT --shape {args.shape}",
        "shape": args.shape,
        "buffer_budget_gib": PROBE_BUFFER_BYTES / 2**30,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"probe_memory_{args.shape}_128k_{torch.cuda.get_device_name().split()[-1].lower()}"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "cases": results}, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(meta, results))
    print(markdown(meta, results), flush=True)


if __name__ == "__main__":
    main()
