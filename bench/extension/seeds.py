"""Training-seed noise: runs of the extension experiment that differ only in the extensions' training seed
(`--extend-set run.seed=N --tag seedN`, the same base, corpus and eval prompts), side by side.

For each evaluated length: sparse − dense in each run and pooled over the runs, and the training noise, i.e. the
same mode trained with another seed (last run − first), for dense and for sparse. Retrieval differences are
paired by prompt (predictions.jsonl in each run's logs tarball; report.py's pairing), over the
prompts that both sides answered, with a 95% half-width (normal approximation); perplexity is the ratio of the
table values. Writes OUT.json and OUT.md.

    python3 -m bench.extension.seeds --out bench/extension/results/extension_experiment_h100_multi_seeds \\
        SEED0.json SEED1.json              # each run's report, with its logs tarball beside it: SEED0_logs.tar.gz
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.extension.markdown import label
from bench.extension.report import BUNDLE_ROOT, PAIRED_METRICS, answers, mean_with_ci95, prompt_differences, prompt_key


def read_logs(report: dict[str, Any], tarball: Path) -> tuple[int, dict[str, dict[tuple, float]]]:
    """(the extensions' training seed, from their config.yaml; model -> prompt_key -> score, from the passed eval
    jobs' predictions, read as the report reads them)."""
    scores: dict[str, dict[tuple, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(tarball) as tar:
        tar.extractall(tmp, filter="data")
        work = Path(tmp) / BUNDLE_ROOT
        seeds = {
            yaml.safe_load(p.read_text())["run"]["seed"]
            for mode in ("dense", "sparse")
            for p in (work / "runs" / mode).glob("*/config.yaml")
        }
        assert len(seeds) == 1, f"{tarball}: the dense and sparse runs have seeds {seeds}"
        here = [{**rec, "run_dir": str(work / "evals" / rec["name"])} for rec in report["records"]]  # not the device's
        for rec, p in answers(here):
            scores.setdefault(rec["meta"]["model"], {})[prompt_key(rec, p)] = p["score"]
    return seeds.pop(), scores


def ppl_ratio(report_a: dict, model_a: str, report_b: dict, model_b: str) -> dict[int, float]:
    """length -> perplexity of (report_b, model_b) / (report_a, model_a) − 1, in %."""
    table_a = report_a["quality"]["table"].get(model_a, {}).get("perplexity", {})
    table_b = report_b["quality"]["table"].get(model_b, {}).get("perplexity", {})
    return {int(n): 100 * (table_b[n] / table_a[n] - 1) for n in table_a if n in table_b}


def summarise(diffs: dict[str, dict[int, list[float]]]) -> dict[str, dict[int, dict[str, Any]]]:
    return {metric: {n: mean_with_ci95(values) for n, values in cells.items()} for metric, cells in diffs.items()}


def compare(paths: list[Path]) -> dict[str, Any]:
    reports = [json.loads(p.read_text()) for p in paths]
    logs = [read_logs(r, p.with_name(p.stem + "_logs.tar.gz")) for r, p in zip(reports, paths, strict=True)]
    scores = [s for _seed, s in logs]
    sparse_minus_dense = [prompt_differences(s.get("dense", {}), s.get("sparse", {})) for s in scores]
    pooled: dict[str, dict[int, list[float]]] = {}
    for diffs in sparse_minus_dense:
        for metric, cells in diffs.items():
            for length, values in cells.items():
                pooled.setdefault(metric, {}).setdefault(length, []).extend(values)
    return {
        "runs": [
            {
                "file": p.name,
                "training_seed": seed,
                "date_utc": r["date_utc"],
                "src_sha256": r["src_sha256"],
                "sparse_vs_dense_tokens_per_s": r["sparse_vs_dense_tokens_per_s"],
                "ppl_sparse_vs_dense_pct": ppl_ratio(r, "dense", r, "sparse"),
                "sparse_minus_dense": summarise(diffs),
            }
            for r, p, (seed, _s), diffs in zip(reports, paths, logs, sparse_minus_dense, strict=True)
        ],
        "pooled_sparse_minus_dense": summarise({m: dict(sorted(c.items())) for m, c in pooled.items()}),
        "training_noise": {
            mode: {
                "ppl_pct": ppl_ratio(reports[0], mode, reports[-1], mode),
                "retrieval": summarise(prompt_differences(scores[0].get(mode, {}), scores[-1].get(mode, {}))),
            }
            for mode in ("dense", "sparse")
        },
    }


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2f}%"


def cell(c: dict[str, Any] | None) -> str:
    if not c:
        return "–"
    half = f" ± {c['ci95']:.1f}" if c["ci95"] is not None else ""
    return f"{c['mean']:+.1f}{half} ({c['prompts']})"


def markdown(result: dict[str, Any]) -> str:
    runs, noise = result["runs"], result["training_noise"]
    lengths = sorted({n for run in runs for n in run["ppl_sparse_vs_dense_pct"]})
    head = "| length | " + " | ".join(label(n) for n in lengths) + " |\n|---|" + "---:|" * len(lengths)
    lines = [
        "# Context extension, training-seed noise",
        "",
        "Runs of the extension experiment (bench/extension_experiment.sh) that differ only in the extensions' "
        "training seed (same base, corpus and eval prompts): "
        + "; ".join(f"`{r['file']}` (seed {r['training_seed']}, {r['date_utc']}, src {r['src_sha256']})" for r in runs)
        + ".",
        f"Command: `{result['command']}`.",
        "",
        "Retrieval in points, paired by prompt: mean ± 95% half-width (prompts). Perplexity: ratio − 1, in %.",
        "",
        "Sparse / dense training tokens/s: "
        + ", ".join(f"seed {r['training_seed']} {r['sparse_vs_dense_tokens_per_s']:.2f}×" for r in runs)
        + ".",
        "",
        "## Sparse − dense",
        "",
        head,
    ]
    for run in runs:
        lines.append(
            f"| ppl, seed {run['training_seed']} | "
            + " | ".join(pct(run["ppl_sparse_vs_dense_pct"].get(n)) for n in lengths)
            + " |"
        )
    for metric in PAIRED_METRICS:
        for run in runs:
            by_length = run["sparse_minus_dense"].get(metric, {})
            cells = " | ".join(cell(by_length.get(n)) for n in lengths)
            lines.append(f"| {metric}, seed {run['training_seed']} | {cells} |")
        pooled = result["pooled_sparse_minus_dense"].get(metric, {})
        lines.append(f"| **{metric}, pooled** | " + " | ".join(cell(pooled.get(n)) for n in lengths) + " |")
    first, last = runs[0]["training_seed"], runs[-1]["training_seed"]
    lines += ["", f"## Training noise: the same mode, seed {last} − seed {first}", "", head]
    for mode, parts in noise.items():
        lines.append(f"| ppl, {mode} | " + " | ".join(pct(parts["ppl_pct"].get(n)) for n in lengths) + " |")
        for metric in PAIRED_METRICS:
            by_length = parts["retrieval"].get(metric, {})
            lines.append(f"| {metric}, {mode} | " + " | ".join(cell(by_length.get(n)) for n in lengths) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.extension.seeds", description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="report JSONs, each with its _logs.tar.gz beside it")
    parser.add_argument("--out", required=True, type=Path, help="output stem: writes STEM.json and STEM.md")
    args = parser.parse_args()
    if len(args.reports) < 2:
        parser.error("give at least two report JSONs (runs with different --extend-set run.seed)")
    result = {"command": shlex.join(["python3", "-m", "bench.extension.seeds", *sys.argv[1:]]), **compare(args.reports)}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    main()
