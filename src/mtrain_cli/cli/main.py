"""The `mtrain` app and its commands: parse → resolve config → build → run; logic lives in the library."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

import mtrain_cli
from mtrain_cli.cli.launch import accelerate_settings, leave_launched_rank, relaunch_under_torchrun
from mtrain_cli.cli.profile import profile_app
from mtrain_cli.cli.usage import Command, Group, click_errors, output_console, require_command, usage_line
from mtrain_cli.errors import UserError
from mtrain_cli.eval import OPTIONS as EVAL_OPTIONS  # torch-free
from mtrain_cli.lazy import import_long_lived

# Heavy modules (torch, transformers, datasets) are imported inside the commands, after the arguments and the
# config are checked: a typo is answered at once.


app = typer.Typer(
    cls=Group,
    help="Extend LLM context windows with distributed dynamic sparse attention.",
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)
console = output_console()


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"mtrain {mtrain_cli.__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _main_options(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
) -> None:
    require_command(ctx)


EXTEND_EPILOG = """Examples:\n
  mtrain extend                                   # the tiny built-in recipe on CPU, a few minutes\n
  mtrain extend --dry-run                         # resolved config, YaRN numbers, memory estimate\n
  mtrain extend --recipe my.yaml --model /models/Qwen2.5-3B --data /data/long.jsonl\n
  mtrain extend --set train.lr=1e-5 --set context.factor=16\n
  mtrain extend --resume runs/tiny-20261122-101500"""


@app.command(cls=Command, epilog=EXTEND_EPILOG)
def extend(
    recipe: str | None = typer.Option(None, "--recipe", "-r", help="Recipe name (see `mtrain recipes`) or YAML path."),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", metavar="KEY=VALUE", help="Dotted override, e.g. train.lr=1e-5 (repeatable)."
    ),
    model: Path | None = typer.Option(None, "--model", help="Local Hugging Face model directory."),
    data: list[str] = typer.Option(
        [], "--data", metavar="PATH", help="Local dataset path (jsonl/parquet/txt/save_to_disk); repeatable."
    ),
    output_dir: Path | None = typer.Option(None, "--output-dir", help="Parent directory for run directories."),
    resume: Path | None = typer.Option(None, "--resume", help="Continue the run in this directory."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Check every input as the run does, print the resolved plan and exit."
    ),
    nproc: int = typer.Option(
        1,
        "--nproc",
        help="Processes on this machine: re-runs itself under torchrun (parallel.dp × parallel.cp must equal it).",
    ),
) -> None:
    """Extend a model's context: pack data, apply the RoPE/YaRN recipe, train, checkpoint, export."""
    import os
    import time

    started = time.perf_counter()

    from mtrain_cli.config import check_launch, default_recipe, load_config, to_yaml  # yaml and dataclasses only

    if nproc < 1:
        raise UserError(f"--nproc {nproc} must be >= 1 (processes on this machine)")
    if resume is not None and recipe is None:
        recipe = str(resume / "config.yaml")
        if not Path(recipe).is_file():
            raise UserError(
                f"--resume {resume}: no config.yaml there; pass the directory of a run made by mtrain extend"
            )
    if model is not None:  # its config.json fills the config: a wrong --model is named before anything else
        from mtrain_cli.inputs import check_model_directory

        check_model_directory(model, tokenizer=False)  # its tokenizer may be given apart: checked later
    if recipe is None:
        recipe = default_recipe(model, data)
    launch_overrides, launch_warnings = accelerate_settings(os.environ)  # under `accelerate launch`
    extra = [*launch_overrides, *([f"model.path={model}"] if model else [])]
    extra += [f"data.sources=[{', '.join(repr(d) for d in data)}]"] if data else []
    extra += [f"run.output_dir={output_dir}"] if output_dir else []
    config = load_config(recipe, [*extra, *overrides])
    from mtrain_cli.inputs import check_local_inputs

    # before torch, transformers and datasets: a mistyped path answers at once, in a dry run as in the run
    check_local_inputs(config, fresh_run=resume is None)
    if dry_run:
        from mtrain_cli.dry_run import make_dry_run
        from mtrain_cli.train import read_inputs

        read_inputs(config, None, console)  # what the run reads, checked as the run checks it
        _print_dry_run(config, make_dry_run(config), to_yaml(config))
        return
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        check_launch(config.parallel, nproc, config.parallel.node_size or nproc, nproc_flag=True)
        raise typer.Exit(relaunch_under_torchrun(nproc))
    import_long_lived("mtrain_cli.train.run")
    from mtrain_cli.train import (
        Interrupted,  # torch
        run_extend,
    )

    try:
        result = run_extend(config, resume, console, launch_warnings)
    except Interrupted as exc:
        _exit_interrupted(exc)
    summary = result.summary
    if os.environ.get("RANK", "0") == "0" and not result.already_finished:  # else run_extend said so in one line
        from mtrain_cli.train import FINAL_LOSS_STEPS

        legs = len(summary["resumed_at"]) + 1  # the run's training time covers every leg, this command's is one
        training = f"training {summary['wall_s']:.1f}s" + (f" over the run's {legs} legs" if legs > 1 else "")
        console.print(
            f"[green]done[/] in {time.perf_counter() - started:.1f}s ({training}) · "
            f"final train loss {summary['final_train_loss']:.4f} (mean of the last "
            f"{min(FINAL_LOSS_STEPS, summary['steps']['end'])} steps)"
            f" · export: {summary['export_dir']} · summary: {result.run_dir / 'summary.json'}",
            highlight=False,
        )
    leave_launched_rank()


