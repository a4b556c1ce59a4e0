"""The extension experiment's training runs, from their metrics.jsonl and summary.json: step time and tokens/s
(the median step after the first WARMUP_STEPS, which compile; over all steps: `throughput_over_steps`; each also
without the dense checks' seconds), peak memory, losses, sparse density and recall overall and per layer over the
steps, and sparse / dense speed against the dense run trained again on the sparse run's machine (`same_machine`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench.extension.markdown import COMPILE_FACTOR, DENSE_HERE, WARMUP_STEPS


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def train_metrics(run_dir: Path) -> dict[str, Any]:
    lines = read_jsonl(run_dir / "metrics.jsonl")
    steps = [m for m in lines if "tokens_per_s" in m]
    steady = steps[WARMUP_STEPS:] or steps[1:] or steps
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    recall = [m["sparse_recall"] for m in steps if "sparse_recall" in m]
    density = [m["sparse_density"] for m in steps if "sparse_density" in m]
    return {
        "steps": len(steps),
        "tokens_per_step": steps[0]["tokens"] if steps else None,
        "first_step_s": steps[0]["step_s"] if steps else None,
        "step_s": median([m["step_s"] for m in steady]),
        "tokens_per_s": median([m["tokens_per_s"] for m in steady]),
        "tokens_per_s_without_checks": median([without_check(m) for m in steady]),
        "mfu": median([m.get("mfu") for m in steady]),
        "peak_mem_gib": max((m["peak_mem_gib"] for m in steps), default=None),
        "loss_first": steps[0]["loss"] if steps else None,
        "loss_last": steps[-1]["loss"] if steps else None,
        "val_loss": summary.get("val_loss"),
        "wall_s": summary.get("wall_s"),
        "num_params": summary.get("num_params"),
        "num_trainable_params": summary.get("num_trainable_params"),
        "sparse_density": sum(density) / len(density) if density else None,
        "sparse_recall": sum(recall) / len(recall) if recall else None,
        "attention_calls": summary.get("attention_calls"),
        "attention_layers": summary.get("attention_layers"),
        "dense_check": summary.get("dense_check"),  # sparse runs: the loss gap against dense on training batches
        "recall_control": summary.get("recall_control"),
        "rope": summary.get("rope"),
        "packing": summary.get("packing"),
        "warnings": summary.get("warnings"),
        "curve": [
            {k: m.get(k) for k in ("step", "loss", "tokens_per_s", "sparse_density", "sparse_recall")} for m in steps
        ],
        **layers_over_training(steps),
    }


def without_check(m: dict[str, Any]) -> float:
    """A step's tokens/s without the dense check it ran (train/dense_check.py: its seconds are inside the step's)."""
    return m["tokens_per_s"] * m["step_s"] / (m["step_s"] - m.get("dense_check_s", 0.0))


def throughput_over_steps(dense_dir: Path, sparse_dir: Path) -> dict[str, Any]:
    """Sparse / dense in tokens over seconds of the same steps (packed rows of one length cost unlike, one
    document against many, so this and the median step can differ): the steps after the first WARMUP_STEPS,
    without those where either run compiled, which are listed: the run's metrics say it built Triton kernels
    (`kernels_built`), or, for runs that did not record it, the step took over COMPILE_FACTOR × the run's median
    (e.g. the sparse run's first row without a long document compiles FlexAttention)."""
    runs = {
        name: {m["step"]: m for m in read_jsonl(path / "metrics.jsonl") if "tokens_per_s" in m}
        for name, path in (("dense", dense_dir), ("sparse", sparse_dir))
    }
    steps = sorted(set(runs["dense"]) & set(runs["sparse"]))[WARMUP_STEPS:]
    if not steps:
        return {}
    medians = {name: statistics.median(run[s]["step_s"] for s in steps) for name, run in runs.items()}
    compiled = [
        s
        for s in steps
        if any(
            run[s].get("kernels_built", 0) > 0 or run[s]["step_s"] > COMPILE_FACTOR * medians[n]
            for n, run in runs.items()
        )
    ]
    kept = [s for s in steps if s not in compiled]
    tokens_per_s = {
        name: sum(run[s]["tokens"] for s in kept) / sum(run[s]["step_s"] for s in kept) for name, run in runs.items()
    }
    check_s = {name: sum(run[s].get("dense_check_s", 0.0) for s in kept) for name, run in runs.items()}
    without_checks = {
        name: sum(run[s]["tokens"] for s in kept) / (sum(run[s]["step_s"] for s in kept) - check_s[name])
        for name, run in runs.items()
    }
    return {
        "ratio": tokens_per_s["sparse"] / tokens_per_s["dense"],
        "tokens_per_s": tokens_per_s,
        # the same steps without the dense checks' seconds (attention.check_every): what sparse attention alone buys
        "ratio_without_checks": without_checks["sparse"] / without_checks["dense"],
        "check_s": check_s,
        "num_steps": len(kept),
        "first_step": steps[0],
        "compiled": {str(s): {name: run[s]["step_s"] for name, run in runs.items()} for s in compiled},
    }


def tenth(points: list) -> int:
    return max(1, len(points) // 10)


def layers_over_training(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """From each step's sparse_by_layer {layer: [recall, density]} (layers that ran dense are absent):
    layer_curve {layer: [[step, recall, density], ...]} and layer_means {layer: means over all steps, over the
    first and over the last tenth of them (one step's row alone can be all short documents)}."""
    curve: dict[str, list[list[float]]] = {}
    for m in steps:
        for layer, (recall, density) in (m.get("sparse_by_layer") or {}).items():
            curve.setdefault(layer, []).append([m["step"], recall, density])
    if not curve:
        return {}
    curve = dict(sorted(curve.items(), key=lambda item: int(item[0])))
    means = {
        layer: {
            "steps": len(points),
            "recall": sum(p[1] for p in points) / len(points),
            "density": sum(p[2] for p in points) / len(points),
            **{
                f"{name}_{end}": sum(p[column] for p in part) / len(part)
                for end, part in (("first", points[: tenth(points)]), ("last", points[-tenth(points) :]))
                for name, column in (("recall", 1), ("density", 2))
            },
        }
        for layer, points in curve.items()
    }
    return {"layer_curve": curve, "layer_means": means}


def same_machine(runs: dict[str, dict[str, Any]], run_dirs: dict[str, Path]) -> dict[str, Any] | None:
    """Sparse / dense speed against the dense run trained again on the sparse run's machine (--dense-here), as the
    figures against the dense run are made, and how many of its steps' losses equal the dense run's (the same
    training when every one does); None without it."""
    dense, sparse = runs.get(DENSE_HERE) or {}, runs.get("sparse") or {}
    if not dense.get("tokens_per_s") or not sparse.get("tokens_per_s"):
        return None
    over_steps = throughput_over_steps(run_dirs[DENSE_HERE], run_dirs["sparse"])
    losses = {
        name: {m["step"]: m["loss"] for m in (runs.get(name) or {}).get("curve", [])} for name in ("dense", DENSE_HERE)
    }
    shared = sorted(set(losses["dense"]) & set(losses[DENSE_HERE]))
    return {
        "median": sparse["tokens_per_s_without_checks"] / dense["tokens_per_s"],
        "median_as_run": sparse["tokens_per_s"] / dense["tokens_per_s"],
        "all_steps": over_steps.get("ratio_without_checks"),
        "dense_step_s": dense["step_s"],
        "dense_run_step_s": (runs.get("dense") or {}).get("step_s"),
        "losses_equal": sum(losses["dense"][s] == losses[DENSE_HERE][s] for s in shared),
        "losses_compared": len(shared),
    }
