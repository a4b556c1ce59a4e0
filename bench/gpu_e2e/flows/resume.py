"""Ctrl-C and --resume: an extension interrupted after its first logged step (exit 130, a checkpoint, the resume
command printed), resumed to its end, and its export loaded by plain transformers."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu_e2e.checks import check_export, check_train, finish, only_subdir, read_jsonl, train_metrics
from bench.gpu_e2e.job import Flow, Job, Record, tail
from bench.gpu_e2e.scales import Scale, length_label


def flow_interrupt(job: Job, rec: Record) -> None:
    """extend (sparse, --model, packed rows); SIGINT once metrics.jsonl shows a step; expect 130 + checkpoint."""
    s = job.scale
    runs = job.out_dir("runs", rec.name)
    cmd = job.mtrain(
        "extend",
        "--recipe",
        str(job.work / "e2e.yaml"),
        "--model",
        str(job.state.run_dirs["pretrain"] / "export"),
        "--data",
        str(job.state.data[f"x4_{s.resume_len}"]),
        "--output-dir",
        str(runs),
        "--set",
        "run.name=resume",
        "--set",
        f"data.seq_len={s.resume_len}",
        "--set",
        f"context.factor={s.resume_len // s.native}",
        "--set",
        "attention.mode=sparse",
        "--set",
        f"train.num_steps={s.resume_steps}",
        "--set",
        "train.warmup_steps=2",
    )
    sent: dict[str, Any] = {}

    def interrupt(proc: subprocess.Popen) -> None:
        deadline = time.time() + rec.timeout_s - 15
        while time.time() < deadline and proc.poll() is None:
            run_dir = only_subdir(runs)
            steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "tokens_per_s" in m] if run_dir else []
            if steps:
                proc.send_signal(signal.SIGINT)  # Ctrl-C
                sent.update(after_step=steps[-1]["step"], at_s=round(time.time() - t0, 2))
                return
            time.sleep(0.02)

    t0 = time.time()
    rc = job.run(rec, cmd, rec.timeout_s, on_start=interrupt)
    rec.metrics["sigint"] = sent or None
    problems, checks = [], []
    run_dir = only_subdir(runs)
    out_text = (job.work / "logs" / f"{rec.name}.out").read_text(errors="replace")
    found = re.search(r"Continue with: mtrain extend --resume (\S+)", out_text)
    if not sent:
        problems.append("the run ended before a step was logged: SIGINT was not sent")
    if rc != 130:
        problems.append(f"exit code {rc}, expected 130 after Ctrl-C" + (" (timeout)" if rec.timed_out else ""))
    if not found:
        problems.append("no 'Continue with: mtrain extend --resume RUN_DIR' line on stdout")
    elif run_dir is not None and Path(found.group(1)).resolve() != run_dir.resolve():
        problems.append(f"--resume names {found.group(1)}, the run directory is {run_dir}")
    ckpts = sorted((run_dir / "checkpoints").glob("step_*")) if run_dir else []
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl") if "tokens_per_s" in m] if run_dir else []
    if not ckpts:
        problems.append("no checkpoint was saved")
    elif steps and not ckpts[-1].name.endswith(f"{steps[-1]:06d}") and str(steps[-1]) not in ckpts[-1].name:
        problems.append(f"last checkpoint {ckpts[-1].name} but the last logged step is {steps[-1]}")
    if steps and steps[-1] >= s.resume_steps:
        problems.append(f"the run reached its last step ({steps[-1]}) before stopping: nothing left to resume")
    if run_dir is not None:
        rec.artifacts["run_dir"] = str(run_dir)
        rec.metrics.update(
            {
                k: v
                for k, v in train_metrics(run_dir).items()
                if k
                in (
                    "steps_logged",
                    "first_step_s",
                    "step_s",
                    "tokens_per_s",
                    "peak_mem_gib",
                    "sparse_density",
                    "sparse_recall",
                    "attention_calls",
                )
            }
        )
    checks.append(
        f"SIGINT after step {sent.get('after_step')}: exit 130, checkpoint "
        f"{ckpts[-1].name if ckpts else None}, resume command printed"
    )
    finish(rec, problems, checks)
    if rec.status == "pass":
        job.state.run_dirs[rec.name], job.state.resume_interrupted_at = run_dir, steps[-1]


def flow_resume(job: Job, rec: Record) -> None:
    s = job.scale
    run_dir = job.state.run_dirs["resume-interrupt"]
    cmd = job.mtrain("extend", "--resume", str(run_dir))
    job.run(rec, cmd, rec.timeout_s)
    out_text = (job.work / "logs" / f"{rec.name}.out").read_text(errors="replace")
    check_train(
        job,
        rec,
        run_dir,
        s.resume_steps,
        "sparse",
        s.resume_len,
        "x4",
        "yarn",
        start_step=job.state.resume_interrupted_at or 0,
    )
    if "resumed from" not in out_text:
        rec.status, rec.reason = "fail", (rec.reason + "; " if rec.reason else "") + "no 'resumed from' line"
    rec.metrics["resumed_at_step"] = job.state.resume_interrupted_at
    if rec.status == "pass":
        job.state.run_dirs[rec.name] = run_dir


EXPORT_PROBE = r"""
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
device = "cuda" if torch.cuda.is_available() else "cpu"
tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).to(device).eval()
ids = tokenizer("The pass key is 71432. Remember it. " * 40, return_tensors="pt").input_ids[:, :256].to(device)
with torch.no_grad():
    logits = model(ids).logits
