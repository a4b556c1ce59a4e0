"""What an eval suite is: its tasks; its own command-line inputs (--pg19-dir, ...) and what it reads of them
before the model loads (bad input stops the run then, and a missing file is a skipped task, never a substitute);
and how it runs on the loaded model and scores. Each suite is one module holding its `SUITE`, listed once in
registry.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from mtrain_cli.eval.options import EvalOptions, Option
from mtrain_cli.eval.prompts import PromptFormat
from mtrain_cli.eval.results import Outcome, SuiteResult

if TYPE_CHECKING:  # torch and transformers: loaded once the options and inputs are checked
    from mtrain_cli.eval.loading import LoadedModel
    from mtrain_cli.eval.runner import Runner


@dataclass
class SuiteRun:
    """What a suite runs with: the options, the loaded model and its runner, the prompt format, where to write."""

    options: EvalOptions
    loaded: LoadedModel
    runner: Runner
    fmt: PromptFormat
    run_dir: Path
    console: Console

    @contextmanager
    def preparing(self, suite: str, total: int) -> Iterator[Callable[[int], None]]:
        """Building a suite's prompts (fitting haystacks with the tokenizer) takes minutes at long lengths: a bar
        from the first second. Yields advance(n)."""
        from mtrain_cli.eval.runner import progress_bar

        with progress_bar(self.console, "prompts") as progress:
            bar = progress.add_task(f"{suite}: building prompts", total=total)
            yield lambda count: progress.advance(bar, count)

    def generate(self, samples: list, suite: str) -> list[Outcome]:
        from mtrain_cli.eval.runner import generate_all

        return generate_all(self.runner, samples, self.console, suite, self.options.batch_size)


@dataclass(frozen=True)
class Suite:
    name: str
    tasks: tuple[str, ...]
    read: Callable[[EvalOptions], Any]  # -> its inputs; torch-free
    run: Callable[[SuiteRun, Any], tuple[SuiteResult, list[Outcome]]]  # (run, its inputs) -> result, outcomes
    options: tuple[Option, ...] = ()  # its own inputs on the command line (a shared one: the same Option)
