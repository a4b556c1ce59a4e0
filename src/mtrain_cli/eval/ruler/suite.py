"""The RULER suite: every task at every length, prompts fitted with the model's tokenizer so that
prompt + generation budget fits the target length; scores averaged per task, per length and overall."""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial

from mtrain_cli.eval.haystack import HAYSTACK_DIR, NOISE_HAYSTACK, essay_haystack
from mtrain_cli.eval.options import EvalOptions, path_option
from mtrain_cli.eval.prompts import PromptDoesNotFit, PromptFormat, Sample, build_cells, fit_largest
from mtrain_cli.eval.results import Outcome, Skip, SuiteResult, percent_table, with_mean_row
from mtrain_cli.eval.ruler.niah_tasks import niah_tasks
from mtrain_cli.eval.ruler.qa import qa_tasks
from mtrain_cli.eval.ruler.qa_data import load_hotpot, load_squad
from mtrain_cli.eval.ruler.task import Draft, RulerTask, TaskData
from mtrain_cli.eval.ruler.variable_tracking import variable_tracking_task
from mtrain_cli.eval.ruler.word_extraction import word_extraction_tasks
from mtrain_cli.eval.suite import Suite, SuiteRun

RULER_TASKS: list[RulerTask] = niah_tasks() + [variable_tracking_task()] + word_extraction_tasks() + qa_tasks()
TASK_NAMES = [task.name for task in RULER_TASKS]


def fit_draft(
    task: RulerTask, data: TaskData, fmt: PromptFormat, length: int, index: int, seed: int
) -> tuple[Draft, int, list[int]]:
    """(draft, haystack units, prompt ids) of one sample, deterministic in (seed, task, length, index): the
    first draft whose smallest prompt fits, with the most units that keep prompt + answer budget <= length."""
    rng = random.Random(f"{seed}:ruler:{task.name}:{length}:{index}")
    budget = length - task.max_new_tokens
    failure = PromptDoesNotFit(f"length {length} leaves no room after the {task.max_new_tokens}-token answer budget")
    for draft in task.drafts(rng, data, budget):
        try:
            units, ids = fit_largest(
                lambda n: fmt.encode(draft.render(n), draft.answer_prefix), budget, draft.max_units
            )
        except PromptDoesNotFit as exc:
            failure = exc
            continue
        return draft, units, ids
    raise failure


def build_sample(task: RulerTask, data: TaskData, fmt: PromptFormat, length: int, index: int, seed: int) -> Sample:
    draft, units, ids = fit_draft(task, data, fmt, length, index, seed)
    meta = {**draft.meta, "haystack_units": units, "prompt_tokens": len(ids)}
    return Sample(task.name, length, index, ids, task.max_new_tokens, draft.references, task.metric, meta)


def prepare_ruler(
    fmt: PromptFormat,
    data: TaskData,
    lengths: list[int],
    samples: int,
    seed: int,
    tasks: list[str] | None = None,
    advance: Callable[[int], None] = lambda count: None,
) -> tuple[list[Sample], list[Skip], dict[str, str]]:
    """(samples to run, skipped tasks/cells with reasons, data source of each task that runs); `tasks`: only
    these (None: all). `advance(n)`: n of the len(selected tasks) × len(lengths) × samples prompts are done."""
    skipped: list[Skip] = []
    sources: dict[str, str] = {}
    cells: list[tuple[str, int]] = []  # (task, length) of each cell to build
    builders: list[list[Callable[[], Sample]]] = []
    for task in RULER_TASKS:
        if tasks is not None and task.name not in tasks:
            continue
        reason = task.unavailable(data)
        if reason:
            skipped.append(Skip("ruler", task.name, None, reason))
            advance(len(lengths) * samples)
            continue
        sources[task.name] = task.source(data)
        for length in lengths:
            cells.append((task.name, length))
            builders.append([partial(build_sample, task, data, fmt, length, index, seed) for index in range(samples)])
    prepared: list[Sample] = []
    for (name, length), cell in zip(cells, build_cells(builders, advance)):
        if isinstance(cell, PromptDoesNotFit):
            skipped.append(Skip("ruler", name, length, str(cell)))
        else:
            prepared += cell
    return prepared, skipped, sources


def score_ruler(
    outcomes: list[Outcome], lengths: list[int], skipped: list[Skip], sources: dict[str, str]
) -> SuiteResult:
    rows, overall = with_mean_row(percent_table(outcomes, TASK_NAMES), lengths)
    short = sorted(
        {
            (o.sample.task, o.sample.length)
            for o in outcomes
            if o.sample.meta["prompt_tokens"] < 0.9 * (o.sample.length - o.sample.max_new_tokens)
        }
    )
    details = {
        "overall": overall,
        "mean_per_length": {str(k): v for k, v in rows.get("mean", {}).items()},
        "short_of_target": [
            f"{task} at {length}: the corpus ran out of documents before the target length" for task, length in short
        ],
    }
    return SuiteResult("ruler", "score (%)", rows, sources, skipped, details)


def read_ruler(options: EvalOptions) -> TaskData:
    return TaskData(
        NOISE_HAYSTACK,
        essay_haystack(options.haystack_dir),
        load_squad(options.squad_file),
        load_hotpot(options.hotpot_file),
    )


def run_ruler(run: SuiteRun, data: TaskData) -> tuple[SuiteResult, list[Outcome]]:
    o = run.options
    selected = [task for task in RULER_TASKS if o.tasks is None or task.name in o.tasks]
    with run.preparing("ruler", len(selected) * len(o.lengths) * o.samples) as advance:
        samples, skipped, sources = prepare_ruler(run.fmt, data, o.lengths, o.samples, o.seed, o.tasks, advance)
    outcomes = run.generate(samples, "ruler")
    return score_ruler(outcomes, o.lengths, skipped, sources), outcomes


SQUAD_FILE = path_option("squad_file", "--squad-file", "Local SQuAD v2.0 json (RULER qa_1).")
HOTPOT_FILE = path_option("hotpot_file", "--hotpot-file", "Local HotpotQA json (RULER qa_2).")
SUITE = Suite("ruler", tuple(TASK_NAMES), read_ruler, run_ruler, (HAYSTACK_DIR, SQUAD_FILE, HOTPOT_FILE))
