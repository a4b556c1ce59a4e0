"""Dynamic sparse attention as one differentiable op: estimate the pattern → block layout → kernels.

`plan_sparse` estimates a vertical-slash pattern from q/k and turns it into a `BlockLayout`;
`sparse_attention_with_layout` runs the Triton kernels (CUDA, or the Triton interpreter) or the plain-torch
reference (CPU) on it, forward and backward. The layout is computed once per forward and saved for
backward; the caller may cache it across an activation-checkpoint recompute (see attention/hook.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mtrain_cli.attention.sparse.kernels_bwd import sparse_backward
from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
from mtrain_cli.attention.sparse.layout import BlockLayout, build_layout
from mtrain_cli.attention.sparse.pattern import SparseSettings, document_spans, estimate_pattern
from mtrain_cli.attention.sparse.reference import reference_attention

Backend = Literal["triton", "reference"]


@dataclass(frozen=True)
class SparsePlan:
    layout: BlockLayout
    document_ids_BS: torch.Tensor  # int32
    recall_BH: torch.Tensor  # share of the probe rows' attention mass the layout computes
    density: torch.Tensor  # share of causal blocks computed (0-dim)


def default_backend(device: torch.device) -> Backend:
    """Triton on CUDA; the plain-torch reference on CPU (tests run the kernels under TRITON_INTERPRET=1)."""
    return "triton" if device.type == "cuda" else "reference"


@torch.no_grad()
def plan_sparse(q_BHSD: torch.Tensor, k_BHkSD: torch.Tensor, document_ids_BS: torch.Tensor | None, scale: float,
                settings: SparseSettings) -> SparsePlan:
    """Pattern estimation and block layout for self-attention over one packed sequence batch."""
    B, _, S, _ = q_BHSD.shape
    if document_ids_BS is None:
        document_ids_BS = torch.zeros(B, S, dtype=torch.int32, device=q_BHSD.device)
    document_ids_BS = document_ids_BS.to(torch.int32)
    pattern = estimate_pattern(q_BHSD, k_BHkSD, document_ids_BS, scale, settings)
    start_BS, length_BS = document_spans(document_ids_BS)
    layout = build_layout(pattern, start_BS, length_BS, S, settings.block_size, settings.dense_below)
    return SparsePlan(layout, document_ids_BS.contiguous(), pattern.recall_BH, layout.density())


class SparseAttentionFunction(torch.autograd.Function):
    """Triton forward/backward; the layout is fixed data, saved from forward for backward."""

    @staticmethod
    def forward(ctx, q_BHSD, k_BHkSD, v_BHkSD, layout: BlockLayout, doc_BS: torch.Tensor, scale: float):
        out_BHSD, lse_BHS = sparse_forward(q_BHSD, k_BHkSD, v_BHkSD, layout, doc_BS, doc_BS, scale)
        ctx.save_for_backward(q_BHSD, k_BHkSD, v_BHkSD, out_BHSD, lse_BHS, doc_BS)
        ctx.layout, ctx.scale = layout, scale
        return out_BHSD

    @staticmethod
    def backward(ctx, dout_BHSD):
        q_BHSD, k_BHkSD, v_BHkSD, out_BHSD, lse_BHS, doc_BS = ctx.saved_tensors
        dq, dk, dv = sparse_backward(q_BHSD, k_BHkSD, v_BHkSD, out_BHSD, lse_BHS, dout_BHSD, ctx.layout, doc_BS,
                                     doc_BS, ctx.scale)
        return dq, dk, dv, None, None, None


def sparse_attention_with_layout(q_BHSD: torch.Tensor, k_BHkSD: torch.Tensor, v_BHkSD: torch.Tensor,
                                 plan: SparsePlan, scale: float, backend: Backend) -> torch.Tensor:
    """-> out [B, H, S, D] in q's dtype. GQA: H must be a multiple of K/V heads (K/V are never repeated)."""
    if backend == "reference":
        out_BHSD, _ = reference_attention(q_BHSD, k_BHkSD, v_BHkSD, plan.layout, plan.document_ids_BS,
                                          plan.document_ids_BS, scale, compute_dtype=torch.float32)
        return out_BHSD.to(q_BHSD.dtype)
    return SparseAttentionFunction.apply(q_BHSD.contiguous(), k_BHkSD.contiguous(), v_BHkSD.contiguous(),
                                         plan.layout, plan.document_ids_BS, scale)

