"""What a run reports: a rich progress bar, a line every N steps, metrics.jsonl always, wandb when enabled."""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mtrain_cli.config import Config
from mtrain_cli.errors import DiskFull, UserError, is_disk_full
from mtrain_cli.train.records import strict_json


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class RunLogger:
    """Writes every step's metrics to metrics.jsonl and to the screen and wandb (rank 0 only: `enabled`)."""

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        start_step: int,
        console: Console,
        enabled: bool = True,
        before_first_write: Callable[[], None] | None = None,
    ):
        self.config = config
        self.console = console
        self.enabled = enabled
        if not enabled:
            return
        # metrics.jsonl is opened (appending) at the first record, after `before_first_write`: a resume
        # changes the run's files only once it has trained a step (train/records.py)
        self.path, self.jsonl, self.before_first_write = run_dir / "metrics.jsonl", None, before_first_write
        self.wandb_run = None
        if config.logging.wandb:
            import wandb

            try:
                self.wandb_run = wandb.init(
                    project=config.logging.wandb_project,
                    name=run_dir.name,
                    dir=str(run_dir),
                    config=config.to_dict(),
                    resume="allow",
                    mode=os.environ.get("WANDB_MODE"),
                )
            except Exception as exc:  # no login (wandb's UsageError), no network, ...: before any step is run
                cause = " ".join(str(exc).split())[:160]
                raise UserError(
                    f"logging.wandb=true: Weights & Biases did not start ({type(exc).__name__}: {cause}); run "
                    f"`wandb login`, or set WANDB_MODE=offline to log locally, or drop logging.wandb"
                ) from None
        self.progress = Progress(
            TextColumn("[bold]extend"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal,
        )
        self.task = self.progress.add_task("train", total=config.train.num_steps, completed=start_step, status="")
        self.first_step_end = time.perf_counter()  # set when this leg's first step ends
        self.start_step = start_step

    def __enter__(self) -> RunLogger:
        if self.enabled:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self.progress.__exit__(*exc)
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()

    def _write(self, record: dict[str, Any]) -> None:
        if self.jsonl is None:
            if self.before_first_write is not None:
                self.before_first_write()
            self.jsonl = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        line = json.dumps(strict_json(record), allow_nan=False) + "\n"
        try:
            self.jsonl.write(line)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self.jsonl = None  # its buffer cannot be flushed: closing it would fail again
            raise DiskFull(
                self.path,
                len(line),
                "a resume drops a line cut short; free some space and resume with "
                f"mtrain extend --resume {self.path.parent}",
            ) from None

    def log_step(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = metrics["step"]
        self._write(metrics)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        status = (
            f"loss {metrics['loss']:.4f} · {metrics['tokens_per_s']:,.0f} tok/s · "
            f"{metrics['tflops']:.2f} TFLOP/s · {metrics['peak_mem_gib']:.2f} GiB"
        )
        if "mfu" in metrics:
            status += f" · MFU {metrics['mfu']:.1%}"
        if "sparse_recall" in metrics:
            status += f" · recall {metrics['sparse_recall']:.3f} · density {metrics['sparse_density']:.2f}"
        if "recall_keep" in metrics:  # the recall controller's mean kept share
            status += f" · keep {metrics['recall_keep']:.3f}"
        if "dense_check_gap" in metrics:  # what sparse attention costs this step's loss, against dense
            status += f" · vs dense {metrics['dense_check_gap']:+.4f} ({metrics['dense_check_gap_rel']:+.2%})"
        layers = metrics.get("layers", {})
        dense = {route: n for route, n in layers.items() if route != "sparse" and n}
        if dense:  # designed switches ran some layer calls dense this step: say which
            status += (
                f" · sparse layers {layers['sparse']}/{sum(layers.values())}"
                f" ({', '.join(f'{route} {n}' for route, n in dense.items())})"
            )
        if "ring_imbalance" in metrics:
            status += f" · ring imbalance {metrics['ring_imbalance']:.3f}"
        if metrics.get("kernels_built") or metrics.get("plans_captured"):  # why this step was slower than the next
            status += f" · built {metrics['kernels_built']} kernels, {metrics['plans_captured']} plans"
        self.progress.update(self.task, completed=step, status=status)
        now = time.perf_counter()
        if step == self.start_step + 1:
            self.first_step_end = now
        every = self.config.logging.every
        if step % every == 0 or step == self.config.train.num_steps or step == self.start_step + 1:
            # the first step (data loading, allocator, compilation) predicts nothing: the eta counts later steps
            after_first = step - self.start_step - 1
            remaining = self.config.train.num_steps - step
            eta = f" · eta {(now - self.first_step_end) / after_first * remaining:,.0f}s" if after_first else ""
            self.console.print(
                f"step {step:>6}/{self.config.train.num_steps} · {status} · "
                f"lr {metrics['lr']:.2e} · gnorm {metrics['grad_norm']:.2f}{eta}",
                highlight=False,
            )

    def log_eval(self, step: int, val_loss: float) -> None:
        if not self.enabled:
            return
        record = {"step": step, "val_loss": val_loss}
        self._write(record)
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=step)
        self.console.print(f"step {step:>6} · validation loss {val_loss:.4f}", highlight=False)
