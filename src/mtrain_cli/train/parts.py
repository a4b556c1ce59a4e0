"""What a Trainer trains with, built from the config in one place: tokenizer → packed data → the model with the
context recipe → parallelised (train/parallelize.py) → the attention router → optimizer and schedule. The
Trainer receives these parts; it builds nothing itself."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console

from mtrain_cli.attention import MEASURED_BLOCK, AttentionRouter, CrossoverPolicy, RecallController, crossover_rule
from mtrain_cli.config import Config
from mtrain_cli.errors import UserError
from mtrain_cli.model import build_hf_config, build_model, check_weight_shapes, count_parameters, load_tokenizer
from mtrain_cli.parallel import ParallelContext
from mtrain_cli.train.data_setup import TrainData, build_datasets
from mtrain_cli.train.lora import apply_lora
from mtrain_cli.train.loss import ChunkedLossModel
from mtrain_cli.train.optim import build_optimizer, build_scheduler
from mtrain_cli.train.parallelize import parallelize

if TYPE_CHECKING:  # loads Triton: imported where a sparse run on a GPU needs it
    from mtrain_cli.attention.sparse import Prebuild


@dataclass
class TrainingParts:
    tokenizer: Any
    data: TrainData
    net: ChunkedLossModel  # the parallelised loss wrapper; the HF model is net.hf
    router: AttentionRouter
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    warnings: list[str] = field(default_factory=list)  # what the build found that the run's summary must say
    prebuild: Prebuild | None = None  # sparse kernels building in worker processes (wait before the first step)


def build_training(config: Config, pc: ParallelContext, console: Console) -> TrainingParts:
    if config.train.dtype == "bf16" and pc.device.type != "cuda":
        raise UserError(
            f"train.dtype bf16 on {pc.device.type}: bf16 autocast is for GPUs (CPU trains in fp32); "
            f"set train.dtype=auto or fp32"
        )
    prebuild = start_kernel_prebuild(config, pc)  # while the data and the model load
    torch.manual_seed(config.run.seed)
    inputs = read_inputs(config, pc, console)
    tokenizer, data, warnings = inputs.tokenizer, inputs.data, inputs.notes
    # Distributed: a local model is built on the meta device and, once sharded, each rank reads its own rows of
    # the weights; a fresh one is built on the CPU (the same seed on every rank) and fully_shard moves one layer
    # at a time to the GPU, keeping only this rank's shard. No GPU holds the whole model.
    # LoRA: the base stays frozen, so on a GPU training in bf16 it is built and kept in bf16 (half the memory)
    bf16 = pc.device.type == "cuda" and config.train.dtype in ("auto", "bf16")
    base_dtype = torch.bfloat16 if config.train.lora is not None and bf16 else torch.float32
    t0 = time.perf_counter()
    if not pc.distributed:
        model = build_model(config, tokenizer, pc.device, base_dtype)
    elif config.model.path is not None:
        model = build_model(config, tokenizer, torch.device("meta"), base_dtype)
    else:
        with cpu_threads(threads_per_local_rank()):
            model = build_model(config, tokenizer, torch.device("cpu"), base_dtype)
    if config.train.lora is not None:
        apply_lora(model, config.train.lora, base_dtype)
    net = parallelize(model, config, pc)
    model.train()
    console.print(model_line(model, pc, time.perf_counter() - t0), highlight=False)

    def warn(message: str) -> None:
        warnings.append(message)
        _warn(console, message)

    router = build_router(config, pc, warn)
    optimizer = build_optimizer(model, config.train)
    scheduler = build_scheduler(optimizer, config.train)
    return TrainingParts(tokenizer, data, net, router, optimizer, scheduler, warnings, prebuild)


def start_kernel_prebuild(config: Config, pc: ParallelContext) -> Prebuild | None:
    """Sparse training in one GPU process: the sparse kernels are built by worker processes into Triton's cache
    while the data and the model load (attention/sparse/prebuild.py); the trainer waits for them before its first
    step. None otherwise (the dense path builds no Triton kernels of ours; a ring's ranks build theirs)."""
    if config.attention.mode != "sparse" or pc.device.type != "cuda" or pc.distributed:
        return None
    from mtrain_cli.attention.sparse import KernelShape, start_prebuild

    m = config.model
    shape = KernelShape(
        heads=m.num_attention_heads,
        kv_heads=m.num_key_value_heads,
        head_dim=m.head_dim or m.hidden_size // m.num_attention_heads,
        dtype="float32" if config.train.dtype == "fp32" else "bfloat16",  # the trainer's autocast
        settings=dataclasses.asdict(config.attention),
        device_index=pc.device.index or 0,
        seq_len=config.data.seq_len,
        batch=config.train.batch_size,
    )
    return start_prebuild(shape)


@dataclass
class RunInputs:
    tokenizer: Any
    data: TrainData
    notes: list[str]  # what the user must be told of the model's RoPE under the context recipe


def read_inputs(config: Config, pc: ParallelContext | None, console: Console) -> RunInputs:
    """What a run reads, each checked, each failure the one line the user sees: the tokenizer, the model's config
    under the context recipe, its weights' shapes (from the files' headers), the data tokenised and packed into
    rows for dp ranks. `--dry-run` runs this too (pc None), so it refuses what the run refuses; the datasets cache
    keeps the tokenised data for the run."""
    notes: list[str] = []
    tokenizer = load_tokenizer(config)
    hf_config = build_hf_config(config, len(tokenizer), notes)  # the model's context, before data is packed
    for message in notes:
        _warn(console, message)
    check_weight_shapes(config, hf_config)
    # rank 0 tokenises first and fills the datasets cache; the others then read it (no concurrent writes)
    if pc is not None and not pc.is_main:
        pc.barrier()
    dp_rank, dp = (pc.dp_rank, pc.dp) if pc is not None else (0, config.parallel.dp)
    data = build_datasets(config, tokenizer, dp_rank, dp)
    if pc is not None and pc.is_main:
        pc.barrier()
    console.print(packing_line(data.stats), highlight=False)
    return RunInputs(tokenizer, data, notes)


def packing_line(stats: dict[str, Any]) -> str:
    """What packing did, in one line: documents and conversations, rows, padding, and the tokens the loss is on."""
    conversations = ""
    if stats["num_conversations"]:
        conversations = (
            f" (of which {stats['num_conversations']:,} conversations: {stats['num_conversations_cut']:,} cut "
            f"and {stats['num_conversations_dropped']:,} dropped past data.seq_len {stats['seq_len']:,})"
        )
    share = stats["num_loss_tokens"] / max(1, stats["num_input_tokens"] - stats["num_tokens_dropped"])
    return (
        f"packed {stats['num_documents']:,} documents{conversations} ({stats['num_input_tokens']:,} tokens) into "
        f"{stats['num_rows']:,} rows of {stats['seq_len']:,} · {stats['num_loss_tokens']:,} tokens carry loss "
        f"({share:.1%}) · {stats['num_short_rows']:,} short-context rows · {stats['num_pad_tokens']:,} pad tokens · "
        f"{stats['num_tokens_dropped']:,} short-mix tokens beyond data.short_fraction unused · "
        f"{stats['num_val_rows']} rows held out for validation"
    )


def model_line(model: torch.nn.Module, pc: ParallelContext, seconds: float) -> str:
    """What was built and how long it took: at 8B, building is a long silent stretch before the first step."""
    num_params, _ = count_parameters(model)
    num_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trained = f" ({num_trained:,} trained)" if num_trained != num_params else ""
    return f"model: {num_params:,} parameters{trained} · ready on {pc.device} in {seconds:.1f} s"


def threads_per_local_rank() -> int:
    """The CPU cores this process may use, shared among the launch's ranks on this node. torchrun sets
    OMP_NUM_THREADS=1 for the training loop; a fresh model's random init on one core runs ~50M parameters a
    second, minutes for an 8B model. torch's CPU init draws the same values at any thread count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@contextmanager
def cpu_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `num_threads` inside, and back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_router(config: Config, pc: ParallelContext, warn: Callable[[str], Any]) -> AttentionRouter:
    """What every attention call runs: the recipe's attention over the cp ring, if any; in single-process GPU
    training with sparse attention, the crossover policy that runs a layer dense where sparse would be slower."""
    rule = None
    if pc.ring is None and config.attention.mode == "sparse" and config.attention.crossover:
        rule = crossover_rule(pc.device)
        if rule is not None and config.attention.block_size != MEASURED_BLOCK:
            warn(
                f"attention.block_size {config.attention.block_size}: the crossover costs were measured "
                f"at block {MEASURED_BLOCK}, so sparse layers may run slower than dense ones; use "
                f"{MEASURED_BLOCK} or re-measure with `mtrain profile crossover`"
            )
    if pc.ring is not None and config.attention.mode == "dense" and pc.ring.layout == "stripe":
        warn(
            "parallel.layout stripe with attention.mode dense: stripe chunk pairs are block-strided, so the dense "
            "ring runs every pair on our kernels, never cuDNN (slower on GPU); set parallel.layout=zigzag (or auto)"
        )
    crossover = CrossoverPolicy(rule) if rule is not None else None
    attention = config.attention
    recall = RecallController(attention) if attention.mode == "sparse" and attention.recall_target else None
    return AttentionRouter(attention, cp=pc.ring, crossover=crossover, recall=recall)


def _warn(console: Console, message: str) -> None:
    console.print(f"[yellow]warning:[/] {message}", highlight=False)
