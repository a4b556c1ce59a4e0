"""A training step's metrics, from what the step returns: throughput, FLOPs (6·N per token for the matmuls plus
causal attention over the pairs the attention layers computed, flops.py), MFU against the GPU's bf16 peak, peak
memory and, over a cp ring, the imbalance of the ranks' attention work. The step function itself only trains: it
returns a LaunchedStep, whose values are read (a host wait) once the next step is launched, so the GPU never
drains between steps while the host reads, logs and votes (train/loop.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mtrain_cli.attention import PendingStats
from mtrain_cli.parallel import ParallelContext
from mtrain_cli.train.dense_check import LaunchedCheck
from mtrain_cli.train.flops import causal_pairs, peak_tflops, torchtitan_flops, training_flops
from mtrain_cli.train.progress import peak_memory_gib


@dataclass
class StepResult:
    """What a training step did, as the step knows it."""

    step: int
    loss: float  # per labelled token, over every micro-batch, rank and document
    lr: float
    grad_norm: float
    rows: list[dict[str, torch.Tensor]]  # this rank's host rows (whole sequences: before the cp layout)
    seconds: float
    attention: dict[str, Any] = field(default_factory=dict)  # the router's records (AttentionRecords.sparse_stats)
    builds: dict[str, int] = field(default_factory=dict)  # kernels_built, plans_captured (train/kernel_builds.py)
    dense_loss: float | None = None  # the dense check's loss on the step's tokens (train/dense_check.py), if run
    check_seconds: float = 0.0  # what the check took (inside `seconds`)


@dataclass
class LaunchedStep:
    """A training step whose kernels are launched; what it computed is on its way to the host."""

    step: int
    rows: list[dict[str, torch.Tensor]]
    num_tokens: int  # labelled tokens over every rank
    lr: float
    loss_sum: torch.Tensor  # [1] float64, summed over every rank; on the host (pinned, arriving by `done`)
    grad_norm: torch.Tensor  # 0-dim, over every rank; as loss_sum
    attention: PendingStats
    builds: dict[str, int]
    started: float  # time.perf_counter() when its launch began
    ended: float  # time.perf_counter() when its launch returned (CPU: the step has run)
    # CUDA, timing events on the step's stream (None on CPU): `begun` when its launch began; `behind` the previous
    # step's `done` when that step was still unread at this launch (its kernels queue behind that step's);
    # `done` after its last kernel and the copies above
    begun: torch.cuda.Event | None = None
    behind: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    check: LaunchedCheck | None = None  # the dense check run on this step's batches (its loss sum as loss_sum's)

    def result(self) -> StepResult:
        """Waits for the step's kernels -> its result. Its seconds, on the GPU's timeline: from the end of the step
        it queued behind, else from its own launch; a gap where the host was late is the step's. Summed over
        steps launched back to back, they are the wall time of the steps. On the host's clock they would not be:
        a step is read after the next one is launched, so its end would include that launch."""
        if self.done is None:
            seconds = self.ended - self.started
        else:
            self.done.synchronize()
            seconds = (self.behind if self.behind is not None else self.begun).elapsed_time(self.done) / 1e3
        loss = float(self.loss_sum[0]) / self.num_tokens
        result = StepResult(  # host tensors: reading them waits for nothing launched later
            self.step, loss, self.lr, float(self.grad_norm), self.rows, seconds, self.attention.read(), self.builds
        )
        if self.check is not None:
            result.dense_loss = float(self.check.loss_sum[0]) / self.num_tokens
            result.check_seconds = self.check.seconds()
        return result


class StepMeter:
    """Turns a StepResult into the step's metrics (the step line, metrics.jsonl, wandb)."""

    def __init__(self, model: torch.nn.Module, num_matmul_params: int, pc: ParallelContext):
        hf = model.config
        self.num_layers, self.num_heads = hf.num_hidden_layers, hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.num_matmul_params, self.pc = num_matmul_params, pc
        self.peak = peak_tflops(pc.device)

    def __call__(self, result: StepResult) -> dict[str, Any]:
        pc, attention = self.pc, dict(result.attention)
        if "ring_work" in attention:  # max / mean of the active blocks over the ring's ranks
            work = attention.pop("ring_work")
            peak, total = torch.tensor([work], dtype=torch.float64), torch.tensor([work], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=pc.topology.group)
            dist.all_reduce(total, group=pc.topology.group)
            attention["ring_imbalance"] = float(peak[0] / (total[0] / pc.cp))
        num_tokens = sum(b["input_ids"].numel() for b in result.rows) * pc.dp  # every rank's rows
        # Attention FLOPs on the work actually done: the share of dense attention's blocks the layers computed
        # (single process: sparse layers' layouts, 1 for layers that ran dense; ring: the layouts').
        work = attention.get("attention_work", attention.get("sparse_density", 1.0))
        pairs = sum(causal_pairs(b["document_ids"]) for b in result.rows) * pc.dp * work
        flops = training_flops(
            self.num_matmul_params, num_tokens, int(pairs), self.num_layers, self.num_heads, self.head_dim
        )
        tflops = flops / result.seconds / 1e12 / pc.world
        seq_len = result.rows[0]["input_ids"].shape[-1] if result.rows else 0
        titan = torchtitan_flops(
            self.num_matmul_params, num_tokens, seq_len, self.num_layers, self.num_heads, self.head_dim
        )
        return {
            "step": result.step,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens": num_tokens,
            "tokens_per_s": num_tokens / result.seconds / pc.world,
            "tflops": tflops,
            **({"mfu": tflops / self.peak} if self.peak else {}),
            # torchtitan's count (every pair of the sequence): comparable with its MFU, not with the work done
            **({"mfu_torchtitan": titan / result.seconds / 1e12 / pc.world / self.peak} if self.peak else {}),
            "peak_mem_gib": peak_memory_gib(pc.device),
            "step_s": result.seconds,
            **result.builds,
            **attention,
        }
