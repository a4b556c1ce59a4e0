"""Shared by the trainer tests: a very small run of the shipped recipe, and a way to run the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def cli_env() -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real console entry point in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "mtrain_cli", *args],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=cwd,
        timeout=timeout,
    )


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
