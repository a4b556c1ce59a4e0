"""The suites `mtrain eval` runs, one line each (a new suite is its module with a `SUITE`, plus its line here); the
command's options, its own and the suites' inputs (OPTIONS); and the command line's values checked against them:
bad ones stop with one line (UserError), good ones are written back as one command (command_line). Torch-free:
only --attention sparse loads torch, to check its settings against the attention router's."""

from __future__ import annotations

import shlex
from pathlib import Path

from mtrain_cli.errors import UserError
from mtrain_cli.eval.infinitebench.suite import SUITE as INFINITEBENCH
from mtrain_cli.eval.niah import SUITE as NIAH
from mtrain_cli.eval.options import COMMAND_OPTIONS, EvalOptions, Option, check_attention
from mtrain_cli.eval.pg19 import SUITE as PG19
from mtrain_cli.eval.ruler.suite import SUITE as RULER
from mtrain_cli.eval.suite import Suite
from mtrain_cli.lengths import parse_lengths

SUITES: dict[str, Suite] = {suite.name: suite for suite in (RULER, NIAH, PG19, INFINITEBENCH)}
SUITE_OPTIONS: tuple[Option, ...] = tuple({o.name: o for suite in SUITES.values() for o in suite.options}.values())
OPTIONS: tuple[Option, ...] = COMMAND_OPTIONS + SUITE_OPTIONS  # the flags of `mtrain eval`, in --help's order


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
    known = [task for suite in suites for task in SUITES[suite].tasks]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise UserError(
            f"--tasks {text!r}: {', '.join(unknown) or '(none given)'} is not a task of --suite "
            f"{','.join(suites)}; use a comma-separated subset of {','.join(known)}"
        )
    for suite in suites:
        if not set(SUITES[suite].tasks) & set(names):
            raise UserError(
                f"--tasks {text!r} names no task of suite {suite}; drop {suite} from --suite or name "
                f"one of its tasks ({','.join(SUITES[suite].tasks)})"
            )
    return names


def parse_options(**given) -> EvalOptions:
    """The command line's values by option name (OPTIONS; those not given take their defaults), checked and
    parsed."""
    raw = {option.name: given.pop(option.name, option.default) for option in OPTIONS}
    assert not given, f"not eval options: {sorted(given)}"
    if raw["model_dir"] is ...:
        raise UserError("mtrain eval needs MODEL_DIR: a Hugging Face model directory, run directory or checkpoint")
    attention, samples, batch_size, yarn = raw["attention"], raw["samples"], raw["batch_size"], raw["yarn"]
    check_attention(attention)
    sparse_set = list(raw["sparse_set"] or [])
    if sparse_set and attention != "sparse":
        raise UserError(f"--sparse-set {sparse_set[0]}: sparse settings need --attention sparse (now {attention})")
    if samples < 1:
        raise UserError(f"--samples {samples}: must be at least 1")
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be at least 1 (prompts decoded together)")
    if yarn is not None and not yarn > 1:
        raise UserError(f"--yarn {yarn:g}: the factor must be > 1 (new context = factor × the model's own, e.g. 8)")
    from mtrain_cli.inputs import check_output_parent

    check_output_parent(
        raw["out"], "--out", "pass a writable directory (the eval-<model>-<time> run directory goes there)"
    )
    # every path resolved: results.json's command reruns the evaluation from any directory
    paths = {
        option.name: Path(raw[option.name]).expanduser().resolve()
        for option in OPTIONS
        if raw[option.name] is not None and option.kind in (Path, Path | None)
    }
    suites = parse_suites(raw["suite"])
    options = EvalOptions(
        model_dir=paths["model_dir"],
        suites=suites,
        lengths=parse_lengths(raw["lengths"]),
        samples=samples,
        attention=attention,
        sparse_set=sparse_set,
        tasks=parse_tasks(raw["tasks"], suites),
        yarn=yarn,
        chat_template=raw["chat_template"],
        out=paths["out"],
        seed=raw["seed"],
        batch_size=batch_size,
        inputs={option.name: paths.get(option.name, raw[option.name]) for option in SUITE_OPTIONS},
        force_lengths=raw["force_lengths"],
    )
    if attention == "sparse":
        from mtrain_cli.eval.sparse import sparse_request

        options.sparse = sparse_request(options.model_dir, sparse_set)
    return options


def command_line(options: EvalOptions) -> str:
    """The options as one `mtrain eval` command, for results.json (it reproduces the run from any directory)."""
    parts = ["mtrain", "eval"]
    for option in OPTIONS:
        text = option.write(getattr(options, option.field or option.name))
        if text is None:
            continue
        if option.flag is None:
            parts.append(text)
        elif isinstance(text, list):
            parts += [arg for item in text for arg in (option.flag, item)]
        else:
            parts += [option.flag] + ([text] if text else [])
    return shlex.join(parts)
