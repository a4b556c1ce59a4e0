"""Checkpoints in one format for one process and many: torch.distributed.checkpoint (DCP).

Layout of a run directory (every world size, one process included):
  checkpoints/step_000100/dcp/{.metadata, __0_0.distcp, ...}   model + optimizer: one file per rank
  checkpoints/step_000100/state_rank0.pt, ...                  step, scheduler, loader, RNG: one file per rank
  export/                                                       the HF export (train/export.py)
Model and optimizer are saved under the keys of `get_state_dict(ChunkedLossModel, optimizer)`, the same for a
plain module and an FSDP2-sharded one (a model with frozen weights, LoRA, saves only what trains), and DCP
reshards on load: a run resumes on any world size (a rank without its own state file takes rank 0's; the data
position is per data-parallel rank, see Trainer.resume).
Without a process group `dcp.save`/`dcp.load` run in the one process.

A checkpoint directory either exists complete or not at all: every rank writes into `step_N.tmp` (DCP fsyncs
its files, we fsync the states), and rank 0 renames it into place once all ranks are done; a crash mid-save
leaves only the `.tmp` directory, removed by the next save. A file damaged later (a disk filling up, a copy
cut short) is found by `verify_checkpoint` from the files alone, before anything is loaded: every rank reaches
the same verdict, `UnreadableCheckpoint` names the file, and a resume falls back to the newest intact
checkpoint. Pruning keeps the last K checkpoints up to the step being saved; newer ones (left by a fallback)
stay until the replayed run overwrites them. Checkpoints of mtrain before DCP (model.pt, optimizer.pt,
state.pt) are refused in one line.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from mtrain_cli.errors import DiskFull, UserError, is_disk_full
from mtrain_cli.parallel import ParallelContext
from mtrain_cli.train.loss import ChunkedLossModel

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


@dataclass
class TrainState:
    """Everything besides model and optimizer that an exact resume needs."""

    step: int
    scheduler: dict[str, Any]
    loader: dict[str, Any]
    rng: dict[str, Any]
    wall_s: float = 0.0  # the run's wall time up to this checkpoint, over every leg
    resumed_at: list[int] = field(default_factory=list)  # the steps earlier legs resumed from
    world: int = 1  # the processes that saved it (set by save_checkpoint)
    dp: int = 1  # their data-parallel size: the loader position is per data-parallel rank
    crossover: dict[str, Any] = field(default_factory=dict)  # this rank's CrossoverPolicy.state_dict()
    recall: dict[str, Any] = field(default_factory=dict)  # RecallController.state_dict() (the same on every rank)


class UnreadableCheckpoint(Exception):
    """A checkpoint file that is missing, truncated or corrupt; the message names the file."""

    def __init__(self, file: Path, problem: str):
        super().__init__(f"{file} is {problem}")
        self.file, self.problem = file, problem


class CheckpointMismatch(Exception):
    """Intact files that do not fit the model (or optimizer) they are loaded into; the message says why."""


def state_dict_options(net: torch.nn.Module) -> StateDictOptions:
    """What a checkpoint holds of `net`: every weight, or (LoRA: a frozen base) only those that train, so the
    base, rebuilt from the model directory or the seed, is not written again at every save."""
    frozen = any(not param.requires_grad for param in net.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def capture_rng() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def prune_checkpoints(root: Path, step: int, keep_last: int) -> None:
    """Keep the last `keep_last` checkpoints up to `step`. Newer ones exist only after a resume fell back past
    unreadable checkpoints: they are overwritten when the run reaches their step, never pruned in their place."""
    for _, old in [found for found in checkpoint_dirs(root) if found[0] <= step][:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _one_process_is_fine():
    """DCP warns when it runs without a process group; one process is what we mean then."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_checkpoint(
    root: Path,
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    keep_last: int,
    pc: ParallelContext,
) -> Path:
    """Every rank: its shards of model and optimizer (DCP) and its trainer state; `net` is the ChunkedLossModel.
    A failed write (a full disk: DiskFull, one line) removes the partial `.tmp` directory on every rank's word
    and leaves earlier checkpoints as they were."""
    final = root / f"step_{state.step:06d}"
    tmp = root / f"{final.name}.tmp"
    failure: BaseException | None = None
    if pc.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob("step_*.tmp*"):  # a save cut short
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            failure = exc
    if _failed_anywhere(failure, pc):
        return _raise_save_failure(failure, tmp, final, 0, pc)
    model_sd, optim_sd = get_state_dict(net, optimizer, options=state_dict_options(net))
    try:
        with _one_process_is_fine():
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        with open(tmp / f"state_rank{pc.rank}.pt", "wb") as handle:
            torch.save(replace(state, world=pc.world, dp=pc.dp).__dict__, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        failure = exc
    if _failed_anywhere(failure, pc):  # every rank learns of any rank's failure: none waits at a barrier alone
        return _raise_save_failure(failure, tmp, final, _state_bytes(model_sd, optim_sd), pc)
    if pc.is_main:
        if final.exists():  # re-saving the same step (e.g. Ctrl-C right after a scheduled save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune_checkpoints(root, state.step, keep_last)
    pc.barrier()
    return final


def _failed_anywhere(failure: BaseException | None, pc: ParallelContext) -> bool:
    return bool(pc.sum_all(torch.tensor([1.0 if failure is not None else 0.0]))[0] > 0)


def _state_bytes(*state_dicts: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in the state dicts: about what its checkpoint files take."""
    total, pending = 0, list(state_dicts)
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending += list(value.values())
        elif isinstance(value, (list, tuple)):
            pending += list(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def _raise_save_failure(failure: BaseException | None, tmp: Path, final: Path, needed: int, pc: ParallelContext):
    """Remove the partial checkpoint (rank 0, once every rank has stopped writing) and raise: DiskFull for a
    full disk, else the failure itself; a rank whose own write went through names another rank's failure."""
    if pc.is_main:  # every rank has stopped writing: the sum in _failed_anywhere waited for all
        shutil.rmtree(tmp, ignore_errors=True)
    pc.barrier()
    earlier = [path.name for _, path in checkpoint_dirs(final.parent)]
    if failure is None:
        raise RuntimeError(f"saving {final}: another rank's write failed; the partial checkpoint is removed")
    if is_disk_full(failure):
        then = (
            f"earlier checkpoints are intact ({', '.join(earlier[-2:])}): free some space and resume with "
            f"mtrain extend --resume {final.parents[1]}"
            if earlier
            else "the run has no earlier checkpoint: free some space and start it again"
        )
        raise DiskFull(
            final, needed * pc.world if needed else None, f"the partial checkpoint is removed; {then}"
        ) from None
    raise failure


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__).split(". ")[0]


def read_file(file: Path, weights_only: bool = True) -> Any:
    """torch.load onto the CPU, memory-mapped; a missing or damaged file raises UnreadableCheckpoint."""
    if not file.is_file():
        raise UnreadableCheckpoint(file, "missing")
    if file.stat().st_size == 0:
        raise UnreadableCheckpoint(file, "empty")
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=weights_only)
    except Exception as exc:  # truncated zip, not a torch.save file, ...
        raise UnreadableCheckpoint(file, f"truncated or corrupt ({first_line(exc)})") from None


