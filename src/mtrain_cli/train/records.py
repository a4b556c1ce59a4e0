"""The run directory and its records: when `mtrain extend` creates, rewrites or removes what is in it.

Nothing a user had is ever lost, and a failed command changes nothing it did not create:
  * A fresh run's directory is created (with config.yaml, written atomically) only once the trainer is built:
    bad settings, data or models fail before any directory exists. If the run then stops before its first
    step is logged and before any checkpoint (an error, a second Ctrl-C), the directory is removed again,
    entry by entry, only what this command wrote. Under torchrun rank 0 creates and removes it.
  * `--resume` reads and checks everything first (the checkpoints newest first, metrics.jsonl, config.yaml,
    summary.json) and writes nothing until the resumed run has finished its first step. A damaged newest
    checkpoint is skipped with a warning naming the file (kept in summary.json); with none intact, or a
    checkpoint that does not fit the config, the resume stops with one line. A finished run (last checkpoint
    at train.num_steps and its summary.json) says so and writes nothing; raise train.num_steps with --set to
    train further. One killed after its last checkpoint, before its summary, is finished: export + summary.
  * config.yaml is the configuration the run trains with now, which a plain `--resume` reuses. As in
    torchtune and torchtitan, a resume trains with the configuration it is given (config.yaml + --set) and the
    checkpoint supplies the state; changed lr, betas, weight decay and schedule apply from the resumed step on
    (the restored optimizer would otherwise keep the old ones, and config.yaml would not tell the truth).
    When the settings differ from config.yaml, the resumed run rewrites it atomically once its first step is
    done and keeps the previous file as config.until_step_NNNNNN.yaml (the settings of the steps up to the
    checkpoint); the change is a warning in summary.json. A run directory never holds a config.yaml that
    describes a command which failed before training.
  * metrics.jsonl holds one line per step and one per validation: at that same first step, lines of steps
    after the checkpoint (which are trained again) and a line cut short by a kill are dropped (atomically).
  * summary.json is written atomically at the end and covers the whole run: every validation loss, the wall
    time of every leg (carried in the checkpoints), the final train loss over the run's last steps.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from mtrain_cli.config import Config, to_yaml
from mtrain_cli.errors import DiskFull, UserError, is_disk_full
from mtrain_cli.parallel import ParallelContext
from mtrain_cli.train.checkpoint import UnreadableCheckpoint, checkpoint_dirs, verify_checkpoint
from mtrain_cli.train.optim import lr_multiplier

FINAL_LOSS_STEPS = 10  # summary.json's final_train_loss: the mean over the run's last steps


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a part (temp file in the same directory + rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise DiskFull(path, len(text.encode()), f"{path.name} is as it was; free some space") from None
        raise
    os.replace(tmp, path)


# -- a fresh run ---------------------------------------------------------------------------------------------


def create_run_dir(config: Config) -> Path:
    """<output_dir>/<name>-<time>[-n], made here and now (never an existing one), with config.yaml in it."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    parent = Path(config.run.output_dir).expanduser()
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for suffix in range(1000):
            run_dir = parent / (f"{config.run.name}-{stamp}" + (f"-{suffix}" if suffix else ""))
            try:
                run_dir.mkdir()
                break
            except FileExistsError:
                continue
        else:
            raise UserError(f"run.output_dir {parent}: 1000 runs named {config.run.name}-{stamp} exist already")
        write_atomic(run_dir / "config.yaml", to_yaml(config))
    except OSError as exc:
        raise UserError(
            f"run.output_dir {config.run.output_dir}: cannot create a run directory there "
            f"({exc.strerror or exc}); pass another --output-dir"
        ) from None
    return run_dir


def create_shared_run_dir(config: Config, pc: ParallelContext) -> Path:
    """Rank 0 creates the run directory (with config.yaml); every rank gets its path, or rank 0's error."""
    run_dir, error = None, None
    if pc.is_main:
        try:
            run_dir = create_run_dir(config)
        except UserError as exc:
            error = str(exc)
    if pc.distributed:
        holder = [str(run_dir) if run_dir else None, error]
        dist.broadcast_object_list(holder, src=0)
        run_dir, error = Path(holder[0]) if holder[0] else None, holder[1]
    if error:
        raise UserError(error)
    return run_dir