print(json.dumps({"class": type(model).__name__, "attn_implementation": model.config._attn_implementation,
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "max_position_embeddings": model.config.max_position_embeddings,
                  "rope_parameters": getattr(model.config, "rope_parameters", None),
                  "logits_shape": list(logits.shape), "logits_finite": bool(torch.isfinite(logits).all())},
                 default=str))
"""


def export_check_flow(run_flow: str, length: int, rope_type: str = "yarn") -> Callable[[Job, Record], None]:
    """The export of the run that flow `run_flow` trained loads with plain transformers and runs a forward; its
    config.json holds at least `length` positions with `rope_type`."""

    def run(job: Job, rec: Record) -> None:
        export = job.state.run_dirs[run_flow] / "export"
        cmd = [job.args.python, "-c", EXPORT_PROBE, str(export)]
        rc = job.run(rec, cmd, rec.timeout_s)
        rec.command = (
            f"{job.args.python} -c '<EXPORT_PROBE in bench/gpu_e2e/flows/resume.py: "
            f"AutoModelForCausalLM.from_pretrained, forward 256 tokens>' {export}"
        )
        problems, checks = [], []
        check_export(export, problems, checks, length, rope_type)
        out = tail(job.work / "logs" / f"{rec.name}.out", 1)
        try:
            loaded = json.loads(out)
            rec.metrics.update(loaded)
            if not loaded.get("logits_finite"):
                problems.append("non-finite logits")
            checks.append(f"loaded as {loaded.get('class')} ({loaded.get('parameters'):,} parameters), forward finite")
        except (json.JSONDecodeError, TypeError):
            problems.append("the load script printed no result")
        if rc != 0:
            problems.insert(0, f"exit code {rc}")
        rec.artifacts["export"] = str(export)
        finish(rec, problems, checks)

    return run


def flows(scale: Scale) -> list[Flow]:
    return [
        Flow(
            "resume-interrupt",
            "interrupt",
            f"extend --model, sparse, {length_label(scale.resume_len)} packed rows; Ctrl-C after a step",
            flow_interrupt,
            ("pretrain",),
            min_s=40,
        ),
        Flow("resume-continue", "resume", "extend --resume RUN_DIR to the end", flow_resume, ("resume-interrupt",)),
        Flow(
            "export-check",
            "export",
            "the resumed run's export/ loads with AutoModelForCausalLM and runs",
            export_check_flow("resume-continue", scale.resume_len),
            ("resume-continue",),
            min_s=15,
        ),
    ]
