"""Shared by the trainer tests: a very small run of the shipped recipe, and a way to run the real CLI."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

SMALL_MODEL = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.max_position_embeddings=64",
    "context.factor=4",
    "data.seq_len=256",
    "data.num_val_rows=2",
    "logging.every=1",
]


def small_run(num_steps: int, output_dir: Path, *extra: str) -> list[str]:
    """Overrides for a run of `num_steps` on a ~100K-parameter model that takes seconds on CPU."""
    return [
        *SMALL_MODEL,
        f"train.num_steps={num_steps}",
        "train.warmup_steps=1",
        f"train.eval_every={num_steps}",
        f"checkpoint.every={num_steps}",
        f"run.output_dir={output_dir}",
        *extra,
    ]


def route_counts(nonzero: dict[str, int]) -> dict[str, int]:
    """Layer calls by every route (attention.Route's values), as the router counts them: these, the others 0."""
    from mtrain_cli.attention import Route

    assert set(nonzero) <= {route.value for route in Route}, nonzero
    return {route.value: nonzero.get(route.value, 0) for route in Route}


def cli_env() -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real console entry point (`mtrain_cli.cli.main`) with these arguments, as a user runs it: its exit code,
    stdout and stderr. In this process, where torch and transformers are imported already (starting a process
    that imports them is most of a small command's time), with the CLI's environment, working directory and
    arguments for the call. In a new process for a torchrun launch (--nproc), whose ranks write to the process's
    own stdout and stderr; a process of its own without a launch: spawned_ranks.run_forked_cli."""
    if any(arg == "--nproc" or arg.startswith("--nproc=") for arg in args):
        return subprocess.run(
            [sys.executable, "-m", "mtrain_cli", *args],
            capture_output=True,
            text=True,
            env=cli_env(),
            cwd=cwd,
            timeout=timeout,
        )
    import datasets

    from mtrain_cli.cli import main

    datasets.disable_progress_bars()  # what a piped command's fresh process gets at import (cli/usage.py)
    saved_environ, saved_cwd, saved_argv = dict(os.environ), Path.cwd(), sys.argv
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        os.environ.clear()
        os.environ.update(cli_env())
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = ["mtrain", *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except BaseException:  # a traceback, as the process would print it
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_environ)
    return subprocess.CompletedProcess(["mtrain", *args], code, out.getvalue(), err.getvalue())


def set_args(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def step_losses(run_dir: Path) -> dict[int, list[float]]:
    """Every training-step loss in metrics.jsonl, by step (a step redone after a crash appears twice)."""
    losses: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses.setdefault(record["step"], []).append(record["loss"])
    return losses


def only_run_dir(parent: Path) -> Path:
    (run_dir,) = [p for p in parent.iterdir() if p.is_dir()]
    return run_dir


def save_weights(model, checkpoint: Path) -> None:
    """A checkpoint's model items as the trainer writes them (DCP, the keys of its ChunkedLossModel), without
    optimizer or trainer state: what `mtrain eval` reads of a checkpoint."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from mtrain_cli.train.loss import ChunkedLossModel

    with warnings.catch_warnings():  # one process on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": get_model_state_dict(ChunkedLossModel(model, 1))}, checkpoint_id=str(checkpoint / "dcp"))


def write_documents(path: Path, count: int = 20, field: str = "text") -> Path:
    """`count` English-like documents of about 800 tokens each (the shipped tokenizer), as JSON lines."""
    from fixtures.eval_corpus import prose

    path.write_text("".join(json.dumps({field: prose(index, 40)}) + "\n" for index in range(count)))
    return path


def write_tensorless_weights(model_dir: Path) -> None:
    """A model.safetensors that lists no tensors: a readable weights file for a dry run of a published config
    whose real weights are gigabytes (no shape to check, nothing to load)."""
    header = b'{"__metadata__": {"format": "pt"}}'
    (model_dir / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


def error_line(result) -> str:
    """The CLI's one line on stderr, after checking the exit code and that no traceback was printed."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]
