"""CPU throughput of `pack_documents` (input tokens per second) on synthetic tokenised documents.

Documents have log-uniform lengths in a range (default 1K..100K tokens, the long-context target) and random
int32 ids. They are written with `save_to_disk` and read back memory-mapped, as a tokenised cache file would be.
Each (length range, seq_len) case is packed `--repeats` times; the median wall time is reported, and the first
run's time too (cold: file pages and fresh output memory faulted in, as in a training run that packs once).
Writes bench/results/packing_cpu.json and .md.

    .venv/bin/python bench/bench_packing.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch

from mtrain_cli.data import pack_documents

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def synthetic_documents(directory: Path, num_tokens: int, min_len: int, max_len: int, seed: int) -> datasets.Dataset:
    """Documents totalling about `num_tokens` tokens, saved to and memory-mapped back from `directory`."""
    rng = np.random.default_rng(seed)
    mean_len = (max_len - min_len) / np.log(max_len / min_len)  # mean of the log-uniform distribution
    lengths = np.exp(rng.uniform(np.log(min_len), np.log(max_len), int(num_tokens / mean_len) + 1)).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # [num_documents + 1]
    values = pa.array(rng.integers(0, 150_000, int(offsets[-1]), dtype=np.int32))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    datasets.Dataset(pa.table({"input_ids": column})).save_to_disk(str(directory))
    return datasets.load_from_disk(str(directory))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=50_000_000, help="input tokens per case")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    datasets.disable_progress_bars()

    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (min_len, max_len) in enumerate([(1_000, 100_000), (100, 1_000)]):
            ds = synthetic_documents(Path(tmp) / f"docs{index}", args.num_tokens, min_len, max_len, seed=index)
            for seq_len in args.seq_lens:
                seconds = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    packed = pack_documents(ds, seq_len, seed=0)
                    seconds.append(time.perf_counter() - start)
                stats = packed.stats
                median = statistics.median(seconds)
                cases.append(
                    {
                        "doc_len_range": [min_len, max_len],
                        "seq_len": seq_len,
                        "num_documents": stats.num_documents,
                        "num_input_tokens": stats.num_input_tokens,
                        "num_rows": stats.num_rows,
                        "median_s": round(median, 4),
                        "first_s": round(seconds[0], 4),
                        "min_s": round(min(seconds), 4),
                        "tokens_per_s": round(stats.num_input_tokens / median),
                        "first_run_tokens_per_s": round(stats.num_input_tokens / seconds[0]),
                        "mean_documents_per_row": round(stats.mean_documents_per_row, 3),
                        "num_documents_split": stats.num_documents_split,
                    }
                )
                print(
                    f"docs {min_len}..{max_len} seq_len {seq_len:>6}: "
                    f"{stats.num_input_tokens / median / 1e6:7.1f} M tokens/s (median of {args.repeats}, "
                    f"{median * 1e3:.0f} ms; first run {seconds[0] * 1e3:.0f} ms; for "
                    f"{stats.num_input_tokens / 1e6:.1f} M tokens, {stats.num_rows} rows)",
                    flush=True,
                )

    result = {
        "benchmark": "pack_documents CPU throughput (input tokens / median wall second)",
        "command": " ".join(["cd /work/main && .venv/bin/python bench/bench_packing.py", *sys.argv[1:]]),
        "machine": {"cpu": cpu_name(), "num_cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "pyarrow": pa.__version__,
            "datasets": datasets.__version__,
            "torch": torch.__version__,
        },
        "repeats": args.repeats,
        "cases": cases,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "packing_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS_DIR / "packing_cpu.md").write_text(markdown(result))


def markdown(result: dict) -> str:
    machine, versions = result["machine"], result["versions"]
    lines = [
        "# Packing throughput on CPU",
        "",
        f"`pack_documents` (seeded shuffle, concatenate, cut into rows, positions/document ids/labels), input "
        f"tokens per median wall second over {result['repeats']} runs. Synthetic int32 token documents with "
        f"log-uniform lengths, memory-mapped from a `save_to_disk` directory.",
        "",
        "The first run of each data set is slower: packing writes 16 bytes of output per token (four int32 "
        "arrays), and the first touch of that much fresh process memory costs ~0.8 s per GiB on this VM "
        "(pre-faulting 1 GiB first makes the first run as fast as the median). A training run packs once, so "
        "expect the first-run rate there; the median is the packing code itself.",
        "",
        f"- machine: {machine['cpu']}, {machine['num_cpus']} CPUs, {machine['platform']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- command: `{result['command']}`",
        "",
        "| doc lengths (tokens) | seq_len | docs | input tokens | rows | median s | M tokens/s (median) "
        "| first run s | M tokens/s (first run) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in result["cases"]:
        low, high = case["doc_len_range"]
        lines.append(
            f"| {low:,}..{high:,} | {case['seq_len']:,} | {case['num_documents']:,} | "
            f"{case['num_input_tokens']:,} | {case['num_rows']:,} | {case['median_s']:.3f} | "
            f"{case['tokens_per_s'] / 1e6:.1f} | {case['first_s']:.3f} | "
            f"{case['first_run_tokens_per_s'] / 1e6:.1f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
