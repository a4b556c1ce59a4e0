"""Offline generators for InfiniteBench's synthetic retrieval tasks, in the official records' shape.

Each returns a `GeneratedExample`: every random choice is made from the rng (deterministic per seed),
only the amount of filler is left open, so the suite can fit the prompt to a length; the needle sits at
`depth` percent of the filler whatever its amount.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from mtrain_cli.eval.haystack import NOISE_HAYSTACK, insert_at_depths
from mtrain_cli.eval.words import number_value, uuid_value


@dataclass
class GeneratedExample:
    context: Callable[[int], str]  # filler units -> context text
    input: str
    answer: list[str]
    max_units: int  # for a token budget: an upper bound on useful filler units


def passkey(rng: random.Random, depth: float, budget: int) -> GeneratedExample:
    key = number_value(rng, digits=5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    return GeneratedExample(
        lambda n: insert_at_depths(NOISE_HAYSTACK.sentences(n), [needle], [depth]),
        "What is the pass key?",
        [key],
        budget,
    )


def number_string(rng: random.Random, depth: float, budget: int) -> GeneratedExample:
    digits = number_value(rng, digits=10)
    needle = f"The sequence of digits is {digits}. Remember it. {digits} is the sequence of digits."
    return GeneratedExample(
        lambda n: insert_at_depths(NOISE_HAYSTACK.sentences(n), [needle], [depth]),
        "What is the sequence of digits?",
        [digits],
        budget,
    )


def kv_retrieval(rng: random.Random, depth: float, budget: int) -> GeneratedExample:
    """A JSON object of UUID -> UUID pairs; the queried pair at `depth` percent of the pairs."""
    pairs = [(uuid_value(rng), uuid_value(rng)) for _ in range(budget // 20 + 1)]
    key, value = uuid_value(rng), uuid_value(rng)

    def context(n: int) -> str:
        chosen = pairs[:n]
        chosen.insert(round(depth / 100 * n), (key, value))
        return json.dumps(dict(chosen), ensure_ascii=False)

    return GeneratedExample(context, f'Key: "{key}"', [value], len(pairs))


def math_find(rng: random.Random, depth: float, budget: int) -> GeneratedExample:
    """A list of integers whose largest (or smallest) element sits at `depth` percent of the list."""
    target_kind = rng.choice(["largest", "smallest"])
    if target_kind == "largest":
        filler = [rng.randint(0, 9899) for _ in range(budget)]
        target = rng.randint(9900, 9999)
    else:
        filler = [rng.randint(100, 9999) for _ in range(budget)]
        target = rng.randint(0, 99)

    def context(n: int) -> str:
        numbers = filler[:n]
        numbers.insert(round(depth / 100 * n), target)
        return "[" + ", ".join(str(number) for number in numbers) + "]"

    return GeneratedExample(context, f"What is the {target_kind} number in the list?", [str(target)], budget)


GENERATORS: dict[str, Callable[[random.Random, float, int], GeneratedExample]] = {
    "passkey": passkey,
    "number_string": number_string,
    "kv_retrieval": kv_retrieval,
    "math_find": math_find,
}
