"""Checkpoints written atomically (temp dir + rename), the last K kept, resumed exactly; the HF export.

Layout of a run directory:
  checkpoints/step_000100/{model.pt, optimizer.pt, state.pt}   state: step, scheduler, loader, RNG
  export/                                                       save_pretrained (safetensors) + tokenizer
A checkpoint directory either exists complete or not at all: a crash mid-save leaves only a
`.tmp-*` directory, which is ignored and cleaned up by the next save. A file damaged later (a disk filling up,
a copy cut short) is found by `read_checkpoint` before anything is loaded: `UnreadableCheckpoint` names it,
and a resume falls back to the newest intact checkpoint. Pruning keeps the last K checkpoints up to the step
being saved; newer ones (left by a fallback) stay until the replayed run overwrites them.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


@dataclass
class TrainState:
    """Everything besides model and optimizer that an exact resume needs."""

    step: int
    scheduler: dict[str, Any]
    loader: dict[str, Any]
    rng: dict[str, Any]
    wall_s: float = 0.0  # the run's wall time up to this checkpoint, over every leg (absent before issue 21)
    resumed_at: list[int] = field(default_factory=list)  # the steps earlier legs resumed from


class UnreadableCheckpoint(Exception):
    """A checkpoint file that is missing, truncated or corrupt; the message names the file."""

    def __init__(self, file: Path, problem: str):
        super().__init__(f"{file} is {problem}")
        self.file, self.problem = file, problem


@dataclass
class ReadCheckpoint:
    """The three files of a single-process checkpoint, read (memory-mapped: pages load on first use)."""

    path: Path
    model: dict[str, Any]
    optimizer: dict[str, Any]
    state: TrainState


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


def save_checkpoint(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
                    keep_last: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("step_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{state.step:06d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    torch.save(model.state_dict(), tmp / "model.pt")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(state.__dict__, tmp / "state.pt")
    for file in tmp.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():  # re-saving the same step (e.g. Ctrl-C right after a scheduled save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune_checkpoints(root, state.step, keep_last)
    return final


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
    except Exception as exc:  # truncated zip, empty file, not a torch.save file, ...
        raise UnreadableCheckpoint(file, f"truncated or corrupt ({first_line(exc)})") from None


def read_checkpoint(path: Path) -> ReadCheckpoint:
    """Every file of a single-process checkpoint, checked by reading it; nothing is loaded into a model yet."""
    model, optimizer = read_file(path / "model.pt"), read_file(path / "optimizer.pt")
    # state.pt holds RNG states (numpy tuples), written by us: not weights-only.
    raw = read_file(path / "state.pt", weights_only=False)
    try:
        state = TrainState(**raw)
    except TypeError as exc:
        raise UnreadableCheckpoint(path / "state.pt", f"not a trainer state ({first_line(exc)})") from None
    return ReadCheckpoint(path, model, optimizer, state)


def apply_checkpoint(read: ReadCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    """Load read files into the model and optimizer (copied to their device); RuntimeError if they don't fit."""
    model.load_state_dict(read.model)
    optimizer.load_state_dict(read.optimizer)
    return read.state


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    return apply_checkpoint(read_checkpoint(path), model, optimizer)


def export_hf(model: torch.nn.Module, tokenizer, out_dir: Path) -> Path:
    """A directory `AutoModelForCausalLM.from_pretrained` loads, with the YaRN settings in config.json.

    The registered attention name is ours; the export names SDPA so any transformers install loads it. Training
    turns the KV cache off: the export turns it on (config.json and generation_config.json), as users generate
    with it, and the tokenizer's model_max_length is the extended context (max_position_embeddings)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    generation = getattr(model, "generation_config", None)
    saved = (model.config._attn_implementation, model.config.use_cache,
             getattr(generation, "use_cache", None), tokenizer.model_max_length)
    model.config._attn_implementation = "sdpa"
    model.config.use_cache = True
    if generation is not None:
        generation.use_cache = True
    tokenizer.model_max_length = model.config.max_position_embeddings
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    finally:
        model.config._attn_implementation, model.config.use_cache = saved[0], saved[1]
        if generation is not None:
            generation.use_cache = saved[2]
        tokenizer.model_max_length = saved[3]
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
