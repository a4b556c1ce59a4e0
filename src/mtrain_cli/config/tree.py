"""The typed config tree: one dataclass a recipe section, each checking its own fields (`check`; attention's at
construction), and the tree back to YAML. Rules across sections: checks.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.errors import UserError
from mtrain_cli.families import FAMILIES

Architecture = Literal[tuple(FAMILIES)]  # the model_type of a family mtrain extends (families.py)


@dataclass
class RunConfig:
    name: str | None = None  # default: the model directory's name (--model), else "run"; a name, never a path
    description: str = ""
    output_dir: str = "runs"  # each run writes to <output_dir>/<name>-<timestamp>/
    seed: int = 0


@dataclass
class ModelConfig:
    # A local HF model directory, or None for a fresh model built from the fields below. With a directory the
    # fields below are read from its config.json (the model decides its shape; config.yaml records it).
    path: str | None = None
    tokenizer: str | None = None  # local tokenizer directory; default: `path`, else the shipped tokenizer
    architecture: Architecture = "qwen2"
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size / num_attention_heads (Qwen3 sets its own)
    max_position_embeddings: int = 256  # the context the fresh model is "pretrained" for
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # a config.json's rope_scaling (e.g. Llama 3.1's llama3); None: plain
    tie_word_embeddings: bool = True

    def check(self) -> None:
        _positive(self, "model", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        _positive(self, "model", "num_key_value_heads", "max_position_embeddings")
        if self.path is not None:  # a model directory decides its shape
            return
        if self.head_dim is not None and (self.head_dim <= 0 or self.head_dim % 2):
            raise UserError(f"model.head_dim {self.head_dim} must be a positive even number (RoPE rotates pairs)")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise UserError(
                f"model.hidden_size {self.hidden_size} must be divisible by model.num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"model.num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"model.num_key_value_heads {self.num_key_value_heads}"
            )


@dataclass
class ContextConfig:
    method: Literal["yarn", "llama3", "theta", "none"] = "yarn"  # model/rope.py: what each does from each starting RoPE
    factor: float = 8.0
    original_max_position_embeddings: int | None = None  # default: the model's max_position_embeddings
    rope_theta: float | None = None  # yarn, llama3: keep the model's theta when None; theta: the new base (required)
    beta_fast: float | None = None  # None: 32, or the model's own (llama3: high_freq_factor; yarn: beta_fast)
    beta_slow: float | None = None  # None: 1, or the model's own (llama3: low_freq_factor; yarn: beta_slow)
    attention_factor: float | None = None  # None: YaRN's default 0.1 * ln(factor) + 1

    def check(self) -> None:
        if self.method != "none" and self.factor <= 1.0:
            raise UserError(
                f"context.factor {self.factor} must be > 1 to extend the context (or set context.method=none)"
            )
        if self.method == "theta" and self.rope_theta is None:
            raise UserError(
                "context.rope_theta is required when context.method=theta, e.g. --set context.rope_theta=1e6"
            )
        if self.beta_fast is not None and self.beta_slow is not None and self.beta_fast <= self.beta_slow:
            raise UserError(
                f"context.beta_fast {self.beta_fast} must be greater than context.beta_slow {self.beta_slow}"
            )


@dataclass
class DataConfig:
    sources: list[str] = field(default_factory=list)  # required: the user's documents (--data)
    text_field: str = "text"
    seq_len: int | None = None  # default: the extended context (context.factor × the model's context)
    short_sources: list[str] = field(default_factory=list)
    short_fraction: float = 0.0  # share of packed rows made of short-context documents
    packing: Literal["concat", "best_fit"] = "concat"  # best_fit never cuts a document of up to seq_len tokens
    # conversations (records with `messages`, rendered with the tokenizer's chat template; data/chat.py)
    chat_turns: Literal["all", "last"] = "all"  # the assistant turns whose tokens carry the loss
    long_conversations: Literal["cut", "drop"] = "cut"  # past seq_len: the middle of the context cut out, or dropped
    num_val_rows: int = 4  # packed rows held out for validation loss
    num_proc: int = 1  # tokenisation workers (datasets.map)

    def check(self) -> None:
        _positive(self, "data", "seq_len", "num_proc")
        if not self.sources:
            raise UserError(
                "data.sources is empty; pass your long documents with --data PATH (a local .jsonl/.parquet/.txt "
                "file or dataset directory; repeatable), or list them in the recipe"
            )
        if not 0.0 <= self.short_fraction < 1.0:
            raise UserError(f"data.short_fraction {self.short_fraction} must be in [0, 1)")
        if self.short_fraction > 0 and not self.short_sources:
            raise UserError(
                f"data.short_fraction {self.short_fraction} needs data.short_sources (local short documents)"
            )
        if self.num_val_rows < 0:
            raise UserError(f"data.num_val_rows {self.num_val_rows} must be >= 0")


@dataclass
class ParallelConfig:
    cp: int = 1  # context-parallel ranks per sequence
    dp: int = 1  # data-parallel (FSDP) ranks
    # token layout over the cp ranks; auto: stripe for sparse attention (balances sparse work), zigzag for dense
    # (balances causal work, and its one-document chunk pairs run cuDNN: ring/plain_pairs.py)
    layout: Literal["auto", "stripe", "zigzag"] = "auto"
    hierarchical: bool = False  # inner ring within a node, outer ring across nodes
    node_size: int | None = None  # ranks per node for the hierarchical ring; default LOCAL_WORLD_SIZE

    def check(self) -> None:
        """Its own fields; whether its ring fits the launch, the nodes and data.seq_len: checks.py."""
        _positive(self, "parallel", "cp", "dp")
        if self.node_size is not None and self.node_size < 1:
            raise UserError(f"parallel.node_size {self.node_size} must be >= 1")
        if self.hierarchical and self.cp == 1:
            raise UserError("parallel.hierarchical needs parallel.cp > 1 (a ring to split into nodes)")
        if not self.hierarchical and self.node_size is not None:
            raise UserError(f"parallel.node_size {self.node_size} is only used with parallel.hierarchical=true")


@dataclass
class LoraConfig:
    """Low-rank adapters (peft) on the frozen model's linear layers; the base weights stay as loaded (bf16 on GPU)."""

    rank: int = 16
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    train_embeddings_norms: bool = False  # LongLoRA's "+": the input embeddings and every norm train too
    export: Literal["merged", "adapter"] = "merged"  # merged: a plain HF directory; adapter: peft's files alone

    def check(self) -> None:
        if self.rank < 1:
            raise UserError(f"train.lora.rank {self.rank} must be >= 1 (8-64 are usual)")
        if self.alpha <= 0:
            raise UserError(f"train.lora.alpha {self.alpha} must be > 0 (the update is scaled by alpha / rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"train.lora.dropout {self.dropout} must be in [0, 1)")
        if not self.target_modules:
            raise UserError(
                "train.lora.target_modules is empty; name the linear layers to adapt, e.g. [q_proj, v_proj]"
            )
        if self.export == "adapter" and self.train_embeddings_norms:
            raise UserError(
                "train.lora.export adapter: the adapter files cannot carry the embeddings and norms that "
                "train.lora.train_embeddings_norms trains; set train.lora.export=merged"
            )


@dataclass
class TrainConfig:
    num_steps: int = 300
    batch_size: int = 1  # sequences per micro-batch
    grad_accum: int = 1
    lr: float | None = None  # default: 2e-5 for a model directory (fine-tuning), 1e-3 for a fresh model
    min_lr_ratio: float = 0.1
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int | None = None  # default: 20, or a tenth of num_steps where that is fewer
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    activation_checkpointing: bool = False
    compile: bool | None = None  # torch.compile each decoder layer; None (`auto`): on when training on CUDA
    loss_chunk_size: int = 1024  # tokens per cross-entropy chunk; full logits are never materialised
    eval_every: int = 100
    device: Literal["auto", "cpu", "cuda"] = "auto"
    lora: LoraConfig | None = None  # None: every parameter trains; `train.lora={}` (or any lora field) enables it

    def check(self) -> None:
        _positive(self, "train", "num_steps", "batch_size", "grad_accum", "lr", "loss_chunk_size", "eval_every")
        if not 0 <= self.warmup_steps <= self.num_steps:
            raise UserError(
                f"train.warmup_steps {self.warmup_steps} must be in [0, train.num_steps={self.num_steps}] (warm-up "
                f"is part of the run); set it too, e.g. "
                f"--set train.warmup_steps={min(max(self.warmup_steps, 0), self.num_steps // 10)}"
            )
        for name, value in (("train.beta1", self.beta1), ("train.beta2", self.beta2)):
            if not 0.0 <= value < 1.0:
                raise UserError(f"{name} {value} must be in [0, 1) (AdamW's moment decay; the defaults are 0.9, 0.95)")
        if self.weight_decay < 0:
            raise UserError(f"train.weight_decay {self.weight_decay} must be >= 0 (0 turns decay off)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"train.min_lr_ratio {self.min_lr_ratio} must be in [0, 1]")
        if self.grad_clip < 0:
            raise UserError(f"train.grad_clip {self.grad_clip} must be >= 0 (0 disables clipping)")
        if self.lora is not None:
            self.lora.check()


@dataclass
class CheckpointConfig:
    every: int = 100
    keep_last: int = 2
    export: bool = True  # write a Hugging Face directory at the end

    def check(self) -> None:
        _positive(self, "checkpoint", "every", "keep_last")


@dataclass
class LoggingConfig:
    every: int = 10
    wandb: bool = False
    wandb_project: str = "mtrain"

    def check(self) -> None:
        _positive(self, "logging", "every")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    data: DataConfig = field(default_factory=DataConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def extended_context(self) -> int:
        """Context length after the extension recipe (the model's new max_position_embeddings)."""
        original = self.context.original_max_position_embeddings or self.model.max_position_embeddings
        return original if self.context.method == "none" else round(self.context.factor * original)

    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.train.grad_accum * self.data.seq_len * self.parallel.dp


def _positive(section: object, name: str, *fields: str) -> None:
    for field_name in fields:
        value = getattr(section, field_name)
        if value <= 0:
            raise UserError(f"{name}.{field_name} {value} must be > 0")


def to_yaml(config: Config) -> str:
    def plain(value: Any) -> Any:  # YAML has lists, not tuples
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value

    return yaml.safe_dump(plain(config.to_dict()), sort_keys=False)