def _exit_interrupted(exc) -> None:
    """A stop signal ended training after a checkpoint was saved (train.stops.Interrupted): how to go on; exit
    code 128 + the signal's number (Ctrl-C 130, SIGTERM 143, SIGUSR1 138)."""
    import os

    if os.environ.get("RANK", "0") == "0":  # every rank stopped at the same step: say it once
        console.print(
            f"[yellow]{exc}. Continue with: mtrain extend --resume {exc.checkpoint.parents[1]}", soft_wrap=True
        )
    raise typer.Exit(exc.exit_code) from None


def _short(count: int) -> str:
    """2779683840 -> '2.78B', 3306240 -> '3.31M'."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def _print_dry_run(config, run, resolved_yaml: str) -> None:
    console.rule("resolved config")
    console.print(resolved_yaml, highlight=False, markup=False)
    r, mem = run.rope, run.memory
    table = Table(title="plan", show_header=False)
    params = f"{_short(run.num_params)} = {run.num_params:,} ({run.num_matmul_params:,} in matmuls)"
    table.add_row("parameters", params + (f"; {run.params_note}" if run.params_note else ""))
    if run.num_trainable_params != run.num_params:
        lora = config.train.lora
        table.add_row(
            "trainable (LoRA)",
            f"{_short(run.num_trainable_params)} = {run.num_trainable_params:,} "
            f"({run.num_trainable_params / run.num_params:.2%}): rank {lora.rank} on "
            f"{', '.join(lora.target_modules)}" + (" + embeddings and norms" if lora.train_embeddings_norms else ""),
        )
    table.add_row("RoPE from", run.rope_start)
    table.add_row(
        "RoPE",
        f"{r.method}: θ={r.rope_theta:g}, factor {r.factor:g}, {r.original_context:,} → {r.extended_context:,} tokens",
    )
    if r.method in ("yarn", "llama3"):
        name = {"yarn": "YaRN", "llama3": "llama3"}[r.method]
        table.add_row(f"{name} attention factor", f"{r.attention_factor:.4f}")
        table.add_row(
            f"{name} bands",
            f"{r.num_dims} frequency pairs: {r.num_kept} kept (high freq), {r.num_blended} "
            f"blended, {r.num_interpolated} interpolated (wavelength ≥ "
            f"{r.shortest_interpolated_wavelength or 0:,.0f} tokens)",
        )
    table.add_row("tokens per step", f"{run.tokens_per_step:,}")
    table.add_row("steps / total tokens", f"{run.num_steps:,} / {run.total_tokens:,}")
    table.add_row(
        "memory per GPU (estimate)",
        f"{mem.total_gib:.2f} GiB = states {mem.weights_grads_optimizer_gib:.2f}"
        f" + activations {mem.activations_gib:.2f} + logits chunk "
        f"{mem.logits_chunk_gib:.2f}",
    )
    from mtrain_cli.dry_run import memory_fit

    fit, warning = memory_fit(mem)
    table.add_row("fits", fit)
    console.print(table)
    if warning:  # the RoPE notes were warned of as the inputs were read
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)


@app.command("demo", cls=Command)
def demo_command() -> None:
    """What `make demo` runs: extend the shipped tiny base 256 -> 2,048 tokens, then passkey before/after."""
    from mtrain_cli.demo import run_demo
    from mtrain_cli.eval import EvalInterrupted
    from mtrain_cli.train import Interrupted

    try:
        run_demo(console, Path("runs"))
    except Interrupted as exc:
        _exit_interrupted(exc)
    except EvalInterrupted as exc:
        console.print(f"[yellow]{exc}", soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None


@app.command("recipes", cls=Command)
def list_recipes_command() -> None:
    """List the shipped recipes."""
    from mtrain_cli.resources import list_recipes

    recipes = list_recipes()
    if not console.is_terminal:  # piped: whole lines (a table at a fixed width would cut the descriptions)
        width = max(len(name) for name, _ in recipes)
        for name, description in recipes:
            console.print(f"{name:<{width}}  {description}", highlight=False, markup=False)
        return
    table = Table("recipe", "description")
    for name, description in recipes:
        table.add_row(name, description)
    console.print(table)


@app.command("env", cls=Command)
def env_command() -> None:
    """Versions and devices, for bug reports."""
    from mtrain_cli.environment import environment_report

    table = Table("component", "version / value")
    for key, value in environment_report().items():
        table.add_row(key, str(value))
    console.print(table)


app.add_typer(profile_app, name="profile")


EVAL_EPILOG = """Examples:\n
  mtrain eval /models/Qwen2.5-3B --lengths 4k,8k,16k --samples 20\n
  mtrain eval runs/tiny-20261122-101500 --suite ruler,niah --lengths 1k,2k     # a run's export/\n
  mtrain eval runs/tiny-20261122-101500/checkpoints/step_000200 --suite pg19 --pg19-dir /data/pg19/test\n
  mtrain eval /models/Qwen2.5-3B --lengths 32k,128k --attention sparse --sparse-set p=0.95\n
  mtrain eval data/tiny-base --yarn 8 --suite infinitebench --tasks passkey --lengths 256,1k,2k   # untrained YaRN"""


