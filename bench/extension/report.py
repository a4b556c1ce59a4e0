"""The report of the extension experiment: what the runs, evals and probes under its work directory wrote
(restored there from earlier jobs at the larger scale), gathered into OUT/<stem>.json and .md (written by
markdown.py), and at the end four figures and a logs tarball.

Tables (model x length): perplexity on held-out packages; NIAH (mean over depths); RULER (each task, and the mean of
its niah tasks); InfiniteBench's generated tasks. Scores pool every round (seed) of a suite: each
prompt's score is read from predictions.jsonl. Training: tokens/s (the median step after the first WARMUP_STEPS,
which compile; over all steps: `throughput_over_steps`; each also without the dense checks' seconds), step time,
peak memory, losses, sparse density/recall, layers by path, the dense check and the recall controller from
metrics.jsonl and summary.json; the sparse run's density and recall per layer over its steps
(metrics.jsonl's sparse_by_layer); per layer on held-out text from sparsity_by_layer.py. Not run on its own.
"""

from __future__ import annotations

import json
import os
import statistics
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.extension.handoff import STATE_FILE
from bench.extension.markdown import COMPILE_FACTOR, DENSE_HERE, MODELS, TRAIN_RUNS, WARMUP_STEPS, markdown
from mtrain_cli.eval import SUITES

BUNDLE_ROOT = "extension_experiment"  # the logs tarball's top folder: the work directory's small files
TASK_SUITES = {task: suite for suite, about in SUITES.items() for task in about.tasks}  # task names are unique
LOG_NAMES = {
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "results.json",
    "summary.md",
    "predictions.jsonl",
    "niah.csv",
    "pg19.csv",
    "probe.json",
    "manifest.json",
    "config.json",
}


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


def eval_dirs(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Path]]:
    """(record, eval run directory) of every eval job that passed."""
    found = []
    for rec in records:
        if rec["name"].startswith("eval-") and rec["status"] == "pass" and rec.get("run_dir"):
            runs = sorted(Path(rec["run_dir"]).glob("eval-*"))
            if runs and (runs[-1] / "results.json").is_file():
                found.append((rec, runs[-1]))
    return found


