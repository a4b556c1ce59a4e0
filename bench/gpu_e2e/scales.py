"""The sizes of the end-to-end flows: GPU (one H100 or H200 in one device call) and CPU (the same flows at tiny
sizes, to test the flows here). A flow reads its lengths, steps and timeouts from the scale it runs at."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Scale:
    name: str
    native: int  # the base model's pretrained context (max_position_embeddings)
    short: int  # the "16K" slot
    long: int  # the "64K" slot
    model: dict[str, Any]  # recipe model section (fresh models and the pretrained base)
    attention: dict[str, Any]  # recipe attention section (sparse settings)
    extend_steps: int
    pretrain_steps: int
    pretrain_batch: int
    pretrain_rows: int
    resume_len: int
    resume_steps: int
    eval_lengths: str
    eval_dense_below: int
    profile_warmup: int
    profile_steps: int
    kernels_args: tuple[str, ...]
    timeouts: dict[str, int]  # per flow kind, seconds
    budget_s: int
    sparse_path: str  # the attention_calls key the sparse path must show


GPU = Scale(
    name="gpu",
    native=2048,
    short=16384,
    long=65536,
    # ~25M parameters: 8 layers of hidden 512, head dim 128 (the kernels' Qwen2.5 head dim), GQA 2:1
    model=dict(
        architecture="qwen2",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    ),
    attention=dict(dense_below=2048),  # the rest as shipped (AttentionConfig)
    extend_steps=4,
    pretrain_steps=200,
    pretrain_batch=8,
    pretrain_rows=120,
    resume_len=16384,
    resume_steps=12,
    eval_lengths="16k",
    eval_dense_below=4096,
    profile_warmup=1,
    profile_steps=2,
    kernels_args=(
        "--lengths",
        "32k",
        "--patterns",
        "planted",
        "--flex-lengths",
        "32k",
        "--repeats",
        "3",
        "--planted-slashes",
        "8",
    ),
    timeouts=dict(
        pretrain=150,
        extend_short=120,
        extend_long=170,
        interrupt=150,
        resume=120,
        export=60,
        eval=200,
        step=120,
        kernels=240,
    ),
    budget_s=540,
    sparse_path="sparse-triton",
)

CPU = Scale(
    name="cpu",
    native=256,
    short=512,
    long=1024,
    model=dict(
        architecture="qwen2",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
    ),
    attention=dict(
        pattern="flex", p=0.96, cap=256, last_q=32, block_size=32, num_sink=4, local_window=64, dense_below=64
    ),
    extend_steps=3,
    pretrain_steps=10,
    pretrain_batch=2,
    pretrain_rows=24,
    resume_len=1024,
    resume_steps=8,
    eval_lengths="1k",
    eval_dense_below=256,
    profile_warmup=1,
    profile_steps=1,
    kernels_args=(
        "--lengths",
        "32k",
        "--patterns",
        "planted",
        "--flex-lengths",
        "32k",
        "--repeats",
        "3",
        "--planted-slashes",
        "8",
    ),
    timeouts=dict(
        pretrain=300,
        extend_short=300,
        extend_long=300,
        interrupt=300,
        resume=300,
        export=120,
        eval=600,
        step=300,
        kernels=120,
    ),
    budget_s=1800,
    sparse_path="sparse-reference",
)


def length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)
