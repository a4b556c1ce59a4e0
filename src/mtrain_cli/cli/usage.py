"""How the `mtrain` command line presents itself, whatever typer version runs it: help without typer's type
placeholders (`<bool>` after flags, `{MODEL_DIR}`), click's usage errors as one line naming the problem and
the fix or the help to read, and output that stays readable when piped to a file."""

from __future__ import annotations

import itertools
import sys

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from mtrain_cli.errors import UserError


def output_console() -> Console:
    """The commands' console. Piped (logs, CI) a line is never wrapped mid-field at rich's default 80 columns,
    and the progress bars of datasets and transformers stay off: mtrain prints its own progress lines."""
    import os

    console = Console()
    if not console.is_terminal:
        console.soft_wrap = True
        if "COLUMNS" not in os.environ:  # rich's 80 would cut rule titles and squeeze tables
            console.width = 160
        for variable in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
            os.environ.setdefault(variable, "1")  # read at import, before datasets and transformers load
    return console


def untyped_flags(params: list) -> list:
    for param in params:  # a flag takes no value: no `<bool>` beside it in the help (typer >= 0.26 shows one)
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(TyperCommand):
    """Help without `<bool>` after flags, and `MODEL_DIR` (click's form) rather than `{MODEL_DIR}` in the usage."""

    def get_params(self, ctx):
        return untyped_flags(super().get_params(ctx))

    def collect_usage_pieces(self, ctx):
        return [
            piece[1:-1] if piece[:1] == "{" and piece[-1:] == "}" else piece
            for piece in super().collect_usage_pieces(ctx)
        ]


class Group(TyperGroup):
    def get_params(self, ctx):
        return untyped_flags(super().get_params(ctx))


def click_errors() -> tuple[type[Exception], ...]:
    """The ClickException classes usage errors come as: click's own up to typer 0.25, typer's vendored copy
    (typer._click) from 0.26. typer.BadParameter, public in every version, derives from the one typer uses."""
    found = [cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "ClickException"]
    if "click" in sys.modules:  # raised by click itself (typer <= 0.25, or a library built on click)
        found.append(sys.modules["click"].ClickException)
    return tuple(found)


_BOOLEAN_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


def _command_path(ctx, argv: list[str], root) -> str:
    """`mtrain extend`: from the error's context, else (errors raised while parsing have none) from argv."""
    if ctx is not None:
        return ctx.command_path
    command, path = root, ["mtrain"]
    for token in argv:
        command = getattr(command, "commands", {}).get(token)
        if command is None:
            break
        path.append(token)
    return " ".join(path)


def _option_value(opts: list[str], argv: list[str]) -> tuple[str, str] | None:
    """(option, value) as given on the command line for one of `opts` (`--opt value` or `--opt=value`)."""
    for before, token in zip(["", *argv], argv):
        if before in opts:
            return before, token
        if "=" in token and token.split("=", 1)[0] in opts:
            return token.split("=", 1)[0], token.split("=", 1)[1]
    return None


def usage_line(exc, argv: list[str], root) -> str:
    """A click usage error as one line: what is wrong, then the fix or where the help is."""
    ctx, kind = getattr(exc, "ctx", None), type(exc).__name__
    param = getattr(exc, "param", None)
    given = _option_value(param.opts, argv) if kind == "BadParameter" and getattr(param, "opts", None) else None
    if kind == "NoSuchOption":
        text = f"no such option {exc.option_name}"
        if getattr(exc, "possibilities", None):
            text += f" (did you mean {' or '.join(sorted(exc.possibilities))}?)"
    elif given is not None:  # `--samples 'abc': input should be a valid integer`, as UserErrors name options
        option, value = given
        reason = " ".join(exc.message.split()).rstrip(".")
        reason = reason[:1].lower() + reason[1:] if reason[1:2].islower() else reason
        reason = reason.removeprefix(f"{value!r} is ")  # click <= 8.2: "'abc' is not a valid integer"
        text = f"{option} {value!r}: {reason}"
    else:
        text = " ".join(exc.format_message().split()).rstrip(".")
        text = text[:1].lower() + text[1:] if text[1:2].islower() else text
    path = _command_path(ctx, argv, root)
    if ctx is not None:
        flags = {opt for p in ctx.command.get_params(ctx) if getattr(p, "is_flag", False) for opt in p.opts}
        for flag, token in itertools.pairwise(argv):
            if text.startswith("got unexpected extra") and flag in flags and token.lower() in _BOOLEAN_WORDS:
                return f"{flag} is a flag and takes no value: drop {token!r} (see {path} --help)"
        if text.startswith("no such command") and hasattr(ctx.command, "list_commands"):
            return f"{text}; choose one of {', '.join(ctx.command.list_commands(ctx))} (see {path} --help)"
    return f"{text}; see {path} --help"


def require_command(ctx: typer.Context) -> None:
    """`mtrain` / `mtrain profile` alone: the help, then a usage error (exit 2), as click >= 8.2 does."""
    if ctx.invoked_subcommand is None and not ctx.resilient_parsing:
        text = ctx.get_help()  # typer's rich help prints itself and returns ""
        if text:
            typer.echo(text)
        raise UserError(
            f"missing command; choose one of {', '.join(ctx.command.list_commands(ctx))} "
            f"(see {ctx.command_path} --help)"
        )
