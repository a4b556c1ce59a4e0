"""The dense check: what sparse attention costs the loss, measured while the run trains.

Every `attention.check_every` steps of a sparse-mode run (a step of `attention.dense_every` has nothing to check),
the step's batches run once more, forward only and without grad, with dense attention (the dense ring under cp),
on the weights the step's own forward used (before its optimizer step). The gap, the step's sparse loss minus
this dense loss on the same tokens, is logged per check (metrics.jsonl, the step line, wandb) and pooled in
summary.json; a mean gap over the last WINDOW checks above `attention.check_warn` (nats: about the relative
perplexity gap) warns. The check leaves training as it was: no gradient, its own router (its plans and caches
apart), and the random state restored, so a run's losses are the same with the check on or off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mtrain_cli.attention import AttentionRouter
from mtrain_cli.parallel import ParallelContext

WINDOW = 3  # checks the warning averages over


@dataclass
class LaunchedCheck:
    """A check's dense loss sum (summed over every rank), on its way to the host as a step's results are."""

    loss_sum: torch.Tensor  # [1] float64
    seconds: Callable[[], float]  # its time, once the step is read


@dataclass
class DenseCheck:
    every: int
    warn_gap: float
    pc: ParallelContext
    gaps: dict[int, float] = field(default_factory=dict)  # step -> sparse - dense loss (this run, every leg)
    seconds: float = 0.0  # this leg's checks
    warnings: list[str] = field(default_factory=list)
    _above: bool = False  # the windowed gap is above warn_gap (warn when it crosses)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @torch.no_grad()
    def launch(self, loss_sum_of: Callable[[dict[str, torch.Tensor]], torch.Tensor], batches: list) -> LaunchedCheck:
        """The dense loss of `batches` by `loss_sum_of(batch)` (the trainer's forward), nothing read on the host."""
        device = self.pc.device
        router = AttentionRouter(None, cp=self.pc.ring)
        begun = done = None
        started = time.perf_counter()
        if device.type == "cuda":
            begun, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begun.record()
        total = torch.zeros(1, dtype=torch.float64, device=device)
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), router:
            for batch in batches:
                total += loss_sum_of(batch).detach()
        total = self.pc.sum_all(total)
        if done is not None:
            done.record()
            return LaunchedCheck(total, lambda: begun.elapsed_time(done) / 1e3)
        ended = time.perf_counter()
        return LaunchedCheck(total, lambda: ended - started)

    def record(self, step: int, loss: float, dense_loss: float, seconds: float) -> tuple[dict[str, Any], str | None]:
        """A read check -> (its metrics, a warning when the windowed gap has just passed warn_gap)."""
        gap = loss - dense_loss
        self.gaps[step] = gap
        self.seconds += seconds
        metrics = {
            "dense_check_loss": dense_loss,
            "dense_check_gap": gap,
            "dense_check_gap_rel": gap / dense_loss if dense_loss else 0.0,
            "dense_check_s": seconds,
        }
        recent = [self.gaps[s] for s in sorted(self.gaps)[-WINDOW:]]
        windowed = sum(recent) / len(recent)
        above = len(recent) == WINDOW and windowed > self.warn_gap
        message = None
        if above and not self._above:
            message = (
                f"step {step}: sparse attention costs {windowed:+.4f} nats of loss over the last {WINDOW} dense checks "
                f"(perplexity {math.expm1(windowed):+.2%}), more than attention.check_warn {self.warn_gap}; raise "
                "attention.recall_target (or attention.p), or train dense"
            )
            self.warnings.append(message)
        self._above = above
        return metrics, message

    def summary(self, num_steps: int, train_seconds: float) -> dict[str, Any]:
        """summary.json's `dense_check`: the mean gap over all checks and over the run's last fifth, the
        perplexity ratio they stand for, and what the checks cost this leg."""
        last_fifth = [gap for step, gap in self.gaps.items() if step > num_steps * 4 / 5]

        def mean(values: list[float]) -> float | None:
            return sum(values) / len(values) if values else None

        gap_last_fifth = mean(last_fifth)
        return {
            "every": self.every,
            "checks": len(self.gaps),
            "gap_mean": mean(list(self.gaps.values())),
            "gap_last_fifth": gap_last_fifth,
            "perplexity_gap_last_fifth": math.expm1(gap_last_fifth) if gap_last_fifth is not None else None,
            "seconds": round(self.seconds, 3),
            "share_of_training": self.seconds / train_seconds if train_seconds > 0 else None,
            "warnings": self.warnings,
        }
