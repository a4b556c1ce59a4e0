"""`mtrain eval`: RULER, Needle-in-a-Haystack, PG-19 perplexity and InfiniteBench, fully offline.

The command end to end: command.py. What a suite is: suite.py; the suites, one line each, and the command line
checked against them: registry.py; the command's options: options.py (each suite's own inputs sit in its
module). Synthetic
tasks are generated here; the others read local files, and a task whose data is missing is reported as skipped,
never replaced.

This is the package's public face; other packages import from here (RULER's tasks: eval.ruler). Names resolve on
first use: importing the face loads nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "EvalInterrupted": "command",
    "run_eval": "command",
    "run_eval_command": "command",
    "OPTIONS": "registry",
    "SUITES": "registry",
    "parse_options": "registry",
    "check_attention": "loading",
    "load_model": "loading",
    "attention_routing": "sparse",
    "sparse_request": "sparse",
    "Runner": "runner",
    "PromptFormat": "prompts",
    "NOISE_HAYSTACK": "haystack",
    "essay_haystack": "haystack",
    "SECOND_HALF": "pg19",
    "length_label": "results",
    "niah_heatmap": "plots",
}
__all__ = [  # noqa: RUF022 (the order of _EXPORTS: by module)
    "EvalInterrupted",
    "run_eval",
    "run_eval_command",
    "OPTIONS",
    "SUITES",
    "parse_options",
    "check_attention",
    "load_model",
    "attention_routing",
    "sparse_request",
    "Runner",
    "PromptFormat",
    "NOISE_HAYSTACK",
    "essay_haystack",
    "SECOND_HALF",
    "length_label",
    "niah_heatmap",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


if TYPE_CHECKING:
    from mtrain_cli.eval.command import EvalInterrupted, run_eval, run_eval_command
    from mtrain_cli.eval.haystack import NOISE_HAYSTACK, essay_haystack
    from mtrain_cli.eval.loading import check_attention, load_model
    from mtrain_cli.eval.pg19 import SECOND_HALF
    from mtrain_cli.eval.plots import niah_heatmap
    from mtrain_cli.eval.prompts import PromptFormat
    from mtrain_cli.eval.registry import OPTIONS, SUITES, parse_options
    from mtrain_cli.eval.results import length_label
    from mtrain_cli.eval.runner import Runner
    from mtrain_cli.eval.sparse import attention_routing, sparse_request
