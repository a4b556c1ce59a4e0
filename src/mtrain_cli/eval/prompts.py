"""Prompts as the model sees them: encoding (optionally through the chat template), samples, and
fitting a prompt to a target length with the model's own tokenizer.

The answer prefix (e.g. "The special magic number is") always ends the input: after the prompt in
plain mode, inside the assistant turn in chat mode, so the model continues the answer directly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mtrain_cli.errors import UserError


class PromptDoesNotFit(Exception):
    """The smallest prompt a task can make is longer than the target length allows."""


@dataclass
class Sample:
    """One model call: the encoded input, the decoding budget, and what the answer is scored against."""

    task: str
    length: int  # the target length (prompt + generation budget)
    index: int
    input_ids: list[int]
    max_new_tokens: int
    references: list[Any]
    metric: str  # a name in scoring.METRICS
    meta: dict[str, Any] = field(default_factory=dict)


class PromptFormat:
    """Turns (prompt, answer prefix) into token ids, the same way for fitting and for running."""

    def __init__(self, tokenizer, chat_template: bool):
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise UserError(
                "--chat-template: the model's tokenizer has no chat template; "
                "drop --chat-template or use a tokenizer that defines one"
            )
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def text(self, prompt: str, answer_prefix: str) -> str:
        if not self.chat_template:
            return f"{prompt}\n{answer_prefix}" if answer_prefix else prompt
        header = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return header + answer_prefix

    def encode(self, prompt: str, answer_prefix: str) -> list[int]:
        # The chat template already holds any BOS token; plain text gets the tokenizer's default specials.
        # verbose=False: a candidate longer than model_max_length is expected while searching for a fit.
        return self.tokenizer(
            self.text(prompt, answer_prefix), add_special_tokens=not self.chat_template, verbose=False
        ).input_ids

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False, verbose=False).input_ids)


def fit_largest(build: Callable[[int], list[int]], budget: int, upper: int) -> tuple[int, list[int]]:
    """The largest n in [0, upper] with len(build(n)) <= budget, assuming length grows with n. Returns
    (n, build(n)).

    Each build tokenises a whole prompt, so their number is the cost. Tokens grow almost linearly with n, so
    the search aims by the tokens per unit measured so far: from the fitting side, 1% past the budget (so
    that the next step brackets the boundary); once bracketed, by interpolating between the bracket's ends,
    which lands within a few units of the boundary. Three steps in a row on the same side of it fall back to
    bisection, which bounds the worst case. About 5 whole-prompt builds at 16K-64K, against 17 for the
    bisection from a 64-unit probe that this replaced (bench/bench_eval_prompts.py).
    """
    smallest = build(0)
    if len(smallest) > budget:
        raise PromptDoesNotFit(f"minimum prompt is {len(smallest)} tokens, budget {budget}")
    lo, best, hi = 0, smallest, upper  # build(lo) fits; no n > hi fits
    over: tuple[int, int] | None = None  # (n, tokens) of the smallest n seen not to fit
    candidate, last_fit, same_side = min(upper, 64), None, 0
    while lo < hi:
        ids = build(candidate)
        fits = len(ids) <= budget
        if fits:
            lo, best = candidate, ids
        else:
            hi, over = candidate - 1, (candidate, len(ids))
        same_side = same_side + 1 if fits == last_fit else 0
        last_fit = fits
        gap = budget - len(best)
        if same_side >= 3 and over is not None:
            aim = (lo + hi + 1) // 2
        elif over is None:
            aim = lo + math.ceil(1.01 * gap * lo / max(len(best) - len(smallest), 1)) + 1
        else:
            aim = lo + gap * (over[0] - lo) // (over[1] - len(best))
        candidate = min(hi, max(lo + 1, aim))
    return lo, best


MAX_PROMPT_THREADS = 16


def prompt_threads() -> int:
    """Threads that build prompts: the cores this process may use, at most MAX_PROMPT_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_PROMPT_THREADS, cores))


def build_cells(
    cells: list[list[Callable[[], Sample]]],
    advance: Callable[[int], None] = lambda count: None,
    threads: int | None = None,
) -> list[list[Sample] | PromptDoesNotFit]:
    """Each cell's samples in order, or the PromptDoesNotFit of one of them (the cell is skipped whole).

    The builders run on a pool of threads: fitting a prompt is whole-prompt encodes (about 5 of ~1 s each at
    256K tokens), and the fast tokenizer releases the GIL while it encodes, so prompts fit side by side. Each
    builder draws from its own seeded generator: the samples do not depend on the number of threads.
    `advance(n)`: n more prompts are done. threads: None for `prompt_threads()`."""
    pool = ThreadPoolExecutor(threads or prompt_threads(), thread_name_prefix="prompts")
    try:
        futures: list[list[Future]] = [[pool.submit(build) for build in cell] for cell in cells]
        results: list[list[Sample] | PromptDoesNotFit] = []
        for cell in futures:
            built: list[Sample] = []
            failure: PromptDoesNotFit | None = None
            for future in cell:
                try:
                    built.append(future.result())
                except PromptDoesNotFit as exc:
                    failure = failure or exc
                advance(1)
            results.append(built if failure is None else failure)
        return results
    finally:
        pool.shutdown(cancel_futures=True)


def middle_truncate(tokenizer, text: str, keep_tokens: int) -> str:
    """The first and last keep_tokens/2 tokens of `text` (InfiniteBench's middle truncation)."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
    if len(ids) <= keep_tokens:
        return text
    head = (keep_tokens + 1) // 2
    tail = keep_tokens - head
    return tokenizer.decode(ids[:head]) + (tokenizer.decode(ids[-tail:]) if tail else "")
