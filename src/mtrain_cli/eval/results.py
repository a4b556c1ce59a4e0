"""Results of one eval run: per-suite tables (rows x lengths), skipped tasks with reasons, and the run
directory with results.json, predictions.jsonl, summary.md and a rich table on screen."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mtrain_cli.eval.prompts import Sample


@dataclass
class Skip:
    suite: str
    task: str
    length: int | None  # None: skipped at every length
    reason: str


@dataclass
class Outcome:
    sample: Sample
    prediction: str
    score: float  # in [0, 1]


@dataclass
class SuiteResult:
    name: str
    metric: str  # what the table's numbers are, e.g. "score (%)"
    rows: dict[str, dict[int, float]]  # row label -> length -> value
    sources: dict[str, str]  # task -> where its data came from
    skipped: list[Skip] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # written next to results.json


def percent_table(outcomes: list[Outcome], tasks: list[str]) -> dict[str, dict[int, float]]:
    """task -> length -> mean score in percent, tasks in the given order, cells only where samples ran."""
    table: dict[str, dict[int, list[float]]] = {}
    for outcome in outcomes:
        table.setdefault(outcome.sample.task, {}).setdefault(outcome.sample.length, []).append(outcome.score)
    return {
        task: {length: 100 * sum(s) / len(s) for length, s in sorted(table[task].items())}
        for task in tasks
        if task in table
    }


def with_mean_row(
    rows: dict[str, dict[int, float]], lengths: list[int]
) -> tuple[dict[str, dict[int, float]], float | None]:
    """Adds a "mean" row (over the tasks that ran at each length) and returns the overall mean of it."""
    means = {}
    for length in lengths:
        values = [cells[length] for cells in rows.values() if length in cells]
        if values:
            means[length] = sum(values) / len(values)
    overall = sum(means.values()) / len(means) if means else None
    return ({**rows, "mean": means} if means else rows), overall


def make_run_dir(out: Path | None, model_name: str) -> Path:
    parent = Path(out).expanduser() if out is not None else Path.cwd()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    safe_name = "".join(c if c.isalnum() or c in "-_." else "-" for c in model_name) or "model"
    run_dir = parent / f"eval-{safe_name}-{stamp}"
    suffix = 1
    while run_dir.exists():
        suffix += 1
        run_dir = parent / f"eval-{safe_name}-{stamp}-{suffix}"
    run_dir.mkdir(parents=True)
    return run_dir


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if math.isfinite(value) and value < 1e6 else f"{value:.3g}"


def _columns(result: SuiteResult, lengths: list[int]) -> list[int]:
    present = {length for cells in result.rows.values() for length in cells}
    return [length for length in lengths if length in present]


def length_label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def rich_table(result: SuiteResult, lengths: list[int]) -> Table:
    columns = _columns(result, lengths)
    table = Table(title=f"{result.name}: {result.metric}")
    table.add_column("task")
    for length in columns:
        table.add_column(length_label(length), justify="right")
    for row, cells in result.rows.items():
        table.add_row(row, *(_cell(cells.get(length)) for length in columns))
    return table


def markdown_table(result: SuiteResult, lengths: list[int]) -> str:
    if not result.rows:
        return "No results (see Skipped)."
    columns = _columns(result, lengths)
    lines = [
        "| task | " + " | ".join(length_label(length) for length in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for row, cells in result.rows.items():
        lines.append(f"| {row} | " + " | ".join(_cell(cells.get(length)) for length in columns) + " |")
    return "\n".join(lines)


def sparse_lines(sparse: dict[str, Any]) -> list[str]:
    """summary.md's account of a sparse run: settings and where they came from, what ran, recall, density."""
    settings = ", ".join(f"{key} {value}" for key, value in sparse["settings"].items())
    calls = ", ".join(f"{path} {count}" for path, count in sparse["attention_calls"].items()) or "none"
    recall = "-" if sparse["sparse_recall"] is None else f"{sparse['sparse_recall']:.3f}"
    density = "-" if sparse["sparse_density"] is None else f"{sparse['sparse_density']:.3f}"
    dense_below = sparse["settings"]["dense_below"]
    return [
        f"- sparse settings: {settings}; from {sparse['settings_source']}",
        f"- attention calls by path: {calls} (prefill runs sparse in one chunk; decoding is dense on the cache)",
        (
            f"- sparse plans: mean recall {recall} (probe queries' attention mass kept) over the "
            f"{sparse['prefills_probed']} of {sparse['prefills']} prompts of at least dense_below ({dense_below}) "
            f"tokens; mean density {density} (share of causal blocks computed) over all {sparse['prefills']}"
        ),
    ]


def write_results(
    run_dir: Path, header: dict[str, Any], suites: list[SuiteResult], outcomes: list[Outcome], console: Console
) -> None:
    skipped = [skip for suite in suites for skip in suite.skipped]
    payload = {
        **header,
        "suites": {
            suite.name: {
                **asdict(suite),
                "rows": {row: {str(k): v for k, v in cells.items()} for row, cells in suite.rows.items()},
            }
            for suite in suites
        },
        "skipped": [asdict(skip) for skip in skipped],
    }
    (run_dir / "results.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    with open(run_dir / "predictions.jsonl", "w") as handle:
        for outcome in outcomes:
            sample = outcome.sample
            handle.write(
                json.dumps(
                    {
                        "task": sample.task,
                        "length": sample.length,
                        "index": sample.index,
                        "prediction": outcome.prediction,
                        "references": sample.references,
                        "score": outcome.score,
                        "prompt_tokens": len(sample.input_ids),
                        "max_new_tokens": sample.max_new_tokens,
                        "meta": sample.meta,
                    },
                    default=str,
                )
                + "\n"
            )
    lengths = header["lengths"]
    parts = [
        f"# mtrain eval: {header['model']['name']}",
        "",
        f"- model: `{header['model']['path']}` ({header['model']['source']})",
        f"- attention: {header['attention']}, dtype {header['dtype']}, device {header['device']}",
        *([f"- {header['yarn']['note']}"] if header.get("yarn") else []),
        *(sparse_lines(header["sparse"]) if header.get("sparse") else []),
        f"- seed {header['seed']}, samples {header['samples']}, decoded in batches of {header['batch_size']}, "
        f"chat template {header['chat_template']}",
        f"- wall time {header['wall_time_s']:.1f} s",
        f"- command: `{header['command']}`",
        "",
    ]
    parts += [f"**Note:** {note}" for note in header["notes"]] + ([""] if header["notes"] else [])
    for suite in suites:
        parts += [f"## {suite.name} — {suite.metric}", "", markdown_table(suite, lengths), ""]
        parts += [f"- {task}: {source}" for task, source in suite.sources.items()]
        parts += [f"- ![{name}]({name})" for name in suite.files if name.endswith(".png")]
        parts.append("")
    if skipped:
        parts += ["## Skipped", ""]
        parts += [f"- {s.suite}/{s.task}" + (f" at {s.length}" if s.length else "") + f": {s.reason}" for s in skipped]
    (run_dir / "summary.md").write_text("\n".join(parts).rstrip() + "\n")
    for suite in suites:
        if suite.rows:
            console.print(rich_table(suite, lengths))
    for note in header["notes"]:
        console.print(f"[yellow]note[/yellow] {note}", soft_wrap=True)
    for skip in skipped:
        console.print(
            f"[yellow]skipped[/yellow] {skip.suite}/{skip.task}"
            + (f" at {skip.length}" if skip.length else "")
            + f": {skip.reason}",
            soft_wrap=True,
        )
    console.print(f"results: {run_dir}")
