"""summary.json of `mtrain extend`: the whole run as it ended, every leg of it (a resumed run's earlier legs come
from its records: metrics.jsonl up to the checkpoint, and the wall time and resumes the checkpoint carries)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Protocol

import torch

from mtrain_cli.attention import AttentionRouter, Route
from mtrain_cli.config import Config
from mtrain_cli.model import rope_summary
from mtrain_cli.parallel import ParallelContext
from mtrain_cli.train.data_setup import TrainData
from mtrain_cli.train.dense_check import DenseCheck
from mtrain_cli.train.kernel_builds import BuildCounter
from mtrain_cli.train.loss import ChunkedLossModel
from mtrain_cli.train.records import FINAL_LOSS_STEPS, RunRecords


class Trained(Protocol):
    """What the summary reads of the Trainer (train/loop.py, which imports this module)."""

    config: Config
    run_dir: Path
    device: torch.device
    pc: ParallelContext
    data: TrainData
    net: ChunkedLossModel
    model: torch.nn.Module  # net.hf
    router: AttentionRouter
    step: int
    resumed_at: list[int]
    num_params: int
    layer_calls: Counter[str]
    builds: BuildCounter
    dense_check: DenseCheck | None
    warnings: list[str]

    def wall_s(self) -> float: ...


def run_summary(
    trainer: Trained,
    records: RunRecords,
    start_step: int,
    losses: dict[int, float],
    val_losses: dict[int, float],
    export_dir: Path | None,
) -> dict[str, Any]:
    """losses, val_losses: this leg's; start_step: where this leg began."""
    losses = {**records.history.steps, **losses}
    val_losses = {**records.history.val, **val_losses}
    tail = [losses[step] for step in sorted(losses)[-FINAL_LOSS_STEPS:]]
    pc, router, dense_check = trainer.pc, trainer.router, trainer.dense_check
    return {
        "run_dir": str(trainer.run_dir),
        "device": str(trainer.device),
        "parallel": {
            "world": pc.world,
            "dp": pc.dp,
            "cp": pc.cp,
            "layout": pc.layout,
            "node_size": pc.topology.node_size if pc.topology else None,
        },
        "steps": {"start": start_step, "end": trainer.step},  # this leg; resumed_at: where each leg resumed
        "resumed_at": trainer.resumed_at,
        "wall_s": round(trainer.wall_s(), 2),  # every leg (killed steps that were trained again not counted)
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        "val_loss": {str(k): v for k, v in sorted(val_losses.items())},
        "num_params": trainer.num_params,
        "num_trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "attention_calls": router.calls(),
        "attention_mode": trainer.config.attention.mode,
        # sparse mode, one process: fresh layer calls by route (records.Route)
        "attention_layers": {route.value: trainer.layer_calls[route.value] for route in Route},
        "compile": trainer.net.compiled,
        # Triton kernels built and sparse plans captured in this leg's steps, and the later steps that paid them
        "builds": trainer.builds.summary(),
        # sparse mode: what sparse attention costs the loss, measured while training (train/dense_check.py)
        "dense_check": dense_check.summary(trainer.config.train.num_steps, trainer.wall_s())
        if dense_check is not None
        else None,
        "recall_control": router.recall.summary() if router.recall is not None else None,
        "rope": rope_summary(trainer.model.config).__dict__,
        "packing": trainer.data.stats,
        "export_dir": str(export_dir) if export_dir else None,
        "warnings": trainer.warnings,
    }
