"""RULER's variable tracking (vt): a chain of assignments `VAR A = 12345`, `VAR B = VAR A`, ... hidden in
the noise haystack, in order; the answer is every variable that ends up holding the value."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from mtrain_cli.eval.haystack import insert_at_depths
from mtrain_cli.eval.ruler.niah_tasks import DEPTH_GRID
from mtrain_cli.eval.ruler.task import Draft, RulerTask, TaskData
from mtrain_cli.eval.words import number_value, variable_name

NUM_HOPS = 4


def make_drafts(rng: random.Random, data: TaskData, budget: int) -> Iterator[Draft]:
    names: list[str] = []
    while len(names) < NUM_HOPS + 1:
        name = variable_name(rng)
        if name not in names:
            names.append(name)
    value = number_value(rng, digits=5)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    depths = sorted(rng.choice(DEPTH_GRID) for _ in chain)
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    question = f"\nQuestion: Find all variables that are assigned the value {value} in the text above."

    def render(n: int) -> str:
        return intro + insert_at_depths(data.noise.sentences(n), chain, depths) + question

    prefix = (
        f"Answer: According to the chain(s) of variable assignment in the text above, {len(names)} "
        f"variables are assigned the value {value}, they are:"
    )
    yield Draft(render, prefix, names, budget, {"depths": depths})


def variable_tracking_task() -> RulerTask:
    return RulerTask("vt", 30, "string_match_all", make_drafts)
