"""Needle-in-a-Haystack: one needle at each (length, depth) of a grid, scored by whether the needle's
value appears in the answer; a CSV and a heat-map PNG."""

from __future__ import annotations

import csv
import random
from collections.abc import Callable
from functools import partial
from pathlib import Path

from mtrain_cli.eval.haystack import HAYSTACK_DIR, NOISE_HAYSTACK, Haystack, essay_haystack, insert_at_depths
from mtrain_cli.eval.options import EvalOptions
from mtrain_cli.eval.prompts import PromptDoesNotFit, PromptFormat, Sample, build_cells, fit_largest
from mtrain_cli.eval.results import Outcome, Skip, SuiteResult, with_mean_row
from mtrain_cli.eval.suite import Suite, SuiteRun
from mtrain_cli.eval.words import key_word, number_value

DEFAULT_DEPTHS = list(range(0, 101, 10))
NIAH_MAX_NEW_TOKENS = 32
CSV_NAME = "niah.csv"
HEATMAP_NAME = "niah_heatmap.png"


def build_niah_sample(fmt: PromptFormat, haystack: Haystack, length: int, depth: int, index: int, seed: int) -> Sample:
    rng = random.Random(f"{seed}:niah:{length}:{depth}:{index}")
    key, value = key_word(rng), number_value(rng)
    needle = f"The secret code of the {key} is {value}."
    intro = "A secret code is hidden somewhere in the following text. Find it and remember it.\n\n"
    question = f"\n\nWhat is the secret code of the {key}?"
    prefix = f"The secret code of the {key} is"
    budget = length - NIAH_MAX_NEW_TOKENS

    def build(n: int) -> list[int]:
        return fmt.encode(intro + insert_at_depths(haystack.sentences(n), [needle], [depth]) + question, prefix)

    units, ids = fit_largest(build, budget, budget)
    return Sample(
        "niah",
        length,
        index,
        ids,
        NIAH_MAX_NEW_TOKENS,
        [value],
        "contains_value",
        {"depth": depth, "haystack_units": units, "prompt_tokens": len(ids)},
    )


def prepare_niah(
    fmt: PromptFormat,
    haystack: Haystack,
    lengths: list[int],
    depths: list[int],
    samples: int,
    seed: int,
    advance: Callable[[int], None] = lambda count: None,
) -> tuple[list[Sample], list[Skip]]:
    """`advance(n)`: n of the len(lengths) × len(depths) × samples prompts are done."""
    cells = [
        [
            partial(build_niah_sample, fmt, haystack, length, depth, index, seed)
            for depth in depths
            for index in range(samples)
        ]
        for length in lengths
    ]
    prepared: list[Sample] = []
    skipped: list[Skip] = []
    for length, cell in zip(lengths, build_cells(cells, advance)):
        if isinstance(cell, PromptDoesNotFit):
            skipped.append(Skip("niah", "niah", length, str(cell)))
        else:
            prepared += cell
    return prepared, skipped


def score_niah(
    outcomes: list[Outcome],
    lengths: list[int],
    depths: list[int],
    skipped: list[Skip],
    haystack: Haystack,
    run_dir: Path,
) -> SuiteResult:
    cells: dict[tuple[int, int], list[float]] = {}
    for outcome in outcomes:
        cells.setdefault((outcome.sample.length, outcome.sample.meta["depth"]), []).append(outcome.score)
    scores = {cell: 100 * sum(values) / len(values) for cell, values in cells.items()}
    with open(run_dir / CSV_NAME, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["length", "depth_percent", "score_percent", "samples"])
        for (length, depth), values in sorted(cells.items()):
            writer.writerow([length, depth, f"{scores[(length, depth)]:.2f}", len(values)])
    ran = [length for length in lengths if any((length, depth) in scores for depth in depths)]
    files = [CSV_NAME]
    if ran:
        from mtrain_cli.eval.plots import niah_heatmap  # matplotlib

        niah_heatmap(run_dir / HEATMAP_NAME, ran, depths, scores, "Needle in a haystack")
        files.append(HEATMAP_NAME)
    rows = {
        f"depth {depth}%": {length: scores[(length, depth)] for length in lengths if (length, depth) in scores}
        for depth in depths
    }
    rows, overall = with_mean_row(rows, lengths)
    return SuiteResult(
        "niah",
        "needle found (%)",
        rows,
        {"niah": haystack.source},
        skipped,
        {"overall": overall, "depths": depths},
        files,
    )


def read_niah(options: EvalOptions) -> Haystack:
    essay = essay_haystack(options.haystack_dir)
    if essay is not None:
        return essay
    return Haystack(NOISE_HAYSTACK.kind, f"{NOISE_HAYSTACK.source} (no --haystack-dir given)")


def run_niah(run: SuiteRun, haystack: Haystack) -> tuple[SuiteResult, list[Outcome]]:
    o = run.options
    with run.preparing("niah", len(o.lengths) * len(DEFAULT_DEPTHS) * o.samples) as advance:
        samples, skipped = prepare_niah(run.fmt, haystack, o.lengths, DEFAULT_DEPTHS, o.samples, o.seed, advance)
    outcomes = run.generate(samples, "niah")
    return score_niah(outcomes, o.lengths, DEFAULT_DEPTHS, skipped, haystack, run.run_dir), outcomes


SUITE = Suite("niah", ("niah",), read_niah, run_niah, (HAYSTACK_DIR,))
