"""What the flows' commands wrote, read and checked: a training run's metrics, steps, attention path, packing and
export; a record passes only when nothing was found wrong."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench.gpu_e2e.job import Job, Record


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def only_subdir(parent: Path) -> Path | None:
    dirs = sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
    return dirs[-1] if dirs else None


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def as_int(value: Any) -> int | None:
    return round(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def rnd(value: Any, digits: int = 4) -> Any:
    return round(value, digits) if isinstance(value, float) and math.isfinite(value) else value


def train_metrics(run_dir: Path, after_step: int = 0) -> dict[str, Any]:
    """metrics.jsonl + summary.json of an extend run: steady-state numbers exclude the first step
    (compilation, autotuning, CUDA graph capture) when there are later ones. after_step: a resumed run's
    numbers come from its own steps (metrics.jsonl also holds those before the interruption)."""
    lines = read_jsonl(run_dir / "metrics.jsonl")
    all_steps = [m for m in lines if "tokens_per_s" in m]
    steps = [m for m in all_steps if m["step"] > after_step]
    steady = steps[1:] if len(steps) > 1 else steps
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    packing, rope = summary.get("packing") or {}, summary.get("rope") or {}
    metrics = {
        "steps_logged": [m["step"] for m in all_steps],
        "first_step_s": rnd(steps[0]["step_s"], 3) if steps else None,
        "step_s": rnd(median([m["step_s"] for m in steady]), 4),
        "tokens_per_s": as_int(median([m["tokens_per_s"] for m in steady])),
        "tflops": rnd(median([m.get("tflops") for m in steady]), 2),
        "mfu": rnd(median([m.get("mfu") for m in steady]), 4),
        "peak_mem_gib": rnd(max((m["peak_mem_gib"] for m in steps), default=None), 3),
        "loss_first": rnd(steps[0]["loss"]) if steps else None,
        "loss_last": rnd(steps[-1]["loss"]) if steps else None,
        "sparse_density": rnd(mean([m.get("sparse_density") for m in steps])),
        "sparse_recall": rnd(mean([m.get("sparse_recall") for m in steps])),
        "val_loss": {str(m["step"]): rnd(m["val_loss"]) for m in lines if "val_loss" in m},
        "run_wall_s": summary.get("wall_s"),
        "attention_calls": summary.get("attention_calls"),
        "attention_layers": summary.get("attention_layers"),
        "num_params": summary.get("num_params"),
        "rope": {
            k: rope.get(k) for k in ("method", "factor", "original_context", "extended_context", "attention_factor")
        }
        if rope
        else None,
        "packing": {
            k: packing.get(k)
            for k in (
                "num_documents",
                "num_rows",
                "seq_len",
                "mean_documents_per_row",
                "num_documents_split",
                "num_train_rows",
                "num_val_rows",
            )
        }
        if packing
        else None,
        "summary_steps": summary.get("steps"),
        "warnings": summary.get("warnings"),
        "device": summary.get("device"),
    }
    return metrics


def check_export(
    export: Path, problems: list[str], checks: list[str], min_context: int | None, rope_type: str | None
) -> None:
    config_file = export / "config.json"
    weights = sorted(export.glob("*.safetensors"))
    if not config_file.is_file() or not weights:
        problems.append(f"export {export}: config.json present {config_file.is_file()}, safetensors {len(weights)}")
        return
    if not (export / "tokenizer.json").is_file() and not (export / "tokenizer_config.json").is_file():
        problems.append(f"export {export}: no tokenizer files")
    config = json.loads(config_file.read_text())
    mpe = config.get("max_position_embeddings")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if min_context and (mpe or 0) < min_context:
        problems.append(f"export max_position_embeddings {mpe} < {min_context}")
    if rope_type and rope.get("rope_type") != rope_type:
        problems.append(f"export rope_type {rope.get('rope_type')!r}, expected {rope_type!r}")
    if rope_type == "yarn" and mpe and rope.get("factor") and rope.get("original_max_position_embeddings"):
        if round(rope["factor"] * rope["original_max_position_embeddings"]) != mpe:
            problems.append(
                f"export max_position_embeddings {mpe} != factor {rope['factor']} × original "
                f"{rope['original_max_position_embeddings']}"
            )
    checks.append(
        f"export: config.json (max_position_embeddings {mpe}, rope {rope.get('rope_type')}) + "
        f"{len(weights)} safetensors"
    )


def check_train(
    job: Job,
    rec: Record,
    run_dir: Path | None,
    num_steps: int,
    mode: str,
    seq_len: int,
    packing: str | None,
    rope_type: str | None,
    start_step: int = 0,
) -> None:
    """rc 0, every step logged with finite loss, summary, export, the attention path that must have run."""
    problems, checks = [], []
    if run_dir is None or not run_dir.is_dir():
        finish(rec, [f"exit code {rec.rc}", "no run directory was created"], [])
        return
    rec.artifacts["run_dir"] = str(run_dir)
    m = train_metrics(run_dir, after_step=start_step)
    rec.metrics.update(m)
    steps = m["steps_logged"]
    if steps != list(range(1, num_steps + 1)):
        problems.append(f"metrics.jsonl steps {steps}, expected 1..{num_steps}")
    losses = [x["loss"] for x in read_jsonl(run_dir / "metrics.jsonl") if "loss" in x]
    if not losses or not all(math.isfinite(x) for x in losses):
        problems.append(f"non-finite or missing losses: {losses[:8]}")
    if m["summary_steps"] != {"start": start_step, "end": num_steps}:
        problems.append(f"summary.json steps {m['summary_steps']}, expected start {start_step} end {num_steps}")
    calls = m["attention_calls"] or {}
    sparse_calls = {k: v for k, v in calls.items() if k.startswith("sparse")}
    if mode == "sparse":
        # every layer call ran the sparse kernels or, above the crossover, dense attention (counted as such)
        layers = m.get("attention_layers") or {}
        if not calls.get(job.scale.sparse_path) and not (
            calls.get("dense-crossover") and layers.get("dense-crossover")
        ):
            problems.append(
                f"attention_calls {calls}: neither {job.scale.sparse_path} nor counted dense-crossover calls"
            )
        if calls.get(job.scale.sparse_path) and (
            m["sparse_density"] is None or not 0 < m["sparse_density"] <= 1 or m["sparse_recall"] is None
        ):
            problems.append(
                f"sparse density {m['sparse_density']} / recall {m['sparse_recall']} missing or out of range"
            )
    elif sparse_calls or not calls.get("dense"):
        problems.append(f"dense run: attention_calls {calls}")
    pack = m["packing"] or {}
    per_row = pack.get("mean_documents_per_row")
    if packing == "x4" and not (per_row and per_row >= 2):
        problems.append(f"packed rows expected (several documents per row), mean_documents_per_row {per_row}")
    if packing == "x1" and not (per_row and per_row <= 1.05):
        problems.append(f"one document per row expected, mean_documents_per_row {per_row}")
    if pack.get("seq_len") not in (None, seq_len):
        problems.append(f"packed seq_len {pack.get('seq_len')} != {seq_len}")
    export = run_dir / "export"
    check_export(export, problems, checks, seq_len, rope_type)
    rec.artifacts["export"] = str(export)
    if rec.rc != 0:
        problems.insert(0, f"exit code {rec.rc}" + (" (killed at its timeout)" if rec.timed_out else ""))
    checks.append(
        f"{len(steps)} steps logged, attention calls {calls}, rows of {seq_len} ({per_row} documents per row)"
    )
    finish(rec, problems, checks)


def finish(rec: Record, problems: list[str], checks: list[str]) -> None:
    if rec.timed_out and not any("timeout" in p for p in problems):
        problems.insert(0, f"killed at its timeout ({rec.timeout_s:.0f} s)")
    if problems:
        rec.status = "fail"
        rec.reason = "; ".join(problems)
        rec.checks = problems
    else:
        rec.status = "pass"
        rec.checks = checks
        rec.stderr_tail = ""  # the logs tar holds it


def check_dense_steps(rec: Record, run_dir: Path, every: int) -> None:
    """A sparse run with attention.dense_every: every layer call of the steps every, 2 every, ... ran dense (route
    dense-step), none of the others did; summary.json counts them."""
    steps = [x for x in read_jsonl(run_dir / "metrics.jsonl") if "loss" in x]
    dense = [x["step"] for x in steps if x["layers"].get("dense-step")]
    wrong = [
        x["step"]
        for x in steps
        if x["layers"].get("dense-step", 0) != (sum(x["layers"].values()) if x["step"] % every == 0 else 0)
    ]
    logged = sum(x["layers"].get("dense-step", 0) for x in steps)
    counted = json.loads((run_dir / "summary.json").read_text()).get("attention_layers", {}).get("dense-step", 0)
    problems = []
    if not dense or wrong:
        problems.append(f"dense steps {dense}, every {every}: steps {wrong} ran other routes than they should")
    if counted != logged:
        problems.append(f"summary.json counts {counted} dense-step layer calls, the steps {logged}")
    finish(rec, problems, [*rec.checks, f"dense steps {dense}: every layer dense, counted ({counted} layer calls)"])


def check_dense_check(rec: Record, run_dir: Path, num_checks: int) -> None:
    """A sparse run with attention.check_every: each check's gap logged, summed up in summary.json, and with
    recall_target the controller's state there too."""
    summary = json.loads((run_dir / "summary.json").read_text())
    check = summary.get("dense_check") or {}
    gaps = [x["dense_check_gap"] for x in read_jsonl(run_dir / "metrics.jsonl") if "dense_check_gap" in x]
    rec.metrics.update(dense_check=check, recall_control=summary.get("recall_control"))
    problems = []
    if check.get("checks") != num_checks or len(gaps) != num_checks or not all(math.isfinite(g) for g in gaps):
        problems.append(f"dense check: {check.get('checks')} checks in summary.json, gaps {gaps}; {num_checks} due")
    if summary.get("recall_control") is None:
        problems.append("summary.json has no recall_control")
    finish(rec, problems, [*rec.checks, f"dense check: {num_checks} checks, gaps {[round(g, 5) for g in gaps]}"])
