"""RULER's QA tasks: a question whose gold paragraphs hide among distractor paragraphs from the same
corpus. qa_1 reads a local SQuAD file (v2.0 json), qa_2 a local HotpotQA file (json list); a task
without its file is skipped, never replaced."""

from __future__ import annotations

import random
from collections.abc import Iterator

from mtrain_cli.eval.ruler.qa_data import QaCorpus
from mtrain_cli.eval.ruler.task import Draft, RulerTask, TaskData

INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)


def make_drafts(corpus: QaCorpus, rng: random.Random, budget: int) -> Iterator[Draft]:
    item = rng.choice(corpus.items)
    distractors = [i for i in range(len(corpus.documents)) if i not in item.gold]
    rng.shuffle(distractors)
    order_seed = rng.getrandbits(64)

    def render(n: int) -> str:
        chosen = item.gold + distractors[:n]
        random.Random(f"{order_seed}:{n}").shuffle(chosen)
        documents = "\n\n".join(f"Document {i + 1}:\n{corpus.documents[d]}" for i, d in enumerate(chosen))
        return (
            f"{INSTRUCTION}\n\nThe following are given documents.\n\n{documents}\n\n{INSTRUCTION}\n\n"
            f"Question: {item.question}"
        )

    yield Draft(render, "Answer:", item.answers, len(distractors), {"question": item.question})


def qa_tasks() -> list[RulerTask]:
    def squad_missing(data: TaskData) -> str | None:
        return None if data.squad else "no --squad-file given (qa_1 reads a local SQuAD v2.0 json file)"

    def hotpot_missing(data: TaskData) -> str | None:
        return None if data.hotpot else "no --hotpot-file given (qa_2 reads a local HotpotQA json file)"

    return [
        RulerTask(
            "qa_1",
            32,
            "string_match_part",
            lambda rng, data, budget: make_drafts(data.squad, rng, budget),
            unavailable=squad_missing,
            source=lambda data: data.squad.source,
        ),
        RulerTask(
            "qa_2",
            32,
            "string_match_part",
            lambda rng, data, budget: make_drafts(data.hotpot, rng, budget),
            unavailable=hotpot_missing,
            source=lambda data: data.hotpot.source,
        ),
    ]
