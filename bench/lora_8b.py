"""LoRA on one GPU at 64K, the Llama-3.1-8B shape: tokens/s sparse and dense, peak memory beside the dry run's plan.

The shipped recipe `llama3.1-8b-64k-lora` as a user runs it (`python3 -m mtrain_cli extend`), on a fresh model of
exactly the published shape, random init, the frozen base in bf16 (LoRA r16 on every projection + embeddings and
norms, activation checkpointing, compile): the 128,256-token vocabulary is the shipped 512-token tokenizer with
127,744 reserved tokens added (what the text is tokenised with is unchanged; the embedding and LM head have their
real size), and every row is one 65,536-token document of the shipped stories. Tokens/s and step time from
metrics.jsonl over every step but the first (Triton autotuning, torch.compile, first plans); the peak is the
largest of every step's `peak_mem_gib`; the prediction is `--dry-run`'s memory estimate of the same config.

Floors (issue 61): peak <= 70 GiB (it fits an 80 GB card), sparse >= 1.5x dense tokens/s.

Cases (CASES): the recipe sparse and dense; `sparse-kernels`, the recipe's flex plans with the crossover rule off
(what the sparse kernels give at the density the plans chose), and `-lq512` with the quality study's 512 probe
queries a document (what its larger probe buffer costs the peak); `sparse-budget`, fixed counts (1,024 verticals and
1,024 slashes a head), and `-v256`, `-v64` with fewer verticals: a vertical keeps its whole 64-key block, so on
near-uniform attention 1,024 scattered verticals already cover ~60% of the blocks. Every case starts from the
same weights (same seed) on the same first batch, so a sparse case's step-1 loss minus dense's is what its
attention costs the loss on this model (random weights: the cost on a trained model is what the dense check and
the quality study measure).

    PYTHONPATH=src python3 -m bench.lora_8b --out $OUT --cases dense,sparse-budget --steps 4  # a case: ~2 min
    PYTHONPATH=src python3 -m bench.lora_8b --out $OUT --cases sparse --merge lora_8b_64k_h200.json
(from the repository root; the device lacks `datasets` and `peft`: carry them as wheels, bench/run_train_gpu.sh.)
`--replan RESULTS_JSON` (no GPU) redoes each case's plan with the current `--dry-run` beside the measured peaks.
Writes $OUT/lora_8b_64k_<gpu>.json and .md (rewritten after every case; --merge: an earlier call's cases kept) and
each case's output as it runs, every line after its seconds since the start, $OUT/lora_8b_<case>.log.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

from bench.train_speed import corpus

REPO = Path(__file__).resolve().parents[1]

RECIPE = "llama3.1-8b-64k-lora"
SEQ_LEN = 65536
VOCAB = 128256  # Llama 3.1's
FLOOR_PEAK_GIB, FLOOR_SPEEDUP = 70.0, 1.5
CASES = {  # name: (attention.mode, the case's own overrides)
    "sparse": ("sparse", []),
    "dense": ("dense", []),
    "sparse-kernels": ("sparse", ["attention.crossover=false"]),
    "sparse-kernels-lq512": (
        "sparse",
        ["attention.crossover=false", "attention.last_q=512", "attention.max_probe_rows=2048"],
    ),
    "sparse-budget": ("sparse", ["attention.pattern=budget"]),
    "sparse-budget-v256": ("sparse", ["attention.pattern=budget", "attention.num_vertical=256"]),
    "sparse-budget-v64": ("sparse", ["attention.pattern=budget", "attention.num_vertical=64"]),
    "sparse-budget-v64-s64": (
        "sparse",
        ["attention.pattern=budget", "attention.num_vertical=64", "attention.num_slash=64"],
    ),
}


def big_tokenizer(work: Path) -> Path:
    """The shipped tokenizer with its BPE vocabulary padded to Llama 3.1's 128,256 entries: a fresh model gets the
    real embedding and LM head. The padding entries are plain vocabulary no merge produces, so text tokenises as
    with the shipped tokenizer and as fast (127,744 added tokens instead made tokenising 64K rows take minutes)."""
    path = work / "tokenizer_128k"
    if (path / "tokenizer.json").is_file():
        return path
    shutil.copytree(REPO / "data" / "tokenizer", path, dirs_exist_ok=True)
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    taken = set(vocab.values()) | {token["id"] for token in spec["added_tokens"]}
    free = (i for i in range(VOCAB) if i not in taken)
    vocab.update({f"<|reserved_{i}|>": i for i in itertools.islice(free, VOCAB - len(taken))})
    (path / "tokenizer.json").write_text(json.dumps(spec))
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(path))) == VOCAB
    return path


def overrides(mode: str, steps: int, tokenizer: Path) -> list[str]:
    return [
        f"model.tokenizer={tokenizer}",
        f"attention.mode={mode}",
        f"train.num_steps={steps}",
        "train.grad_accum=1",
        "train.warmup_steps=1",
        "train.eval_every=100000",
        "data.num_val_rows=0",
        "data.num_proc=8",
        "checkpoint.every=100000",
        "checkpoint.export=false",
        "logging.every=1",
    ]


def predicted_gib(sets: list[str]) -> dict:
    """--dry-run's plan of the same config, in this process (no GPU memory)."""
    from mtrain_cli.config import load_config
    from mtrain_cli.dry_run import make_dry_run

    plan = make_dry_run(load_config(RECIPE, sets))
    return {
        "total_gib": round(plan.memory.total_gib, 2),
        "states_gib": round(plan.memory.weights_grads_optimizer_gib, 2),
        "activations_gib": round(plan.memory.activations_gib, 2),
        "logits_chunk_gib": round(plan.memory.logits_chunk_gib, 2),
        "num_params": plan.num_params,
        "num_trainable_params": plan.num_trainable_params,
    }


