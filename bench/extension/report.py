"""The report of the extension experiment: what the runs, evals and probes under its work directory wrote
(restored there from earlier jobs at the larger scale), gathered into OUT/<stem>.json and .md (written by
markdown.py), and at the end four figures and a logs tarball.

Tables (model x length): perplexity on held-out packages; NIAH (mean over depths); RULER (each task, and the mean of
its niah tasks); InfiniteBench's generated tasks. Scores pool every round (seed) of a suite: each
prompt's score is read from predictions.jsonl. Training (training.py): tokens/s, step time, peak memory, losses,
sparse density/recall, layers by path, the dense check and the recall controller, the sparse run's density and
recall per layer over its steps; per layer on held-out text from sparsity_by_layer.py. Not run on its own.
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
from bench.extension.markdown import MODELS, TRAIN_RUNS, markdown
from bench.extension.training import read_jsonl, same_machine, throughput_over_steps, train_metrics
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
