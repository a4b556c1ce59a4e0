"""RULER's eight needle-in-a-haystack variants: single (noise / essay haystack, number / UUID values),
multi-key (distractor needles in an essay, or a haystack made only of needles), multi-value, multi-query.

Each needle sits at a depth drawn from a 40-point grid over 0-100%; the answer is every queried value.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from mtrain_cli.eval.haystack import Haystack, insert_at_depths
from mtrain_cli.eval.ruler.task import Draft, RulerTask, TaskData
from mtrain_cli.eval.words import KEY_SPACE, distinct_keys, number_value, uuid_value

DEPTH_GRID = [round(100 * i / 39) for i in range(40)]
NIAH_MAX_NEW_TOKENS = 128
ESSAY_MISSING = "no --haystack-dir given, so not essays but the {}"


@dataclass(frozen=True)
class NeedleSpec:
    haystack: str  # "noise" | "essay" | "needles"
    key_kind: str  # "words" | "uuids"
    value_kind: str  # "numbers" | "uuids"
    num_keys: int = 1  # needles with different keys (1 queried unless num_queries > 1)
    num_values: int = 1  # values under the queried key
    num_queries: int = 1


SPECS = {
    "niah_single_1": NeedleSpec("noise", "words", "numbers"),
    "niah_single_2": NeedleSpec("essay", "words", "numbers"),
    "niah_single_3": NeedleSpec("essay", "words", "uuids"),
    "niah_multikey_1": NeedleSpec("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NeedleSpec("needles", "words", "numbers"),
    "niah_multikey_3": NeedleSpec("needles", "uuids", "uuids"),
    "niah_multivalue": NeedleSpec("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NeedleSpec("essay", "words", "numbers", num_keys=4, num_queries=4),
}


def _keys(rng: random.Random, kind: str, count: int) -> list[str]:
    return distinct_keys(rng, count) if kind == "words" else [uuid_value(rng) for _ in range(count)]


def _value(rng: random.Random, kind: str) -> str:
    return number_value(rng) if kind == "numbers" else uuid_value(rng)


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _join_queries(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + f", and {keys[-1]}"


def _haystack_for(spec: NeedleSpec, data: TaskData) -> Haystack:
    return data.noise if spec.haystack == "noise" or data.essay is None else data.essay


def _distractor_keys(rng: random.Random, spec: NeedleSpec, keys: list[str], budget: int) -> list[str]:
    """Keys for the needles-only haystack: enough to fill `budget` tokens at >= 8 tokens a needle (one is
    ~17 with common tokenizers); word keys are capped by how many distinct ones exist (12,397)."""
    if spec.key_kind == "uuids":
        return [uuid_value(rng) for _ in range(budget // 8)]
    taken = set(keys)
    unused = [key for key in KEY_SPACE if key not in taken]
    return rng.sample(unused, min(budget // 8, len(unused)))


def make_drafts(spec: NeedleSpec, rng: random.Random, data: TaskData, budget: int) -> Iterator[Draft]:
    kind = spec.value_kind
    keys = _keys(rng, spec.key_kind, spec.num_keys)
    values = {key: [_value(rng, kind) for _ in range(spec.num_values)] for key in keys}
    needles = [(key, value) for key in keys for value in values[key]]
    rng.shuffle(needles)
    depths = [rng.choice(DEPTH_GRID) for _ in needles]
    queried = keys[: spec.num_queries]
    references = [value for key in queried for value in values[key]]
    needle_texts = [_needle(kind, key, value) for key, value in needles]

    if spec.haystack == "needles":
        filler = [_needle(kind, key, _value(rng, kind)) for key in _distractor_keys(rng, spec, keys, budget)]
        max_units = len(filler)

        def sentences(n: int) -> list[str]:
            return filler[:n]
    else:
        max_units = budget  # every sentence or word is at least one token
        sentences = _haystack_for(spec, data).sentences

    query = _join_queries(queried)
    intro = (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind} afterwards.\n"
    )
    question = f"\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"

    def render(n: int) -> str:
        return intro + insert_at_depths(sentences(n), needle_texts, depths) + question

    yield Draft(
        render,
        f"The special magic {kind} for {query} mentioned in the provided text are",
        references,
        max_units,
        {"depths": depths},
    )


def _source(spec: NeedleSpec):
    def source(data: TaskData) -> str:
        if spec.haystack == "needles":
            return "synthetic: a haystack of distractor needles"
        if spec.haystack == "noise":
            return data.noise.source
        return data.essay.source if data.essay else ESSAY_MISSING.format(data.noise.source)

    return source


def niah_tasks() -> list[RulerTask]:
    return [
        RulerTask(
            name,
            NIAH_MAX_NEW_TOKENS,
            "string_match_all",
            lambda rng, data, budget, spec=spec: make_drafts(spec, rng, data, budget),
            source=_source(spec),
        )
        for name, spec in SPECS.items()
    ]
