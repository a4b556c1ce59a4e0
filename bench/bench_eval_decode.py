"""`mtrain eval --batch-size`: decoding time of the runner by batch size, on a randomly initialised model with
the shape of the issue-22 experiment's (recipes/code-extend.yaml: 29M parameters, 8 layers, 4 heads of 128, 2 KV
heads, vocabulary 8,192). Weights do not matter here: the end token is disabled, so every prompt decodes exactly
--new-tokens tokens.

--num-prompts prompts of about --length tokens (each a few tokens shorter than the one before, so batches are
left-padded as in an eval) run through `Runner.generate` in batches of each --batch-sizes value. Each prompt is
prefilled alone whatever the batch size, so the prefill is timed once on its own (every prompt, one new token)
and subtracted: decode s = wall s − prefill s, decode tokens/s = prompts × (new tokens − 1) / decode s. One
warm-up call per batch size comes first. On CUDA, peak memory is `torch.cuda.max_memory_allocated` per batch
size; on CPU the process's peak RSS so far. Times are medians of --repeats runs.

    .venv/bin/python -m bench.bench_eval_decode --length 1k --out bench/results/eval_decode_cpu.json   # CPU
    python3 -m bench.bench_eval_decode --length 64k --out $OUT/eval_decode_h100.json                    # GPU

(from the repository root: it imports bench.bench_eval_prefill)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from bench.bench_eval_prefill import peak_gib, synchronize
from mtrain_cli.eval import Runner
from mtrain_cli.lengths import parse_lengths
from mtrain_cli.resources import shipped_path


def model_config(args: argparse.Namespace) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=args.length + args.new_tokens,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def timed(runner: Runner, prompts: list[list[int]], batch_size: int, new_tokens: int) -> float:
    """Wall seconds of every prompt through runner.generate, batch_size at a time."""
    synchronize(runner.device)
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        answers = runner.generate(batch, [new_tokens] * len(batch))
        assert len(answers) == len(batch)
    synchronize(runner.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=lambda text: parse_lengths(text)[0], default=1024, help="prompt tokens")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (median reported)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    torch.manual_seed(0)
    config = model_config(args)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(shipped_path("data/tokenizer")), local_files_only=True)
    runner = Runner(model, tokenizer)
    runner.eos_ids = set()
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, len(tokenizer), (args.length - 7 * i,), generator=generator).tolist()  # the shipped 512
        for i in range(args.num_prompts)
    ]

    timed(runner, prompts[:1], 1, 2)  # warm-up: kernels, allocator
    prefill_s = statistics.median(timed(runner, prompts, 1, 1) for _ in range(args.repeats))
    rows = []
    for batch_size in batch_sizes:
        timed(runner, prompts[:batch_size], batch_size, 2)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        wall_s = statistics.median(timed(runner, prompts, batch_size, args.new_tokens) for _ in range(args.repeats))
        decode_s = wall_s - prefill_s
        rows.append(
            {
                "batch_size": batch_size,
                "wall_s": round(wall_s, 3),
                "decode_s": round(decode_s, 3),
                "decode_tokens_per_s": round(args.num_prompts * (args.new_tokens - 1) / decode_s, 1),
                "peak_gib": round(peak_gib(device), 2),
            }
        )
        print(rows[-1], flush=True)
    base = rows[0]["decode_s"] if batch_sizes[0] == 1 else None
    for row in rows:
        row["decode_speedup_vs_batch_1"] = round(base / row["decode_s"], 2) if base else None
    payload = {
        "benchmark": "mtrain eval decoding by --batch-size (Runner.generate), random init, end token disabled",
        "command": " ".join([Path(sys.executable).name, "-m", "bench.bench_eval_decode", *sys.argv[1:]]),
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "model": {"parameters": sum(p.numel() for p in model.parameters()), "layers": config.num_hidden_layers},
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": args.new_tokens,
        "prefill_s": round(prefill_s, 3),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
