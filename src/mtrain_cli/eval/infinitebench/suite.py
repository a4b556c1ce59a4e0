"""The InfiniteBench suite: each task from `<task>.jsonl` in --infinitebench-dir (context middle-truncated
so prompt + budget fits each target length), or generated offline for the four synthetic tasks; tasks
with neither are skipped with the reason. A task's file, when present, always wins over its generator."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from mtrain_cli.errors import UserError
from mtrain_cli.eval.haystack import json_kind, utf8_lines
from mtrain_cli.eval.infinitebench.generators import GENERATORS, GeneratedExample
from mtrain_cli.eval.infinitebench.tasks import TASKS, Record, parse_record, references, render
from mtrain_cli.eval.options import EvalOptions, path_option
from mtrain_cli.eval.prompts import (
    PromptDoesNotFit,
    PromptFormat,
    Sample,
    build_cells,
    fit_largest,
    middle_truncate,
)
from mtrain_cli.eval.results import Outcome, Skip, SuiteResult, percent_table, with_mean_row
from mtrain_cli.eval.suite import Suite, SuiteRun


@dataclass
class TaskInput:
    """Where one task's samples come from: records read from its file, or its offline generator."""

    source: str
    records: list[Record] | None  # None: generated offline


def budget_for(task: str, length: int) -> int:
    """The task's official generation budget, capped at a quarter of the target length."""
    return min(TASKS[task].max_new_tokens, length // 4)


def read_records(path: Path, task: str, limit: int) -> list[Record]:
    records = []
    fix = "pass the official <task>.jsonl files (UTF-8, one JSON object per line)"
    for line_number, line in utf8_lines(path, f"--infinitebench-dir: {path}", fix):
        if len(records) >= limit:
            break
        if line.strip():
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"--infinitebench-dir: {path} line {line_number} is not json ({exc.msg}); "
                    f"pass the official <task>.jsonl files"
                ) from None
            if not isinstance(raw, dict):
                raise UserError(
                    f"--infinitebench-dir: {path} line {line_number} is {json_kind(raw)}, not an object; {fix}"
                )
            records.append(parse_record(task, raw, f"{path.name} line {line_number}"))
    return records


def load_infinitebench(
    directory: Path | None, samples: int, seed: int, tasks: list[str] | None = None
) -> tuple[dict[str, TaskInput], list[Skip]]:
    """Reads the first `samples` records of every task file (`tasks`: of these only) up front, so a bad file
    stops the run before the model loads. -> (input of each task that can run, skipped tasks with the reason)."""
    if directory is not None and not directory.is_dir():
        raise UserError(
            f"--infinitebench-dir {str(directory)!r} is not a directory; pass the folder holding "
            f"the official <task>.jsonl files"
        )
    inputs: dict[str, TaskInput] = {}
    skipped: list[Skip] = []
    for task in TASKS if tasks is None else [task for task in TASKS if task in tasks]:
        file = directory / f"{task}.jsonl" if directory is not None else None
        if file is not None and file.is_file():
            records = read_records(file, task, samples)
            if records:
                inputs[task] = TaskInput(f"file {file} (first {len(records)} records)", records)
            else:
                skipped.append(Skip("infinitebench", task, None, f"{file} has no records"))
        elif task in GENERATORS:
            inputs[task] = TaskInput(f"generated offline (seed {seed})", None)
        else:
            where = f"no {task}.jsonl in {directory}" if directory is not None else "no --infinitebench-dir given"
            skipped.append(Skip("infinitebench", task, None, f"{where}, and this task has no offline generator"))
    return inputs, skipped


def truncated_sample(fmt: PromptFormat, task: str, record: Record, length: int, index: int) -> Sample:
    """The record's prompt with its context cut in the middle until prompt + budget fits `length`."""
    max_new = budget_for(task, length)
    budget = length - max_new
    room = budget - len(fmt.encode(*render(task, "", record.input, record.options)))
    if room < 0:
        raise PromptDoesNotFit(f"the prompt without its context is {budget - room} tokens, budget {budget}")
    context_tokens = fmt.count(record.context)
    for _ in range(8):  # decoding then re-encoding a cut can merge tokens differently: shrink until it fits
        context = middle_truncate(fmt.tokenizer, record.context, room)
        ids = fmt.encode(*render(task, context, record.input, record.options))
        if len(ids) <= budget:
            meta = {
                "id": record.id,
                "context_tokens": context_tokens,
                "truncated": context != record.context,
                "prompt_tokens": len(ids),
            }
            return Sample(task, length, index, ids, max_new, references(task, record), TASKS[task].metric, meta)
        room -= len(ids) - budget
    raise PromptDoesNotFit(f"could not truncate record {record.id} to {budget} tokens")


