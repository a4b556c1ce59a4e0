"""Prefill wall time and peak memory of `mtrain eval`'s runner at long lengths, on a randomly initialised
model with the Qwen2.5-3B shape (no weights are needed: prefill cost does not depend on their values).

Each length runs the eval path itself: `Runner.prefill` (chunks of --prefill-chunk tokens into a KV cache,
no LM head over the sequence) plus the LM head on the last position, as before the first generated token.
`--attention sparse` runs `mtrain eval --attention sparse`'s prefill instead: the whole prompt in one
forward through mtrain's attention hook (Triton kernels on CUDA), with AttentionConfig's default settings
and any --sparse-set overrides; each length records the plans' mean recall and density.
One warm-up prefill at the first length comes first; each length is timed --repeats times (median
reported). On CUDA, peak memory is `torch.cuda.max_memory_allocated` per length, next to the weights and
the KV cache it must hold, so an O(S²) term would stand out; on CPU it is the process's peak RSS so far.

    .venv/bin/python bench/bench_eval_prefill.py                           # on a GPU: 4K..128K, 36 layers
    .venv/bin/python bench/bench_eval_prefill.py --attention sparse --out bench/results/eval_prefill_sparse_cuda.json
    .venv/bin/python bench/bench_eval_prefill.py --layers 2 --hidden-size 64 --intermediate-size 128 \\
        --heads 4 --kv-heads 2 --vocab-size 512 --lengths 256,1k --out /tmp/prefill.json   # CPU smoke run
    (add --attention sparse --sparse-set block_size=16 --sparse-set dense_below=0 for the sparse path on CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

from mtrain_cli.attention import ATTENTION_NAME
from mtrain_cli.errors import UserError
from mtrain_cli.eval import Runner, attention_routing, check_attention, sparse_request
from mtrain_cli.lengths import parse_lengths

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GIB = 2**30


def qwen25_3b_config(args: argparse.Namespace) -> Qwen2Config:
    """Qwen2.5-3B's published shape (tied embeddings, RoPE θ = 1e6); every size is a flag."""
    return Qwen2Config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(131072, max(args.lengths)),
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        use_cache=True,
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux reports KiB


def prefill_once(runner: Runner, ids: list[int]) -> tuple[float, int]:
    """(wall seconds, argmax token) of prefill + LM head on the last position."""
    synchronize(runner.device)
    start = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache(config=runner.model.config)
        token = int(runner.head(runner.prefill(ids, cache))[0, -1].argmax())
    synchronize(runner.device)
    return time.perf_counter() - start, token


def kv_bytes_per_token(config: Qwen2Config, dtype: torch.dtype) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize


def measure(
    runner: Runner, config: Qwen2Config, args: argparse.Namespace, dtype: torch.dtype, weights_gib: float
) -> list[dict[str, Any]]:
    """One warm-up prefill, then each length --repeats times. Sparse: each case gets the mean recall and
    density of its own prefills' plans (recall None below dense_below: nothing is probed there)."""
    device = runner.device
    generator = torch.Generator().manual_seed(0)
    prefill_once(runner, torch.randint(0, config.vocab_size, (min(args.lengths),), generator=generator).tolist())
    cases: list[dict[str, Any]] = []
    for length in args.lengths:
        ids = torch.randint(0, config.vocab_size, (length,), generator=generator).tolist()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            seconds = [prefill_once(runner, ids)[0] for _ in range(args.repeats)]
        except torch.OutOfMemoryError:
            cases.append({"length": length, "oom": True})
            print(f"{length:>7}: out of memory", flush=True)
            break
        median = statistics.median(seconds)
        kv_gib = kv_bytes_per_token(config, dtype) * length / GIB
        case = {
            "length": length,
            "prefill_s": round(median, 4),
            "tokens_per_s": round(length / median),
            "all_s": [round(s, 4) for s in seconds],
            "peak_memory_gib": round(peak_gib(device), 3),
            "kv_cache_gib": round(kv_gib, 3),
        }
        plans = ""
        if runner.sparse is not None:
            mine = runner.sparse.prefills[-args.repeats :]
            recall = round(statistics.mean(p.recall for p in mine), 4) if mine[0].probed else None
            case |= {"sparse_recall": recall, "sparse_density": round(statistics.mean(p.density for p in mine), 4)}
            plans = f", recall {'-' if recall is None else f'{recall:.3f}'}, density {case['sparse_density']:.3f}"
        cases.append(case)
        print(
            f"{length:>7}: prefill {median:8.3f} s ({length / median:,.0f} tokens/s), peak memory "
            f"{case['peak_memory_gib']:.2f} GiB (weights {weights_gib:.2f} + KV cache {kv_gib:.2f}){plans}",
            flush=True,
        )
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=parse_lengths, default=parse_lengths("4k,16k,32k,64k,128k"))
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=4096,
        help="tokens per prefill chunk (the runner's; dense only: sparse prefills in one chunk)",
    )
    parser.add_argument("--attention", default="dense", help="dense (SDPA, chunked) or sparse (one chunk, the hook)")
    parser.add_argument(
        "--sparse-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --attention sparse: override one setting of the recipe's attention section",
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON path (default bench/results/eval_prefill_<device>.json)"
    )
    args = parser.parse_args()
    try:
        check_attention(args.attention)
        if args.sparse_set and args.attention != "sparse":
            raise UserError(f"--sparse-set {args.sparse_set[0]}: sparse settings need --attention sparse")
        request = sparse_request(None, args.sparse_set) if args.attention == "sparse" else None
    except UserError as exc:
        parser.error(str(exc))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = args.out or RESULTS_DIR / f"eval_prefill_{device.type}.json"

    config = qwen25_3b_config(args)
    with attention_routing(request) as tracker:
        torch.manual_seed(0)
        with device:  # initialise on the device: a 3B model's random init on CPU would take minutes
            model = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation="sdpa" if tracker is None else ATTENTION_NAME
            ).eval()
        weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
        # The runner reads EOS ids and decodes with its tokenizer; prefill needs neither.
        runner = Runner(model, SimpleNamespace(eos_token_id=None), prefill_chunk=args.prefill_chunk, sparse=tracker)
        print(
            f"{device} {dtype}, {args.attention} attention: {args.layers} layers, "
            f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters ({weights_gib:.2f} GiB), "
            f"KV cache {kv_bytes_per_token(config, dtype) / 1024:.0f} KiB/token",
            flush=True,
        )
        cases = measure(runner, config, args, dtype, weights_gib)
        sparse = tracker.report() if tracker else None

    result = {
        "benchmark": "mtrain eval prefill (Runner.prefill + last-position LM head), random init, batch 1",
        "command": " ".join([os.path.basename(sys.executable), "bench/bench_eval_prefill.py", *sys.argv[1:]]),
        "attention": args.attention,
        "prefill_chunk": "whole prompt" if sparse else args.prefill_chunk,
        "sparse": {
            "settings": sparse["settings"],
            "settings_source": sparse["settings_source"],
            "attention_calls": sparse["attention_calls"],
        }
        if sparse
        else None,
        "repeats": args.repeats,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "peak_memory_kind": "torch.cuda.max_memory_allocated per length"
        if device.type == "cuda"
        else "process peak RSS so far (cumulative over lengths)",
        "model": {
            "layers": args.layers,
            "hidden_size": args.hidden_size,
            "intermediate_size": args.intermediate_size,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab_size": args.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters()),
            "weights_gib": round(weights_gib, 3),
        },
        "machine": {"platform": platform.platform(), "num_cpus": os.cpu_count()},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
        },
        "cases": cases,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
