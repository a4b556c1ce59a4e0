"""Training: the parts built from the config (parts.py), parallelism applied to the model (parallelize.py), the
processes set up (distributed.py), the loop (loop.py), loss, optimizer and schedule, DCP checkpoints, progress and
the run's records; `mtrain extend` as a run (run.py).

This is the package's public face; other packages import from here. Names resolve on first use: importing the
face loads nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "run_extend": "run",
    "build_trainer": "loop",
    "parallel_scope": "distributed",
    "FINAL_LOSS_STEPS": "records",
    "Interrupted": "stops",
    "CheckpointMismatch": "checkpoint",
    "UnreadableCheckpoint": "checkpoint",
    "checkpoint_dirs": "checkpoint",
    "load_model_weights": "checkpoint",
    "verify_checkpoint": "checkpoint",
}
__all__ = [  # noqa: RUF022 (the order of _EXPORTS: by module)
    "run_extend",
    "build_trainer",
    "parallel_scope",
    "FINAL_LOSS_STEPS",
    "Interrupted",
    "CheckpointMismatch",
    "UnreadableCheckpoint",
    "checkpoint_dirs",
    "load_model_weights",
    "verify_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


if TYPE_CHECKING:
    from mtrain_cli.train.checkpoint import (
        CheckpointMismatch,
        UnreadableCheckpoint,
        checkpoint_dirs,
        load_model_weights,
        verify_checkpoint,
    )
    from mtrain_cli.train.distributed import parallel_scope
    from mtrain_cli.train.loop import build_trainer
    from mtrain_cli.train.records import FINAL_LOSS_STEPS
    from mtrain_cli.train.run import run_extend
    from mtrain_cli.train.stops import Interrupted
