"""The single-process training loop of `mtrain extend`.

build (tokenizer → packed data → model with the context recipe → optimizer/schedule) → resume if asked →
steps (gradient accumulation, per-token loss over all documents, clipping) → checkpoints → HF export →
summary.json. Ctrl-C finishes the current step, saves a checkpoint and exits; a second Ctrl-C aborts.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from mtrain_cli.attention.crossover import crossover_rule
from mtrain_cli.attention.hook import (ContextParallel, attention_calls, configure_attention, plan_cache,
                                      sparse_settings, sparse_stats)
from mtrain_cli.config import Config, to_yaml
from mtrain_cli.errors import UserError
from mtrain_cli.model import build_hf_config, build_model, count_parameters, load_tokenizer
from mtrain_cli.rope import rope_summary
from mtrain_cli.parallel.context import ParallelContext, init_parallel
from mtrain_cli.parallel.layouts import shard_batch
from mtrain_cli.train.checkpoint import (TrainState, capture_rng, checkpoint_dirs, export_hf, load_checkpoint,
                                         restore_rng, save_checkpoint)
from mtrain_cli.train.compile import compile_layers, eager_fallbacks, should_compile
from mtrain_cli.train.data_setup import build_datasets
from mtrain_cli.train.flops import causal_pairs, peak_tflops, training_flops
from mtrain_cli.train.loss import ChunkedLossModel
from mtrain_cli.train.optim import build_optimizer, build_scheduler
from mtrain_cli.train.progress import RunLogger, peak_memory_gib
from mtrain_cli.train.hf_weights import load_sharded_weights
from mtrain_cli.train.sharded import apply_fsdp, export_gathered, is_sharded, load_sharded, save_sharded


class Interrupted(Exception):
    """Raised after Ctrl-C once the checkpoint is safely on disk."""

    def __init__(self, checkpoint: Path):
        super().__init__(f"interrupted; checkpoint saved to {checkpoint}")
        self.checkpoint = checkpoint


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)


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
    def __init__(self, config: Config, run_dir: Path, console: Console, pc: ParallelContext | None = None):
        self.config, self.run_dir, self.console = config, run_dir, console
        self.pc = pc or init_parallel(config)
        self.device = self.pc.device
        if config.train.dtype == "bf16" and self.device.type != "cuda":
            raise UserError(f"train.dtype bf16 on {self.device.type}: bf16 autocast is for GPUs (CPU trains in fp32); "
                            f"set train.dtype=auto or fp32")
        torch.manual_seed(config.run.seed)
        self.tokenizer = load_tokenizer(config)
        build_hf_config(config, len(self.tokenizer))  # a local model's context is checked before data is packed
        # rank 0 tokenises first and fills the datasets cache; the others then read it (no concurrent writes)
        if not self.pc.is_main:
            self.pc.barrier()
        self.data = build_datasets(config, self.tokenizer, self.pc.dp_rank, self.pc.dp)
        if self.pc.is_main:
            self.pc.barrier()
        stats = self.data.stats
        console.print(f"packed {stats['num_documents']:,} documents ({stats['num_input_tokens']:,} tokens) into "
                      f"{stats['num_rows']:,} rows of {stats['seq_len']:,} · {stats['num_short_rows']:,} short-context "
                      f"rows · {stats['num_pad_tokens']:,} pad tokens · {stats['num_tokens_dropped']:,} short-mix "
                      f"tokens beyond data.short_fraction unused · {stats['num_val_rows']} rows held out for validation",
                      highlight=False)
        # Distributed: a local model is built on the meta device and, once sharded, each rank reads its own
        # rows of the weights; a fresh one is built on the CPU (the same seed on every rank) and fully_shard
        # moves one layer at a time to the GPU, keeping only this rank's shard. No GPU holds the whole model.
        load_sharded = self.pc.distributed and config.model.path is not None
        build_device = self.device if not self.pc.distributed else torch.device("meta" if load_sharded else "cpu")
        self.model = build_model(config, self.tokenizer, build_device)
        if config.train.activation_checkpointing:
            if hasattr(self.model, "activation_checkpointing_enable"):  # the name in recent transformers v5
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.compiled = should_compile(config.train.compile, self.device)
        if self.compiled:  # torchtitan's order: activation checkpointing, then compile each layer, then FSDP
            compile_layers(self.model)
        if self.pc.cp > 1:
            configure_attention(sparse_settings(config.attention), cp=ContextParallel(
                self.pc.topology, self.pc.layout, self.pc.block))
        elif config.attention.mode == "sparse" and config.attention.crossover:
            configure_attention(sparse_settings(config.attention), crossover=crossover_rule(self.device))
        self.net = ChunkedLossModel(self.model, config.train.loss_chunk_size)
        if self.pc.distributed:
            apply_fsdp(self.net, self.pc)
        if load_sharded:
            load_sharded_weights(self.model, Path(config.model.path).expanduser(), self.device)
        self.model.train()
        self.optimizer = build_optimizer(self.model, config.train)
        self.scheduler = build_scheduler(self.optimizer, config.train)
        self.step = 0
        self.use_bf16 = self.device.type == "cuda" and config.train.dtype in ("auto", "bf16")
        hf = self.model.config
        self.num_params, self.num_matmul_params = count_parameters(self.model)
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.warnings: list[str] = []
        self.layer_calls = {"sparse_layers": 0, "dense_layers": 0}  # sparse mode: fresh layer calls by path
        self._stop_requested = False

    # -- state ---------------------------------------------------------------------------------
    def resume(self, checkpoint: Path) -> None:
        if is_sharded(checkpoint):
            state, saved_dp = load_sharded(checkpoint, self.net, self.optimizer, self.pc)
            loader = dict(state.loader)
            if saved_dp != self.pc.dp:  # the position is per data-parallel rank: convert through global batches
                consumed = loader["index"] * saved_dp
                loader["index"] = consumed // self.pc.dp
                self._warn(f"resuming a checkpoint written with {saved_dp} data-parallel rank(s) on {self.pc.dp}: "
                           f"data order continues from global batch {loader['index'] * self.pc.dp} of epoch "
                           f"{loader['epoch']} (was {consumed}); losses will not match an uninterrupted run exactly")
        else:
            if self.pc.distributed:
                raise UserError(f"--resume: {checkpoint} was written by a single-process run; resume it without "
                                f"torchrun (or start a new distributed run)")
            state = load_checkpoint(checkpoint, self.model, self.optimizer)
            loader = state.loader
        self.scheduler.load_state_dict(state.scheduler)
        self.data.loader.load_state_dict(loader)
        restore_rng(state.rng)
        self.step = state.step
        self.console.print(f"resumed from {checkpoint} at step {self.step}")

    def save(self) -> Path:
        state = TrainState(step=self.step, scheduler=self.scheduler.state_dict(),
                           loader=self.data.loader.state_dict(), rng=capture_rng())
        root, keep = self.run_dir / "checkpoints", self.config.checkpoint.keep_last
        if self.pc.distributed:
            return save_sharded(root, self.net, self.optimizer, state, keep, self.pc)
        return save_checkpoint(root, self.model, self.optimizer, state, keep)

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        self.console.print(f"[yellow]warning:[/] {message}", highlight=False)

    # -- compute -------------------------------------------------------------------------------
    def _autocast(self):
        if self.use_bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tokens of each row (context parallelism), on the device."""
        if self.pc.cp > 1:
            batch = shard_batch(batch, self.pc.token_layout(batch["input_ids"].shape[1]), self.pc.cp_rank)
        return {k: v.to(self.device) for k, v in batch.items()}

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        with self._autocast():
            return self.net(batch["input_ids"], batch["position_ids"], batch["document_ids"], batch["labels"])

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        rows = [next(self.data.loader) for _ in range(self.config.train.grad_accum)]
        batches = [self._shard(b) for b in rows]
        # Average per labelled token over the whole step: all micro-batches, all ranks, all documents.
        counts = self.pc.sum_all(torch.tensor([float(sum(int((b["labels"] != -100).sum()) for b in batches))]))
        num_tokens = max(1, int(counts[0]))
        loss_sum_total = torch.zeros(1, dtype=torch.float64)
        sparse_stats()  # drop plans made outside training (validation)
        for batch in batches:
            with plan_cache():  # sparse plans made in forward are reused by the activation-checkpoint recompute
                loss_sum, _ = self._loss_sum(batch)
                (loss_sum * (self.pc.world / num_tokens)).backward()  # FSDP averages over the world: sum
            loss_sum_total += float(loss_sum.detach())
        attention = sparse_stats()
        if "ring_work" in attention:  # max / mean of the active blocks over the ring's ranks
            work = attention.pop("ring_work")
            peak, total = torch.tensor([work], dtype=torch.float64), torch.tensor([work], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.pc.topology.group)
            dist.all_reduce(total, group=self.pc.topology.group)
            attention["ring_imbalance"] = float(peak[0] / (total[0] / self.pc.cp))
        with torch.profiler.record_function("mtrain.optimizer"):  # the optimizer phase of `mtrain profile step`
            clip = self.config.train.grad_clip if self.config.train.grad_clip > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        hf = self.model.config
        num_input_tokens = sum(b["input_ids"].numel() for b in rows) * self.pc.dp  # every rank's rows
        # Attention FLOPs on the work actually done: the share of dense attention's blocks the layers computed
        # (single process: sparse layers' layouts, 1 for layers the crossover ran dense; ring: the layouts').
        work = attention.get("attention_work", attention.get("sparse_density", 1.0))
        pairs = sum(causal_pairs(b["document_ids"]) for b in rows) * self.pc.dp * work
        flops = training_flops(self.num_matmul_params, num_input_tokens, int(pairs), hf.num_hidden_layers,
                               hf.num_attention_heads, self.head_dim)
        loss = float(self.pc.sum_all(loss_sum_total)[0]) / num_tokens
        tflops = flops / seconds / 1e12 / self.pc.world
        peak = peak_tflops(self.device)
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens": num_input_tokens, "tokens_per_s": num_input_tokens / seconds / self.pc.world,
                "tflops": tflops, **({"mfu": tflops / peak} if peak else {}),
                "peak_mem_gib": peak_memory_gib(self.device), "step_s": seconds, **attention}

    @torch.no_grad()
    def validation_loss(self) -> float | None:
        """Per-token loss on the held-out rows; rows split over data-parallel ranks, tokens over cp ranks."""
        if self.data.val is None:
            return None
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        for index in range(self.pc.dp_rank, len(self.data.val), self.pc.dp):
            batch = self._shard({k: v[None] for k, v in self.data.val[index].items()})
            loss_sum, num_tokens = self._loss_sum(batch)
            sums += torch.tensor([float(loss_sum), num_tokens], dtype=torch.float64)
        self.model.train()
        total, count = self.pc.sum_all(sums).tolist()
        return total / max(1, count)

    # -- loop ----------------------------------------------------------------------------------
    def _on_sigint(self, *_):
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        self.console.print("[yellow]Ctrl-C: finishing this step and saving a checkpoint (Ctrl-C again to abort)")

    def _stop_everywhere(self) -> bool:
        """Ctrl-C reaches ranks at slightly different times: agree, so every rank saves in the same step."""
        flag = self.pc.sum_all(torch.tensor([1.0 if self._stop_requested else 0.0]))
        return bool(flag[0] > 0)

    def fit(self) -> dict[str, Any]:
        cfg = self.config
        start_step, t_start = self.step, time.perf_counter()
        losses: list[float] = []
        val_losses: dict[int, float] = {}
        if self.step == 0 and (val := self.validation_loss()) is not None:
            val_losses[0] = val
        previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            with RunLogger(cfg, self.run_dir, self.step, self.console, enabled=self.pc.is_main) as logger:
                if 0 in val_losses:
                    logger.log_eval(0, val_losses[0])
                while self.step < cfg.train.num_steps:
                    try:
                        metrics = self.train_step()
                    except dist.DistBackendError as exc:
                        raise RuntimeError(f"step {self.step + 1}: a collective failed or timed out on rank "
                                           f"{self.pc.rank} ({str(exc).splitlines()[0]})") from exc
                    losses.append(metrics["loss"])
                    for key in ("sparse_layers", "dense_layers"):
                        self.layer_calls[key] += int(metrics.get(key, 0))
                    logger.log_step(metrics)
                    if self.step % cfg.train.eval_every == 0 or self.step == cfg.train.num_steps:
                        if (val := self.validation_loss()) is not None:
                            val_losses[self.step] = val
                            logger.log_eval(self.step, val)
                    if self.step % cfg.checkpoint.every == 0 or self.step == cfg.train.num_steps:
                        self.save()
                    for message in eager_fallbacks():  # dynamo gave up compiling a function: say so
                        self._warn(message)
                    if self._stop_everywhere():
                        raise Interrupted(self.save())
        finally:
            signal.signal(signal.SIGINT, previous_handler)
        export_dir = None
        if cfg.checkpoint.export:
            out = self.run_dir / "export"
            export_dir = (export_gathered(self.net, self.tokenizer, out, self.pc) if self.pc.distributed
                          else export_hf(self.model, self.tokenizer, out))
        return self._summary(start_step, time.perf_counter() - t_start, losses, val_losses, export_dir)

    def _summary(self, start_step: int, seconds: float, losses: list[float], val_losses: dict[int, float],
                 export_dir: Path | None) -> dict[str, Any]:
        tail = losses[-10:]
        summary = {
            "run_dir": str(self.run_dir), "device": str(self.device),
            "parallel": {"world": self.pc.world, "dp": self.pc.dp, "cp": self.pc.cp, "layout": self.pc.layout,
                         "node_size": self.pc.topology.node_size if self.pc.topology else None},
            "steps": {"start": start_step, "end": self.step},
            "wall_s": round(seconds, 2),
            "final_train_loss": sum(tail) / len(tail) if tail else None,
            "val_loss": {str(k): v for k, v in val_losses.items()},
            "num_params": self.num_params,
            "attention_calls": attention_calls(),
            "attention_mode": self.config.attention.mode,
            # sparse mode, one process: layer calls that ran sparse, and dense because above the crossover
            "attention_layers": {"sparse": self.layer_calls["sparse_layers"],
                                 "dense_by_crossover": self.layer_calls["dense_layers"]},
            "compile": self.compiled,
            "rope": rope_summary(self.model.config).__dict__,
            "packing": self.data.stats,
            "export_dir": str(export_dir) if export_dir else None,
            "warnings": self.warnings,
        }
        if self.pc.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary


def _shared_run_dir(config: Config, resume: Path | None, pc: ParallelContext) -> Path:
    """Rank 0 names (and creates) the run directory; every rank gets the same path."""
    if resume is not None:
        return resume
    run_dir = new_run_dir(config) if pc.is_main else None
    if pc.distributed:
        holder = [str(run_dir) if run_dir else None]
        dist.broadcast_object_list(holder, src=0)
        run_dir = Path(holder[0])
    return run_dir


def run_extend(config: Config, resume: Path | None, console: Console) -> RunResult:
    """Train a fresh run, or continue the run in directory `resume` from its latest checkpoint.

    Under torchrun every rank calls this; rank 0 alone prints and writes logs and the summary."""
    found = []
    if resume is not None:
        found = checkpoint_dirs(resume / "checkpoints")
        if not found:
            raise UserError(f"--resume {resume}: no checkpoint under {resume / 'checkpoints'}; pass a run directory "
                            f"written by mtrain extend")
    pc = init_parallel(config)
    if not pc.is_main:
        console = Console(file=io.StringIO())
    try:
        run_dir = _shared_run_dir(config, resume, pc)
        if pc.is_main:
            (run_dir / "config.yaml").write_text(to_yaml(config))
        console.print(f"run directory: {run_dir}" + (f" · {pc.world} ranks (dp {pc.dp} × cp {pc.cp})"
                                                      if pc.distributed else ""))
        trainer = Trainer(config, run_dir, console, pc)
        if resume is not None:
            trainer.resume(found[-1][1])
        return RunResult(run_dir=run_dir, summary=trainer.fit())
    finally:
        if pc.distributed and dist.is_initialized():
            dist.destroy_process_group()