def remove_unstarted_run_dir(run_dir: Path) -> bool:
    """After a failed fresh start: remove the run directory if the run never logged a step nor saved a
    checkpoint. Only what a run writes is removed; anything else found there keeps the directory."""
    if checkpoint_dirs(run_dir / "checkpoints") or read_metrics(run_dir / "metrics.jsonl", None).steps:
        return False
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "wandb", "export.tmp"):
        target = run_dir / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists() or target.is_symlink():
            target.unlink()
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        for partial in checkpoints.glob("step_*.tmp*"):  # a save cut short
            shutil.rmtree(partial, ignore_errors=True)
        with _ignore_os_errors():
            checkpoints.rmdir()
    with _ignore_os_errors():
        run_dir.rmdir()
    return not run_dir.exists()


class _ignore_os_errors:
    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        return kind is not None and issubclass(kind, OSError)


# -- metrics.jsonl -------------------------------------------------------------------------------------------


def strict_json(value: Any) -> Any:
    """`value` with every float that is not finite as the string "nan", "inf" or "-inf": strict JSON has no NaN,
    and jq or JavaScript reject a file holding one (Python's json writes bare NaN). float() reads them back."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def _number(value: Any) -> Any:
    return float(value) if isinstance(value, str) else value


@dataclass
class Metrics:
    lines: list[str] = field(default_factory=list)  # kept lines, as they were written
    steps: dict[int, float] = field(default_factory=dict)  # training loss by step
    val: dict[int, float] = field(default_factory=dict)  # validation loss by step
    dense_gaps: dict[int, float] = field(default_factory=dict)  # the dense check's loss gap by step
    dropped: int = 0  # lines left out


def read_metrics(path: Path, up_to_step: int | None) -> Metrics:
    """metrics.jsonl up to a step: one line per (step, kind), the last one written for it; lines of later
    steps and lines that do not parse (cut short by a kill) are left out."""
    if not path.is_file():
        return Metrics()
    lines = path.read_text(errors="replace").splitlines()
    last: dict[tuple[str, int], int] = {}
    for number, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and (up_to_step is None or step <= up_to_step):
            last[("val" if "val_loss" in record else "train", step)] = number
    metrics = Metrics(dropped=len(lines) - len(last))
    for number in sorted(last.values()):
        record = json.loads(lines[number])
        metrics.lines.append(lines[number])
        if "val_loss" in record:
            metrics.val[record["step"]] = _number(record["val_loss"])
        elif "loss" in record:
            metrics.steps[record["step"]] = _number(record["loss"])
            if "dense_check_gap" in record:
                metrics.dense_gaps[record["step"]] = _number(record["dense_check_gap"])
    return metrics


# -- a resumed run -------------------------------------------------------------------------------------------


@dataclass
class ResumePlan:
    run_dir: Path
    checkpoint: Path | None = None
    step: int = 0
    warnings: list[str] = field(default_factory=list)
    history: Metrics = field(default_factory=Metrics)  # metrics.jsonl up to the checkpoint
    changes: list[str] = field(default_factory=list)  # settings that differ from config.yaml
    config_text: str | None = None  # config.yaml as it is
    finished: dict[str, Any] | None = None  # the summary of a run that is already done


def plan_resume(run_dir: Path, config: Config) -> ResumePlan:
    """Everything a resume needs, read and checked, nothing written; the same verdict on every rank, for any
    number of processes. Raises UserError (one line)."""
    found = checkpoint_dirs(run_dir / "checkpoints")
    if not found:
        raise UserError(
            f"--resume {run_dir}: no checkpoint under {run_dir / 'checkpoints'}; pass a run directory "
            f"written by mtrain extend"
        )
    newest, num_steps = found[-1][0], config.train.num_steps
    if newest > num_steps:
        raise UserError(
            f"--resume {run_dir}: its newest checkpoint is step {newest}, beyond train.num_steps "
            f"{num_steps}; to train further pass a larger one, e.g. --set train.num_steps={2 * newest}"
        )
    plan = ResumePlan(run_dir)
    summary = _read_json(run_dir / "summary.json")
    if (
        newest == num_steps
        and summary.get("steps", {}).get("end") == newest
        and isinstance(summary.get("final_train_loss"), (int, float))
    ):
        plan.finished = summary
        return plan
    problems = []
    for step, path in reversed(found):
        try:
            verify_checkpoint(path)
        except UnreadableCheckpoint as exc:
            problems.append(str(exc))
            continue
        plan.checkpoint, plan.step = path, step
        break
    else:
        raise UserError(f"--resume {run_dir}: no intact checkpoint to resume from: {'; '.join(problems)}")
    if problems:
        plan.warnings.append(
            f"{'; '.join(problems)}: resuming from {plan.checkpoint} instead, the newest intact "
            f"checkpoint (steps after {plan.step} are trained again)"
        )
    plan.history = read_metrics(run_dir / "metrics.jsonl", plan.step)
    config_file = run_dir / "config.yaml"
    if config_file.is_file():
        plan.config_text = config_file.read_text()
        plan.changes = _changes(yaml.safe_load(plan.config_text) or {}, config, plan.step)
    if plan.changes:
        plan.warnings.append(
            f"resumed with changed settings: {'; '.join(plan.changes)} (config.yaml is updated "
            f"at the first step; the previous one is kept as {_previous_name(plan.step)})"
        )
    return plan


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return {key.rstrip("."): value for key, value in flat.items()}


def _changes(old: dict[str, Any], config: Config, step: int) -> list[str]:
    """'key old → new' for every setting that differs from config.yaml; for the schedule, the lr of the next step.
    Both sides as YAML reads them (a tuple in the config is a list in the file: no change)."""
    before, after = _flatten(old), _flatten(yaml.safe_load(to_yaml(config)))
    changes = [f"{key} {before.get(key)} → {after.get(key)}" for key in after if before.get(key) != after.get(key)]
    keys = ("lr", "num_steps", "warmup_steps", "schedule", "min_lr_ratio")
    if any(before.get(f"train.{key}") != after.get(f"train.{key}") for key in keys):
        try:
            from mtrain_cli.config import config_from_dict

            previous = config_from_dict(old).train
            lr_then = previous.lr * lr_multiplier(step, previous)
            lr_now = config.train.lr * lr_multiplier(step, config.train)
            if lr_then != lr_now:
                changes.append(f"learning rate of step {step + 1}: {lr_then:.3g} → {lr_now:.3g}")
        except (UserError, TypeError, ValueError):
            pass
    return changes


def _previous_name(step: int) -> str:
    return f"config.until_step_{step:06d}.yaml"


class RunRecords:
    """What fit() needs of the run directory: history before this leg, the hook that commits a resume (called
    before its first metrics line), and the atomic summary. Rank 0 writes; other ranks only read."""

    def __init__(self, run_dir: Path, config: Config, is_main: bool, plan: ResumePlan | None = None):
        self.run_dir, self.config, self.is_main, self.plan = run_dir, config, is_main, plan
        self.history = plan.history if plan else Metrics()
        self.begun = False

    def begin(self) -> None:
        """The resume has begun (its first step is done, or it had none left and is done): drop the replayed
        steps' lines, update config.yaml. Once."""
        plan, begun, self.begun = self.plan, self.begun, True
        if plan is None or not self.is_main or begun:
            return
        if plan.history.dropped:
            write_atomic(self.run_dir / "metrics.jsonl", "".join(line + "\n" for line in plan.history.lines))
        new_text = to_yaml(self.config)
        if plan.config_text is not None and plan.changes and new_text != plan.config_text:
            previous = self.run_dir / _previous_name(plan.step)
            suffix = 1
            while previous.exists():
                previous = previous.with_name(f"{_previous_name(plan.step)[:-5]}-{suffix}.yaml")
                suffix += 1
            write_atomic(previous, plan.config_text)
        if plan.config_text is None or (plan.changes and new_text != plan.config_text):
            write_atomic(self.run_dir / "config.yaml", new_text)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if not self.begun:  # a resume of a run killed after its last checkpoint: no step left to train
            self.begin()
        if self.is_main:
            write_atomic(self.run_dir / "summary.json", json.dumps(strict_json(summary), indent=2, default=str))