def answers(records: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(record, one line of predictions.jsonl) for every prompt a passed eval job answered (PG-19 answers none)."""
    for rec, run in eval_dirs(records):
        if rec["meta"]["kind"] != "pg19":
            yield from ((rec, p) for p in read_jsonl(run / "predictions.jsonl"))


def suite_of(rec: dict[str, Any], p: dict[str, Any]) -> str:
    """The suite of one answer: its eval job's, or, for a job of several suites, its task's."""
    kind = rec["meta"]["kind"]
    return TASK_SUITES[p["task"]] if "," in kind else kind


def prompt_key(rec: dict[str, Any], p: dict[str, Any]) -> tuple:
    """One prompt, the same for every model that answered it: (suite, round, task, length, index, NIAH depth)."""
    return (suite_of(rec, p), rec["meta"]["seed"], p["task"], p["length"], p["index"], p["meta"].get("depth"))


def quality(records: list[dict[str, Any]]) -> dict[str, Any]:
    """model -> metric -> length -> value, plus per-cell sample counts, NIAH grids and eval-level skips."""
    scores: dict[tuple[str, str, str, int], list[float]] = {}  # (model, suite, task, length) -> scores
    by_prompt: dict[str, dict[tuple, float]] = {}  # model -> (suite, seed, task, length, index, depth) -> score
    niah: dict[str, dict[tuple[int, int], list[float]]] = {}
    table: dict[str, dict[str, dict[int, float]]] = {m: {} for m in MODELS}
    skipped: dict[str, list[str]] = {}  # "suite/task [at length]: reason" -> models
    versions = None
    for rec, run in eval_dirs(records):
        model = rec["meta"]["model"]
        results = json.loads((run / "results.json").read_text())
        versions = versions or results.get("versions")
        for skip in results.get("skipped", []):
            what = f"{skip['suite']}/{skip['task']}" + (f" at {skip['length']}" if skip.get("length") else "")
            models = skipped.setdefault(f"{what}: {skip['reason']}", [])
            models += [model] if model not in models else []
        if "pg19" in results["suites"]:
            for row, cells in results["suites"]["pg19"]["rows"].items():  # perplexity, and its second half's
                table[model][row] = {int(k): v for k, v in cells.items()}
    for rec, p in answers(records):
        model, suite = rec["meta"]["model"], suite_of(rec, p)
        scores.setdefault((model, suite, p["task"], p["length"]), []).append(p["score"])
        by_prompt.setdefault(model, {})[prompt_key(rec, p)] = p["score"]
        if suite == "niah":
            niah.setdefault(model, {}).setdefault((p["length"], p["meta"]["depth"]), []).append(p["score"])
    counts: dict[str, dict[str, dict[int, int]]] = {m: {} for m in MODELS}
    for (model, suite, task, length), values in scores.items():
        name = "niah" if suite == "niah" else f"{suite}/{task}"
        table[model].setdefault(name, {})[length] = 100 * sum(values) / len(values)
        counts[model].setdefault(name, {})[length] = len(values)
    for model in MODELS:  # the RULER niah tasks' mean, per length
        cells: dict[int, list[float]] = {}
        prompts: dict[int, int] = {}  # behind each mean: its resolution
        for name, by_length in table[model].items():
            if name.startswith("ruler/niah_"):
                for length, value in by_length.items():
                    cells.setdefault(length, []).append(value)
                    prompts[length] = prompts.get(length, 0) + counts[model][name][length]
        if cells:
            table[model]["ruler niah tasks"] = {n: sum(v) / len(v) for n, v in cells.items()}
            counts[model]["ruler niah tasks"] = prompts
    grids = {m: {f"{n}:{d}": 100 * sum(v) / len(v) for (n, d), v in g.items()} for m, g in niah.items()}
    return {
        "table": table,
        "samples": counts,
        "niah_grid": grids,
        "paired": paired_differences(by_prompt.get("sparse", {}), by_prompt.get("dense", {})),
        "paired_sparse_prefill": paired_differences(by_prompt.get("sparse-prefill", {}), by_prompt.get("dense", {})),
        "eval_skipped": skipped,
        "versions": versions,
    }


PAIRED_METRICS = {
    "niah": lambda suite, task: suite == "niah",
    "ruler niah tasks": lambda suite, task: suite == "ruler" and task.startswith("niah_"),
}


def paired_differences(sparse: dict[tuple, float], dense: dict[tuple, float]) -> dict[str, dict[int, dict]]:
    """metric -> length -> sparse − dense in points over the prompts both models answered (the same prompts: one
    seed and tokenizer), with the 95% half-width of that mean (normal approximation, paired by prompt): how
    far apart the two can be told, whatever the per-cell counts."""
    return {
        metric: {length: mean_with_ci95(diffs) for length, diffs in by_length.items()}
        for metric, by_length in prompt_differences(dense, sparse).items()
    }


def prompt_differences(first: dict[tuple, float], second: dict[tuple, float]) -> dict[str, dict[int, list[float]]]:
    """metric -> length -> second − first in points, one value per prompt that both answered."""
    out: dict[str, dict[int, list[float]]] = {}
    for metric, keep in PAIRED_METRICS.items():
        by_length: dict[int, list[float]] = {}
        for prompt, score in second.items():
            suite, _seed, task, length = prompt[:4]
            if prompt in first and keep(suite, task):
                by_length.setdefault(length, []).append(100 * (score - first[prompt]))
        if by_length:
            out[metric] = dict(sorted(by_length.items()))
    return out


def mean_with_ci95(values: list[float]) -> dict[str, Any]:
    half = 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None
    return {"mean": sum(values) / len(values), "ci95": half, "prompts": len(values)}


def probes(records: list[dict[str, Any]]) -> dict[str, Any]:
    found = {}
    for rec in records:
        path = Path(rec.get("run_dir") or "") / "probe.json"
        if rec["name"].startswith("probe-") and rec["status"] == "pass" and path.is_file():
            found[rec["meta"]["model"]] = json.loads(path.read_text())
    return found


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


def collect(work: Path, header: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    manifest_path = work / "corpus" / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    run_dirs = {
        r["name"]: Path(r["run_dir"])
        for r in records
        if r["name"] in TRAIN_RUNS and r.get("run_dir") and Path(r["run_dir"]).is_dir()
    }
    runs = {name: train_metrics(run_dir) for name, run_dir in run_dirs.items()}
    speed, speed_without_checks, over_steps = None, None, {}
    if runs.get("dense", {}).get("tokens_per_s") and runs.get("sparse", {}).get("tokens_per_s"):
        speed = runs["sparse"]["tokens_per_s"] / runs["dense"]["tokens_per_s"]
        speed_without_checks = runs["sparse"]["tokens_per_s_without_checks"] / runs["dense"]["tokens_per_s"]
        over_steps = throughput_over_steps(run_dirs["dense"], run_dirs["sparse"])
    here = same_machine(runs, run_dirs)
    phases = {r["name"]: r["wall_s"] for r in records if not r["name"].startswith(("eval-", "probe-"))}
    machines = {  # job -> its machine
        j["phase"]: f"{j.get('procs') or 1} × {j.get('gpu_name')}" for j in header.get("jobs") or []
    }
    trained_in = {r["name"]: r["meta"].get("job") for r in records if r["name"] in ("dense", "sparse")}
    trained_on = {name: machines.get(job) for name, job in trained_in.items()}
    profiled = [
        Path(r["run_dir"]) / "sparse.json" for r in records if r["name"] == "profile-sparse" and r["status"] == "pass"
    ]
    evals = [r for r in records if r["name"].startswith(("eval-", "probe-"))]
    return {
        **header,
        "corpus": manifest,
        "training": runs,
        "sparse_vs_dense_tokens_per_s": speed,
        "sparse_vs_dense_tokens_per_s_all": over_steps.get("ratio"),
        "sparse_vs_dense_tokens_per_s_without_checks": speed_without_checks,  # median step, the check's time out
        "speed_steps": over_steps,
        "same_machine": here,
        "quality": quality(records),
        "sparsity_by_layer": probes(records),
        "sparse_step_profile": json.loads(profiled[0].read_text()) if profiled and profiled[0].is_file() else None,
        "phases_s": phases,
        "trained_on": trained_on,
        "trained_in": trained_in,
        "eval_jobs": {s: sum(r["status"] == s for r in evals) for s in ("pass", "fail", "skipped")},
        "records": records,
    }


def write(
    out: Path,
    work: Path,
    stem: str,
    header: dict[str, Any],
    records: list[dict[str, Any]],
    final: bool,
    figures: bool,
    bundle_to: Path | None = None,
) -> None:
    """OUT/<stem>.json and .md; the figures when asked; the logs tarball at the end (to OUT/<stem>_logs.tar.gz)
    or whenever `bundle_to` is given (the base job's, which travels with its parts)."""
    out.mkdir(parents=True, exist_ok=True)
    payload = collect(work, header, records)
    files = []
    if figures:
        from bench.extension.plots import plot_all  # matplotlib: only once, at the end

        files = plot_all(payload, work / "plots", out, stem)
    if final or bundle_to is not None:
        bundle(work, bundle_to or out / f"{stem}_logs.tar.gz")
    for name, text in (
        (f"{stem}.json", json.dumps(without_steps(payload), indent=2, default=str) + "\n"),
        (f"{stem}.md", markdown(payload, files)),
    ):
        (out / f"{name}.tmp").write_text(text)
        os.replace(out / f"{name}.tmp", out / name)


def without_steps(payload: dict[str, Any]) -> dict[str, Any]:
    """The report without the training runs' per-step curves (what the figures draw): their metrics.jsonl is in the
    logs tarball."""
    training = {
        name: {key: value for key, value in run.items() if key not in ("curve", "layer_curve")}
        for name, run in payload["training"].items()
    }
    return {**payload, "training": training}


def bundle(work: Path, path: Path) -> None:
    """Logs, the job's state (header and records), the step profile and the small files runs, evals and probes
    wrote (no weights, no checkpoints, no corpus text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")  # a job stopped while bundling keeps the last whole tarball
    with tarfile.open(partial, "w:gz") as tar:
        for file in sorted(work.rglob("*")):
            parts = file.relative_to(work).parts
            wanted = (
                parts[0] in ("logs", "profile")
                or parts == (STATE_FILE,)
                or (file.name in LOG_NAMES and parts[0] in ("runs", "evals", "corpus", "models"))
            )
            if (
                file.is_file()
                and not file.is_symlink()
                and wanted
                and "checkpoints" not in parts
                and "export" not in parts
                and file.stat().st_size <= 8 * 2**20
            ):
                tar.add(file, arcname=f"{BUNDLE_ROOT}/{file.relative_to(work)}")
    os.replace(partial, path)
