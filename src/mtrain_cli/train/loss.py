"""Linear cross-entropy in chunks, gradients computed in the forward: sequence × vocab logits never exist.

At 128K tokens and a 150K vocabulary the full logits would be tens of GB. We apply the LM head to `chunk_size`
tokens at a time. For each chunk the forward computes the token losses and, when a backward will follow, the
chunk's gradients too (softmax − one-hot, through the LM head into the hidden states and the head's weight), so
one chunk's logits exist at once and nothing is recomputed; the backward only scales the stored gradients by the
incoming one. This is the fused linear cross-entropy of Liger and Apple's cut-cross-entropy, chunked in PyTorch:
3 GEMMs a chunk instead of the 4 of activation checkpointing, and with `compiled` the softmax, loss and
gradient are three fused kernels over the bf16 logits instead of ~15 passes over fp32 copies. Labels of -100 are
masked, not gathered out, so the step never waits on the device for their count.

Returns the summed loss and the labelled-token count (a 0-d tensor) so the caller can average per token across
micro-batches and documents.
"""

from __future__ import annotations

import functools

import torch

IGNORE_INDEX = -100


def _losses_and_grad(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the chunk's token losses, d loss_sum / d logits in the logits' dtype): softmax in fp32 or wider."""
    dtype = logits_NV.dtype
    logits_NV = logits_NV.to(_softmax_dtype(dtype))
    keep_N = labels_N != IGNORE_INDEX
    target_N = labels_N.clamp(min=0)  # an ignored row's target: any valid index, masked below
    lse_N = torch.logsumexp(logits_NV, dim=-1)
    target_logit_N = logits_NV.gather(1, target_N[:, None]).squeeze(1)
    loss_sum = torch.where(keep_N, lse_N - target_logit_N, 0.0).sum()
    one_hot_NV = torch.arange(logits_NV.shape[1], device=logits_NV.device)[None, :] == target_N[:, None]
    grad_NV = (torch.exp(logits_NV - lse_N[:, None]) - one_hot_NV.to(logits_NV.dtype)) * keep_N[:, None]
    return loss_sum, grad_NV.to(dtype)


def _losses(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """The loss alone, when no gradient is asked for (validation)."""
    logits_NV = logits_NV.to(_softmax_dtype(logits_NV.dtype))
    keep_N = labels_N != IGNORE_INDEX
    lse_N = torch.logsumexp(logits_NV, dim=-1)
    target_logit_N = logits_NV.gather(1, labels_N.clamp(min=0)[:, None]).squeeze(1)
    return torch.where(keep_N, lse_N - target_logit_N, 0.0).sum()


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # bf16 logits: fp32 softmax; fp64 stays fp64


@functools.cache
def _compiled_losses_and_grad():
    return torch.compile(_losses_and_grad, dynamic=False)  # two shapes at most: full chunks and the last one


class LinearCrossEntropy(torch.autograd.Function):
    """sum over labelled tokens of -log softmax(hidden @ weight.T)[label]; matmuls in `dtype` (autocast's)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, chunk_size: int, dtype: torch.dtype, compiled: bool):
        losses_and_grad = _compiled_losses_and_grad() if compiled else _losses_and_grad
        weight_c = weight_VH.to(dtype)
        total = torch.zeros((), dtype=_softmax_dtype(dtype), device=hidden_NH.device)
        grad_hidden_NH = torch.empty_like(hidden_NH)
        grad_weight_VH = torch.zeros(weight_VH.shape, dtype=_softmax_dtype(dtype), device=weight_VH.device)
        with torch.autocast(hidden_NH.device.type, enabled=False):  # dtypes are explicit here
            for start in range(0, hidden_NH.shape[0], chunk_size):
                chunk = slice(start, start + chunk_size)
                hidden_c = hidden_NH[chunk].to(dtype)
                loss_sum, grad_NV = losses_and_grad(hidden_c @ weight_c.T, labels_N[chunk])
                total += loss_sum
                grad_hidden_NH[chunk] = grad_NV @ weight_c
                grad_weight_VH += grad_NV.T @ hidden_c
        ctx.save_for_backward(grad_hidden_NH, grad_weight_VH.to(weight_VH.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden_NH, grad_weight_VH = ctx.saved_tensors
        return grad_hidden_NH * grad_total, grad_weight_VH * grad_total, None, None, None, None


def chunked_cross_entropy(
    hidden_BSH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_BS: torch.Tensor,
    chunk_size: int,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, number of labelled tokens as a 0-d tensor); labels are already shifted, -100 is
    ignored. `compiled`: the softmax and gradient as fused kernels (torch.compile)."""
    device_type = hidden_BSH.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden_BSH.dtype
    labels_N = labels_BS.reshape(-1)
    hidden_NH = hidden_BSH.reshape(-1, hidden_BSH.shape[-1])
    num_tokens = (labels_N != IGNORE_INDEX).sum()
    if torch.is_grad_enabled() and (hidden_NH.requires_grad or lm_head_weight_VH.requires_grad):
        total = LinearCrossEntropy.apply(hidden_NH, lm_head_weight_VH, labels_N, chunk_size, dtype, compiled)
        return total, num_tokens
    total = hidden_NH.new_zeros((), dtype=_softmax_dtype(dtype))
    with torch.autocast(device_type, enabled=False):
        weight_c = lm_head_weight_VH.to(dtype)
        for start in range(0, hidden_NH.shape[0], chunk_size):
            chunk = slice(start, start + chunk_size)
            total += _losses(hidden_NH[chunk].to(dtype) @ weight_c.T, labels_N[chunk])
    return total, num_tokens


class ChunkedLossModel(torch.nn.Module):
    """The HF model plus the chunked loss, as one module: FSDP2's root wraps this, so the embedding, the final
    norm and the (tied) LM head are gathered for the whole forward, loss included, and again in backward."""

    def __init__(self, hf_model: torch.nn.Module, chunk_size: int, compiled: bool = False):
        super().__init__()
        self.hf = hf_model
        self.chunk_size = chunk_size
        self.compiled = compiled

    def forward(self, input_ids, position_ids, document_ids, labels) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_BSH = self.hf.model(
            input_ids=input_ids, position_ids=position_ids, document_ids=document_ids, use_cache=False
        ).last_hidden_state
        weight_VH = self.hf.get_output_embeddings().weight
        return chunked_cross_entropy(hidden_BSH, weight_VH, labels, self.chunk_size, self.compiled)