def eval_command(**options) -> None:
    """Evaluate long-context ability offline: RULER, needle-in-a-haystack, PG-19 perplexity, InfiniteBench."""
    from mtrain_cli.eval import EvalInterrupted, run_eval_command

    try:
        run_eval_command(console, **options)
    except EvalInterrupted as exc:  # what finished is written, marked partial
        console.print(f"[yellow]{exc}", soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None


def _typer_signature(options) -> inspect.Signature:
    """The command's parameters from the options' one definition (eval.OPTIONS: the command's and the suites')."""
    parameters = []
    for option in options:
        if option.flag is None:
            default = typer.Argument(option.default, metavar=option.metavar, help=option.help)
        else:
            default = typer.Option(option.default, option.flag, metavar=option.metavar, help=option.help)
        parameters.append(
            inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=option.kind)
        )
    return inspect.Signature(parameters)


eval_command.__signature__ = _typer_signature(EVAL_OPTIONS)
app.command("eval", cls=Command, epilog=EVAL_EPILOG)(eval_command)


def _fail(message: str, exit_code: int = 2) -> None:
    import os

    from rich.markup import escape

    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank sees the same bad input: say it once
        Console(stderr=True).print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(exit_code)


def main() -> None:
    """Console entry point: user and usage errors are one line on stderr with exit code 2, never a traceback."""
    import os

    # OpenMP's threads (torch's CPU ops) spin after each parallel region, waiting for the next: on cores another
    # process also uses, libgomp's default spin took 2-4x the CPU time of the work (the demo, the tests), and not
    # spinning at all (OMP_WAIT_POLICY=PASSIVE) made the demo alone 1.3-1.6x slower. A short spin keeps both.
    # Read when torch loads, which is later: every command imports it inside.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    try:
        exit_code = app(standalone_mode=False, prog_name="mtrain")  # returns typer.Exit's code instead of exiting
    except UserError as exc:
        _fail(str(exc), exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        Console(stderr=True).print("[yellow]aborted[/] (Ctrl-C); steps after the last checkpoint are not saved")
        sys.exit(130)
    except Exception as exc:
        if isinstance(exc, click_errors()):  # usage errors (exit code 2), from whichever click typer runs on
            _fail(usage_line(exc, sys.argv[1:], typer.main.get_command(app)), exc.exit_code)
        raise
    sys.exit(exit_code if isinstance(exit_code, int) else 0)
