"""`mtrain extend` as a run: a fresh run in a new run directory, or a resumed one from its newest intact checkpoint.

Every rank of a torchrun launch calls `run_extend`; the process groups live exactly as long as the call (and are
destroyed only once the trainer is unreachable, see train.distributed.end_parallel). The training itself:
train/loop.py; what is written when, and what a failure leaves behind: train/records.py.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from mtrain_cli.config import Config
from mtrain_cli.inputs import check_output_dir
from mtrain_cli.parallel import ParallelContext
from mtrain_cli.train.distributed import parallel_scope
from mtrain_cli.train.loop import build_trainer
from mtrain_cli.train.records import (
    RunRecords,
    create_shared_run_dir,
    plan_resume,
    remove_unstarted_run_dir,
)


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)
    already_finished: bool = False  # --resume of a finished run: nothing was done; summary is the run's own


def run_extend(config: Config, resume: Path | None, console: Console, warnings: Sequence[str] = ()) -> RunResult:
    """Train a fresh run, or continue the run in directory `resume` from its newest intact checkpoint. `warnings`
    (e.g. launcher settings not applied) are shown and kept in the summary like the trainer's own.

    Under torchrun every rank calls this; rank 0 alone prints and writes logs and the summary. What is written
    when, and what a failure leaves behind: train/records.py."""
    with parallel_scope(config) as pc:  # the groups go once the trainer, made inside, is out of scope
        return _extend(config, resume, console if pc.is_main else Console(file=io.StringIO()), pc, warnings)


def _extend(
    config: Config, resume: Path | None, console: Console, pc: ParallelContext, warnings: Sequence[str]
) -> RunResult:
    ranks = f" · {pc.world} ranks (dp {pc.dp} × cp {pc.cp})" if pc.distributed else ""
    if resume is not None:
        plan = plan_resume(resume, config)  # everything checked; nothing written yet
        if plan.finished is not None:
            console.print(
                f"run {resume} already finished at step {plan.finished['steps']['end']}/"
                f"{config.train.num_steps}; raise train.num_steps with --set to train further",
                highlight=False,
                soft_wrap=True,
            )
            return RunResult(run_dir=resume, summary=plan.finished, already_finished=True)
        for message in plan.warnings:
            console.print(f"[yellow]warning:[/] {message}", highlight=False)
        console.print(f"run directory: {resume}{ranks}")
        trainer = build_trainer(config, resume, console, pc)
        for message in plan.warnings:
            trainer._warn(message, echo=False)
        for message in warnings:
            trainer._warn(message)
        trainer.resume(plan.checkpoint)
        return RunResult(run_dir=resume, summary=trainer.fit(RunRecords(resume, config, pc.is_main, plan)))
    check_output_dir(config.run.output_dir)
    trainer = build_trainer(config, Path(config.run.output_dir), console, pc)
    for message in warnings:
        trainer._warn(message)
    run_dir = trainer.run_dir = create_shared_run_dir(config, pc)  # once the trainer is built
    console.print(f"run directory: {run_dir}{ranks}")
    try:
        return RunResult(run_dir=run_dir, summary=trainer.fit(RunRecords(run_dir, config, pc.is_main)))
    except BaseException:
        if pc.is_main and remove_unstarted_run_dir(run_dir):
            console.print(f"removed {run_dir}: the run stopped before its first step", highlight=False)
        raise