def fit_generated(
    fmt: PromptFormat, task: str, length: int, index: int, samples: int, seed: int
) -> tuple[GeneratedExample, float, int, list[int]]:
    """(example, needle depth %, filler units, prompt ids) of generated sample `index` of `samples`: its
    depth steps evenly from 0% to 100% over the samples; the most filler that fits prompt + budget."""
    rng = random.Random(f"{seed}:infinitebench:{task}:{length}:{index}")
    depth = 100 * index / (samples - 1) if samples > 1 else 50.0
    budget = length - budget_for(task, length)
    example = GENERATORS[task](rng, depth, budget)
    units, ids = fit_largest(
        lambda n: fmt.encode(*render(task, example.context(n), example.input, [])), budget, example.max_units
    )
    return example, depth, units, ids


def generated_sample(fmt: PromptFormat, task: str, length: int, index: int, samples: int, seed: int) -> Sample:
    example, depth, units, ids = fit_generated(fmt, task, length, index, samples, seed)
    meta = {"depth": depth, "filler_units": units, "prompt_tokens": len(ids)}
    return Sample(task, length, index, ids, budget_for(task, length), example.answer, TASKS[task].metric, meta)


def prepare_infinitebench(
    fmt: PromptFormat,
    inputs: dict[str, TaskInput],
    lengths: list[int],
    samples: int,
    seed: int,
    advance: Callable[[int], None] = lambda count: None,
) -> tuple[list[Sample], list[Skip]]:
    """`advance(n)`: n of the prompts are done (each task's records, or `samples`, at every length)."""
    cells: list[tuple[str, int]] = []  # (task, length) of each cell to build
    builders: list[list[Callable[[], Sample]]] = []
    for task, task_input in inputs.items():
        for length in lengths:
            cells.append((task, length))
            if task_input.records is not None:
                records = task_input.records
                builders.append([partial(truncated_sample, fmt, task, r, length, i) for i, r in enumerate(records)])
            else:
                made = [partial(generated_sample, fmt, task, length, i, samples, seed) for i in range(samples)]
                builders.append(made)
    prepared: list[Sample] = []
    skipped: list[Skip] = []
    for (task, length), cell in zip(cells, build_cells(builders, advance)):
        if isinstance(cell, PromptDoesNotFit):
            skipped.append(Skip("infinitebench", task, length, str(cell)))
        else:
            prepared += cell
    return prepared, skipped


def score_infinitebench(
    outcomes: list[Outcome], lengths: list[int], skipped: list[Skip], inputs: dict[str, TaskInput]
) -> SuiteResult:
    rows, overall = with_mean_row(percent_table(outcomes, list(TASKS)), lengths)
    metrics = {task: TASKS[task].metric for task in inputs}
    sources = {task: task_input.source for task, task_input in inputs.items()}
    return SuiteResult("infinitebench", "score (%)", rows, sources, skipped, {"overall": overall, "metrics": metrics})


def read_infinitebench(options: EvalOptions) -> tuple[dict[str, TaskInput], list[Skip]]:
    return load_infinitebench(options.infinitebench_dir, options.samples, options.seed, options.tasks)


def run_infinitebench(
    run: SuiteRun, read: tuple[dict[str, TaskInput], list[Skip]]
) -> tuple[SuiteResult, list[Outcome]]:
    o = run.options
    inputs, read_skipped = read
    total = sum(len(i.records) if i.records is not None else o.samples for i in inputs.values()) * len(o.lengths)
    with run.preparing("infinitebench", total) as advance:
        samples, skipped = prepare_infinitebench(run.fmt, inputs, o.lengths, o.samples, o.seed, advance)
    outcomes = run.generate(samples, "infinitebench")
    return score_infinitebench(outcomes, o.lengths, read_skipped + skipped, inputs), outcomes


INFINITEBENCH_DIR = path_option(
    "infinitebench_dir", "--infinitebench-dir", "Folder of official InfiniteBench <task>.jsonl files."
)
SUITE = Suite("infinitebench", tuple(TASKS), read_infinitebench, run_infinitebench, (INFINITEBENCH_DIR,))
