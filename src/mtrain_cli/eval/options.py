"""`mtrain eval`'s command line: the options, checked and parsed (`parse_options`), and written back as one
command for results.json (`command_line`). Torch-free: only --attention sparse loads torch, to check its settings
against the attention router's, so a typo is answered in a fraction of a second."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mtrain_cli.errors import UserError
from mtrain_cli.eval.infinitebench.tasks import TASKS as INFINITEBENCH_TASKS
from mtrain_cli.eval.ruler.suite import TASK_NAMES as RULER_TASKS
from mtrain_cli.lengths import parse_lengths

if TYPE_CHECKING:  # imports torch: loaded only for --attention sparse
    from mtrain_cli.eval.sparse import SparseRequest

SUITES = ("ruler", "niah", "pg19", "infinitebench")
SUITE_TASKS = {"ruler": RULER_TASKS, "niah": ["niah"], "pg19": ["pg19"], "infinitebench": list(INFINITEBENCH_TASKS)}
ATTENTION_MODES = ("dense", "sparse")  # = eval.loading.ATTENTION_MODES, checked here before torch loads


@dataclass
class EvalOptions:
    """The command line, parsed. Lengths are in tokens and include each task's generation budget."""

    model_dir: Path
    suites: list[str]
    lengths: list[int]
    samples: int  # per task and length (RULER, InfiniteBench), per cell (NIAH); books (PG-19)
    seed: int
    attention: str
    out: Path  # parent of the run directory
    chat_template: bool = False
    pg19_dir: Path | None = None
    haystack_dir: Path | None = None
    squad_file: Path | None = None
    hotpot_file: Path | None = None
    infinitebench_dir: Path | None = None
    sparse_set: list[str] = field(default_factory=list)  # --sparse-set items, as given
    sparse: SparseRequest | None = None  # resolved settings when attention is sparse
    tasks: list[str] | None = None  # --tasks: run only these tasks of the suites; None: all
    yarn: float | None = None  # --yarn: YaRN with this factor applied to the model's RoPE at load, no training
    batch_size: int = 1  # prompts decoded together (each prefilled alone)


def parse_suites(text: str) -> list[str]:
    suites = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [suite for suite in suites if suite not in SUITES]
    if unknown or not suites:
        raise UserError(
            f"--suite {text!r}: unknown suite {', '.join(unknown) or '(none given)'}; use a "
            f"comma-separated subset of {','.join(SUITES)}"
        )
    return [suite for suite in SUITES if suite in suites]


def parse_tasks(text: str | None, suites: list[str]) -> list[str] | None:
    """--tasks: names of tasks of the selected suites, each suite keeping at least one; None: every task."""
    if text is None:
        return None
    names = [item.strip() for item in text.split(",") if item.strip()]
    known = [task for suite in suites for task in SUITE_TASKS[suite]]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise UserError(
            f"--tasks {text!r}: {', '.join(unknown) or '(none given)'} is not a task of --suite "
            f"{','.join(suites)}; use a comma-separated subset of {','.join(known)}"
        )
    for suite in suites:
        if not set(SUITE_TASKS[suite]) & set(names):
            raise UserError(
                f"--tasks {text!r} names no task of suite {suite}; drop {suite} from --suite or name "
                f"one of its tasks ({','.join(SUITE_TASKS[suite])})"
            )
    return names


def parse_options(
    model_dir: Path,
    suite: str,
    lengths: str,
    samples: int,
    seed: int,
    attention: str,
    out: Path,
    chat_template: bool = False,
    pg19_dir: Path | None = None,
    haystack_dir: Path | None = None,
    squad_file: Path | None = None,
    hotpot_file: Path | None = None,
    infinitebench_dir: Path | None = None,
    sparse_set: list[str] | None = None,
    tasks: str | None = None,
    yarn: float | None = None,
    batch_size: int = 1,
) -> EvalOptions:
    """The command line's values, checked and parsed; bad ones stop with one line (UserError). Only
    --attention sparse imports torch here (its settings are checked against the attention hook's)."""
    if attention not in ATTENTION_MODES:
        raise UserError(f"--attention {attention!r} is not a mode; use one of: {', '.join(ATTENTION_MODES)}")
    sparse_set = list(sparse_set or [])
    if sparse_set and attention != "sparse":
        raise UserError(f"--sparse-set {sparse_set[0]}: sparse settings need --attention sparse (now {attention})")
    if samples < 1:
        raise UserError(f"--samples {samples}: must be at least 1")
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be at least 1 (prompts decoded together)")
    if yarn is not None and not yarn > 1:
        raise UserError(f"--yarn {yarn:g}: the factor must be > 1 (new context = factor × the model's own, e.g. 8)")
    from mtrain_cli.inputs import check_output_parent

    check_output_parent(out, "--out", "pass a writable directory (the eval-<model>-<time> run directory goes there)")
    # every path resolved: results.json's command reruns the evaluation from any directory
    model_dir, out, pg19_dir, haystack_dir, squad_file, hotpot_file, infinitebench_dir = (
        Path(p).expanduser().resolve() if p is not None else None
        for p in (model_dir, out, pg19_dir, haystack_dir, squad_file, hotpot_file, infinitebench_dir)
    )
    suites, parsed_lengths = parse_suites(suite), parse_lengths(lengths)
    parsed_tasks = parse_tasks(tasks, suites)
    sparse = None
    if attention == "sparse":
        from mtrain_cli.eval.sparse import sparse_request

        sparse = sparse_request(model_dir, sparse_set)
    return EvalOptions(
        model_dir,
        suites,
        parsed_lengths,
        samples,
        seed,
        attention,
        out,
        chat_template,
        pg19_dir,
        haystack_dir,
        squad_file,
        hotpot_file,
        infinitebench_dir,
        sparse_set,
        sparse,
        parsed_tasks,
        yarn,
        batch_size,
    )


def check_model_dir(model_dir: Path) -> None:
    """MODEL is on disk (what it is, load_model tells once torch is loaded)."""
    if not Path(model_dir).expanduser().exists():
        raise UserError(
            f"MODEL {model_dir} does not exist; pass a local Hugging Face model directory (config.json, "
            f"*.safetensors, tokenizer.json), an mtrain run directory or one of its checkpoints"
        )


def command_line(options: EvalOptions) -> str:
    """The options as one `mtrain eval` command, for results.json (reproduces the run)."""
    parts = [
        "mtrain",
        "eval",
        str(options.model_dir),
        "--suite",
        ",".join(options.suites),
        "--lengths",
        ",".join(map(str, options.lengths)),
        "--samples",
        str(options.samples),
        "--seed",
        str(options.seed),
        "--attention",
        options.attention,
        "--out",
        str(options.out),
    ]
    parts += ["--tasks", ",".join(options.tasks)] if options.tasks is not None else []
    parts += ["--yarn", f"{options.yarn:g}"] if options.yarn is not None else []
    parts += ["--batch-size", str(options.batch_size)] if options.batch_size != 1 else []
    parts += ["--chat-template"] if options.chat_template else []
    parts += [arg for item in options.sparse_set for arg in ("--sparse-set", item)]
    for flag, value in (
        ("--pg19-dir", options.pg19_dir),
        ("--haystack-dir", options.haystack_dir),
        ("--squad-file", options.squad_file),
        ("--hotpot-file", options.hotpot_file),
        ("--infinitebench-dir", options.infinitebench_dir),
    ):
        parts += [flag, str(value)] if value is not None else []
    return shlex.join(parts)
