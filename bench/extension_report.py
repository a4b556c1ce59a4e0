"""The report of bench/extension_experiment.py: what the runs, evals and probes under its work directory wrote
(restored there from earlier jobs at the larger scale), gathered into OUT/<stem>.json and .md, and at the end
four figures and a logs tarball.

Tables (model x length): perplexity on held-out packages; NIAH (mean over depths); RULER (mean of its niah tasks
and of all tasks that ran); InfiniteBench's generated tasks. Scores pool every round (seed) of a suite: each
prompt's score is read from predictions.jsonl. Training: tokens/s (median after the first step, which
compiles), step time, peak memory, losses, sparse density/recall and layers by path from metrics.jsonl and
summary.json; the sparse run's density and recall per layer over its steps (metrics.jsonl's sparse_by_layer);
per layer on held-out text from bench/sparsity_by_layer.py. Not run on its own.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import tarfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from extension_jobs import STATE_FILE
from source_identity import source_identity

REPO = Path(__file__).resolve().parents[1]
MODELS = ("base", "base-yarn", "dense", "sparse")
TRAIN_RUNS = ("base", "dense", "sparse")
HEADLINE_METRICS = (
    "perplexity",
    "niah",
    "ruler niah tasks",
    "ruler all tasks",
    "infinitebench/passkey",
    "infinitebench/number_string",
    "infinitebench/kv_retrieval",
    "infinitebench/math_find",
)
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


def environment(python: str, scale: str) -> dict[str, Any]:
    """GPU (nvidia-smi), versions (package metadata, no imports), source commit: cheap, at the start."""
    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python_exe": python,
        "cpus": os.cpu_count(),
    }
    name = ""
    if scale != "smoke" and shutil.which("nvidia-smi"):
        query = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()
        )
        if query:
            name, info["driver"] = [part.strip() for part in query[0].split(",")[:2]]
    info["gpu_name"] = name or "CPU"
    info["gpu"] = (
        "cpu"
        if not name
        else "h100"
        if "H100" in name
        else "h200"
        if "H200" in name
        else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    )
    versions = {}
    for package in ("torch", "triton", "transformers", "datasets", "tokenizers", "matplotlib"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "missing"
    info["versions"] = versions

    info.update(source_identity())
    return info


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
    steady = steps[1:] or steps
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    recall = [m["sparse_recall"] for m in steps if "sparse_recall" in m]
    density = [m["sparse_density"] for m in steps if "sparse_density" in m]
    return {
        "steps": len(steps),
        "tokens_per_step": steps[0]["tokens"] if steps else None,
        "first_step_s": steps[0]["step_s"] if steps else None,
        "step_s": median([m["step_s"] for m in steady]),
        "tokens_per_s": median([m["tokens_per_s"] for m in steady]),
        "mfu": median([m.get("mfu") for m in steady]),
        "peak_mem_gib": max((m["peak_mem_gib"] for m in steps), default=None),
        "loss_first": steps[0]["loss"] if steps else None,
        "loss_last": steps[-1]["loss"] if steps else None,
        "val_loss": summary.get("val_loss"),
        "wall_s": summary.get("wall_s"),
        "num_params": summary.get("num_params"),
        "sparse_density": sum(density) / len(density) if density else None,
        "sparse_recall": sum(recall) / len(recall) if recall else None,
        "attention_calls": summary.get("attention_calls"),
        "attention_layers": summary.get("attention_layers"),
        "rope": summary.get("rope"),
        "packing": summary.get("packing"),
        "warnings": summary.get("warnings"),
        "curve": [
            {k: m.get(k) for k in ("step", "loss", "tokens_per_s", "sparse_density", "sparse_recall")} for m in steps
        ],
        **layers_over_training(steps),
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


def quality(records: list[dict[str, Any]]) -> dict[str, Any]:
    """model -> metric -> length -> value, plus per-cell sample counts, NIAH grids and eval-level skips."""
    scores: dict[tuple[str, str, str, int], list[float]] = {}  # (model, suite, task, length) -> scores
    niah: dict[str, dict[tuple[int, int], list[float]]] = {}
    table: dict[str, dict[str, dict[int, float]]] = {m: {} for m in MODELS}
    skipped: dict[str, list[str]] = {}  # "suite/task [at length]: reason" -> models
    versions = None
    for rec, run in eval_dirs(records):
        model, suite = rec["meta"]["model"], rec["meta"]["kind"]
        results = json.loads((run / "results.json").read_text())
        versions = versions or results.get("versions")
        for skip in results.get("skipped", []):
            what = f"{skip['suite']}/{skip['task']}" + (f" at {skip['length']}" if skip.get("length") else "")
            models = skipped.setdefault(f"{what}: {skip['reason']}", [])
            models += [model] if model not in models else []
        if suite == "pg19":
            perplexity = results["suites"]["pg19"]["rows"].get("perplexity", {})
            table[model]["perplexity"] = {int(k): v for k, v in perplexity.items()}
            continue
        for p in read_jsonl(run / "predictions.jsonl"):
            scores.setdefault((model, suite, p["task"], p["length"]), []).append(p["score"])
            if suite == "niah":
                niah.setdefault(model, {}).setdefault((p["length"], p["meta"]["depth"]), []).append(p["score"])
    counts: dict[str, dict[str, dict[int, int]]] = {m: {} for m in MODELS}
    for (model, suite, task, length), values in scores.items():
        name = "niah" if suite == "niah" else f"{suite}/{task}"
        table[model].setdefault(name, {})[length] = 100 * sum(values) / len(values)
        counts[model].setdefault(name, {})[length] = len(values)
    for model in MODELS:  # RULER means over tasks, per length
        for label, keep in (
            ("ruler niah tasks", lambda t: t.startswith("ruler/niah_")),
            ("ruler all tasks", lambda t: t.startswith("ruler/")),
        ):
            cells: dict[int, list[float]] = {}
            prompts: dict[int, int] = {}  # behind each mean: its resolution
            for name, by_length in table[model].items():
                if keep(name):
                    for length, value in by_length.items():
                        cells.setdefault(length, []).append(value)
                        prompts[length] = prompts.get(length, 0) + counts[model][name][length]
            if cells:
                table[model][label] = {n: sum(v) / len(v) for n, v in cells.items()}
                counts[model][label] = prompts
    grids = {m: {f"{n}:{d}": 100 * sum(v) / len(v) for (n, d), v in g.items()} for m, g in niah.items()}
    return {"table": table, "samples": counts, "niah_grid": grids, "eval_skipped": skipped, "versions": versions}


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
    runs = {
        r["name"]: train_metrics(Path(r["run_dir"]))
        for r in records
        if r["name"] in TRAIN_RUNS and r.get("run_dir") and Path(r["run_dir"]).is_dir()
    }
    speed = None
    if runs.get("dense", {}).get("tokens_per_s") and runs.get("sparse", {}).get("tokens_per_s"):
        speed = runs["sparse"]["tokens_per_s"] / runs["dense"]["tokens_per_s"]
    phases = {r["name"]: r["wall_s"] for r in records if not r["name"].startswith(("eval-", "probe-"))}
    profiled = [
        Path(r["run_dir"]) / "sparse.json" for r in records if r["name"] == "profile-sparse" and r["status"] == "pass"
    ]
    evals = [r for r in records if r["name"].startswith(("eval-", "probe-"))]
    return {
        **header,
        "corpus": manifest,
        "training": runs,
        "sparse_vs_dense_tokens_per_s": speed,
        "quality": quality(records),
        "sparsity_by_layer": probes(records),
        "sparse_step_profile": json.loads(profiled[0].read_text()) if profiled and profiled[0].is_file() else None,
        "phases_s": phases,
        "eval_jobs": {s: sum(r["status"] == s for r in evals) for s in ("pass", "fail", "skipped")},
        "records": records,
    }


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def header_lines(p: dict[str, Any]) -> list[str]:
    v = {**(p.get("versions") or {}), **(p["quality"].get("versions") or {})}
    lines = [
        f"# Context extension, dense vs sparse (issue 22): {p.get('gpu_name')} ({p.get('scale')} scale)",
        "",
        f"- {p.get('date_utc')} · "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + f" · commit {str(p.get('git_commit'))[:12]} ({len(p.get('git_dirty') or [])} files changed"
        + (f", src sha256 {p['src_sha256']})" if p.get("src_sha256") else ")"),
        f"- {p.get('elapsed_s', 0):.0f} s of a {p.get('budget_s', 0):.0f} s budget · "
        f"{'complete' if p.get('complete') else 'PARTIAL (rewritten after every phase)'} · phases (s): "
        + ", ".join(f"{k} {fmt(val, 0)}" for k, val in p["phases_s"].items())
        + f" · eval jobs {p['eval_jobs']}",
    ]
    jobs = p.get("jobs") or []
    if len(jobs) > 1 or (jobs and jobs[0]["phase"] != "all"):
        lines.append(
            "- jobs: "
            + "; ".join(
                f"**{j['phase']}** on {j.get('gpu_name')} {j.get('date_utc')}, {fmt(j.get('elapsed_s'), 0)} s of "
                f"{fmt(j.get('budget_s'), 0)}, commit {str(j.get('git_commit'))[:12]}"
                + (f", src sha256 {j['src_sha256']}" if j.get("src_sha256") else "")
                for j in jobs
            )
        )
    lines += [f"- **note:** {note}" for note in p.get("notes") or []]
    c = p.get("corpus")
    if c:
        f = c["files"]
        lines += [
            f"- corpus: {c['num_packages']} packages (sha256 {c['packages_sha256'][:16]}), {c['split']['train']} "
            f"train / {c['split']['held_out']} held out; "
            + ", ".join(
                f"{name} {f['num_docs'][name]:,} docs ~{f['approx_tokens'][name] / 1e6:.1f}M tokens"
                for name in f["num_docs"]
            )
            + f"; held-out text {c['heldout']['files']} files "
            f"~{c['heldout']['approx_tokens'] / 1e6:.1f}M tokens; tokenizer {c['tokenizer']['vocab_size']} "
            f"({c['tokenizer']['chars_per_token']['heldout_code']} chars/token on held-out code)"
        ]
    return lines


def training_lines(p: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Training",
        "",
        "| run | params | steps × tokens | wall s | tokens/s | step s | peak GiB | loss "
        "first→last | val loss | density / recall | layers sparse / dense |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for name, m in p["training"].items():
        val = m["val_loss"] or {}
        layers = m.get("attention_layers") or {}
        lines.append(
            f"| {name} | {fmt(m['num_params'])} | {m['steps']} × {fmt(m['tokens_per_step'])} | "
            f"{fmt(m['wall_s'])} | {fmt(m['tokens_per_s'], 0)} | {fmt(m['step_s'], 3)} | "
            f"{fmt(m['peak_mem_gib'], 2)} | {fmt(m['loss_first'], 3)}→{fmt(m['loss_last'], 3)} | "
            f"{fmt(val[max(val, key=int)], 3) if val else '–'} | {fmt(m['sparse_density'], 3)} / "
            f"{fmt(m['sparse_recall'], 3)} | "
            + (f"{layers.get('sparse')} / {layers.get('dense_by_crossover')} |" if name == "sparse" else "– |")
        )
    means = (p["training"].get("sparse") or {}).get("layer_means")
    if means:
        steps = sorted({m["steps"] for m in means.values()})
        lines += [
            "",
            f"**Sparse run, per layer over its training** (mean over its {'–'.join(map(str, steps))} steps "
            f"of each decoder layer's plans; first → last: means over the first and the last tenth of the steps; a "
            "layer that ran dense has no plan)",
            "",
            "| layer | density | recall | density first → last | recall first → last |",
            "|---|---:|---:|---|---|",
        ]
        lines += [
            f"| {layer} | {m['density']:.3f} | {m['recall']:.3f} | {m['density_first']:.3f} → "
            f"{m['density_last']:.3f} | {m['recall_first']:.3f} → {m['recall_last']:.3f} |"
            for layer, m in means.items()
        ]
    if p.get("sparse_vs_dense_tokens_per_s"):
        lines += [
            "",
            f"Sparse / dense training tokens/s: **{p['sparse_vs_dense_tokens_per_s']:.2f}×** (median step "
            "after the first; the runs one after the other, alone on the device). Validation loss: each run "
            "with its own attention (the sparse run's is sparse).",
        ]
    profile = p.get("sparse_step_profile")
    if profile:
        mean, step_ms = profile["mean"], profile["mean"]["step_ms"]
        parts = ", ".join(
            f"{phase} {mean[phase]:.1f} ms ({mean[phase] / step_ms:.0%})"
            for phase in ("plan", "attention", "matmul", "optimizer", "other")
        )
        lines += [
            "",
            f"Where the sparse step's time goes (`mtrain profile step`, the sparse-extended model at "
            f"{profile['seq_len']:,} tokens, {profile['steps']} steps after {profile['warmup']}, kernel time per "
            f"step): step {step_ms:.1f} ms; {parts}; density {fmt(profile.get('sparse_density'), 3)}. The plan's "
            f"share of the step: **{mean['plan'] / step_ms:.1%}**.",
        ]
    return lines


def target_lines(p: dict[str, Any]) -> list[str]:
    """The issue's figures to reach, read off the tables: sparse against dense, both against base+YaRN."""
    table, base_context = p["quality"]["table"], p.get("base_context")

    def cell(model: str, metric: str, length: int) -> float | None:
        return (table.get(model, {}).get(metric) or {}).get(length)

    def diff(metric: str, length: int) -> str:
        dense, sparse = cell("dense", metric, length), cell("sparse", metric, length)
        return "–" if dense is None or sparse is None else f"{sparse - dense:+.1f}"

    lines = [
        "",
        "## Figures to reach",
        "",
        f"- base at its context ({base_context}): passkey "
        f"{fmt(cell('base', 'infinitebench/passkey', base_context))}%, "
        f"NIAH {fmt(cell('base', 'niah', base_context))}% (target ≥ 90)",
        f"- sparse / dense training tokens/s {fmt(p.get('sparse_vs_dense_tokens_per_s'), 2)} (target ≥ 2 at the "
        f"longest length)",
        "",
        "| length | ppl sparse / dense − 1 (≤ 2%) | NIAH sparse − dense | RULER niah sparse − dense | RULER all "
        "sparse − dense | ppl below base+YaRN: dense, sparse |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for length in p.get("lengths") or []:
        dense, sparse, yarn = (cell(m, "perplexity", length) for m in ("dense", "sparse", "base-yarn"))
        ratio = f"{100 * (sparse / dense - 1):+.2f}%" if dense and sparse else "–"
        beats = ", ".join("–" if v is None or yarn is None else ("yes" if v < yarn else "NO") for v in (dense, sparse))
        lines.append(
            f"| {label(length)} | {ratio} | {diff('niah', length)} | {diff('ruler niah tasks', length)} | "
            f"{diff('ruler all tasks', length)} | {beats} |"
        )
    return lines


def quality_lines(p: dict[str, Any]) -> list[str]:
    table, samples, lengths = p["quality"]["table"], p["quality"]["samples"], p.get("lengths") or []
    present = {name for model in table.values() for name in model}
    lines = [
        "",
        "## Quality (model × length)",
        "",
        "Each RULER task, and every prompt's answer: the JSON and the logs tarball. RULER means are over the "
        "tasks that ran at a length (qa_1/qa_2 need SQuAD/HotpotQA files, not given).",
        "",
    ]
    for metric in [m for m in HEADLINE_METRICS if m in present]:
        unit = (
            "perplexity on held-out packages; the base beyond its context without YaRN"
            if metric == "perplexity"
            else "% correct"
        )
        counts = sorted({n for model in samples.values() for n in (model.get(metric) or {}).values()})
        note = f"; {'–'.join(map(str, counts[:: max(1, len(counts) - 1)]))} prompts a cell" if counts else ""
        lines += [
            f"**{metric}** ({unit}{note})",
            "",
            "| model | " + " | ".join(map(label, lengths)) + " |",
            "|---|" + "---:|" * len(lengths),
        ]
        for model in MODELS:
            cells = table.get(model, {}).get(metric)
            if cells:
                lines.append(
                    f"| {model} | "
                    + " | ".join(fmt(cells.get(n), 2 if metric == "perplexity" else 1) for n in lengths)
                    + " |"
                )
        lines.append("")
    for model, probe in p["sparsity_by_layer"].items():
        rows = [r for r in probe["lengths"] if r.get("layers") and not r.get("dense_below")]
        if rows:
            lines += [
                f"**Sparse pattern per layer, {model}-extended model** (density / recall; one held-out text, "
                f"settings of the sparse run)",
                "",
                "| layer | " + " | ".join(label(r["length"]) for r in rows) + " |",
                "|---|" + "---:|" * len(rows),
            ]
            for i in range(len(rows[0]["layers"])):
                lines.append(
                    f"| {i} | "
                    + " | ".join(
                        f"{fmt(r['layers'][i]['density'], 3)} / {fmt(r['layers'][i]['recall'], 3)}" for r in rows
                    )
                    + " |"
                )
            lines.append("")
    return lines


def markdown(p: dict[str, Any], files: list[str]) -> str:
    lines = header_lines(p) + training_lines(p) + target_lines(p) + quality_lines(p)
    lines += [f"![{name}]({name})" for name in files]
    lines += ["", "## Skipped and failed", ""]
    lines += [
        f"- {r['name']}: {r['status']} — {r['reason']}" for r in p["records"] if r["status"] in ("fail", "skipped")
    ]
    lines += [f"- eval ({', '.join(models)}): {what}" for what, models in p["quality"]["eval_skipped"].items()]
    return "\n".join(lines) + "\n"


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
        from extension_plots import plot_all  # matplotlib: only once, at the end

        files = plot_all(payload, work / "plots", out, stem)
    if final or bundle_to is not None:
        bundle(work, bundle_to or out / f"{stem}_logs.tar.gz")
    for name, text in (
        (f"{stem}.json", json.dumps(payload, indent=2, default=str) + "\n"),
        (f"{stem}.md", markdown(payload, files)),
    ):
        (out / f"{name}.tmp").write_text(text)
        os.replace(out / f"{name}.tmp", out / name)


def bundle(work: Path, path: Path) -> None:
    """Logs, the job's state (header and records) and the small files runs, evals and probes wrote (no weights,
    no checkpoints, no corpus text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")  # a job stopped while bundling keeps the last whole tarball
    with tarfile.open(partial, "w:gz") as tar:
        for file in sorted(work.rglob("*")):
            parts = file.relative_to(work).parts
            wanted = (
                parts[0] == "logs"
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
                tar.add(file, arcname=f"extension_experiment/{file.relative_to(work)}")
    os.replace(partial, path)
