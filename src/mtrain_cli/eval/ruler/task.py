"""What a RULER task is: a generation budget, a metric, and drafts whose size is searched to fit a length."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mtrain_cli.eval.haystack import Haystack
from mtrain_cli.eval.ruler.qa_data import QaCorpus


@dataclass
class Draft:
    """One sample with every random choice made except its size: `render(n)` -> prompt text with n
    haystack units (sentences, words, distractor needles, list entries or documents)."""

    render: Callable[[int], str]
    answer_prefix: str
    references: list[str]
    max_units: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class TaskData:
    """What tasks draw on: the noise haystack, the essay haystack if given, the QA corpora if given."""

    noise: Haystack
    essay: Haystack | None
    squad: QaCorpus | None
    hotpot: QaCorpus | None


@dataclass
class RulerTask:
    name: str
    max_new_tokens: int
    metric: str
    # Drafts in order of preference: the first whose smallest prompt fits the length is used.
    drafts: Callable[[random.Random, TaskData, int], Iterator[Draft]]
    # None when the task can run; else why not (data missing).
    unavailable: Callable[[TaskData], str | None] = lambda data: None
    source: Callable[[TaskData], str] = lambda data: data.noise.source
