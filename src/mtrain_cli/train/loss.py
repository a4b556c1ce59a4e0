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

from mtrain_cli.families import backbone, lm_head

IGNORE_INDEX = -100


def _loss_and_grad(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, with_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum of the chunk's token losses, d loss_sum / d logits in the logits' dtype or None): softmax in fp32 or
    wider."""
    dtype = logits_NV.dtype
    logits_NV = logits_NV.to(torch.promote_types(dtype, torch.float32))  # bf16 logits: fp32 softmax
    keep_N = labels_N != IGNORE_INDEX
    target_N = labels_N.clamp(min=0)  # an ignored row's target: any valid index, masked below
    lse_N = torch.logsumexp(logits_NV, dim=-1)
    target_logit_N = logits_NV.gather(1, target_N[:, None]).squeeze(1)
    loss_sum = torch.where(keep_N, lse_N - target_logit_N, 0.0).sum()
    if not with_grad:
        return loss_sum, None
    one_hot_NV = torch.arange(logits_NV.shape[1], device=logits_NV.device)[None, :] == target_N[:, None]
    grad_NV = (torch.exp(logits_NV - lse_N[:, None]) - one_hot_NV.to(logits_NV.dtype)) * keep_N[:, None]
    return loss_sum, grad_NV.to(dtype)


@functools.cache
def _compiled_loss_and_grad():
    return torch.compile(_loss_and_grad, dynamic=False)  # two shapes at most: full chunks and the last one


def _chunked(
    hidden_NH, weight_VH, labels_N, chunk_size: int, dtype: torch.dtype, compiled: bool, with_grad: bool,
    weight_grad: bool = True,
):  # fmt: skip
    """(loss sum, d/d hidden, d/d weight; both None without `with_grad`, the second also without `weight_grad`: a
    frozen LM head, LoRA), one chunk of logits at a time, the matmuls in `dtype`."""
    loss_and_grad = _compiled_loss_and_grad() if compiled else _loss_and_grad
    weight_c = weight_VH.to(dtype)
    accum_dtype = torch.promote_types(dtype, torch.float32)
    total = torch.zeros((), dtype=accum_dtype, device=hidden_NH.device)
    grad_hidden_NH = torch.empty_like(hidden_NH) if with_grad else None
    weight_grad = with_grad and weight_grad
    grad_weight_VH = torch.zeros(weight_VH.shape, dtype=accum_dtype, device=weight_VH.device) if weight_grad else None
    with torch.autocast(hidden_NH.device.type, enabled=False):  # dtypes are explicit here
        for start in range(0, hidden_NH.shape[0], chunk_size):
            chunk = slice(start, start + chunk_size)
            hidden_c = hidden_NH[chunk].to(dtype)
            loss_sum, grad_NV = loss_and_grad(hidden_c @ weight_c.T, labels_N[chunk], with_grad)
            total += loss_sum
            if with_grad:
                grad_hidden_NH[chunk] = grad_NV @ weight_c
                if weight_grad:
                    grad_weight_VH += grad_NV.T @ hidden_c
    return total, grad_hidden_NH, grad_weight_VH


class LinearCrossEntropy(torch.autograd.Function):
    """sum over labelled tokens of -log softmax(hidden @ weight.T)[label]; matmuls in `dtype` (autocast's)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, chunk_size: int, dtype: torch.dtype, compiled: bool):
        weight_grad = ctx.needs_input_grad[1]
        total, grad_hidden_NH, grad_weight_VH = _chunked(
            hidden_NH, weight_VH, labels_N, chunk_size, dtype, compiled, with_grad=True, weight_grad=weight_grad
        )
        ctx.save_for_backward(grad_hidden_NH, grad_weight_VH.to(weight_VH.dtype) if weight_grad else None)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden_NH, grad_weight_VH = ctx.saved_tensors
        grad_weight = grad_weight_VH * grad_total if grad_weight_VH is not None else None
        return grad_hidden_NH * grad_total, grad_weight, None, None, None, None


def chunked_cross_entropy(
    hidden_BSH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_BS: torch.Tensor,
    chunk_size: int,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, number of labelled tokens as a 0-d tensor); labels are already shifted, -100 is
    ignored. `compiled`: the softmax and gradient as fused kernels (torch.compile); a loss without gradients
    (validation) runs eager."""
    device_type = hidden_BSH.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden_BSH.dtype
    labels_N = labels_BS.reshape(-1)
    hidden_NH = hidden_BSH.reshape(-1, hidden_BSH.shape[-1])
    num_tokens = (labels_N != IGNORE_INDEX).sum()
    if torch.is_grad_enabled() and (hidden_NH.requires_grad or lm_head_weight_VH.requires_grad):
        total = LinearCrossEntropy.apply(hidden_NH, lm_head_weight_VH, labels_N, chunk_size, dtype, compiled)
    else:
        total, _, _ = _chunked(hidden_NH, lm_head_weight_VH, labels_N, chunk_size, dtype, False, with_grad=False)
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
        hidden_BSH = backbone(self.hf)(
            input_ids=input_ids, position_ids=position_ids, document_ids=document_ids, use_cache=False
        ).last_hidden_state
        weight_VH = lm_head(self.hf).weight
        return chunked_cross_entropy(hidden_BSH, weight_VH, labels, self.chunk_size, self.compiled)
