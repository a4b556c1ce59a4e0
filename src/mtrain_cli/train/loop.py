"""The single-process training loop of `mtrain extend`.

build (tokenizer → packed data → model with the context recipe → optimizer/schedule) → resume if asked →
steps (gradient accumulation, per-token loss over all documents, clipping) → checkpoints → HF export →
summary.json. Ctrl-C finishes the current step, saves a checkpoint and exits; a second Ctrl-C aborts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from mtrain_cli.attention.hook import attention_calls, plan_cache, sparse_stats
from mtrain_cli.config import Config, to_yaml
from mtrain_cli.errors import UserError
from mtrain_cli.model import build_model, count_parameters, load_tokenizer
from mtrain_cli.rope import rope_summary
from mtrain_cli.train.checkpoint import (TrainState, capture_rng, checkpoint_dirs, export_hf, load_checkpoint,
                                         restore_rng, save_checkpoint)
from mtrain_cli.train.data_setup import build_datasets
from mtrain_cli.train.flops import causal_pairs, training_flops
from mtrain_cli.train.loss import chunked_cross_entropy
from mtrain_cli.train.optim import build_optimizer, build_scheduler
from mtrain_cli.train.progress import RunLogger, peak_memory_gib


class Interrupted(Exception):
    """Raised after Ctrl-C once the checkpoint is safely on disk."""

    def __init__(self, checkpoint: Path):
        super().__init__(f"interrupted; checkpoint saved to {checkpoint}")
        self.checkpoint = checkpoint


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device cuda: no CUDA GPU is visible; use train.device=auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def new_run_dir(config: Config) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.run.output_dir) / f"{config.run.name}-{stamp}"
    suffix = 1
    while run_dir.exists():
        run_dir = Path(config.run.output_dir) / f"{config.run.name}-{stamp}-{suffix}"
        suffix += 1
    run_dir.mkdir(parents=True)
    return run_dir


class Trainer:
    def __init__(self, config: Config, run_dir: Path, console: Console):
        self.config, self.run_dir, self.console = config, run_dir, console
        self.device = pick_device(config.train.device)
        if config.train.dtype == "bf16" and self.device.type != "cuda":
            raise UserError(f"train.dtype bf16 on {self.device.type}: bf16 autocast is for GPUs (CPU trains in fp32); "
                            f"set train.dtype=auto or fp32")
        torch.manual_seed(config.run.seed)
        self.tokenizer = load_tokenizer(config)
        self.data = build_datasets(config, self.tokenizer)
        stats = self.data.stats
        console.print(f"packed {stats['num_documents']:,} documents ({stats['num_input_tokens']:,} tokens) into "
                      f"{stats['num_rows']:,} rows of {stats['seq_len']:,} · {stats['num_short_rows']:,} short-context "
                      f"rows · {stats['num_pad_tokens']:,} pad tokens · {stats['num_tokens_dropped']:,} short-mix "
                      f"tokens beyond data.short_fraction unused · {stats['num_val_rows']} rows held out for validation",
                      highlight=False)
        self.model = build_model(config, self.tokenizer, self.device)
        if config.train.activation_checkpointing:
            if hasattr(self.model, "activation_checkpointing_enable"):  # the name in recent transformers v5
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.optimizer = build_optimizer(self.model, config.train)
        self.scheduler = build_scheduler(self.optimizer, config.train)
        self.step = 0
        self.use_bf16 = self.device.type == "cuda" and config.train.dtype in ("auto", "bf16")
        hf = self.model.config
        self.num_params, self.num_matmul_params = count_parameters(self.model)
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.warnings: list[str] = []
        self._stop_requested = False

    # -- state ---------------------------------------------------------------------------------
    def resume(self, checkpoint: Path) -> None:
        state = load_checkpoint(checkpoint, self.model, self.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        self.data.loader.load_state_dict(state.loader)
        restore_rng(state.rng)
        self.step = state.step
        self.console.print(f"resumed from {checkpoint} at step {self.step}")

    def save(self) -> Path:
        state = TrainState(step=self.step, scheduler=self.scheduler.state_dict(),
                           loader=self.data.loader.state_dict(), rng=capture_rng())
        return save_checkpoint(self.run_dir / "checkpoints", self.model, self.optimizer, state,
                               self.config.checkpoint.keep_last)

    # -- compute -------------------------------------------------------------------------------
    def _autocast(self):
        if self.use_bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        with self._autocast():
            hidden_BSH = self.model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                          document_ids=batch["document_ids"], use_cache=False).last_hidden_state
            return chunked_cross_entropy(hidden_BSH, self.model.get_output_embeddings().weight, batch["labels"],
                                         self.config.train.loss_chunk_size)

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        batches = [{k: v.to(self.device) for k, v in next(self.data.loader).items()}
                   for _ in range(self.config.train.grad_accum)]
        # Average per labelled token over the whole accumulation window, not per micro-batch.
        num_tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
        total_loss = 0.0
        sparse_stats()  # drop plans made outside training (validation)
        for batch in batches:
            with plan_cache():  # sparse plans made in forward are reused by the activation-checkpoint recompute
                loss_sum, _ = self._loss_sum(batch)
                (loss_sum / max(1, num_tokens)).backward()
            total_loss += float(loss_sum.detach())
        attention = sparse_stats()
        clip = self.config.train.grad_clip if self.config.train.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        num_input_tokens = sum(b["input_ids"].numel() for b in batches)
        hf = self.model.config
        # Attention FLOPs on the work actually done: the sparse layout's share of the causal blocks.
        pairs = sum(causal_pairs(b["document_ids"]) for b in batches) * attention.get("sparse_density", 1.0)
        flops = training_flops(self.num_matmul_params, num_input_tokens, int(pairs), hf.num_hidden_layers,
                               hf.num_attention_heads, self.head_dim)
        return {"step": self.step, "loss": total_loss / max(1, num_tokens), "lr": lr, "grad_norm": grad_norm,
                "tokens": num_input_tokens, "tokens_per_s": num_input_tokens / seconds,
                "tflops": flops / seconds / 1e12, "peak_mem_gib": peak_memory_gib(self.device),
                "step_s": seconds, **attention}

    @torch.no_grad()
    def validation_loss(self) -> float | None:
        if self.data.val is None:
            return None
        self.model.eval()
        total, count = 0.0, 0
        for index in range(len(self.data.val)):
            batch = {k: v[None].to(self.device) for k, v in self.data.val[index].items()}
            loss_sum, num_tokens = self._loss_sum(batch)
            total, count = total + float(loss_sum), count + num_tokens
        self.model.train()
        return total / max(1, count)

    # -- loop ----------------------------------------------------------------------------------
    def _on_sigint(self, *_):
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        self.console.print("[yellow]Ctrl-C: finishing this step and saving a checkpoint (Ctrl-C again to abort)")

    def fit(self) -> dict[str, Any]:
        cfg = self.config
        start_step, t_start = self.step, time.perf_counter()
        losses: list[float] = []
        val_losses: dict[int, float] = {}
        if self.step == 0 and (val := self.validation_loss()) is not None:
            val_losses[0] = val
        previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            with RunLogger(cfg, self.run_dir, self.step, self.console) as logger:
                if 0 in val_losses:
                    logger.log_eval(0, val_losses[0])
                while self.step < cfg.train.num_steps:
                    metrics = self.train_step()
                    losses.append(metrics["loss"])
                    logger.log_step(metrics)
                    if self.step % cfg.train.eval_every == 0 or self.step == cfg.train.num_steps:
                        if (val := self.validation_loss()) is not None:
                            val_losses[self.step] = val
                            logger.log_eval(self.step, val)
                    if self.step % cfg.checkpoint.every == 0 or self.step == cfg.train.num_steps:
                        self.save()
                    if self._stop_requested:
                        raise Interrupted(self.save())
        finally:
            signal.signal(signal.SIGINT, previous_handler)
        export_dir = None
        if cfg.checkpoint.export:
            export_dir = export_hf(self.model, self.tokenizer, self.run_dir / "export")
        return self._summary(start_step, time.perf_counter() - t_start, losses, val_losses, export_dir)

    def _summary(self, start_step: int, seconds: float, losses: list[float], val_losses: dict[int, float],
                 export_dir: Path | None) -> dict[str, Any]:
        tail = losses[-10:]
        summary = {
            "run_dir": str(self.run_dir), "device": str(self.device),
            "steps": {"start": start_step, "end": self.step},
            "wall_s": round(seconds, 2),
            "final_train_loss": sum(tail) / len(tail) if tail else None,
            "val_loss": {str(k): v for k, v in val_losses.items()},
            "num_params": self.num_params,
            "attention_calls": attention_calls(),
            "attention_mode": self.config.attention.mode,
            "rope": rope_summary(self.model.config).__dict__,
            "packing": self.data.stats,
            "export_dir": str(export_dir) if export_dir else None,
            "warnings": self.warnings,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary


def run_extend(config: Config, resume: Path | None, console: Console) -> RunResult:
    """Train a fresh run, or continue the run in directory `resume` from its latest checkpoint."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        raise UserError(f"WORLD_SIZE {world_size}: this version of mtrain extend trains in one process; "
                        f"run it without torchrun (each rank would train its own copy)")
    if resume is not None:
        found = checkpoint_dirs(resume / "checkpoints")
        if not found:
            raise UserError(f"--resume {resume}: no checkpoint under {resume / 'checkpoints'}; pass a run directory "
                            f"written by mtrain extend")
        run_dir = resume
    else:
        run_dir = new_run_dir(config)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    console.print(f"run directory: {run_dir}")
    trainer = Trainer(config, run_dir, console)
    if resume is not None:
        trainer.resume(found[-1][1])
    return RunResult(run_dir=run_dir, summary=trainer.fit())
