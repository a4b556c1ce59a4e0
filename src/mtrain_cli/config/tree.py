"""The typed config tree: one dataclass a recipe section, and the tree back to YAML."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.families import FAMILIES

Architecture = Literal[tuple(FAMILIES)]  # the model_type of a family mtrain extends (families.py)


@dataclass
class RunConfig:
    name: str | None = None  # default: the model directory's name (--model), else "run"
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


@dataclass
class ContextConfig:
    method: Literal["yarn", "llama3", "theta", "none"] = "yarn"  # model/rope.py: what each does from each starting RoPE
    factor: float = 8.0
    original_max_position_embeddings: int | None = None  # default: the model's max_position_embeddings
    rope_theta: float | None = None  # yarn, llama3: keep the model's theta when None; theta: the new base (required)
    beta_fast: float | None = None  # None: 32, or the model's own (llama3: high_freq_factor; yarn: beta_fast)
    beta_slow: float | None = None  # None: 1, or the model's own (llama3: low_freq_factor; yarn: beta_slow)
    attention_factor: float | None = None  # None: YaRN's default 0.1 * ln(factor) + 1


@dataclass
class DataConfig:
    sources: list[str] = field(default_factory=list)  # required: the user's documents (--data)
    text_field: str = "text"
    seq_len: int | None = None  # default: the extended context (context.factor × the model's context)
    short_sources: list[str] = field(default_factory=list)
    short_fraction: float = 0.0  # share of packed rows made of short-context documents
    packing: Literal["concat", "best_fit"] = "concat"  # best_fit never cuts a document of up to seq_len tokens
    num_val_rows: int = 4  # packed rows held out for validation loss
    num_proc: int = 1  # tokenisation workers (datasets.map)


@dataclass
class ParallelConfig:
    cp: int = 1  # context-parallel ranks per sequence
    dp: int = 1  # data-parallel (FSDP) ranks
    # token layout over the cp ranks; auto: stripe for sparse attention (balances sparse work), zigzag for dense
    # (balances causal work, and its one-document chunk pairs run cuDNN: ring/plain_pairs.py)
    layout: Literal["auto", "stripe", "zigzag"] = "auto"
    hierarchical: bool = False  # inner ring within a node, outer ring across nodes
    node_size: int | None = None  # ranks per node for the hierarchical ring; default LOCAL_WORLD_SIZE


@dataclass
class TrainConfig:
    num_steps: int = 300
    batch_size: int = 1  # sequences per micro-batch
    grad_accum: int = 1
    lr: float | None = None  # default: 2e-5 for a model directory (fine-tuning), 1e-3 for a fresh model
    min_lr_ratio: float = 0.1
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 20
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


@dataclass
class CheckpointConfig:
    every: int = 100
    keep_last: int = 2
    export: bool = True  # write a Hugging Face directory at the end


@dataclass
class LoggingConfig:
    every: int = 10
    wandb: bool = False
    wandb_project: str = "mtrain"


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


def to_yaml(config: Config) -> str:
    def plain(value: Any) -> Any:  # YAML has lists, not tuples
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value

    return yaml.safe_dump(plain(config.to_dict()), sort_keys=False)
