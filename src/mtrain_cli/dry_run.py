"""`--dry-run`: what a recipe will do before any data is read or weights are loaded.

The model is instantiated on the meta device (no memory) to count parameters exactly. The memory figure is an
estimate per GPU: fp32 master weights + grads + AdamW moments (16 B/param, sharded by FSDP2 over all dp × cp
ranks; with LoRA only what trains, and the frozen base in bf16 at 2 B/param), bf16 activations of this rank's
seq_len / cp tokens per token per layer (Korthikanti et al.'s 34·h bytes for h = hidden, MLP 4h, generalised to
the real MLP width; no S² term since attention never materialises scores; the layer inputs that checkpointing
keeps are fp32 in one process's full fine-tuning), one loss chunk's fp32 logits.

torch and transformers are imported inside the functions that need them, so importing this module is cheap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtrain_cli.config import Config
from mtrain_cli.resources import shipped_path

if TYPE_CHECKING:
    from mtrain_cli.model import RopeSummary


@dataclass
class MemoryEstimate:
    weights_grads_optimizer_gib: float
    activations_gib: float
    logits_chunk_gib: float
    total_gib: float


@dataclass
class DryRun:
    num_params: int
    num_matmul_params: int
    num_trainable_params: int
    rope: RopeSummary
    tokens_per_step: int
    num_steps: int
    total_tokens: int
    memory: MemoryEstimate
    params_note: str | None = None  # why num_params is not the named model's count (a fresh model's vocabulary)
    rope_start: str = ""  # the RoPE the model starts from (rope.describe_rope)
    rope_notes: list[str] = field(default_factory=list)  # frequencies the recipe changes beyond the extension

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_memory(config: Config, hf_config, num_params: int, num_trainable: int | None = None) -> MemoryEstimate:
    """num_trainable: the parameters that train (LoRA: the adapters, ...); None: all of them."""
    gib = 2**30
    tokens = config.train.batch_size * config.data.seq_len // config.parallel.cp
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    per_token_layer = 18 * hidden + 4 * inter  # bytes, bf16; = 34·h when inter = 4h
    # a layer's backward holds the gradients of its MLP's gate, up and their product at once (bf16)
    backward = 6 * inter
    layers = hf_config.num_hidden_layers
    if config.train.activation_checkpointing:
        # layer inputs kept + one layer live; one process trains fp32 weights, so its residual stream is fp32
        # (FSDP2 computes in bf16, LoRA in its bf16 base's dtype)
        distributed = config.parallel.dp * config.parallel.cp > 1
        residual_bytes = 2 if config.train.lora is not None or distributed else 4
        activations = tokens * (residual_bytes * hidden * layers + per_token_layer + backward)
    else:
        activations = tokens * (per_token_layer * layers + backward)
    num_trainable = num_params if num_trainable is None else num_trainable
    frozen_bytes = 2 * (num_params - num_trainable)  # LoRA's base, bf16
    states = (16 * num_trainable + frozen_bytes) / (config.parallel.dp * config.parallel.cp)  # FSDP2: over dp × cp
    logits = 2 * config.train.loss_chunk_size * hf_config.vocab_size * 4  # fp32 logits and their grad
    return MemoryEstimate(states / gib, activations / gib, logits / gib, (states + activations + logits) / gib)


def _params_note(config: Config, vocab_size: int) -> str | None:
    """A fresh model built with the demo tokenizer is not the model a recipe is named after: say so."""
    shipped = shipped_path("data/tokenizer")
    if config.model.path is not None or shipped is None or config.model.tokenizer is None:
        return None
    if Path(config.model.tokenizer).expanduser().resolve() != shipped.resolve():
        return None
    return f"fresh model with the shipped {vocab_size:,}-token vocabulary; pass --model for a pretrained model's count"


def make_dry_run(config: Config) -> DryRun:
    import torch
    from transformers import AutoModelForCausalLM

    from mtrain_cli.model import (
        build_hf_config,
        count_parameters,
        describe_rope,
        load_hf_config,
        load_tokenizer,
        rope_summary,
    )

    tokenizer = load_tokenizer(config)
    rope_start = describe_rope(load_hf_config(config, len(tokenizer)))
    rope_notes: list[str] = []
    hf_config = build_hf_config(config, len(tokenizer), rope_notes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    num_params, num_matmul_params = count_parameters(model)
    if config.train.lora is not None:
        from mtrain_cli.train import apply_lora

        apply_lora(model, config.train.lora)
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tokens_per_step = config.tokens_per_step()
    return DryRun(
        num_params=num_params,
        num_matmul_params=num_matmul_params,
        num_trainable_params=num_trainable,
        rope=rope_summary(hf_config),
        tokens_per_step=tokens_per_step,
        num_steps=config.train.num_steps,
        total_tokens=tokens_per_step * config.train.num_steps,
        memory=estimate_memory(config, hf_config, num_params, num_trainable),
        params_note=_params_note(config, len(tokenizer)),
        rope_start=rope_start,
        rope_notes=rope_notes,
    )


def memory_fit(memory: MemoryEstimate) -> tuple[str, str | None]:
    """(one line for the dry run's table, a warning when the estimate does not fit the GPU it is compared with)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        capacity, against = props.total_memory / 2**30, f"this {props.name}"
    else:  # compare with the largest GPU we size recipes for
        capacity, against = 139.8, "an H200 (139.8 GiB usable; no GPU visible here)"
    line = f"{memory.total_gib:.1f} of {capacity:.1f} GiB on {against}"
    if memory.total_gib <= 0.9 * capacity:  # leave room for the allocator, NCCL buffers and kernels' workspaces
        return line, None
    return line, (
        f"the memory estimate {memory.total_gib:.1f} GiB per GPU does not fit {against} with 10% headroom; "
        f"raise parallel.cp, set train.activation_checkpointing=true or lower data.seq_len"
    )
