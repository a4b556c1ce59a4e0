"""One (query chunk, key chunk) step of sparse attention, as the ring calls it: merge-forward and
accumulate-backward, by the Triton kernels or by plain torch on the same layout. mask_bounds: the pair's
kernels.tile_mask_bounds, made once per batch by the ring plan (the Triton launchers make them when not given).

forward: merge this key chunk's partial result into fp32 (out, lse) in place.
backward: given the rows' *final* lse and delta = rowsum(dO ∘ O), add this chunk's dQ into dq and its dK, dV
into dk, dv (all fp32, in place). The torch version builds the dense mask from the layout (O(Sq·Sk)
memory: CPU runs and tests); it is the same arithmetic as the kernels, not autograd through a softmax.
"""

from __future__ import annotations

import torch

from mtrain_cli.attention.sparse.engine import Engine
from mtrain_cli.attention.sparse.kernels import MaskBounds
from mtrain_cli.attention.sparse.kernels_bwd import attention_delta, sparse_backward
from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
from mtrain_cli.attention.sparse.layout import BlockLayout
from mtrain_cli.attention.sparse.reference import allowed_mask


def merge_partial(
    out_BHSD: torch.Tensor, lse_BHS: torch.Tensor, part_BHSD: torch.Tensor, part_lse_BHS: torch.Tensor
) -> None:
    """out, lse <- merge by LSE, in place (fp32, sigmoid form: finite for any gap; empty stays empty)."""
    both_empty = torch.isinf(lse_BHS) & torch.isinf(part_lse_BHS)
    diff = torch.where(both_empty, 0.0, part_lse_BHS - lse_BHS)
    out_BHSD.add_(torch.sigmoid(diff)[..., None] * (part_BHSD - out_BHSD))
    merged = torch.maximum(lse_BHS, part_lse_BHS) + torch.nn.functional.softplus(-diff.abs())
    lse_BHS.copy_(torch.where(both_empty, -torch.inf, merged))


def _scores(q_BHSD, k_BHkSD, mask, scale):
    G = q_BHSD.shape[1] // k_BHkSD.shape[1]
    score = (q_BHSD.float() @ k_BHkSD.float().repeat_interleave(G, 1).transpose(-1, -2)) * scale
    return score if mask is None else score.masked_fill(~mask, -torch.inf)


def masked_forward(q_BHSD, k_BHkSD, v_BHkSD, mask, scale: float, out_BHSD, lse_BHS) -> None:
    """Plain torch: merge softmax(q·kᵀ·scale, where `mask`) · v into fp32 (out, lse). mask: bool, broadcast to
    [B, H, Sq, Sk], or None (every key)."""
    G = q_BHSD.shape[1] // k_BHkSD.shape[1]
    score = _scores(q_BHSD, k_BHkSD, mask, scale)
    part_lse = torch.logsumexp(score, -1)
    prob = torch.exp(score - torch.where(torch.isinf(part_lse), 0.0, part_lse)[..., None])
    merge_partial(out_BHSD, lse_BHS, prob @ v_BHkSD.float().repeat_interleave(G, 1), part_lse)


def masked_backward(q_BHSD, k_BHkSD, v_BHkSD, lse_BHS, dout_BHSD, delta_BHS, mask, scale: float, grads) -> None:
    """Plain torch: add this key chunk's dQ, dK, dV into grads (fp32), given the rows' final lse and delta."""
    dq, dk, dv = grads
    B, H, _Sq, D = q_BHSD.shape
    G = H // k_BHkSD.shape[1]
    score = _scores(q_BHSD, k_BHkSD, mask, scale)
    final = torch.where(torch.isinf(lse_BHS), torch.inf, lse_BHS)  # rows with no key anywhere: P = 0
    prob = torch.exp(score - final[..., None])
    do = dout_BHSD.float()
    dv.add_((prob.transpose(-1, -2) @ do).view(B, -1, G, prob.shape[-1], D).sum(2))
    dp = do @ v_BHkSD.float().repeat_interleave(G, 1).transpose(-1, -2)
    ds = prob * (dp - delta_BHS[..., None])
    dq.add_(ds @ k_BHkSD.float().repeat_interleave(G, 1) * scale)
    dk.add_((ds.transpose(-1, -2) @ q_BHSD.float() * scale).view(B, -1, G, prob.shape[-1], D).sum(2))


def chunk_forward(
    engine: Engine,
    q_BHSD,
    k_BHkSD,
    v_BHkSD,
    layout: BlockLayout,
    doc_q_BSq,
    doc_k_BSk,
    scale: float,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    mask_bounds: MaskBounds | None = None,
) -> None:
    if engine == "triton":
        sparse_forward(
            q_BHSD, k_BHkSD, v_BHkSD, layout, doc_q_BSq, doc_k_BSk, scale, out_BHSD, lse_BHS, mask_bounds=mask_bounds
        )
        return
    mask = allowed_mask(layout, doc_q_BSq, doc_k_BSk)
    masked_forward(q_BHSD, k_BHkSD, v_BHkSD, mask, scale, out_BHSD, lse_BHS)


def row_delta(engine: Engine, out_BHSD: torch.Tensor, dout_BHSD: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dO ∘ O) in fp32 of the rows' final output, once per backward."""
    if engine == "triton":
        return attention_delta(out_BHSD, dout_BHSD)
    return (dout_BHSD.float() * out_BHSD.float()).sum(-1)


def chunk_backward(
    engine: Engine,
    q_BHSD,
    k_BHkSD,
    v_BHkSD,
    out_BHSD,
    lse_BHS,
    dout_BHSD,
    delta_BHS,
    layout: BlockLayout,
    doc_q_BSq,
    doc_k_BSk,
    scale: float,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask_bounds: MaskBounds | None = None,
) -> None:
    if engine == "triton":
        sparse_backward(
            q_BHSD,
            k_BHkSD,
            v_BHkSD,
            out_BHSD,
            lse_BHS,
            dout_BHSD,
            layout,
            doc_q_BSq,
            doc_k_BSk,
            scale,
            grads=grads,
            delta_BHS=delta_BHS,
            mask_bounds=mask_bounds,
        )
        return
    mask = allowed_mask(layout, doc_q_BSq, doc_k_BSk)
    masked_backward(q_BHSD, k_BHkSD, v_BHkSD, lse_BHS, dout_BHSD, delta_BHS, mask, scale, grads)
