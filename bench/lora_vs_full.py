"""LoRA against full fine-tuning of the same base, at the same steps and length: perplexity by length, side by side.

Both are extension-experiment reports (`python -m bench.extension`) of one base: the quality frontier's `llama3`
base (bench/quality_frontier: a 28M Llama pretrained here at 2K, extended 32x to 64K, 150 steps). The full
fine-tuning twin is that study's dense run (its call 2); the LoRA twin is the same dense job with LoRA through
--extend-set. Floor (issue 61): the LoRA model's perplexity within 5% of its full fine-tuning twin's at every length.

Device calls (1 H200; carry [".whl", ".exp/llama3/base_parts"], the base from `quality_frontier call llama3 1`):
  PYTHONPATH=src python3 -m bench.quality_frontier call llama3 2           # full: extension_experiment_*_llama3.json
  OUT=$OUT bash bench/extension_experiment.sh --scale 64k --phase dense --evals pg19 \\
    --base-parts .exp/llama3/base_parts --tag llama3-lora --extend-steps 150 --budget 420 \\
    --extend-set train.lora.rank=64 --extend-set train.lora.alpha=128 \\
    --extend-set train.lora.train_embeddings_norms=true --extend-set train.lr=1e-3
then, here:
  python -m bench.lora_vs_full FULL.json LORA.json --out bench/results/lora_vs_full_<gpu>
(FULL.json, LORA.json: the two jobs' extension_experiment_<gpu>_64k_dense_*.json.) Writes OUT.json and OUT.md. The
steps are fixed (a budget would otherwise fit fewer): the comparison refuses runs of different steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FLOOR = 0.05  # LoRA's perplexity at most 5% above full fine-tuning's


def perplexities(report: dict, model: str) -> dict[int, float]:
    table = (report.get("quality") or {}).get("table") or {}
    return {int(length): value for length, value in ((table.get(model) or {}).get("perplexity") or {}).items()}


def job_record(report: dict) -> dict:
    """Where and how a job ran: its date, commit, versions and command."""
    versions = report.get("versions") or {}
    return {
        "date_utc": report.get("date_utc"),
        "git_commit": report.get("git_commit"),
        "num_files_changed": len(report.get("git_dirty") or []),  # the device's checkout: the commit + these
        "torch": versions.get("torch"),
        "triton": versions.get("triton"),
        "command": report.get("command"),
    }


def compare(full: dict, lora: dict) -> dict:
    """Per trained model (dense, sparse) and length: both perplexities, LoRA / full - 1, and the floor's verdict."""
    if full.get("extend_steps") != lora.get("extend_steps"):
        raise SystemExit(f"the runs trained {full.get('extend_steps')} and {lora.get('extend_steps')} steps")
    rows = {}
    for model in ("dense", "sparse"):
        ours, theirs = perplexities(lora, model), perplexities(full, model)
        rows[model] = [
            {
                "length": length,
                "full": theirs[length],
                "lora": ours[length],
                "gap": ours[length] / theirs[length] - 1,
            }
            for length in sorted(set(ours) & set(theirs))
        ]
    dense = rows["dense"]
    return {
        "extend_steps": full.get("extend_steps"),
        "lengths": full.get("lengths"),
        "gpu": full.get("gpu_name"),
        "lora_extend_set": lora.get("extend_set"),
        "full_training": {m: (full.get("training") or {}).get(m) for m in ("dense", "sparse")},
        "lora_training": {m: (lora.get("training") or {}).get(m) for m in ("dense", "sparse")},
        "jobs": {name: job_record(report) for name, report in (("full", full), ("lora", lora))},
        "rows": rows,
        "floor": FLOOR,
        "meets_floor": bool(dense) and all(row["gap"] <= FLOOR for row in dense),
    }


def markdown(result: dict) -> str:
    lines = [
        f"{result['gpu']} · {result['extend_steps']} extension steps each · "
        f"LoRA: {' '.join(result['lora_extend_set'])}",
        "",
        "| trained | length | full fine-tuning ppl | LoRA ppl | LoRA / full − 1 |",
        "|---|---:|---:|---:|---:|",
    ]
    for model, rows in result["rows"].items():
        lines += [
            f"| {model} | {row['length']:,} | {row['full']:.3f} | {row['lora']:.3f} | {row['gap']:+.2%} |"
            for row in rows
        ]
    for name in ("full", "lora"):
        training = result[f"{name}_training"]["dense"] or {}
        trainable = training.get("num_trainable_params")
        lines.append(
            f"\n{name}, dense training: {training.get('steps')} steps, {training.get('tokens_per_s') or 0:,.0f} "
            f"tokens/s (median step), peak {training.get('peak_mem_gib') or 0:.1f} GiB, "
            f"{training.get('num_params') or 0:,} parameters"
            + (f", {trainable:,} trained" if trainable is not None else "")
        )
    lines.append("")
    for name, job in result["jobs"].items():
        lines.append(
            f"- {name}: {job['date_utc']}, commit {(job['git_commit'] or '?')[:12]} "
            f"({job['num_files_changed']} files changed), torch {job['torch']}, "
            f"triton {job['triton']}: `{job['command']}`"
        )
    verdict = "meets" if result["meets_floor"] else "misses"
    lines.append(f"\nLoRA (dense training) {verdict} the floor: within {result['floor']:.0%} of full at every length.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_vs_full", description=__doc__.splitlines()[0])
    parser.add_argument("full", type=Path, help="the report of the full fine-tuning (extend job without --tag)")
    parser.add_argument("lora", type=Path, help="the report of the LoRA extend job (--tag lora)")
    parser.add_argument("--out", type=Path, required=True, help="output stem: writes OUT.json and OUT.md")
    args = parser.parse_args()
    result = compare(json.loads(args.full.read_text()), json.loads(args.lora.read_text()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
