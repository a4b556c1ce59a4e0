"""The first sparse steps on a fresh machine, as a user meets them: `mtrain extend` of a small fresh model at 64K and
128K, dense and sparse, each run with TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR pointed at empty directories.

Each case is one whole command, timed from its start to its exit, and 30 steps (`metrics.jsonl`: every step's time
and what it built). Sparse runs twice: as shipped (the kernels built ahead in worker processes while data and model
load, attention/sparse/prebuild.py) and with that turned off (MTRAIN_PREBUILD_WORKERS=0), the behaviour before it.
The crossover is off so that sparse layers run sparse on a random model. The issue's floor: the first five sparse
steps cost at most 5 s more than the first five dense ones, and a 30-step sparse run is never slower end to end.

    OUT=/tmp/out bash bench/cold_start.sh            # one H200: about 6 minutes, under 9 (--budget)
    python -m bench.cold_start --out /tmp/o --smoke  # CPU: the same flow at 2K / 4K, 6 steps (checks the script)
Writes $OUT/cold_start.json and $OUT/cold_start.md (rewritten after every case) and each case's log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

FIRST = 5  # the first steps the floor compares
MODEL = [  # ~19M parameters with the shipped 512-token tokenizer: the extension experiment's width, 6 layers
    "model.hidden_size=512",
    "model.intermediate_size=1536",
    "model.num_hidden_layers=6",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.max_position_embeddings=4096",
]
SMOKE_MODEL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2"]
SMOKE_MODEL += ["model.num_attention_heads=4", "model.num_key_value_heads=2", "model.max_position_embeddings=512"]
SMOKE_ATTENTION = ["attention.block_size=32", "attention.dense_below=512", "attention.last_q=32"]
SMOKE_ATTENTION += ["attention.local_window=64", "attention.cap=256"]
CASES = ("dense", "sparse", "sparse-no-prebuild")


def case_env(case: str, caches: Path) -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env |= {"TRITON_CACHE_DIR": str(caches / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    if case == "sparse-no-prebuild":
        env["MTRAIN_PREBUILD_WORKERS"] = "0"
    return env


def command(case: str, length: int, data: Path, runs: Path, steps: int, smoke: bool) -> list[str]:
    sets = [
        *(SMOKE_MODEL + SMOKE_ATTENTION if smoke else MODEL),
        f"data.seq_len={length}",
        f"context.factor={length // (512 if smoke else 4096)}",
        "data.num_val_rows=0",
        f"train.num_steps={steps}",
        "train.warmup_steps=0",
        f"train.eval_every={steps}",
        f"checkpoint.every={steps}",
        "checkpoint.export=false",
        "logging.every=1",
        f"attention.mode={case.split('-')[0]}",
        "attention.crossover=false",
        "run.name=run",
    ]
    return [sys.executable, "-m", "mtrain_cli", "extend", "--data", str(data), "--output-dir", str(runs)] + [
        arg for item in sets for arg in ("--set", item)
    ]


def run_case(case: str, length: int, data: Path, work: Path, steps: int, smoke: bool, timeout_s: float) -> dict:
    name = f"{case}-{length // 1024}k"
    caches, runs = work / name / "caches", work / name / "runs"
    shutil.rmtree(work / name, ignore_errors=True)
    caches.mkdir(parents=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command(case, length, data, runs, steps, smoke),
            env=case_env(case, caches),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        code, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, log = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
    wall = time.perf_counter() - started
    (work / f"{name}.log").write_text(log if isinstance(log, str) else log.decode(errors="replace"))
    run_dir = next(runs.glob("run-*"), None) if runs.exists() else None
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()] if run_dir else []
    steps_ = [m for m in metrics if "loss" in m]
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if run_dir and (run_dir / "summary.json").exists() else {}
    )
    prebuild = next((line for line in log.splitlines() if line.startswith("sparse kernels:")), None)
    return {
        "case": case,
        "length": length,
        "exit_code": code,
        "command_s": round(wall, 2),
        "training_s": summary.get("wall_s"),
        "step_s": [round(m["step_s"], 3) for m in steps_],
        "kernels_built": [m.get("kernels_built", 0) for m in steps_],
        "plans_captured": [m.get("plans_captured", 0) for m in steps_],
        "prebuild": prebuild,
        "warnings": summary.get("warnings", []),
        "log_tail": log.splitlines()[-3:] if code != 0 else [],
    }


def verdicts(rows: list[dict]) -> list[dict]:
    """Per length and sparse case: its first FIRST steps minus dense's, and whole command, against the floor."""
    out = []
    for length in sorted({r["length"] for r in rows}):
        dense = next((r for r in rows if r["length"] == length and r["case"] == "dense"), None)
        for row in (r for r in rows if r["length"] == length and r["case"] != "dense"):
            if dense is None or len(dense["step_s"]) < FIRST or len(row["step_s"]) < FIRST:
                out.append({"length": length, "case": row["case"], "verdict": "incomplete"})
                continue
            first = sum(row["step_s"][:FIRST]) - sum(dense["step_s"][:FIRST])
            whole = row["command_s"] - dense["command_s"]
            out.append(
                {
                    "length": length,
                    "case": row["case"],
                    "first_steps_extra_s": round(first, 2),
                    "command_extra_s": round(whole, 2),
                    "floor_met": first <= 5.0 and whole <= 0.0,
                }
            )
    return out


