"""What stops a training run early. Stop signals: Ctrl-C, and what schedulers send before they stop a job (SLURM,
Kubernetes, `timeout`: SIGTERM, often after SIGUSR1 as a warning); each finishes the steps launched, saves a
checkpoint and exits with 128 + the signal's number, once the ranks agree on the step (train/loop.py votes once a
step). A non-finite loss or gradient norm: the run stops before that step is saved, in one line."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import torch
from rich.console import Console

from mtrain_cli.train.checkpoint import checkpoint_dirs

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class Interrupted(Exception):
    """Raised after a stop signal once the checkpoint is safely on disk."""

    def __init__(self, checkpoint: Path, signum: int = signal.SIGINT):
        super().__init__(f"interrupted ({signal_name(signum)}); checkpoint saved to {checkpoint}")
        self.checkpoint, self.exit_code = checkpoint, 128 + signum


def abort_now(console, cleanup: Callable[[], object]) -> NoReturn:
    """A second Ctrl-C: exit at once with 130 after one line. A KeyboardInterrupt raised from the handler would
    land wherever the main thread is: inside a checkpoint save (DCP wraps it in its own exception and the run
    printed a traceback), a collective, a library that catches it. What is on disk needs no unwinding:
    checkpoints are renamed into place when complete (a partial `.tmp` one is ignored, and removed by the next
    save), and a resume drops a metrics.jsonl line cut short. `cleanup` removes a fresh run's directory if no
    step was logged in it."""
    console.print("[yellow]aborted[/] (Ctrl-C again): steps after the last checkpoint are not saved", highlight=False)
    cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


def agree_to_stop(own: int | None, sum_all: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
    """Signals reach ranks at slightly different times (or only some): agree, so every rank saves in the same
    step. The decision is the reduced counts alone: a signal that lands during the all-reduce is this rank's news
    only, and counts at the next vote on every rank. own: this rank's signal before the vote; sum_all: the sum
    over ranks. -> the signal to stop for (this rank's, else another rank's), or None."""
    received = sum_all(torch.tensor([float(own == signum) for signum in STOP_SIGNALS])).tolist()
    if not any(received):
        return None
    return own or next(signum for signum, count in zip(STOP_SIGNALS, received) if count > 0)


class StopRequests:
    """This rank's stop signal while `installed`: the first one finishes the steps launched and saves (once the ranks
    agree, `agree`); a second Ctrl-C aborts at once (abort_now, with `cleanup`)."""

    def __init__(self, console: Console, cleanup: Callable[[], object]):
        self.console, self.cleanup = console, cleanup
        self.received: int | None = None

    def _on_signal(self, signum: int, _frame) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:  # a second Ctrl-C aborts; a scheduler's later signal waits for the save
                abort_now(self.console, self.cleanup)
            return
        self.received = signum
        again = " (Ctrl-C again to abort)" if signum == signal.SIGINT else ""
        notice = f"{signal_name(signum)}: finishing this step and saving a checkpoint{again}"
        self.console.print(f"[yellow]{notice}", highlight=False)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def agree(self, sum_all: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
        """The signal every rank stops for now (agree_to_stop), or None."""
        return agree_to_stop(self.received, sum_all)


def diverged_message(metrics: dict, run_dir: Path) -> str:
    """The one line of a step whose loss or gradient norm is not finite: what is kept, and how to go on."""
    saved = checkpoint_dirs(run_dir / "checkpoints")
    kept = (
        f"the newest checkpoint, {saved[-1][1]}, is from before it: resume from it with a lower train.lr "
        f"(mtrain extend --resume {run_dir} --set train.lr=...)"
        if saved
        else "no checkpoint was saved before it; start again with a lower train.lr"
    )
    return (
        f"step {metrics['step']}: loss {metrics['loss']}, gradient norm {metrics['grad_norm']}: training diverged "
        f"and stopped; nothing of this step is saved or exported; {kept}"
    )
