"""`mtrain extend` on every GPU of one machine, through the CLI under torchrun: one sequence per step over a cp
ring of all the GPUs, random init of a recipe's model shape (the shipped 512-token tokenizer, so the embedding and
LM head are small), long documents cut into rows (bench/make_long_docs.py).

Cases (`--cases`, comma-separated): {qwen2.5-3b,llama3.1-8b}-{256k,512k}-{sparse,dense}. Sparse runs the shipped
sparse settings on the stripe layout; dense runs the dense ring (parallel.layout auto).
From each run's metrics.jsonl: the first (compiled, autotuned) step apart, then over the later steps the median
step time, tokens/s per GPU, MFU as mtrain counts it (the attention pairs computed) and as torchtitan counts it
(6·N + 12·L·H·D·S per token), peak memory, the ring's work imbalance, and the sparse plans' density and recall.

    python3 -m bench.train_multi_gpu --out $OUT --cases qwen2.5-3b-256k-sparse --steps 20 --budget 560
Writes $OUT/train_<n>gpu.json and .md: a case's row as "running" before its launch, then its result, so a call
killed midway still returns them. $OUT/<case>.log is this call's launch log, written as the ranks print; the runs,
their checkpoints and the documents are under --work.

--budget is the seconds the whole command may take, counted from its start: the device call's limit must be above
it. The cases share it, in order. Every launch gets SIGTERM at the same time, STOP_GRACE_S + RESULTS_S before the
budget ends, as from a scheduler: `mtrain extend --nproc` hands it to the ranks, which finish their step and save
a checkpoint (--checkpoint-every also saves on the way); the launch is killed if it is still there STOP_GRACE_S
later. A case with less than MIN_LAUNCH_S left before that signal is skipped, with the reason.
A case longer than one device call runs in legs: the same command in the next call on the same machine (--work on
its /tmp, kept while it stays warm) resumes the case from its checkpoint; the first step of every leg is reported
apart. The 8B shape's checkpoint (~96 GB) took over 4 minutes to write to the disk of a 4 x H100 machine: put
--work in memory (/dev/shm, where it holds ~100 GB more than the ranks' ~130 GB of host memory at start-up) or its
legs lose their checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"qwen2.5-3b": "qwen2.5-3b-512k", "llama3.1-8b": "llama3.1-8b-512k"}
LENGTHS = {"256k": 262144, "512k": 524288}
# after SIGTERM: the step in progress (up to ~85 s, the 3B shape's dense 512K step) and the checkpoint (the 3B
# shape's ~33 GB at the ~330 MB/s measured on disk; the 8B shape's 80 GB took ~85 s to /dev/shm over 2 ranks)
STOP_GRACE_S = 240
RESULTS_S = 10  # after the launch ends or is killed: its metrics read, the results written
MIN_LAUNCH_S = 60  # a launch stopped sooner has not built its trainer


def device_info() -> dict:
    import torch
    import triton

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)",
        "num_gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def latest_run(case_dir: Path) -> Path | None:
    runs = sorted(p.parent for p in case_dir.glob("*/config.yaml"))
    return runs[-1] if runs else None


def launch(cmd: list[str], log: Path, stop_at: float) -> int | str:
    """Run a launch to its end or, at `stop_at` (time.monotonic()), stop it as a scheduler would: SIGTERM (the
    ranks finish their step and save a checkpoint), then the process group killed if it is still there
    STOP_GRACE_S later."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the log holds every line printed when the call is killed
    with log.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=max(stop_at - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
            return "stopped"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "killed"


def extend_command(
    name: str, num_gpus: int, steps: int, data: Path, case_dir: Path, checkpoint_every: int
) -> list[str]:
    """The case's launch: its first leg, or the next one from an earlier call's checkpoint."""
    shape, length, mode = name.rsplit("-", 2)
    launcher = [sys.executable, "-m", "mtrain_cli", "extend", "--nproc", str(num_gpus)]
    earlier = latest_run(case_dir)
    if earlier is not None and any(earlier.glob("checkpoints/*")):
        return [*launcher, "--resume", str(earlier)]
    sets = [
        f"run.name={name}",
        f"data.seq_len={LENGTHS[length]}",
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
    cmd = [*launcher, "--recipe", RECIPES[shape], "--data", str(data), "--output-dir", str(case_dir)]
    return cmd + [arg for item in sets for arg in ("--set", item)]


def make_docs(data: Path, seq_len: int, num_docs: int, log: Path, stop_at: float) -> None:
    """~3.5 characters a token, documents of one row each; renamed once whole, so a killed call leaves none short."""
    part = data.with_suffix(".part")
    cmd = [sys.executable, str(REPO / "bench/make_long_docs.py"), "--chars", str(seq_len * 7 // 2)]
    cmd += ["--num-docs", str(num_docs), "--out", str(part)]
    with log.open("a") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=stop_at - time.monotonic())
    part.rename(data)


def can_launch(row: dict, stop_at: float) -> bool:
    """Whether a launch has MIN_LAUNCH_S before the stop signal; if not, the row says the case is skipped."""
    left = stop_at - time.monotonic()
    if left < MIN_LAUNCH_S:
        row.update(
            status="skipped", reason=f"time budget: {max(left, 0):.0f} s left, a launch needs {MIN_LAUNCH_S:g} s"
        )
    return left >= MIN_LAUNCH_S


def run_case(row: dict, save: Callable[[], None], num_gpus: int, args: argparse.Namespace, stop_at: float) -> None:
    """Fills in `row` (saved as "running"): this call's leg of the case, then what its run measured."""
    name = row["case"]
    length = name.rsplit("-", 2)[1]
    case_dir, data, log = args.work / name, args.work / f"long_{length}.jsonl", args.out / row["log"]
    earlier = latest_run(case_dir)
    if earlier is not None and (earlier / "summary.json").exists():  # written when a run reaches its end
        row["rc"] = "finished in an earlier call"
    else:
        if not data.exists() and can_launch(row, stop_at):
            with contextlib.suppress(subprocess.TimeoutExpired):  # then skipped for the budget below
                make_docs(data, LENGTHS[length], args.steps + 2, log, stop_at)
        if not can_launch(row, stop_at):
            return
        cmd = extend_command(name, num_gpus, args.steps, data, case_dir, args.checkpoint_every)
        row["command"] = " ".join(cmd[1:])
        save()
        print(f"{name}: SIGTERM in {stop_at - time.monotonic():.0f} s, log {log}", flush=True)
        start = time.monotonic()
        row["rc"] = launch(cmd, log, stop_at)
        row["wall_s"] = round(time.monotonic() - start, 1)
    row["status"] = "done"
    measure(row, latest_run(case_dir), num_gpus, log)


def measure(row: dict, run_dir: Path | None, num_gpus: int, log: Path) -> None:
    metrics = run_dir / "metrics.jsonl" if run_dir else None
    steps_done = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics and metrics.exists() else []
    steps_done = [s for s in steps_done if "loss" in s]
    row["steps"] = len(steps_done)
    if not steps_done:
        row["log_tail"] = log.read_text()[-1500:] if log.exists() else ""
        return
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
            state = {
                "running": f"running (the call ended first; log {r['log']})",
                "skipped": f"skipped ({r.get('reason')})",
            }
            state = state.get(r["status"], f"no steps (rc {r.get('rc')})")
            lines.append(f"| {r['case']} | {state} | | | | | | | | |")
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


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--work", type=Path, default=Path("/tmp/train_multi_gpu"))
    parser.add_argument(
        "--budget",
        type=float,
        default=590.0,
        help="seconds the whole command may take; the call's limit must be above it",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=100000, help="steps; a case longer than a call goes on from it"
    )
    args = parser.parse_args(argv)
    sigterm_at_s = args.budget - STOP_GRACE_S - RESULTS_S
    if sigterm_at_s < MIN_LAUNCH_S:
        print(
            f"--budget {args.budget:g}: no case can run; a launch needs {MIN_LAUNCH_S} s before its SIGTERM, then "
            f"{STOP_GRACE_S} s to save and {RESULTS_S} s for the results: pass --budget "
            f"{STOP_GRACE_S + RESULTS_S + MIN_LAUNCH_S} or more",
            file=sys.stderr,
        )
        raise SystemExit(2)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {**device_info(), "date": date.today().isoformat(), "budget_s": args.budget}
    result.update(sigterm_at_s=sigterm_at_s, rows=[])
    num_gpus = result["num_gpus"]

    def save() -> None:  # written whole, then renamed: a call killed midway leaves the last version
        for path, text in (
            (f"train_{num_gpus}gpu.json", json.dumps(result, indent=1)),
            (f"train_{num_gpus}gpu.md", markdown(result)),
        ):
            (args.out / f"{path}.part").write_text(text)
            (args.out / f"{path}.part").rename(args.out / path)

    for name in args.cases.split(","):
        result["rows"].append(row := {"case": name, "status": "running", "log": f"{name}.log"})
        save()
        run_case(row, save, num_gpus, args, started + sigterm_at_s)
        save()
        print(markdown(result), flush=True)


if __name__ == "__main__":
    main()