def markdown(result: dict) -> str:
    lines = [
        f"# The first sparse steps on a fresh machine: {result['device']}",
        "",
        f"{result['date']} · torch {result['torch']}, triton {result['triton']} · `{result['command']}` · "
        f"{result['wall_s']:.0f} s in all. Each case a fresh `mtrain extend` (empty Triton and Inductor caches), "
        f"{result['steps']} steps of one row, a fresh Qwen2 ({', '.join(result['model'])}), crossover off. "
        "`sparse-no-prebuild`: MTRAIN_PREBUILD_WORKERS=0, kernels built in the first step as before.",
        "",
        f"| case | length | command s | training s | first {FIRST} steps s | steps 1, 2, 3 s | later step s "
        "(median) | kernels built (steps 1-3) | prebuild |",
        "|---|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for r in result["rows"]:
        s = r["step_s"]
        if r["exit_code"] != 0 or len(s) < FIRST:
            lines.append(
                f"| {r['case']} | {r['length'] // 1024}K | failed ({r['exit_code']}): {' / '.join(r['log_tail'])} |"
            )
            continue
        later = sorted(s[FIRST:])[len(s[FIRST:]) // 2] if len(s) > FIRST else float("nan")
        first3 = ", ".join(f"{x:.2f}" for x in s[:3])
        lines.append(
            f"| {r['case']} | {r['length'] // 1024}K | {r['command_s']:.1f} | {r['training_s']} | "
            f"{sum(s[:FIRST]):.2f} | {first3} | {later:.3f} | {r['kernels_built'][:3]} | {r['prebuild'] or '-'} |"
        )
    lines += [
        "",
        "| length | sparse case | first 5 steps − dense s | whole command − dense s | floor met |",
        "|---:|---|---:|---:|---|",
    ]
    for v in result["verdicts"]:
        if v.get("verdict") == "incomplete":
            lines.append(f"| {v['length'] // 1024}K | {v['case']} | – | – | incomplete |")
        else:
            lines.append(
                f"| {v['length'] // 1024}K | {v['case']} | {v['first_steps_extra_s']:+.2f} | "
                f"{v['command_extra_s']:+.2f} | {'yes' if v['floor_met'] else 'no'} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", default="65536,131072")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--budget", type=float, default=530.0, help="seconds for every case; later ones are skipped")
    parser.add_argument("--work", type=Path, default=Path("/tmp/cold_start"))
    parser.add_argument("--smoke", action="store_true", help="CPU: 2K and 4K, 6 steps, a tiny model")
    args = parser.parse_args()
    lengths = [2048, 4096] if args.smoke else [int(x) for x in args.lengths.split(",")]
    steps = FIRST + 1 if args.smoke else args.steps
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    data = args.work / "docs.jsonl"
    chars = 4 * max(lengths)  # ~1.2 rows of the longest length per document (2.9 characters a token)
    subprocess.run(
        [sys.executable, "bench/make_long_docs.py", "--chars", str(chars), "--num-docs", "6", "--out", str(data)],
        check=True,
    )
    import torch
    import triton

    result = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": date.today().isoformat(),
        "command": "OUT=... bash bench/cold_start.sh" + (" --smoke" if args.smoke else ""),
        "steps": steps,
        "model": [item.removeprefix("model.") for item in (SMOKE_MODEL if args.smoke else MODEL)],
        "rows": [],
        "verdicts": [],
        "wall_s": 0.0,
        "skipped": [],
    }
    for length in lengths:  # the dense twin first: its first steps are the reference
        for case in CASES:
            left = args.budget - (time.perf_counter() - started)
            if left < 60 and not args.smoke:
                result["skipped"].append(f"{case} at {length}: {left:.0f} s of the budget left")
                continue
            result["rows"].append(run_case(case, length, data, args.work, steps, args.smoke, timeout_s=max(60, left)))
            result["verdicts"] = verdicts(result["rows"])
            result["wall_s"] = time.perf_counter() - started
            (args.out / "cold_start.json").write_text(json.dumps(result, indent=1))
            (args.out / "cold_start.md").write_text(markdown(result))
            row = result["rows"][-1]
            print(
                f"{case} at {length}: exit {row['exit_code']}, {row['command_s']} s, steps {row['step_s'][:3]}",
                flush=True,
            )
    for log in args.work.glob("*.log"):
        shutil.copy(log, args.out / f"cold_start_{log.name}")
    print(markdown(result))


if __name__ == "__main__":
    main()
