"""`mtrain eval`'s options, defined once: each Option is a command-line flag (the Typer command is built from
them), a field of the parsed EvalOptions, and how its value is written back into the command that results.json
records (registry.command_line). Here: the command's own options; a suite's own inputs (--pg19-dir, ...) are
defined in its module and listed by its Suite. All of them, checked and parsed against the suites: registry.py.
Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtrain_cli.attention.settings import ATTENTION_MODES
from mtrain_cli.errors import UserError

if TYPE_CHECKING:  # imports torch: loaded only for --attention sparse
    from mtrain_cli.eval.sparse import SparseRequest


def check_attention(attention: str) -> None:
    """--attention: one of the attention modes, checked before torch loads."""
    if attention not in ATTENTION_MODES:
        raise UserError(f"--attention {attention!r} is not a mode; use one of: {', '.join(ATTENTION_MODES)}")


@dataclass(frozen=True)
class Option:
    """One option. `field`: the EvalOptions field its parsed value goes to (default: `name`); `write`: that value
    as command-line text, None to leave the flag out."""

    name: str  # the Typer parameter
    flag: str | None  # None: the positional MODEL_DIR
    kind: Any  # what Typer parses: str, int, float, bool, Path, list[str], or X | None
    default: Any
    help: str
    metavar: str | None = None
    field: str | None = None
    write: Callable[[Any], str | list[str] | None] = str


def _joined(values: list | None) -> str | None:
    return None if values is None else ",".join(map(str, values))


def _given(value: Any) -> str | None:
    return None if value is None else str(value)


def path_option(name: str, flag: str, help: str) -> Option:
    """A suite's input: an optional local path (resolved when parsed)."""
    return Option(name, flag, Path | None, None, help, write=_given)


COMMAND_OPTIONS: tuple[Option, ...] = (
    Option("model_dir", None, Path, ..., "HF model directory, mtrain run directory or run checkpoint.", "MODEL_DIR"),
    Option(
        "suite", "--suite", str, "ruler,niah,pg19,infinitebench", "Comma-separated suites.", None, "suites", _joined
    ),
    Option(
        "lengths",
        "--lengths",
        str,
        "4k,8k,16k,32k,64k,128k",
        "Target lengths in tokens, prompt + answer budget (k = 1024).",
        write=_joined,
    ),
    Option(
        "force_lengths",
        "--force-lengths",
        bool,
        False,
        "Run lengths that are refused otherwise: more than 8x the model's context, or KV caches larger than the "
        "device's memory.",
        write=lambda on: "" if on else None,
    ),
    Option("samples", "--samples", int, 10, "Samples per task and length (NIAH: per cell; PG-19: books)."),
    Option("seed", "--seed", int, 0, "Seed of every generated sample."),
    Option(
        "attention",
        "--attention",
        str,
        "dense",
        "dense (SDPA, chunked prefill) or sparse (one-chunk sparse prefill, dense decoding).",
    ),
    Option("out", "--out", Path, Path("runs"), "Parent directory of the eval-<model>-<time> run directory."),
    Option(
        "tasks",
        "--tasks",
        str | None,
        None,
        "Comma-separated tasks of the suites to run, e.g. passkey (default: every task).",
        write=_joined,
    ),
    Option(
        "yarn",
        "--yarn",
        float | None,
        None,
        "Apply YaRN xFACTOR to the model's RoPE at load, without training (a base model at the context an "
        "extension would reach).",
        "FACTOR",
        write=lambda factor: None if factor is None else f"{factor:g}",
    ),
    Option(
        "batch_size",
        "--batch-size",
        int,
        1,
        "Prompts decoded together, each prefilled alone; holds their KV caches at once (memory grows with it: the "
        "batch's longest prompt × N).",
    ),
    Option(
        "chat_template",
        "--chat-template",
        bool,
        False,
        "Wrap prompts in the tokenizer's chat template.",
        write=lambda on: "" if on else None,
    ),
    Option(
        "sparse_set",
        "--sparse-set",
        list[str] | None,
        None,
        "With --attention sparse: override one setting of the recipe's attention section, e.g. p=0.95 (repeatable).",
        "KEY=VALUE",
        write=lambda items: list(items) or None,
    ),
)


@dataclass
class EvalOptions:
    """The command line, parsed (registry.parse_options). Lengths are in tokens and include each task's generation
    budget; every path is resolved. A suite's own inputs are read as attributes too (options.pg19_dir)."""

    model_dir: Path
    suites: list[str]
    lengths: list[int]
    samples: int  # per task and length (RULER, InfiniteBench), per cell (NIAH); books (PG-19)
    attention: str
    sparse_set: list[str]  # --sparse-set items, as given
    tasks: list[str] | None  # --tasks: run only these tasks of the suites; None: all
    yarn: float | None  # --yarn: YaRN with this factor applied to the model's RoPE at load, no training
    chat_template: bool
    out: Path  # parent of the run directory
    seed: int
    batch_size: int  # prompts decoded together (each prefilled alone)
    inputs: dict[str, Any] = field(default_factory=dict)  # every suite's own options (Suite.options), by name
    force_lengths: bool = False  # run lengths far past the model's context or the device's memory
    sparse: SparseRequest | None = field(default=None)  # resolved settings when attention is sparse

    def __getattr__(self, name: str) -> Any:
        inputs = self.__dict__.get("inputs", {})
        if name not in inputs:
            raise AttributeError(f"EvalOptions has no option {name!r}")
        return inputs[name]