def copy_timed(lines, log_file, t0: float) -> None:
    """Each line of the run's output into the log as it comes, after the seconds since the case started: a case
    killed at its timeout still shows where its time went."""
    for line in lines:
        log_file.write(f"{time.perf_counter() - t0:7.1f}s  {line}")
        log_file.flush()


def run_case(case: str, work: Path, steps: int, timeout: float, log: Path, extra: list[str]) -> dict:
    """`log` gets the run's output as it comes: a device call cut short still brings back how far the case got."""
    tokenizer = big_tokenizer(work)
    mode, case_sets = CASES[case]
    sets = [*overrides(mode, steps, tokenizer), *case_sets, *extra]
    out_dir = work / "runs" / case
    command = [
        sys.executable, "-m", "mtrain_cli", "extend", "--recipe", RECIPE,
        "--data", str(corpus(f"single-{SEQ_LEN}", work)), "--output-dir", str(out_dir),
        *[arg for item in [*sets, f"run.name=lora8b-{case}"] for arg in ("--set", item)],
    ]  # fmt: skip
    row = {"case": case, "command": " ".join(command), "plan": predicted_gib(sets)}
    t0 = time.perf_counter()
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env={**os.environ, "WANDB_MODE": "disabled", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        copier = threading.Thread(target=copy_timed, args=(process.stdout, log_file, t0), daemon=True)
        copier.start()
        try:
            rc = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            rc = 124
        copier.join(timeout=10)
    tail = log.read_text(errors="replace")[-3000:]
    row.update(rc=rc, wall_s=round(time.perf_counter() - t0, 1), log=log.name)
    runs = sorted(out_dir.glob(f"lora8b-{case}-*")) if out_dir.exists() else []
    metrics_file = runs[-1] / "metrics.jsonl" if runs else None
    metrics = (
        [json.loads(line) for line in metrics_file.read_text().splitlines() if '"loss"' in line]
        if metrics_file is not None and metrics_file.exists()
        else []
    )
    if len(metrics) < 2:
        return {**row, "error": tail}
    timed = metrics[1:]
    seconds = sum(m["step_s"] for m in timed)
    summary = json.loads((runs[-1] / "summary.json").read_text()) if (runs[-1] / "summary.json").exists() else {}
    row.update(
        steps=len(metrics),
        tokens_per_s=round(sum(m["tokens"] for m in timed) / seconds, 1),
        step_s=[round(m["step_s"], 3) for m in metrics],
        peak_mem_gib=max(m["peak_mem_gib"] for m in metrics),
        losses=[round(m["loss"], 4) for m in metrics],
        sparse_density=[m.get("sparse_density") for m in metrics],
        sparse_recall=[m.get("sparse_recall") for m in metrics],
        layers=[m.get("layers") for m in metrics],
        num_params=summary.get("num_params"),
        num_trainable_params=summary.get("num_trainable_params"),
        attention_layers=summary.get("attention_layers"),
        warnings=summary.get("warnings"),
    )
    if rc != 0:
        row["error"] = tail
    return row


def markdown(result: dict) -> str:
    lines = [
        f"{result['device']} · torch {result['torch']} · {result['date']} · recipe {RECIPE}: Llama-3.1-8B shape "
        f"(random init, vocabulary 128,256), LoRA r16 + embeddings and norms, bf16 frozen base, 64K rows, activation "
        f"checkpointing, compile",
        "",
        f"command (the last call's): `{result['command']}`; each case's `mtrain extend` command is in the JSON",
        "",
        "| case | tokens/s | step s (median) | peak GiB | dry run GiB | peak / plan | trainable | note |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    by_case = {}
    for r in result["cases"]:
        plan = r["plan"]["total_gib"]
        if "tokens_per_s" not in r:
            lines.append(f"| {r['case']} | – | – | – | {plan:.1f} | – | – | failed (rc {r['rc']}) |")
            continue
        by_case[r["case"]] = r
        steps = sorted(r["step_s"][1:])
        note = f"{r['steps']} steps, first not timed"
        if r["rc"] != 0:  # e.g. 124: cut at its timeout after its last step, before the summary
            note += f"; exit {r['rc']} after step {r['steps']}"
        trainable = f"{r['num_trainable_params']:,}" if r["num_trainable_params"] else "–"
        lines.append(
            f"| {r['case']} | {r['tokens_per_s']:,.0f} | {steps[len(steps) // 2]:.2f} | {r['peak_mem_gib']:.1f} | "
            f"{plan:.1f} | {r['peak_mem_gib'] / plan:.2f} | {trainable} | {note} |"
        )
    lines.append("")
    for name, r in by_case.items():
        verdict = "meets" if r["peak_mem_gib"] <= FLOOR_PEAK_GIB else "misses"
        lines.append(f"- {name}: peak {r['peak_mem_gib']:.1f} GiB {verdict} the floor of {FLOOR_PEAK_GIB:.0f} GiB")
        routes = {route: n for route, n in (r.get("attention_layers") or {}).items() if n}
        if routes:  # a sparse run's layer calls: what ran sparse, what the crossover or recall sent dense
            lines.append(f"  - layer calls by route: {', '.join(f'{route} {n}' for route, n in routes.items())}")
    dense = by_case.get("dense")
    if dense is not None:
        speedups = {}
        for name, r in by_case.items():
            if name == "dense":
                continue
            speedup = r["tokens_per_s"] / dense["tokens_per_s"]
            speedups[name] = round(speedup, 3)
            verdict = "meets" if speedup >= FLOOR_SPEEDUP else "misses"
            gap = r["losses"][0] - dense["losses"][0]
            densities = [d for d in r["sparse_density"] if d is not None]
            recalls = [d for d in r.get("sparse_recall", []) if d is not None]
            density = f", planned density {sum(densities) / len(densities):.2f}" if densities else ""
            density += f", probe recall {sum(recalls) / len(recalls):.3f}" if recalls else ""
            lines.append(
                f"- {name} / dense tokens/s: {speedup:.2f}x, {verdict} the floor of {FLOOR_SPEEDUP}x; step-1 loss "
                f"{r['losses'][0]:.4f} against dense's {dense['losses'][0]:.4f} (gap {gap:+.4f} nats, same weights "
                f"and batch){density}"
            )
        result["speedups"] = speedups
    return "\n".join(lines)


def replan(path: Path, work: Path) -> None:
    """Each case's dry-run plan again with today's code, from the overrides its command recorded (CPU only): the
    measured peaks stay, the plan beside them is current. Rewrites the JSON and its .md."""
    result = json.loads(path.read_text())
    big_tokenizer(work)  # the cases' model.tokenizer (the default --work is where the device built it)
    for row in result["cases"]:
        words = row["command"].split()
        sets = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
        row["plan"] = predicted_gib(sets)
    result["replanned"] = date.today().isoformat()
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown(result) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default="sparse,dense", help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lora_8b"))
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds per case")
    parser.add_argument("--merge", type=Path, default=None, help="an earlier call's JSON: its cases are kept")
    parser.add_argument("--set", action="append", default=[], help="a further override of every case (recorded)")
    parser.add_argument("--replan", type=Path, default=None, help="a results JSON: its plans redone here (no GPU)")
    args = parser.parse_args()
    if args.replan is not None:
        return replan(args.replan, args.work)
    cases = args.cases.split(",")
    if unknown := [case for case in cases if case not in CASES]:
        parser.error(f"--cases {','.join(unknown)}: not a case; the cases are {', '.join(CASES)}")
    import torch

    gpu = "h200" if "H200" in torch.cuda.get_device_name() else "h100"
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": date.today().isoformat(),
        "command": " ".join(sys.argv),
        "floors": {"peak_gib": FLOOR_PEAK_GIB, "sparse_over_dense": FLOOR_SPEEDUP},
        "cases": [],
    }
    if args.merge is not None and args.merge.is_file():
        result["cases"] = [c for c in json.loads(args.merge.read_text())["cases"] if c["case"] not in cases]
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        row = run_case(case, args.work, args.steps, args.timeout, args.out / f"lora_8b_{case}.log", args.set)
        result["cases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("command", "error")}), flush=True)
        if "error" in row:
            print(row["error"][-1500:], flush=True)
        text = markdown(result)
        (args.out / f"lora_8b_64k_{gpu}.json").write_text(json.dumps(result, indent=2))
        (args.out / f"lora_8b_64k_{gpu}.md").write_text(text + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
