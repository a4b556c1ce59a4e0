"""Training speed and memory of `mtrain extend` on one GPU, through the CLI, for the Qwen2.5-0.5B shape.

Each case is one `python3 -m mtrain_cli extend` run (random init, the shipped 512-token tokenizer, so the
embedding and LM head are small: 0.36B parameters instead of 0.49B; bf16 autocast, activation checkpointing).
Tokens/s and step time come from the run's metrics.jsonl over every step but the first (Triton autotuning,
torch.compile and the first plans land there): with 9 steps that includes one crossover re-probe of every
layer (attention/crossover.py: REPROBE_EVERY = 8), so sparse mode's planning is paid as often as in a real run.

Cases (`--cases`, comma-separated; default all):
  memory-128k-packed   dense, one 131,072-token row of 4 packed documents (FlexAttention, document-causal BlockMask)
  memory-128k-single   dense, the same length as one document per row (SDPA is_causal: cuDNN/flash)
  speed-{16k,64k,128k}-{dense,sparse}   one document per row, same data and seed; sparse = attention.mode=sparse
  compile-32k-{on,off}  dense, train.compile on/off: step time and MFU

    python3 bench/train_speed.py --out $OUT [--cases speed-16k-dense,speed-16k-sparse]
Writes $OUT/train_speed_<gpu>.json and .md (rewritten after every case).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from mtrain_cli.attention import AttentionConfig

REPO = Path(__file__).resolve().parents[1]
CHARS_PER_TOKEN = 2.9  # the shipped byte-level BPE on the shipped stories
QWEN25_05B = [
    "model.architecture=qwen2",
    "model.hidden_size=896",
    "model.intermediate_size=4864",
    "model.num_hidden_layers=24",
    "model.num_attention_heads=14",
    "model.num_key_value_heads=2",
    "model.max_position_embeddings=32768",
    "model.rope_theta=1000000.0",
    "context.factor=4",
]
# the shipped attention defaults, not the demo recipe's CPU-sized ones
SHIPPED = AttentionConfig()
SPARSE_DEFAULTS = [
    f"attention.{name}={getattr(SHIPPED, name)}"
    for name in ("p", "cap", "last_q", "max_probe_rows", "block_size", "local_window", "dense_below", "num_sink")
]
COMMON = [
    *SPARSE_DEFAULTS,
    "data.num_val_rows=0",
    "data.short_fraction=0",
    "train.activation_checkpointing=true",
    "train.lr=1e-4",
    "train.warmup_steps=1",
    "train.eval_every=100000",
    "checkpoint.every=100000",
    "checkpoint.export=false",
    "logging.every=1",
]


def case_overrides(name: str) -> tuple[list[str], str, int]:
    """-> (overrides, corpus kind, steps) of a case."""
    kind, length, variant = name.split("-")
    seq_len = int(length[:-1]) * 1024
    base = [*QWEN25_05B, *COMMON, f"data.seq_len={seq_len}"]
    if kind == "memory":
        return [*base, "attention.mode=dense"], f"{variant}-{seq_len}", 4
    if kind == "speed":
        return [*base, f"attention.mode={variant}"], f"single-{seq_len}", 9
    return (
        [*base, "attention.mode=dense", f"train.compile={'true' if variant == 'on' else 'false'}"],
        f"single-{seq_len}",
        8,
    )


def corpus(kind: str, work: Path) -> Path:
    """single-S: 12 documents of exactly S tokens with their EOS (every row is one whole document: no row
    runs the packed path); packed-S: documents of about S/4 tokens (rows of 4-5 packed pieces)."""
    path = work / f"{kind}.jsonl"
    if path.exists():
        return path
    layout, seq_len = kind.split("-")
    seq_len = int(seq_len)
    if layout == "packed":
        subprocess.run(
            [
                sys.executable,
                str(REPO / "bench" / "make_long_docs.py"),
                "--chars",
                str(int(seq_len // 4 * CHARS_PER_TOKEN)),
                "--num-docs",
                "24",
                "--out",
                str(path),
            ],
            check=True,
        )
        return path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "data" / "tokenizer"))
    stories = [
        json.loads(line)["text"]
        for line in (REPO / "data" / "corpus" / "long.jsonl").read_text().splitlines()
        if line.strip()
    ]
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(12):
            text = "\n\n".join(rng.choice(stories) for _ in range(int(seq_len * CHARS_PER_TOKEN / 3000) + 8))
            ids = tokenizer(text)["input_ids"]
            text = tokenizer.decode(ids[: seq_len - 1])  # + the EOS packing appends = seq_len
            assert len(tokenizer(text)["input_ids"]) == seq_len - 1, "re-encoding changed the length"
            f.write(json.dumps({"text": text}) + "\n")
    return path


def run_case(name: str, work: Path, timeout: float) -> dict:
    overrides, kind, steps = case_overrides(name)
    out_dir = work / "runs" / name
    command = [
        sys.executable,
        "-m",
        "mtrain_cli",
        "extend",
        "--data",
        str(corpus(kind, work)),
        "--output-dir",
        str(out_dir),
        "--set",
        f"train.num_steps={steps}",
        "--set",
        f"run.name={name}",
        *[a for o in overrides for a in ("--set", o)],
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "WANDB_MODE": "disabled", "COLUMNS": "200"},
        )
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = 124, (str(exc.stdout or "") + str(exc.stderr or ""))[-3000:]
    row = {"case": name, "command": " ".join(command), "rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
    runs = sorted(out_dir.glob(f"{name}-*")) if out_dir.exists() else []
    metrics = (
        [json.loads(line) for line in (runs[-1] / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        if runs and (runs[-1] / "metrics.jsonl").exists()
        else []
    )
    if rc != 0 or len(metrics) < 2:
        return {**row, "error": tail}
    timed = metrics[1:]
    seconds = sum(m["step_s"] for m in timed)
    summary = json.loads((runs[-1] / "summary.json").read_text())
    row.update(
        steps=len(metrics),
        timed_steps=len(timed),
        tokens_per_s=sum(m["tokens"] for m in timed) / seconds,
        step_s_median=statistics.median(m["step_s"] for m in timed),
        tflops_median=statistics.median(m["tflops"] for m in timed),
        mfu_median=statistics.median(m["mfu"] for m in timed) if "mfu" in timed[0] else None,
        peak_mem_gib=max(m["peak_mem_gib"] for m in metrics),
        num_params=summary["num_params"],
        attention_calls=summary["attention_calls"],
        attention_layers=summary.get("attention_layers"),
        compile=summary.get("compile"),
        warnings=summary["warnings"],
        sparse_density=[m.get("sparse_density") for m in metrics],
        sparse_recall=[m.get("sparse_recall") for m in metrics],
        layers=[m.get("layers") for m in metrics],
        step_s=[round(m["step_s"], 3) for m in metrics],
    )
    return row


def markdown(result: dict) -> str:
    lines = [
        f"{result['device']} · torch {result['torch']} · triton {result['triton']} · {result['date']} · "
        f"Qwen2.5-0.5B shape (24 layers, 14/2 heads, head dim 64), random init, bf16, activation checkpointing",
        "",
        "| case | tokens/s | step s (median) | TFLOP/s | MFU | peak GiB | layers sparse / dense | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cases"]:
        if "error" in r:
            lines.append(f"| {r['case']} | – | – | – | – | – | – | failed (rc {r['rc']}) |")
            continue
        layers = r.get("attention_layers") or {}
        split = f"{layers.get('sparse', 0)} / {layers.get('dense-crossover', 0)}" if "sparse" in r["case"] else "–"
        mfu = f"{r['mfu_median']:.1%}" if r["mfu_median"] else "–"
        lines.append(
            f"| {r['case']} | {r['tokens_per_s']:,.0f} | {r['step_s_median']:.3f} | {r['tflops_median']:.0f} | "
            f"{mfu} | {r['peak_mem_gib']:.1f} | {split} | {r['timed_steps']} timed steps |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--cases",
        default="memory-128k-packed,memory-128k-single,speed-16k-dense,speed-16k-sparse,"
        "speed-64k-dense,speed-64k-sparse,speed-128k-dense,speed-128k-sparse,"
        "compile-32k-off,compile-32k-on",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/train_speed"))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    args = parser.parse_args()
    import torch
    import triton

    gpu = "h200" if "H200" in torch.cuda.get_device_name() else "h100"
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": date.today().isoformat(),
        "command": " ".join(sys.argv),
        "cases": [],
    }
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.cases.split(","):
        row = run_case(name, args.work, args.timeout)
        result["cases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("command", "error")}), flush=True)
        if "error" in row:
            print(row["error"][-1500:], flush=True)
        (args.out / f"train_speed_{gpu}.json").write_text(json.dumps(result, indent=2))
        (args.out / f"train_speed_{gpu}.md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
