"""The `mtrain` command line: thin commands (parse → resolve config → build → run); logic lives in the library."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from mtrain_cli.errors import UserError

app = typer.Typer(
    help="Extend LLM context windows with distributed dynamic sparse attention.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
console = Console()

EXTEND_EPILOG = """Examples:\n
  mtrain extend                                   # the tiny built-in recipe on CPU, a few minutes\n
  mtrain extend --dry-run                         # resolved config, YaRN numbers, memory estimate\n
  mtrain extend --recipe my.yaml --model /models/Qwen2.5-3B --data /data/long.jsonl\n
  mtrain extend --set train.lr=1e-5 --set context.factor=16\n
  mtrain extend --resume runs/tiny-20261122-101500"""


@app.command(epilog=EXTEND_EPILOG)
def extend(
    recipe: Optional[str] = typer.Option(None, "--recipe", "-r", help="Recipe name (see `mtrain recipes`) or YAML path."),
    overrides: list[str] = typer.Option([], "--set", "-s", help="Dotted override, e.g. train.lr=1e-5 (repeatable)."),
    model: Optional[Path] = typer.Option(None, "--model", help="Local Hugging Face model directory."),
    data: list[str] = typer.Option([], "--data", help="Local dataset path (jsonl/parquet/txt/save_to_disk); repeatable."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", help="Parent directory for run directories."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this directory."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved plan and exit."),
) -> None:
    """Extend a model's context: pack data, apply the RoPE/YaRN recipe, train, checkpoint, export."""
    from mtrain_cli.config import load_config, to_yaml
    from mtrain_cli.plan import make_plan
    from mtrain_cli.train.loop import Interrupted, run_extend

    if resume is not None and recipe is None:
        recipe = str(resume / "config.yaml")
        if not Path(recipe).is_file():
            raise UserError(f"--resume {resume}: no config.yaml there; pass the directory of a run made by mtrain extend")
    extra = [f"model.path={model}"] if model else []
    extra += [f"data.sources=[{', '.join(repr(d) for d in data)}]"] if data else []
    extra += [f"run.output_dir={output_dir}"] if output_dir else []
    config = load_config(recipe, [*extra, *overrides])
    if dry_run:
        _print_plan(config, make_plan(config), to_yaml(config))
        return
    try:
        result = run_extend(config, resume, console)
    except Interrupted as exc:
        console.print(f"[yellow]{exc}. Continue with: mtrain extend --resume {exc.checkpoint.parents[1]}",
                      soft_wrap=True)
        raise typer.Exit(130) from None
    summary = result.summary
    console.print(f"[green]done[/] in {summary['wall_s']:.0f}s · final train loss {summary['final_train_loss']:.4f}"
                  f" · export: {summary['export_dir']} · summary: {result.run_dir / 'summary.json'}")


def _print_plan(config, plan, resolved_yaml: str) -> None:
    console.rule("resolved config")
    console.print(resolved_yaml, highlight=False, markup=False)
    r, mem = plan.rope, plan.memory
    table = Table(title="plan", show_header=False)
    table.add_row("parameters", f"{plan.num_params:,} ({plan.num_matmul_params:,} in matmuls)")
    table.add_row("RoPE", f"{r.method}: θ={r.rope_theta:g}, factor {r.factor:g}, "
                          f"{r.original_context:,} → {r.extended_context:,} tokens")
    if r.method == "yarn":
        table.add_row("YaRN attention factor", f"{r.attention_factor:.4f}")
        table.add_row("YaRN bands", f"{r.num_dims} frequency pairs: {r.num_kept} kept (high freq), {r.num_blended} "
                                    f"blended, {r.num_interpolated} interpolated (wavelength ≥ "
                                    f"{r.shortest_interpolated_wavelength or 0:,.0f} tokens)")
    table.add_row("tokens per step", f"{plan.tokens_per_step:,}")
    table.add_row("steps / total tokens", f"{plan.num_steps:,} / {plan.total_tokens:,}")
    table.add_row("memory per GPU (estimate)", f"{mem.total_gib:.2f} GiB = states {mem.weights_grads_optimizer_gib:.2f}"
                                               f" + activations {mem.activations_gib:.2f} + logits chunk "
                                               f"{mem.logits_chunk_gib:.2f}")
    console.print(table)


@app.command("recipes")
def list_recipes_command() -> None:
    """List the shipped recipes."""
    from mtrain_cli.resources import list_recipes

    table = Table("recipe", "description")
    for name, description in list_recipes():
        table.add_row(name, description)
    console.print(table)


@app.command("env")
def env_command() -> None:
    """Versions and devices, for bug reports."""
    from mtrain_cli.environment import environment_report

    table = Table("component", "version / value")
    for key, value in environment_report().items():
        table.add_row(key, str(value))
    console.print(table)


def main() -> None:
    """Console entry point: user errors are one line on stderr with exit code 2, never a traceback."""
    try:
        exit_code = app(standalone_mode=False)  # click returns typer.Exit's code instead of exiting
    except UserError as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        Console(stderr=True).print("[yellow]aborted[/] (Ctrl-C); steps after the last checkpoint are not saved")
        sys.exit(130)
    except Exception as exc:  # click usage errors carry their own exit code (2)
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
    sys.exit(exit_code if isinstance(exit_code, int) else 0)
