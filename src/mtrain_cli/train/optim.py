"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine/constant LR schedule."""

from __future__ import annotations

import math

import torch

from mtrain_cli.config import TrainConfig


def build_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    # Norm gains and biases are not decayed (standard for LLM fine-tuning).
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        groups,
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=1e-8,
        fused=torch.cuda.is_available() and next(model.parameters()).is_cuda,
    )


def lr_multiplier(step: int, train: TrainConfig) -> float:
    """Multiplier of train.lr for optimizer step `step` (0-based): linear warmup, then cosine or constant."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return 1.0
    progress = (step - train.warmup_steps) / max(1, train.num_steps - train.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return train.min_lr_ratio + (1.0 - train.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, train))


def use_configured_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, train: TrainConfig
) -> None:
    """The checkpoint restores lr, betas and weight decay with the optimizer and scheduler; the config's values
    apply from the resumed step on (a resume with --set train.lr=... trains with it, as config.yaml then says).
    Unchanged settings change nothing: the resumed run stays bit for bit the same."""
    for group, decay in zip(optimizer.param_groups, (train.weight_decay, 0.0)):
        group.update(weight_decay=decay, betas=(train.beta1, train.beta2), initial_lr=train.lr)
    scheduler.base_lrs = [train.lr] * len(optimizer.param_groups)
    lr = train.lr * lr_multiplier(scheduler.last_epoch, train)  # a changed schedule applies to the next step too
    if any(group["lr"] != lr for group in optimizer.param_groups):
        for group in optimizer.param_groups:
            group["lr"] = lr
        scheduler._last_lr = [lr] * len(optimizer.param_groups)
