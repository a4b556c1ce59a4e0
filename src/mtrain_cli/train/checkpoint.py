"""Checkpoints written atomically (temp dir + rename), the last K kept, resumed exactly; the HF export.

Layout of a run directory:
  checkpoints/step_000100/{model.pt, optimizer.pt, state.pt}   state: step, scheduler, loader, RNG
  export/                                                       save_pretrained (safetensors) + tokenizer
A checkpoint directory either exists complete or not at all: a crash mid-save leaves only a
`.tmp-*` directory, which is ignored and cleaned up by the next save.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass
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
    for _, old in checkpoint_dirs(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    device = next(model.parameters()).device
    model.load_state_dict(torch.load(path / "model.pt", map_location=device, weights_only=True))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    # state.pt holds RNG states (numpy tuples), written by us: not weights-only.
    return TrainState(**torch.load(path / "state.pt", map_location="cpu", weights_only=False))


def export_hf(model: torch.nn.Module, tokenizer, out_dir: Path) -> Path:
    """A directory `AutoModelForCausalLM.from_pretrained` loads, with the YaRN settings in config.json.

    The registered attention name is ours; the export names SDPA so any transformers install loads it."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    attn_implementation = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    model.config.use_cache = True
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        model.config._attn_implementation = attn_implementation
        model.config.use_cache = False
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
