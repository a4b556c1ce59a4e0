"""`mtrain extend` on every GPU of one machine, through the CLI under torchrun: one sequence per step over a cp
ring of all the GPUs, random init of a recipe's model shape (the shipped 512-token tokenizer, so the embedding and
LM head are small), long documents cut into rows (bench/make_long_docs.py).

Cases (`--cases`, comma-separated): {qwen2.5-3b,llama3.1-8b}-{256k,512k}-{sparse,dense}. Sparse runs the shipped
sparse settings on the stripe layout; dense runs the dense ring (parallel.layout auto).
From each run's metrics.jsonl: the first (compiled, autotuned) step apart, then over the later steps the median
step time, tokens/s per GPU, MFU as mtrain counts it (the attention pairs computed) and as torchtitan counts it
(6·N + 12·L·H·D·S per token), peak memory, the ring's work imbalance, and the sparse plans' density and recall.

    python3 -m bench.train_multi_gpu --out $OUT --cases qwen2.5-3b-256k-sparse --steps 20
Writes $OUT/train_<n>gpu.json and .md (rewritten after every case); logs and runs under --work.

A case longer than one device call (20 steps of the 512K or 8B shapes) runs in legs. At --timeout the launch gets
SIGTERM, as from a scheduler: `mtrain extend --nproc` hands it to the ranks, which finish their step and save a
checkpoint (--checkpoint-every also saves on the way).
The same command in the next call on the same machine (--work on its /tmp, kept while it stays warm) resumes the
case from its checkpoint; the first step of every leg is reported apart. The launch is killed STOP_GRACE_S after
the signal, so --timeout + STOP_GRACE_S must fit the call. The 8B shape's checkpoint (~96 GB) took over 4
minutes to write to the disk of a 4 x H100 machine: put --work in memory (/dev/shm, where it holds ~100 GB more
than the ranks' ~130 GB of host memory at start-up) or its legs lose their checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"qwen2.5-3b": "qwen2.5-3b-512k", "llama3.1-8b": "llama3.1-8b-512k"}
LENGTHS = {"256k": 262144, "512k": 524288}
STOP_GRACE_S = 240  # for the step in progress and a checkpoint of the 8B shape's weights and AdamW state


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def latest_run(case_dir: Path) -> Path | None:
    runs = sorted(p.parent for p in case_dir.glob("*/config.yaml"))
    return runs[-1] if runs else None


def launch(cmd: list[str], log: Path, timeout: float) -> int | str:
    """Run a launch to its end or, at `timeout`, stop it as a scheduler would: SIGTERM (the ranks finish their
    step and save a checkpoint), then the process group killed if it is still there a grace later."""
    with log.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
            return "stopped"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "killed"


def run_case(name: str, num_gpus: int, steps: int, work: Path, timeout: float, checkpoint_every: int) -> dict:
    shape, length, mode = name.rsplit("-", 2)
    seq_len = LENGTHS[length]
    data = work / f"long_{length}.jsonl"
    if not data.exists():  # about 3.5 characters a token; rows are cut from documents of one row each
        subprocess.run(
            [sys.executable, str(REPO / "bench/make_long_docs.py"), "--chars", str(seq_len * 7 // 2)]
            + ["--num-docs", str(steps + 2), "--out", str(data)],
            check=True,
        )
    case_dir = work / name
    earlier = latest_run(case_dir)
    launcher = [sys.executable, "-m", "mtrain_cli", "extend", "--nproc", str(num_gpus)]
    finished = earlier is not None and (earlier / "summary.json").exists()  # written when a run reaches its end
    if finished:
        cmd = []
    elif earlier is not None and any(earlier.glob("checkpoints/*")):  # an earlier call's leg: go on from it
        cmd = [*launcher, "--resume", str(earlier)]
    else:
        cmd = [*launcher, "--recipe", RECIPES[shape], "--data", str(data), "--output-dir", str(case_dir)]
        sets = [
            f"run.name={name}",
            f"data.seq_len={seq_len}",
            "data.num_val_rows=0",
            f"parallel.cp={num_gpus}",
            "parallel.dp=1",
            f"attention.mode={mode}",
            *(["parallel.layout=stripe"] if mode == "sparse" else []),
            f"train.num_steps={steps}",
            "train.warmup_steps=1",
            f"checkpoint.every={checkpoint_every}",
            "checkpoint.keep_last=1",  # a leg resumes from the newest; an 8B one is ~96 GB
            "checkpoint.export=false",
            "logging.every=1",
        ]
        cmd += [arg for item in sets for arg in ("--set", item)]
    start = time.time()
    rc = launch(cmd, work / f"{name}.log", timeout) if cmd else "finished in an earlier call"
    row = {"case": name, "command": " ".join(cmd[1:]), "rc": rc, "wall_s": round(time.time() - start, 1)}
    run_dir = latest_run(case_dir)
    metrics = run_dir / "metrics.jsonl" if run_dir else None
    steps_done = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics and metrics.exists() else []
    steps_done = [s for s in steps_done if "loss" in s]
    row["steps"] = len(steps_done)
    if not steps_done:
        row["log_tail"] = (work / f"{name}.log").read_text()[-1500:]
        return row
    # the first step of each leg compiles, autotunes and captures the plan's graph
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    first_steps = {steps_done[0]["step"], *(step + 1 for step in summary.get("resumed_at", []))}
    later = [s for s in steps_done if s["step"] not in first_steps] or steps_done

    def median(key: str) -> float | None:
        values = [s[key] for s in later if s.get(key) is not None]
        return statistics.median(values) if values else None

    row.update(
        legs=1 + len(summary.get("resumed_at", [])),
        first_step_s=steps_done[0]["step_s"],
        resumed_first_step_s=[s["step_s"] for s in steps_done[1:] if s["step"] in first_steps],
        step_s=median("step_s"),
        tokens_per_s_per_gpu=median("tokens_per_s"),
        tokens_per_s_per_gpu_all_steps=sum(s["tokens"] for s in later) / sum(s["step_s"] for s in later) / num_gpus,
        mfu=median("mfu"),
        mfu_torchtitan=median("mfu_torchtitan"),
        peak_mem_gib=max(s.get("peak_mem_gib") or 0 for s in steps_done),
        ring_imbalance=median("ring_imbalance"),
        sparse_density=median("sparse_density"),
        sparse_recall=median("sparse_recall"),
        loss_first_last=[steps_done[0]["loss"], steps_done[-1]["loss"]],
    )
    return row


def markdown(result: dict) -> str:
    head = f"{result['device']} × {result['num_gpus']} · torch {result['torch']} · triton {result['triton']}"
    head += f" · {result['date']}"
    lines = [
        head,
        "",
        "| case | steps | first step s | step s (median) | tokens/s/GPU | MFU (mtrain) | MFU (torchtitan's count) "
        "| peak GiB | ring work imbalance | density / recall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def legs(row: dict) -> str:  # a case run over several calls: the first steps of the later legs
        later = ", ".join(f"{s:.1f}" for s in row.get("resumed_first_step_s", []))
        return f" in {row['legs']} legs (later legs' first steps: {later} s)" if row.get("legs", 1) > 1 else ""

    def f(value, fmt):
        return "–" if value is None else format(value, fmt)

    for r in result["rows"]:
        if "first_step_s" not in r:
            lines.append(f"| {r['case']} | failed ({r['rc']}) | | | | | | | | |")
            continue
        dr = "–" if r["sparse_density"] is None else f"{r['sparse_density']:.3f} / {r['sparse_recall']:.3f}"
        lines.append(
            f"| {r['case']} | {r['steps']}{legs(r)} | {r['first_step_s']:.1f} | {r['step_s']:.2f} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {f(r['mfu'], '.1%')} | {f(r['mfu_torchtitan'], '.1%')} | "
            f"{r['peak_mem_gib']:.1f} | {f(r['ring_imbalance'], '.3f')} | {dr} |"
        )
    done = {r["case"]: r for r in result["rows"] if "first_step_s" in r}
    for name, sparse in done.items():
        if name.endswith("-sparse") and (dense := done.get(name.removesuffix("sparse") + "dense")):
            lines.append(
                f"\n{name.removesuffix('-sparse')}: sparse/dense tokens/s per GPU "
                f"{sparse['tokens_per_s_per_gpu'] / dense['tokens_per_s_per_gpu']:.2f}x by the median step, "
                f"{sparse['tokens_per_s_per_gpu_all_steps'] / dense['tokens_per_s_per_gpu_all_steps']:.2f}x over "
                "every step after the first"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--work", type=Path, default=Path("/tmp/train_multi_gpu"))
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds per case, then SIGTERM")
    parser.add_argument(
        "--checkpoint-every", type=int, default=100000, help="steps; a case longer than a call goes on from it"
    )
    args = parser.parse_args()
    import torch
    import triton

    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    num_gpus = gpu_count()
    result = {
        "device": torch.cuda.get_device_name(0),
        "num_gpus": num_gpus,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": date.today().isoformat(),
        "rows": [],
    }
    for name in args.cases.split(","):
        result["rows"].append(run_case(name, num_gpus, args.steps, args.work, args.timeout, args.checkpoint_every))
        (args.out / f"train_{num_gpus}gpu.json").write_text(json.dumps(result, indent=1))
        (args.out / f"train_{num_gpus}gpu.md").write_text(markdown(result))
        print(markdown(result), flush=True)


if __name__ == "__main__":
    main()
