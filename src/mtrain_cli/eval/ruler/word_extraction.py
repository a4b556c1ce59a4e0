"""RULER's aggregation tasks. cwe: a numbered word list where 10 words appear far more often than the
rest; name them. fwe: a coded text whose word frequencies follow Zipf's law (alpha 2); name the top 3."""

from __future__ import annotations

import random
from collections.abc import Iterator

from mtrain_cli.eval.ruler.task import Draft, RulerTask, TaskData
from mtrain_cli.eval.words import ADJECTIVES, EXTRACTION_WORDS, NOUNS, coded_word

NUM_COMMON = 10
# (common frequency, rare frequency): RULER's 30/3 first; shorter lengths fall back to lower counts.
CWE_FREQUENCIES = ((30, 3), (20, 3), (10, 3), (6, 2), (4, 2), (3, 1), (2, 1))
CWE_VOCABULARY = EXTRACTION_WORDS + [f"{adjective}-{noun}" for adjective in ADJECTIVES for noun in NOUNS]
FWE_VOCABULARY_SIZE = 1000
FWE_ALPHA = 2.0
FWE_MIN_WORDS = 60  # below this the Zipf counts of ranks 3 and 4 can tie


def cwe_drafts(rng: random.Random, data: TaskData, budget: int) -> Iterator[Draft]:
    vocabulary = list(CWE_VOCABULARY)
    rng.shuffle(vocabulary)
    common, rare = vocabulary[:NUM_COMMON], vocabulary[NUM_COMMON:]
    order_seed = rng.getrandbits(64)
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n"
    )
    question = f"\nQuestion: What are the {NUM_COMMON} most common words in the above list?"
    prefix = f"Answer: The top {NUM_COMMON} words that appear most often in the list are:"
    for common_count, rare_count in CWE_FREQUENCIES:
        # Units are rare-word entries (each rare word rare_count times in a row), so the fit is per entry.
        rare_entries = [word for word in rare for _ in range(rare_count)]

        def render(n: int, common_count=common_count, rare_entries=rare_entries) -> str:
            words = common * common_count + rare_entries[:n]
            random.Random(f"{order_seed}:{n}").shuffle(words)
            return intro + " ".join(f"{i + 1}. {word}" for i, word in enumerate(words)) + question

        yield Draft(
            render, prefix, common, len(rare_entries), {"common_frequency": common_count, "rare_frequency": rare_count}
        )


def _zipf_counts(total: int, size: int) -> list[int]:
    weights = [rank**-FWE_ALPHA for rank in range(1, size + 1)]
    norm = sum(weights)
    return [round(total * weight / norm) for weight in weights]


def fwe_drafts(rng: random.Random, data: TaskData, budget: int) -> Iterator[Draft]:
    vocabulary: list[str] = []
    while len(vocabulary) < FWE_VOCABULARY_SIZE:
        word = coded_word(rng)
        if word not in vocabulary:
            vocabulary.append(word)
    order_seed = rng.getrandbits(64)
    intro = (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. "
    )
    question = (
        "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three "
        "most frequently appeared words in the above coded text?"
    )

    def render(n: int) -> str:
        counts = _zipf_counts(FWE_MIN_WORDS + n, FWE_VOCABULARY_SIZE)
        words = [word for word, count in zip(vocabulary, counts) for _ in range(count)]
        random.Random(f"{order_seed}:{n}").shuffle(words)
        return intro + " .... ".join(words) + question

    yield Draft(
        render,
        "Answer: According to the coded text above, the three most frequently appeared words are:",
        vocabulary[:3],
        budget,
        {"zipf_alpha": FWE_ALPHA},
    )


def word_extraction_tasks() -> list[RulerTask]:
    synthetic = "synthetic: generated word lists"
    return [
        RulerTask("cwe", 120, "string_match_all", cwe_drafts, source=lambda data: synthetic),
        RulerTask("fwe", 50, "string_match_all", fwe_drafts, source=lambda data: synthetic),
    ]
