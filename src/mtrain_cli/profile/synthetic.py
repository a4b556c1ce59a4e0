"""Synthetic attention inputs with planted vertical-slash structure, and random patterns, for profiling.

Real long-context heads put most of their mass on a few key positions (sinks, separators) and a few
query-key offsets (the local window, periodic offsets). We plant both into random Q/K:
- slashes: for a few offsets d per KV head, key j gets a copy of the group's shared query direction at
  position j + d, so every query i scores high against key i - d;
- verticals: a few key positions per KV head get a direction that every query of the group shares;
- a sink: the first key gets that direction too, strongly.
Pattern estimation then runs on these inputs exactly as in training, so the measured layout is what the
estimator produces, not a hand-made mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtrain_cli.attention import AttentionConfig, BatchCache
from mtrain_cli.attention.sparse import SENTINEL, Pattern, PlanGraph, SparsePlan, plan_sparse


def planted_qkv(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    seq_len: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    num_slash: int = 16,
    num_vertical: int = 64,
    slash_logit: float = 12.0,
    vertical_logit: float = 11.0,
    sink_logit: float = 14.0,
    local_logit: float = 40.0,
    rope_theta: float = 1e6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> q [B, H, S, D], k and v [B, Hk, S, D] in `dtype` (planted in fp32, then cast).

    Strengths are logit boosts (after the 1/sqrt(D) scale) over random scores of about unit variance: at
    128K the planted entries hold most, not all, of each row's mass, as in real long-context heads."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    G = num_heads // num_kv_heads
    root_d = head_dim**0.5
    shared_BKSD = randn(batch, num_kv_heads, seq_len, head_dim)  # the query direction a KV group shares
    direction_BK1D = torch.nn.functional.normalize(randn(batch, num_kv_heads, 1, head_dim), dim=-1)
    shared_BKSD += root_d * direction_BK1D  # unit logit per unit of key length along the vertical direction
    q_BHSD = shared_BKSD.repeat_interleave(G, 1) + 0.3 * randn(batch, num_heads, seq_len, head_dim)
    k_BKSD = randn(batch, num_kv_heads, seq_len, head_dim)
    # Distance decay (RoPE's own): a shared rotated vector adds sum_f c_f cos(theta_f (i - j)) to every score,
    # largest at offset 0 and fading with distance, so mass spreads over near offsets as in real heads.
    half = head_dim // 2
    inv_freq_F = rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angle_SF = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq_F
    rotated_SD = torch.cat([angle_SF.cos(), angle_SF.sin()], -1).to(device) * (local_logit * root_d / half) ** 0.5
    q_BHSD += rotated_SD
    k_BKSD += rotated_SD
    for kv_head in range(num_kv_heads):
        offsets = torch.randint(4, max(5, seq_len // 2), (num_slash,), generator=gen).tolist()
        logits = slash_logit + torch.rand(num_slash + 3, generator=gen) - 0.5
        for d, logit in zip([1, 2, 3] + offsets, logits.tolist()):  # near offsets (local attention), far ones
            # q_i · k_{i-d} / sqrt(D) gains `logit`: shared_i · shared_i ≈ D + D (the direction term)
            k_BKSD[:, kv_head, : seq_len - d] += logit * root_d / (2 * head_dim) * shared_BKSD[:, kv_head, d:]
        columns = torch.randint(0, seq_len, (num_vertical,), generator=gen).to(device)
        k_BKSD[:, kv_head, columns] += vertical_logit * direction_BK1D[:, kv_head]
        k_BKSD[:, kv_head, 0] += sink_logit * direction_BK1D[:, kv_head, 0]
    v_BKSD = randn(batch, num_kv_heads, seq_len, head_dim)
    return q_BHSD.to(dtype), k_BKSD.to(dtype), v_BKSD.to(dtype)


def random_pattern(
    batch: int,
    num_heads: int,
    seq_len: int,
    num_vertical: int,
    num_slash: int,
    local_window: int,
    device: torch.device,
    seed: int = 0,
) -> Pattern:
    """Uniformly random verticals and slash offsets per head (plus sink 0 and the local window)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    vertical = torch.rand(batch, num_heads, seq_len, generator=gen).topk(num_vertical, dim=-1).indices
    vertical = torch.cat([torch.zeros_like(vertical[..., :1]), vertical], -1)
    slash = torch.rand(batch, num_heads, seq_len, generator=gen)
    slash[..., :local_window] = 2.0  # always kept
    slash = slash.topk(num_slash + local_window, dim=-1).indices
    vertical = _dedup_sorted(vertical)
    return Pattern(
        vertical.to(device=device, dtype=torch.int32), slash.sort(-1).values.to(device=device, dtype=torch.int32)
    )


def _dedup_sorted(index_BHN: torch.Tensor) -> torch.Tensor:
    """Sort each row and replace repeats by SENTINEL (kept sorted: sentinels go last)."""
    index_BHN = index_BHN.sort(-1).values
    repeat = torch.zeros_like(index_BHN, dtype=torch.bool)
    repeat[..., 1:] = index_BHN[..., 1:] == index_BHN[..., :-1]
    return torch.where(repeat, SENTINEL, index_BHN).sort(-1).values


@dataclass(frozen=True)
class PlantedCase:
    """One long document of planted inputs in the Qwen2.5-3B attention shape, its plan and an output gradient."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    doc_BS: torch.Tensor
    scale: float
    settings: AttentionConfig
    plan: SparsePlan
    dout: torch.Tensor


def planted_case(
    seq_len: int,
    device: torch.device,
    num_heads: int = 16,
    num_kv_heads: int = 2,
    head_dim: int = 128,
    num_slash: int = 16,
) -> PlantedCase:
    scale = head_dim**-0.5
    # MTraining's probe (the last queries): planted structure is the same at every position, and spread windows'
    # short early rows would add noise keys (docs/results.md, "Probe windows")
    settings = AttentionConfig(dense_below=0, probe_windows=1)
    q, k, v = planted_qkv(1, num_heads, num_kv_heads, seq_len, head_dim, torch.bfloat16, device, num_slash=num_slash)
    doc_BS = torch.zeros(1, seq_len, dtype=torch.int32, device=device)
    plan = plan_sparse(q, k, doc_BS, scale, settings, BatchCache(), PlanGraph())
    return PlantedCase(q, k, v, doc_BS, scale, settings, plan, torch.randn_like(q))