def _read_metadata(path: Path) -> Metadata:
    metadata = path / "dcp" / ".metadata"
    if not metadata.is_file():
        raise UnreadableCheckpoint(metadata, "missing")
    try:
        return FileSystemReader(str(path / "dcp")).read_metadata()
    except Exception as exc:
        raise UnreadableCheckpoint(metadata, f"truncated or corrupt ({first_line(exc)})") from None


def verify_checkpoint(path: Path, model_only: bool = False) -> None:
    """Raise UnreadableCheckpoint naming the first missing or truncated file of checkpoint `path`: DCP's
    .metadata, every data file it points into (long enough for each item), and the trainer states.
    A checkpoint of mtrain before DCP is a UserError."""
    if (path / "model.pt").is_file() and not (path / "dcp").exists():
        raise UserError(
            f"{path} was written by an mtrain before DCP checkpoints (model.pt, torch.save), which "
            f"this version does not read; use the mtrain version that wrote it, or the run's export/"
        )
    needed: dict[str, int] = {}
    for index, info in (_read_metadata(path).storage_data or {}).items():
        if not model_only or index.fqn.startswith("model."):
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / "dcp" / name
        if not file.is_file():
            raise UnreadableCheckpoint(file, "missing")
        if file.stat().st_size < size:
            raise UnreadableCheckpoint(file, f"truncated ({file.stat().st_size:,} bytes; its items need {size:,})")
    if not model_only:
        for file in [path / "state_rank0.pt", *sorted(set(path.glob("state_rank*.pt")) - {path / "state_rank0.pt"})]:
            _read_state_file(file)


