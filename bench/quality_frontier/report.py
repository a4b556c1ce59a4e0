"""The frontier (frontier.py) as OUT.json, OUT.md and OUT.png: per model, a table of its sparse settings and a plot
of the perplexity gap at the training length (and over its second half) against sparse / dense tokens/s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.extension.markdown import label


def pct(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:+.{digits}f}%"


def times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def num(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def floors_cell(verdicts: dict[str, Any]) -> str:
    marks = []
    for verdict in verdicts.values():
        mark = {True: "✓", False: "✗", None: "–"}[verdict["holds"]]
        marks.append(mark + ("²" if verdict["second_seed_due"] else ""))
    return " ".join(marks) or "–"


def model_lines(name: str, entry: dict[str, Any]) -> list[str]:
    rows = entry["rows"]
    lengths = sorted({n for r in rows for n in r["gap_pct"]})
    longest = lengths[-1] if lengths else None
    lines = [f"## {name}", ""] + ([entry["about"] + ".", ""] if entry["about"] else [])
    if entry["floors"]:
        lines += [f"Floors, in the last column's order: {'; '.join(f['text'] for f in entry['floors'])}.", ""]
    lines += [
        "| variant | seed | "
        + " | ".join(label(n) for n in lengths)
        + f" | sparse prefill {label(longest) if longest else ''} | tokens/s median / all | density / recall "
        "(layer 0) | dense-recall / dense-step | check, last fifth | check − eval | floors |",
        "|---|---|" + "---:|" * len(lengths) + "---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        cells = " | ".join(f"{pct(r['gap_pct'].get(n))} ({pct(r['gap_second_half_pct'].get(n))})" for n in lengths)
        speed = f"{times(r['speed']['median'])} / {times(r['speed']['all_steps'])}" + (
            " here" if r["speed"].get("here") else ""
        )
        recall = f"{num(r['density'])} / {num(r['recall'])} ({num(r['layer0_recall'])})"
        shares = " / ".join("–" if s is None else f"{s:.1%}" for s in (r["dense_recall_share"], r["dense_step_share"]))
        lines.append(
            f"| {r['variant']} | {r['seed']} | {cells} | {pct(r['sparse_prefill_pct'].get(longest))} | {speed} | "
            f"{recall} | {shares} | {pct(r['check']['last_fifth_pct'])} "
            f"({r['check']['checks'] or 0}) | {pct(r['check_minus_eval_pct'])} | {floors_cell(r['floors'])} |"
        )
    a = entry["agreement"]
    if a["runs"]:
        rho = a["spearman_check_eval"]
        rho_prefill = a["spearman_check_sparse_prefill"]
        lines += [
            "",
            f"Dense check against the eval gap at {label(longest)} over {a['runs']} runs: check − eval "
            f"{pct(a['mean_check_minus_eval'])} on average, {a['mean_abs_check_minus_eval']:.2f} points apart; rank "
            f"correlation {num(rho, 2)} (against the sparse model's own sparse-prefill gap: {num(rho_prefill, 2)}).",
        ]
    costs = entry.get("probe_cost") or []
    if costs:
        parts = ", ".join(
            f"{c['variant']} (seed {c['seed']}) {c['share_of_step']:+.1%} ({times(c['speed_on_the_line'])} without it)"
            for c in costs
        )
        lines += [
            "",
            "Runs with more probe queries, above the default probe's line: each one's share of the median step above "
            "the line that the runs of the default probe against the same dense run fit through step time against "
            f"density ({costs[0]['fit_runs']} runs, {max(c['fit_error'] for c in costs):.1%} from it at most): "
            f"{parts}. Its plan's probe work is part of it (`python -m bench.step_variants` splits a step).",
        ]
    niah = [(r, r["niah_sparse_minus_dense"]) for r in rows if r["niah_sparse_minus_dense"]]
    for r, cells in niah:
        parts = ", ".join(
            f"{label(int(n))} {c['mean']:+.1f}"
            + (f" ± {c['ci95']:.1f}" if c["ci95"] is not None else "")
            + f" ({c['prompts']})"
            for n, c in sorted(cells.items(), key=lambda item: int(item[0]))
        )
        lines.append(f"- NIAH sparse − dense, {r['variant']} seed {r['seed']} (paired, points): {parts}")
    lines += ["", "Reports (the sparse job's commit, date, device and versions; the dense run it resumed):"]
    for r in rows:
        if r["seed"] == "pooled":
            continue
        made = r.get("provenance") or {}
        dirty = " + changes" if made.get("dirty") else ""
        dense = f"against the dense run of {r['dense_job']}" if r.get("dense_job") else "dense run not recorded"
        lines.append(
            f"- `{r['file']}`: {made.get('commit')}{dirty}, {made.get('date_utc')}, {r['gpu_name']}, torch "
            f"{made.get('torch')}, triton {made.get('triton')}, {dense}"
        )
    return lines


def markdown(result: dict[str, Any], figure: str | None) -> str:
    lines = [
        "# Sparse training's quality frontier",
        "",
        f"Command: `{result['command']}`. A row: one sparse run against its model's dense run of the same base, "
        "data, steps and training seed (bench/extension), both models evaluated with dense attention on held-out "
        "code. Per length: perplexity sparse / dense − 1, and (in brackets) the same over each length's second "
        "half. Sparse prefill: the sparse model with sparse prefill against itself with dense attention. "
        "Tokens/s: sparse / dense by the median step and over all steps, the dense checks' seconds taken out; "
        '"here": against the dense run trained again on the sparse run\'s machine (bench.extension --dense-here), '
        "else against the dense run's own job, another machine (machines differ by 1–2%). "
        "Density / recall: the sparse run's plans (layer 0's recall). Dense-recall / dense-step: the share of layer "
        "calls the recall controller ran dense, and of those in dense steps (`dense_every`). Check: the dense "
        "check's mean loss gap over the last fifth of the run as a perplexity ratio − 1 (checks); check − eval: "
        "that minus the gap at the training length. Floors: ✓ holds, "
        "✗ does not, ² within 0.2 of the bound on one training seed (a second is due); pooled rows: the mean "
        "over training seeds.",
        "",
    ]
    if figure:
        lines += [f"![gap against speed]({figure})", ""]
    for name, entry in result["frontier"]["models"].items():
        lines += model_lines(name, entry) + [""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Per model a column: the gap at the training length (top) and over its second half (bottom) against sparse /
    dense tokens/s, the median step filled, all steps open; dense at (1, 0); the floors dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["frontier"]["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 8), squeeze=False)
    for column, (name, entry) in enumerate(models.items()):
        rows = [r for r in entry["rows"] if r["gap_pct"]]
        for row_index, key in enumerate(("gap_pct", "gap_second_half_pct")):
            ax = axes[row_index][column]
            ax.plot([1.0], [0.0], "k*", markersize=10, label="dense")
            for index, r in enumerate(rows):
                longest = max(r["gap_pct"])
                gap, speed = r[key].get(longest), r["speed"]
                if gap is None or speed["median"] is None:
                    continue
                color = f"C{index % 10}"
                ax.plot([speed["median"]], [gap], "o", color=color, label=f"{r['variant']} (seed {r['seed']})")
                if speed["all_steps"] is not None:
                    ax.plot([speed["all_steps"]], [gap], "o", mfc="none", color=color)
                    ax.plot([speed["median"], speed["all_steps"]], [gap, gap], "-", color=color, linewidth=0.8)
            for floor in entry["floors"]:
                if floor["figure"] == {"gap_pct": "gap", "gap_second_half_pct": "gap, second half"}[key]:
                    ax.axhline(floor["bound"], linestyle="--", color="grey", linewidth=0.8)
                elif floor["figure"].startswith("speed"):
                    ax.axvline(floor["bound"], linestyle="--", color="grey", linewidth=0.8)
            where = "the training length's second half" if row_index else "the training length"
            ax.set_title(f"{name}: gap at {where}" if rows else name, fontsize=10)
            ax.set_xlabel("sparse / dense tokens/s (filled: median step, open: all steps)")
            ax.set_ylabel("perplexity sparse / dense − 1 (%)")
            ax.grid(alpha=0.3)
            if row_index == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict[str, Any], stem: Path) -> list[Path]:
    """STEM.json, STEM.png (where any row has a gap and a speed) and STEM.md. -> the files written."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    files = [stem.with_suffix(".json")]
    files[0].write_text(json.dumps(result, indent=2) + "\n")
    figure = None
    if any(r["gap_pct"] for entry in result["frontier"]["models"].values() for r in entry["rows"]):
        plot(result, stem.with_suffix(".png"))
        figure = stem.with_suffix(".png").name
        files.append(stem.with_suffix(".png"))
    stem.with_suffix(".md").write_text(markdown(result, figure))
    return [*files, stem.with_suffix(".md")]
