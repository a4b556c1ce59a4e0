"""Model FLOPs actually done per step: 6·N per token for the matmuls, plus causal attention counted
only over the (query, key) pairs inside each document — packed short documents do far less work."""

from __future__ import annotations

import torch


def causal_pairs(document_ids_BS: torch.Tensor) -> int:
    """Number of (query, key ≤ query) pairs within documents; padding (id -1) counts as one document."""
    total = 0
    for row_S in document_ids_BS:
        _, lengths = torch.unique_consecutive(row_S, return_counts=True)
        total += int((lengths * (lengths + 1) // 2).sum())
    return total


def training_flops(
    num_matmul_params: int, num_tokens: int, num_pairs: int, num_layers: int, num_heads: int, head_dim: int
) -> float:
    """Forward + backward FLOPs (backward = 2 × forward); activation recompute is not counted (MFU convention)."""
    matmul = 6.0 * num_matmul_params * num_tokens
    attention = 3.0 * 4.0 * num_heads * head_dim * num_pairs * num_layers  # QKᵀ and PV, 2 FLOPs per MAC
    return matmul + attention


def torchtitan_flops(
    num_matmul_params: int, num_tokens: int, seq_len: int, num_layers: int, num_heads: int, head_dim: int
) -> float:
    """FLOPs as torchtitan counts them, to compare MFU with it: 6·N + 12·L·H·D·S per token, i.e. every (query,
    key) pair of the sequence, whether causal, in another packed document or skipped by a sparse plan."""
    return num_tokens * (6.0 * num_matmul_params + 12.0 * num_layers * num_heads * head_dim * seq_len)


# Dense bf16 tensor-core peak per GPU (TFLOP/s), for MFU; None for devices not listed (MFU is then omitted).
_PEAK_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAK_BF16.items() if key in name), None)
