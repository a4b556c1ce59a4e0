"""Chunked cross-entropy: sequence × vocab logits are never materialised.

At 128K tokens and a 150K vocabulary the full logits would be tens of GB. We apply the LM head to
`chunk_size` tokens at a time under activation checkpointing, so one chunk's logits exist at once in
forward and in backward. Returns the summed loss and the token count so the caller can average per
token across micro-batches and documents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    logits_NV = F.linear(hidden_NH, weight_VH)
    logits_NV = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))  # bf16 logits: fp32 softmax
    return F.cross_entropy(logits_NV, labels_N, reduction="sum")


def chunked_cross_entropy(
    hidden_BSH: torch.Tensor, lm_head_weight_VH: torch.Tensor, labels_BS: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, int]:
    """(sum of token losses, number of labelled tokens); labels are already shifted, -100 is ignored."""
    labels_N = labels_BS.reshape(-1)
    keep_N = labels_N != IGNORE_INDEX
    hidden_NH = hidden_BSH.reshape(-1, hidden_BSH.shape[-1])[keep_N]
    labels_N = labels_N[keep_N]
    num_tokens = int(labels_N.numel())
    total = hidden_BSH.new_zeros((), dtype=torch.float32)
    for start in range(0, num_tokens, chunk_size):
        stop = start + chunk_size
        total = total + checkpoint(
            _chunk_loss_sum, hidden_NH[start:stop], lm_head_weight_VH, labels_N[start:stop], use_reentrant=False
        )
    return total, num_tokens


class ChunkedLossModel(torch.nn.Module):
    """The HF model plus the chunked loss, as one module: FSDP2's root wraps this, so the embedding, the final
    norm and the (tied) LM head are gathered for the whole forward, loss included, and again in backward."""

    def __init__(self, hf_model: torch.nn.Module, chunk_size: int):
        super().__init__()
        self.hf = hf_model
        self.chunk_size = chunk_size

    def forward(self, input_ids, position_ids, document_ids, labels) -> tuple[torch.Tensor, int]:
        hidden_BSH = self.hf.model(
            input_ids=input_ids, position_ids=position_ids, document_ids=document_ids, use_cache=False
        ).last_hidden_state
        return chunked_cross_entropy(hidden_BSH, self.hf.get_output_embeddings().weight, labels, self.chunk_size)
