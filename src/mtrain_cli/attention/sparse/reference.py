"""Plain-torch sparse attention from the same layout the kernels read: the test oracle and the CPU path.

The dense boolean mask is rebuilt from the layout's row-major fields only (the Δ list slice, the dense
block range and the vertical slice of every query block), then intersected with causality (global
positions) and same-document. The column-major fields are never read here, so agreement of the kernels'
dK/dV with autograd through this function checks the transposed layout too. Memory is O(Sq·Sk):
small inputs only.
"""

from __future__ import annotations

import torch

from mtrain_cli.attention.sparse.layout import BlockLayout


def layout_mask(layout: BlockLayout) -> torch.Tensor:
    """Boolean [B, H, Sq, Sk]: the (query, key) pairs the layout computes, before causal/document masks."""
    B, H, nq, _ = layout.row_BHM6.shape
    nk, blk = layout.num_k_blocks, layout.block
    device = layout.row_BHM6.device
    row = layout.row_BHM6.long()
    rows_M = torch.arange(nq, device=device)

    L = layout.delta_BHL.shape[-1]
    t_L = torch.arange(L, device=device)
    in_slice_BHML = (t_L >= row[..., 0, None]) & (t_L < row[..., 1, None])
    j_BHML = rows_M[:, None] - layout.delta_BHL.long()[:, :, None, :]
    j_BHML = torch.where(in_slice_BHML, j_BHML, nk)
    blocks_BHMN = torch.zeros(B, H, nq, nk + 1, dtype=torch.bool, device=device)
    blocks_BHMN.scatter_(3, j_BHML, True)
    cols_N = torch.arange(nk, device=device)
    blocks_BHMN = blocks_BHMN[..., :nk] | ((cols_N >= row[..., 2, None]) & (cols_N < row[..., 3, None]))

    V = layout.vcol_BHV.shape[-1]
    t_V = torch.arange(V, device=device)
    in_vert_BHMV = (t_V >= row[..., 4, None]) & (t_V < row[..., 5, None])
    col_BHMV = torch.where(in_vert_BHMV, layout.vcol_BHV.long()[:, :, None, :].clamp(max=layout.k_len), layout.k_len)
    vert_BHMS = torch.zeros(B, H, nq, layout.k_len + 1, dtype=torch.bool, device=device)
    vert_BHMS.scatter_(3, col_BHMV, True)

    elem = blocks_BHMN.repeat_interleave(blk, 2).repeat_interleave(blk, 3)[..., : layout.q_len, : layout.k_len]
    return elem | vert_BHMS[..., : layout.k_len].repeat_interleave(blk, 2)[..., : layout.q_len, :]


def global_positions(length: int, offset: int, stride: int, block: int, device) -> torch.Tensor:
    """Global position of each local token of a chunk whose local block m is global block offset/block + stride·m."""
    local = torch.arange(length, device=device)
    return (offset // block + stride * (local // block)) * block + local % block


def allowed_mask(layout: BlockLayout, doc_q_BSq: torch.Tensor, doc_k_BSk: torch.Tensor) -> torch.Tensor:
    """Layout mask ∧ causal (on true global positions, not the kernels' shift) ∧ same document."""
    device = doc_q_BSq.device
    q_pos = global_positions(layout.q_len, layout.q_offset, layout.stride, layout.block, device)
    k_pos = global_positions(layout.k_len, layout.k_offset, layout.stride, layout.block, device)
    causal_SqSk = k_pos[None, :] <= q_pos[:, None]
    same_doc_BSqSk = doc_q_BSq[:, :, None] == doc_k_BSk[:, None, :]
    return layout_mask(layout) & (causal_SqSk & same_doc_BSqSk)[:, None]


def reference_attention(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    v_BHkSD: torch.Tensor,
    layout: BlockLayout,
    doc_q_BSq: torch.Tensor,
    doc_k_BSk: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [B, H, Sq, D] in compute_dtype, lse [B, H, Sq] fp32). Rows that see no key: out 0, lse -inf.

    Differentiable in q, k, v (autograd gives dQ, dK, dV); GQA by repeating K/V (fine at reference sizes)."""
    G = q_BHSD.shape[1] // k_BHkSD.shape[1]
    q = q_BHSD.to(compute_dtype)
    k = k_BHkSD.to(compute_dtype).repeat_interleave(G, 1)
    v = v_BHkSD.to(compute_dtype).repeat_interleave(G, 1)
    mask_BHSS = allowed_mask(layout, doc_q_BSq, doc_k_BSk)
    score = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask_BHSS, -torch.inf)
    lse = torch.logsumexp(score, dim=-1)
    # a finite stand-in for empty rows keeps exp() and its gradient free of NaN
    safe_lse = torch.where(torch.isinf(lse), 0.0, lse)
    prob = torch.exp(score - safe_lse[..., None])
    return prob @ v, lse.float()
