"""The training loop of `mtrain extend`, the same for one process and for each rank of many.

The Trainer receives its parts built (train/parts.py: tokenizer, packed data, the parallelised model, the
attention router, optimizer and schedule) → resume if asked → steps (gradient accumulation, per-token loss over
all documents, clipping; their metrics from train/metrics.py) → checkpoints → HF export → summary.json.
Steps run one ahead: step N+1 is launched before step N is read, so the GPU does not drain while the host reads,
logs and votes. Ctrl-C, SIGTERM and SIGUSR1 finish the steps launched, save a checkpoint and exit (a second Ctrl-C
aborts; train/stops.py); a non-finite loss or gradient norm stops the run before that step is saved.
When the run directory and its files are created, rewritten or removed (and why a failed command never
changes them): train/records.py.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console

from mtrain_cli.attention import Route, layer_observations
from mtrain_cli.config import Config
from mtrain_cli.errors import TrainingDiverged
from mtrain_cli.model import count_parameters, rope_summary
from mtrain_cli.parallel import ParallelContext
from mtrain_cli.train.batch_upload import StepBatches, StepFeed
from mtrain_cli.train.checkpoint import TrainState, capture_rng, load_checkpoint, restore_rng, save_checkpoint
from mtrain_cli.train.compile import eager_fallbacks
from mtrain_cli.train.dense_check import DenseCheck
from mtrain_cli.train.distributed import init_parallel
from mtrain_cli.train.export import export_trained
from mtrain_cli.train.kernel_builds import BuildCounter, triton_builds
from mtrain_cli.train.lora import flops_params
from mtrain_cli.train.metrics import LaunchedStep, StepMeter, StepResult
from mtrain_cli.train.optim import use_configured_hyperparameters
from mtrain_cli.train.parts import TrainingParts, build_training
from mtrain_cli.train.progress import RunLogger
from mtrain_cli.train.records import FINAL_LOSS_STEPS, RunRecords, remove_unstarted_run_dir
from mtrain_cli.train.stops import Interrupted, StopRequests, diverged_message


def build_trainer(config: Config, run_dir: Path, console: Console, pc: ParallelContext | None = None) -> Trainer:
    """A Trainer with its parts built from `config` (and the parallel context set up, unless given)."""
    pc = pc or init_parallel(config)
    return Trainer(config, run_dir, console, build_training(config, pc, console), pc)


class Trainer:
    """Trains the parts it is given (train/parts.py) over the process's place in the run (`pc`)."""

    def __init__(self, config: Config, run_dir: Path, console: Console, parts: TrainingParts, pc: ParallelContext):
        self.config, self.run_dir, self.console, self.pc = config, run_dir, console, pc
        self.device = pc.device
        self.tokenizer, self.data, self.router = parts.tokenizer, parts.data, parts.router
        self.net, self.model = parts.net, parts.net.hf
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.prebuild = parts.prebuild  # sparse kernels building in worker processes, until the first step
        self.warnings: list[str] = list(parts.warnings)  # also in summary.json
        # host rows -> device, pinned and without blocking; two steps' micro-batches in flight (launch_step)
        self.feed = StepFeed(self.data.loader, pc, self.router, config.train.grad_accum, self.device)
        self.use_bf16 = self.device.type == "cuda" and config.train.dtype in ("auto", "bf16")
        self.num_params, num_matmul_params = count_parameters(self.model)
        if config.train.lora is not None:
            num_matmul_params = flops_params(self.model, num_matmul_params)
        self.meter = StepMeter(self.model, num_matmul_params, pc)
        self.builds = BuildCounter(triton_builds if self.device.type == "cuda" else None)
        self.step = 0
        self.wall_offset, self.resumed_at, self._fit_t0 = 0.0, [], None  # wall time and resumes of earlier legs
        self.layer_calls: Counter[str] = Counter()  # sparse mode: fresh layer calls by Route
        attention = config.attention
        self.dense_check = (
            DenseCheck(attention.check_every, attention.check_warn, pc)
            if attention.mode == "sparse" and attention.check_every > 0
            else None
        )
        self.stops = StopRequests(console, self._remove_if_unstarted)
        self._next: StepBatches | None = None  # the next step's batches, fetched during this one
        self._unread: LaunchedStep | None = None  # the last step launched, until it is read
        self._records: RunRecords | None = None  # the run directory's records while fit() runs

    # -- state ---------------------------------------------------------------------------------
    def resume(self, checkpoint: Path) -> None:
        """Load `checkpoint` (its files checked by records.plan_resume), written by any number of processes."""
        state = load_checkpoint(checkpoint, self.net, self.optimizer, self.pc)
        loader = dict(state.loader)
        if state.dp != self.pc.dp:  # the position is per data-parallel rank: convert through global batches
            consumed = loader["index"] * state.dp
            loader["index"] = consumed // self.pc.dp
            self._warn(
                f"resuming a checkpoint written with {state.dp} data-parallel rank(s) on {self.pc.dp}: "
                f"data order continues from global batch {loader['index'] * self.pc.dp} of epoch "
                f"{loader['epoch']} (was {consumed}); losses will not match an uninterrupted run exactly"
            )
        self.scheduler.load_state_dict(state.scheduler)
        use_configured_hyperparameters(self.optimizer, self.scheduler, self.config.train)
        self.data.loader.load_state_dict(loader)
        self._next = None
        restore_rng(state.rng)
        if self.router.crossover is not None:
            self.router.crossover.load_state_dict(state.crossover)
        if self.router.recall is not None:
            self.router.recall.load_state_dict(state.recall)
        self.step = state.step
        self.wall_offset, self.resumed_at = state.wall_s, [*state.resumed_at, state.step]
        self.console.print(f"resumed from {checkpoint} at step {self.step}")

    def _data_position(self) -> dict[str, int]:
        """The loader's position before the next step's rows (fetched already, or not)."""
        return self._next.position if self._next is not None else self.data.loader.state_dict()

    @contextlib.contextmanager
    def rewinding_data(self) -> Iterator[None]:
        """The steps after the block read again the batches that the block's steps read; model, optimizer and
        schedule go on. `mtrain profile step` warms up on the batches it then profiles, so the Triton kernels and
        sparse plans their shapes need (train/kernel_builds.py) are built before the profile. The first of them are
        fetched again at the end, ahead of their step, as in training."""
        position = self._data_position()
        yield
        self.data.loader.load_state_dict(position)
        self._next = self.feed.fetch()

    def save(self) -> Path:
        state = TrainState(
            step=self.step,
            scheduler=self.scheduler.state_dict(),
            loader=self._data_position(),
            rng=capture_rng(),
            wall_s=self._wall_s(),
            resumed_at=list(self.resumed_at),
            crossover=self.router.crossover.state_dict() if self.router.crossover is not None else {},
            recall=self.router.recall.state_dict() if self.router.recall is not None else {},
        )
        root, keep = self.run_dir / "checkpoints", self.config.checkpoint.keep_last
        return save_checkpoint(root, self.net, self.optimizer, state, keep, self.pc)

    def _wall_s(self) -> float:
        """The run's wall time so far: earlier legs (from the checkpoint) and this one."""
        return self.wall_offset + (time.perf_counter() - self._fit_t0 if self._fit_t0 is not None else 0.0)

    def _warn(self, message: str, echo: bool = True) -> None:
        self.warnings.append(message)
        if echo:
            self.console.print(f"[yellow]warning:[/] {message}", highlight=False)

    # -- compute -------------------------------------------------------------------------------
    def _autocast(self):
        if self.use_bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        with self._autocast():
            return self.net(batch["input_ids"], batch["position_ids"], batch["document_ids"], batch["labels"])

    def train_step(self) -> StepResult:
        """One step, launched and read: its results once its kernels have run."""
        return self._result(self.launch_step())

    def _kernels_ready(self) -> None:
        """Wait for the sparse kernels that worker processes build into Triton's cache (train/build.py), once:
        waiting for a build under way is quicker than building it again here."""
        if self.prebuild is None:
            return
        line, warning = self.prebuild.wait()
        self.prebuild = None
        self.console.print(line, highlight=False)
        if warning:
            self._warn(warning)

    def run_steps(self, num_steps: int) -> list[StepResult]:
        """num_steps steps, each launched before the previous one is read, as `fit` runs them."""
        self._kernels_ready()
        results, in_flight = [], None
        for _ in range(num_steps):
            launched = self.launch_step()
            if in_flight is not None:
                results.append(self._result(in_flight))
            in_flight = launched
        return results + ([self._result(in_flight)] if in_flight is not None else [])

    def _result(self, launched: LaunchedStep) -> StepResult:
        if self._unread is launched:
            self._unread = None
        return launched.result()

    def launch_step(self) -> LaunchedStep:
        """Launch a step's kernels (forward, backward, optimizer) and fetch the next step's batches; nothing here
        reads the device, so the GPU runs the step while the host goes on (LaunchedStep.result reads it)."""
        started, begun, behind = time.perf_counter(), None, None
        if self.device.type == "cuda":
            begun = torch.cuda.Event(enable_timing=True)
            begun.record()
            behind = self._unread.done if self._unread is not None else None
        self.builds.start(self.router.plan_captures())
        if self.router.recall is not None:
            self.router.recall.start_step(self.step + 1)
        fetched = self._next if self._next is not None else self.feed.fetch()
        self._next = None
        rows, num_tokens, batches = fetched.rows, fetched.num_tokens, fetched.batches
        # A read here (the loss, the gradient norm, the plans' records) would leave the GPU idle while the host
        # launches what follows it.
        loss_sum_total = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.router.drop_records()  # plans made outside training (validation)
        dense_step = self.dense_step_due(self.step + 1)
        with self.router, self.router.dense_step(dense_step):
            for batch in batches:
                # sparse plans made in forward are reused by the activation-checkpoint recompute
                with self.router.micro_batch():
                    loss_sum, _ = self._loss_sum(batch)
                    (loss_sum * (self.pc.world / num_tokens)).backward()  # FSDP averages over the world: sum
                loss_sum_total += loss_sum.detach()
        check = None
        # on the weights forward used; a dense step has nothing to check
        if self.dense_check is not None and not dense_step and self.dense_check.due(self.step + 1):
            check = self.dense_check.launch(lambda batch: self._loss_sum(batch)[0], batches)
        with torch.profiler.record_function("mtrain.optimizer"):  # the optimizer phase of `mtrain profile step`
            clip = self.config.train.grad_clip if self.config.train.grad_clip > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        loss_sum_total = self.pc.sum_all(loss_sum_total)
        if self.step + 1 < self.config.train.num_steps:
            # the next step's batches while this step's kernels run (see StepBatches)
            self._next = self.feed.fetch()
        attention = self.router.take_sparse_stats()  # its deferred accounting launches behind the step's kernels
        self.step += 1
        done = None
        if self.device.type == "cuda":  # the results to pinned host memory: a read waits for this step alone
            loss_sum_total, norm = (t.to("cpu", non_blocking=True) for t in (loss_sum_total, norm))
            if check is not None:
                check.loss_sum = check.loss_sum.to("cpu", non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        built = self.builds.take(self.step, self.router.plan_captures())
        self._unread = LaunchedStep(
            self.step, rows, num_tokens, lr, loss_sum_total, norm, attention, built,
            started, time.perf_counter(), begun, behind, done, check,
        )  # fmt: skip
        return self._unread

    def dense_step_due(self, step: int) -> bool:
        """`step` trains dense attention in every layer: a step of a sparse run's `attention.dense_every`."""
        attention = self.config.attention
        return attention.mode == "sparse" and attention.dense_every > 0 and step % attention.dense_every == 0

    @torch.no_grad()
    def validation_loss(self) -> float | None:
        """Per-token loss on the held-out rows; rows split over data-parallel ranks, tokens over cp ranks."""
        if self.data.val is None:
            return None
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        with self.router:
            for index in range(self.pc.dp_rank, len(self.data.val), self.pc.dp):
                batch = self.feed.to_device({k: v[None] for k, v in self.data.val[index].items()})
                loss_sum, num_tokens = self._loss_sum(batch)
                sums += torch.tensor([float(loss_sum), float(num_tokens)], dtype=torch.float64)
        self.model.train()
        total, count = self.pc.sum_all(sums).tolist()
        return total / max(1, count)

    # -- loop ----------------------------------------------------------------------------------
    def _remove_if_unstarted(self) -> None:
        if self.pc.is_main and self._records is not None and self._records.plan is None:  # a fresh run
            remove_unstarted_run_dir(self.run_dir)

    def _check_finite(self, metrics: dict[str, Any], logger: RunLogger) -> None:
        """A non-finite loss or gradient norm (the same on every rank: both are reduced over all) stops the run
        before anything of this step is saved; its line goes to the screen and metrics.jsonl."""
        if math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]):
            return
        logger.log_step(metrics)
        raise TrainingDiverged(diverged_message(metrics, self.run_dir))

    def _settles(self, step: int) -> bool:
        """Whether the run validates or saves after `step`: the next step waits until it has."""
        cfg = self.config
        return step % cfg.train.eval_every == 0 or step % cfg.checkpoint.every == 0 or step == cfg.train.num_steps

    def _read(self, launched: LaunchedStep, logger: RunLogger, losses: dict[int, float]) -> int:
        """Wait for a launched step, check, record and log it -> its step number."""
        result = self._result(launched)
        self._observe_recall(result.step, result.attention)
        metrics = self.meter(result)
        if result.dense_loss is not None:
            check_metrics, warning = self.dense_check.record(
                result.step, result.loss, result.dense_loss, result.check_seconds
            )
            metrics.update(check_metrics)
            if warning is not None:
                self._warn(warning)
        if self.router.recall is not None:
            metrics["recall_keep"] = self.router.recall.summary()["keep_mean"]
        self._check_finite(metrics, logger)
        losses[result.step] = metrics["loss"]
        self.layer_calls.update(metrics.get("layers", {}))
        logger.log_step(metrics)
        return result.step

    def _observe_recall(self, step: int, attention: dict[str, Any]) -> None:
        """The step's per-head plan records (taken out of what is logged) to the recall controller."""
        by_head = attention.pop("by_head", {})
        if self.router.recall is not None:
            hf = self.model.config
            by_layer = attention.get("sparse_by_layer", {})
            observations = layer_observations(
                by_head, by_layer, hf.num_hidden_layers, hf.num_attention_heads, self.pc.distributed
            )
            self.router.recall.observe(step, observations)

    def _launch_ahead(self, in_flight: LaunchedStep, logger: RunLogger, losses: dict[int, float]) -> LaunchedStep:
        """The next step, launched before `in_flight` is read. If it fails (out of memory...), one process reads
        and logs in_flight first: that step trained. Ranks do not: the others would wait for it in collectives."""
        try:
            return self.launch_step()
        except Exception:
            if not self.pc.distributed:
                self._read(in_flight, logger, losses)
            raise

    @contextlib.contextmanager
    def _naming_failed_collectives(self) -> Iterator[None]:
        try:
            yield
        except dist.DistBackendError as exc:
            raise RuntimeError(
                f"step {self.step}: a collective failed or timed out on rank {self.pc.rank} "
                f"({str(exc).splitlines()[0]})"
            ) from exc

    def fit(self, records: RunRecords | None = None) -> dict[str, Any]:
        """Train to train.num_steps; `records`: the run directory's history and its resume hook (run_extend)."""
        cfg = self.config
        records = self._records = records or RunRecords(self.run_dir, cfg, self.pc.is_main)
        self._kernels_ready()
        start_step, self._fit_t0 = self.step, time.perf_counter()
        if self.dense_check is not None:  # earlier legs' checks count in the window and the summary
            self.dense_check.gaps = {**records.history.dense_gaps, **self.dense_check.gaps}
        losses: dict[int, float] = {}
        val_losses: dict[int, float] = {}
        if self.step == 0 and (val := self.validation_loss()) is not None:
            val_losses[0] = val
        with (
            self.stops.installed(),
            RunLogger(
                cfg, self.run_dir, self.step, self.console, enabled=self.pc.is_main, before_first_write=records.begin
            ) as logger,
        ):
            if 0 in val_losses:
                logger.log_eval(0, val_losses[0])
            # One step ahead: step N+1 is launched before step N is read, logged and voted on, so the GPU
            # runs while the host does that; not after a step that validates or saves, which needs the model
            # as that step left it.
            in_flight: LaunchedStep | None = None
            while in_flight is not None or self.step < cfg.train.num_steps:
                with self._naming_failed_collectives():
                    if in_flight is None:
                        in_flight = self.launch_step()
                    ahead = None
                    if self.step < cfg.train.num_steps and not self._settles(in_flight.step):
                        ahead = self._launch_ahead(in_flight, logger, losses)
                    step = self._read(in_flight, logger, losses)
                if step % cfg.train.eval_every == 0 or step == cfg.train.num_steps:
                    if (val := self.validation_loss()) is not None:
                        val_losses[step] = val
                        logger.log_eval(step, val)
                checkpoint = None
                if step % cfg.checkpoint.every == 0 or step == cfg.train.num_steps:
                    checkpoint = self.save()
                for message in eager_fallbacks():  # dynamo gave up compiling a function: say so
                    self._warn(message)
                if (signum := self.stops.agree(self.pc.sum_all)) is not None:
                    if ahead is not None:  # trained already: read it, and save after it
                        with self._naming_failed_collectives():
                            self._read(ahead, logger, losses)
                        checkpoint = None
                    raise Interrupted(checkpoint or self.save(), signum)
                in_flight = ahead
        export_dir = None
        if cfg.checkpoint.export:
            out = self.run_dir / "export"
            export_dir = export_trained(self.net, self.tokenizer, out, self.pc, cfg.train.lora, cfg.model.path)
        return self._summary(records, start_step, losses, val_losses, export_dir)

    def _summary(
        self,
        records: RunRecords,
        start_step: int,
        losses: dict[int, float],
        val_losses: dict[int, float],
        export_dir: Path | None,
    ) -> dict[str, Any]:
        """The whole run: earlier legs' losses (metrics.jsonl up to the checkpoint), wall time and resumes."""
        losses = {**records.history.steps, **losses}
        val_losses = {**records.history.val, **val_losses}
        tail = [losses[step] for step in sorted(losses)[-FINAL_LOSS_STEPS:]]
        summary = {
            "run_dir": str(self.run_dir),
            "device": str(self.device),
            "parallel": {
                "world": self.pc.world,
                "dp": self.pc.dp,
                "cp": self.pc.cp,
                "layout": self.pc.layout,
                "node_size": self.pc.topology.node_size if self.pc.topology else None,
            },
            "steps": {"start": start_step, "end": self.step},  # this leg; resumed_at: where each leg resumed
            "resumed_at": self.resumed_at,
            "wall_s": round(self._wall_s(), 2),  # every leg (killed steps that were trained again not counted)
            "final_train_loss": sum(tail) / len(tail) if tail else None,
            "val_loss": {str(k): v for k, v in sorted(val_losses.items())},
            "num_params": self.num_params,
            "num_trainable_params": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            "attention_calls": self.router.calls(),
            "attention_mode": self.config.attention.mode,
            # sparse mode, one process: fresh layer calls by route (records.Route)
            "attention_layers": {route.value: self.layer_calls[route.value] for route in Route},
            "compile": self.net.compiled,
            # Triton kernels built and sparse plans captured in this leg's steps, and the later steps that paid them
            "builds": self.builds.summary(),
            # sparse mode: what sparse attention costs the loss, measured while training (train/dense_check.py)
            "dense_check": self.dense_check.summary(self.config.train.num_steps, self._wall_s())
            if self.dense_check is not None
            else None,
            "recall_control": self.router.recall.summary() if self.router.recall is not None else None,
            "rope": rope_summary(self.model.config).__dict__,
            "packing": self.data.stats,
            "export_dir": str(export_dir) if export_dir else None,
            "warnings": self.warnings,
        }
        records.write_summary(summary)
        return summary