def _fit_problem(metadata: Metadata, model_sd: dict[str, Any]) -> str | None:
    """Why the checkpoint's model items do not fit `model_sd` (names and global shapes), or None. DCP would
    load a checkpoint with extra items silently and name a size mismatch less plainly."""
    saved = {
        name.removeprefix("model."): item
        for name, item in metadata.state_dict_metadata.items()
        if name.startswith("model.")
    }
    for name, tensor in model_sd.items():
        if name not in saved:
            return f"{name} is not in the checkpoint"
        item = saved[name]
        if isinstance(item, TensorStorageMetadata) and list(item.size) != list(tensor.shape):
            return f"size mismatch for {name}: {list(item.size)} in the checkpoint, {list(tensor.shape)} in the model"
    extra = sorted(set(saved) - set(model_sd))
    return f"{extra[0]} is in the checkpoint but not in the model" if extra else None


def load_dcp(path: Path, state: dict[str, Any]) -> None:
    """Load checkpoint `path` into `state` ({"model": ..., and "optimizer": ... if wanted}) in place, in every
    rank (collective); CheckpointMismatch with a one-line reason if the items don't fit."""
    problem = _fit_problem(_read_metadata(path), state["model"])
    if problem is None:
        try:
            with _one_process_is_fine():
                dcp.load(state, checkpoint_id=str(path / "dcp"))
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            problem = dcp_reason(exc)
    if problem is not None:
        raise CheckpointMismatch(problem)


def _read_state_file(file: Path) -> TrainState:
    try:
        return TrainState(**read_file(file, weights_only=False))  # RNG states hold numpy tuples: written by us
    except TypeError as exc:
        raise UnreadableCheckpoint(file, f"not a trainer state ({first_line(exc)})") from None


def read_state(path: Path, rank: int = 0) -> TrainState:
    """Rank `rank`'s trainer state of checkpoint `path`; rank 0's for a rank the saving run did not have."""
    own = path / f"state_rank{rank}.pt"
    return _read_state_file(own if own.exists() else path / "state_rank0.pt")


def load_checkpoint(
    path: Path, net: torch.nn.Module, optimizer: torch.optim.Optimizer, pc: ParallelContext
) -> TrainState:
    """Model and optimizer loaded, -> this rank's trainer state. The files were checked by `verify_checkpoint`:
    a failure here means they don't fit the model, a one-line UserError."""
    options = state_dict_options(net)
    model_sd, optim_sd = get_state_dict(net, optimizer, options=options)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        load_dcp(path, state)
    except CheckpointMismatch as exc:
        raise UserError(
            f"--resume: {path} does not fit the model and optimizer built from the config ({exc}); "
            f"resume with the settings the run was trained with"
        ) from None
    set_state_dict(
        net, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
    )
    return read_state(path, pc.rank)


def load_model_weights(path: Path, model: torch.nn.Module) -> None:
    """The weights of checkpoint `path` (written by any number of processes) into the plain HF `model` (with
    LoRA adapters: only what trains), in this one process; the optimizer's items are not read."""
    net = ChunkedLossModel(model, chunk_size=1)  # the keys the trainer saved
    options = state_dict_options(net)
    state = {"model": get_model_state_dict(net, options=options)}
    load_dcp(path, state)
    set_model_state_dict(net, state["model"], options=options)


def dcp_reason(exc: BaseException) -> str:
    """DCP wraps each rank's failure in a CheckpointException: the innermost cause's first line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))  # (exception, traceback)
        exc = inner[0] if isinstance(inner, tuple) else inner
    return first_line(exc)
