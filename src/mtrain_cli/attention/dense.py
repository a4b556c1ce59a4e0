"""Dense causal attention with per-document masking (packed sequences), through PyTorch SDPA.

The reference and CPU path for training; tokens attend only to earlier tokens of their own document.
Padding tokens carry document id -1 and attend among themselves, so no row is empty (no NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_causal_mask(document_ids_BSk: torch.Tensor, num_queries: int) -> torch.Tensor:
    """Boolean mask [B, 1, Sq, Sk], True where attention is allowed.

    The queries are the last Sq of the Sk keys (bottom-right aligned, as with a KV cache)."""
    num_keys = document_ids_BSk.shape[1]
    device = document_ids_BSk.device
    q_pos_Sq = torch.arange(num_keys - num_queries, num_keys, device=device)
    causal_SqSk = torch.arange(num_keys, device=device)[None, :] <= q_pos_Sq[:, None]
    same_doc_BSqSk = document_ids_BSk[:, -num_queries:, None] == document_ids_BSk[:, None, :]
    return (causal_SqSk[None] & same_doc_BSqSk)[:, None]


def dense_attention(q_BHSD: torch.Tensor, k_BHkSD: torch.Tensor, v_BHkSD: torch.Tensor,
                    document_ids_BS: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Causal (document-masked when ids are given) attention; GQA without repeating K/V. -> [B, H, Sq, D]."""
    num_queries, num_keys = q_BHSD.shape[2], k_BHkSD.shape[2]
    gqa = q_BHSD.shape[1] != k_BHkSD.shape[1]
    if document_ids_BS is None and num_queries == num_keys:
        return F.scaled_dot_product_attention(q_BHSD, k_BHkSD, v_BHkSD, is_causal=True, scale=scale, enable_gqa=gqa)
    if document_ids_BS is None:
        document_ids_BS = torch.zeros(q_BHSD.shape[0], num_keys, dtype=torch.long, device=q_BHSD.device)
    assert document_ids_BS.shape[1] == num_keys, "document ids must cover every key"
    mask_B1SqSk = document_causal_mask(document_ids_BS, num_queries)
    return F.scaled_dot_product_attention(q_BHSD, k_BHkSD, v_BHkSD, attn_mask=mask_B1SqSk, scale=scale,
                                          enable_gqa=gqa)
