"""The `mtrain` command line: thin Typer commands (parse → resolve config → build → run; the logic lives in the
library). main.py holds the app and its commands, profile.py the `mtrain profile` group, usage.py the usage and
output conventions (one-line errors, exit codes, piped output), launch.py the re-launch under torchrun (`--nproc`)
and what `accelerate launch` passes. The console script is `main`."""

from mtrain_cli.cli.main import app, main

__all__ = ["app", "main"]
