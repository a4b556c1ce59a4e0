"""Extension recipes side by side: which makes an extended model retrieve at least as well as the base with
YaRN and no training: the fast loop for a recipe, on one GPU at 4K -> 64K.

Each variant is one job of the extension experiment over one base, with its own --extend-set and --tag:
`--phase dense` (or extend, for sparse too). For each variant and each extended model in it: perplexity
against base+YaRN's, and NIAH and RULER's niah tasks against base+YaRN paired by prompt (both evaluated in the
same job, on the same prompts), with 95% half-widths. A variant "matches" where no length is below base+YaRN by
more than its half-width, and "beats" where every mean difference is >= 0. Over one base every job draws the same
eval prompts, so each later variant is also set against the first (the recipe's defaults, say), model by model,
paired by prompt across the jobs: more prompts a cell than base+YaRN's, which a job evaluates for fewer rounds.
Writes OUT.json and OUT.md.

    python3 -m bench.extension.search --out bench/extension/results/extension_recipes_h100 \\
        REPORT_A.json REPORT_B.json ...            # each with its logs tarball beside it: REPORT_A_logs.tar.gz

One device call a variant (its default budget, 560 s: training takes ~170 s of it, and what is left buys eval
rounds, the later ones at the longest lengths, where variants differ), over a 4K base's parts carried as
.exp/base_parts (from `--phase base`):

    OUT=/tmp/o bash bench/extension_experiment.sh --phase dense --base-parts .exp/base_parts \
      --extend-set train.lr=1e-4 --tag lr1e4
    cp /tmp/o/*.json /tmp/o/*.md $OUT/
    cp /tmp/o/dense_parts/logs.tar.gz $OUT/$(basename /tmp/o/*.json .json)_logs.tar.gz
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from bench.extension.markdown import label
from bench.extension.report import PAIRED_METRICS, prompt_differences
from bench.extension.seeds import cell, pct, ppl_ratio, read_logs, summarise

BASELINE = "base-yarn"
EXTENDED = ("dense", "sparse")


def verdict(by_metric: dict[str, dict[int, dict[str, Any]]]) -> str:
    """beats: every paired mean >= 0; matches: none below 0 by more than its half-width; else the cells below."""
    cells = [(metric, n, c) for metric, by_length in by_metric.items() for n, c in sorted(by_length.items())]
    if not cells:
        return "no paired prompts"
    below = [(m, n, c) for m, n, c in cells if c["mean"] < 0]
    if not below:
        return "beats"
    clearly = [f"{m} {label(n)}" for m, n, c in below if c["ci95"] is not None and c["mean"] + c["ci95"] < 0]
    return f"below: {', '.join(clearly)}" if clearly else "matches"


def same_answers(first: dict[tuple, float], second: dict[tuple, float]) -> list[int]:
    """[prompts both answered alike, prompts both answered]: one model's answers in two jobs, a check that the
    jobs asked the same prompts under the same keys."""
    shared = [key for key in second if key in first]
    return [sum(first[key] == second[key] for key in shared), len(shared)]


def compare(paths: list[Path]) -> list[dict[str, Any]]:
    """Each report's extended models against its base+YaRN, and (after the first) against the first report's
    models: over one base, every job draws the same eval prompts, so models of two jobs pair by prompt too."""
    variants = []
    for path in paths:
        report = json.loads(path.read_text())
        _seed, scores = read_logs(report, path.with_name(path.stem + "_logs.tar.gz"))
        if not variants:
            first_report, first_scores = report, scores
        training = report.get("training", {})
        models = {}
        for model in EXTENDED:
            if model not in scores:
                continue
            paired = summarise(prompt_differences(scores.get(BASELINE, {}), scores[model]))
            run = training.get(model, {})
            models[model] = {
                "ppl_vs_base_yarn_pct": ppl_ratio(report, BASELINE, report, model),
                "minus_base_yarn": paired,
                "verdict": verdict(paired),
                "loss_first_last": [run.get("loss_first"), run.get("loss_last")],
                "val_loss": run.get("val_loss"),
            }
            if variants and model in first_scores:
                models[model]["ppl_vs_first_pct"] = ppl_ratio(first_report, model, report, model)
                models[model]["minus_first"] = summarise(prompt_differences(first_scores[model], scores[model]))
        variants.append(
            {
                "file": path.name,
                "extend_set": report.get("extend_set", []),
                "extend_steps": report.get("extend_steps"),
                "date_utc": report.get("date_utc"),
                "gpu": report.get("gpu"),
                "gpu_name": report.get("gpu_name"),
                "versions": report.get("versions", {}),
                "git_commit": report.get("git_commit"),
                "job_commands": [job["command"] for job in report.get("jobs", [])],
                "src_sha256": report.get("src_sha256"),
                "models": models,
                "base_yarn_same_answers_as_first": same_answers(
                    first_scores.get(BASELINE, {}), scores.get(BASELINE, {})
                ),
            }
        )
    return variants


def variant_name(variant: dict[str, Any]) -> str:
    return " ".join(variant["extend_set"]) or "(recipe defaults)"


def markdown(result: dict[str, Any]) -> str:
    variants = result["variants"]
    lengths = sorted(
        {int(n) for v in variants for m in v["models"].values() for n in m["ppl_vs_base_yarn_pct"]}
        | {n for v in variants for m in v["models"].values() for c in m["minus_base_yarn"].values() for n in c}
    )
    head = "| variant | model | what | " + " | ".join(label(n) for n in lengths) + " | verdict |"
    lines = [
        "# Extension recipes against base+YaRN",
        "",
        f"Command: `{result['command']}`. Each row: an extended model of one variant (its --extend-set) minus",
        "base+YaRN untrained, evaluated in the same job on the same prompts. Retrieval in points, paired by",
        "prompt: mean ± 95% half-width (prompts); perplexity: ratio − 1, in % (lower is better).",
        "",
        head,
        "|---|---|---|" + "---:|" * len(lengths) + "---|",
    ]
    for v in variants:
        name = variant_name(v)
        for model, m in v["models"].items():
            ppl = " | ".join(pct(m["ppl_vs_base_yarn_pct"].get(n)) for n in lengths)
            lines.append(f"| {name} | {model} | ppl | {ppl} | {m['verdict']} |")
            for metric in PAIRED_METRICS:
                by_length = m["minus_base_yarn"].get(metric, {})
                lines.append(f"| | | {metric} | " + " | ".join(cell(by_length.get(n)) for n in lengths) + " | |")
    later = [v for v in variants[1:] if any("minus_first" in m for m in v["models"].values())]
    if later:
        first = variant_name(variants[0])
        alike = [v["base_yarn_same_answers_as_first"] for v in later]
        lines += [
            "",
            f"Each later variant minus the first (`{first}`): the same model of two jobs, paired by prompt. Over",
            "one base every job draws the same eval prompts; base+YaRN, evaluated in each job, answered "
            + ", ".join(f"{same} of {shared}" for same, shared in alike)
            + " shared prompts alike.",
            "",
            head.replace(" verdict |", ""),
            "|---|---|---|" + "---:|" * len(lengths),
        ]
        for v in later:
            name = variant_name(v)
            for model, m in v["models"].items():
                if "minus_first" not in m:
                    continue
                ppl = " | ".join(pct(m["ppl_vs_first_pct"].get(n)) for n in lengths)
                lines.append(f"| {name} | {model} | ppl | {ppl} |")
                for metric in PAIRED_METRICS:
                    by_length = m["minus_first"].get(metric, {})
                    lines.append(f"| | | {metric} | " + " | ".join(cell(by_length.get(n)) for n in lengths) + " |")
    lines += ["", "Tried, one line each (validation loss on held-out code, before and after training):", ""]
    for v in variants:
        name = variant_name(v)
        for model, m in v["models"].items():
            val = m["val_loss"] or {}
            loss = f"{val[min(val, key=int)]:.3f} -> {val[max(val, key=int)]:.3f}" if val else "–"
            steps = f", {v['extend_steps']} steps" if v["extend_steps"] else ""
            lines.append(f"- `{name}`, {model}{steps}: val loss {loss}; {m['verdict']}")
    lines += ["", "Reports, and the device jobs behind each (the base's job, then the variant's):", ""]
    for v in variants:
        versions = ", ".join(f"{k} {v['versions'][k]}" for k in ("torch", "triton") if k in v["versions"])
        lines.append(
            f"- `{v['file']}`: {v['gpu_name'] or v['gpu']}, {versions}, {v['date_utc']}, commit "
            f"{(v['git_commit'] or '?')[:12]}; " + "; ".join(f"`{c}`" for c in v["job_commands"])
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.extension.search", description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="report JSONs, each with its _logs.tar.gz beside it")
    parser.add_argument("--out", required=True, type=Path, help="output stem: writes STEM.json and STEM.md")
    args = parser.parse_args()
    result = {
        "command": shlex.join(["python3", "-m", "bench.extension.search", *sys.argv[1:]]),
        "variants": compare(args.reports),
    }
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    main()
