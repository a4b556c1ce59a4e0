"""The one attention function mtrain registers with transformers' `AttentionInterface` (name ATTENTION_NAME).

HF models call it in place of SDPA/flash for every layer; the model code stays single-device and
unpatched. It hands each call to the attention router entered around the forward (router.py), which decides
what runs. Packed batches pass `document_ids` [B, S] through the model's forward kwargs; every path masks by
them without ever building an [S, S] mask (transformers builds none for us: our mask function returns None).
"""

from __future__ import annotations

import torch

from mtrain_cli.attention.router import active_router
from mtrain_cli.errors import UserError

ATTENTION_NAME = "mtrain"


def mtrain_attention(
    module: torch.nn.Module,
    query_BHSD: torch.Tensor,
    key_BHkSD: torch.Tensor,
    value_BHkSD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **_,
) -> tuple[torch.Tensor, None]:
    """-> (output [B, S, H, D], None): the shape and contract of transformers' attention functions."""
    router = active_router()
    if sliding_window is not None and key_BHkSD.shape[2] > sliding_window:
        raise UserError(
            f"the model's attention uses a sliding_window of {sliding_window:,} tokens and this sequence has "
            f"{key_BHkSD.shape[2]:,}; mtrain's attention is full causal, so it would compute another model: use "
            f"--attention dense or a checkpoint with sliding_window null"
        )
    assert attention_mask is None, "mtrain masks by document_ids; transformers must not pass a mask"
    assert dropout == 0.0, "attention dropout is not supported"
    # Every path (SDPA, FlexAttention, the Triton kernels, the ring) takes q/k/v in one dtype. Under autocast
    # transformers' rotary step leaves q/k in fp32 while v comes from the projection in the autocast dtype:
    # compute in the autocast dtype then (the output, and so the incoming gradient, follow it).
    dtype = compute_dtype(query_BHSD)
    query_BHSD, key_BHkSD, value_BHkSD = (t.to(dtype) for t in (query_BHSD, key_BHkSD, value_BHkSD))
    with torch.profiler.record_function("mtrain.attention"):  # the attention phase of `mtrain profile step`
        out_BHSD = router.attention(
            module,
            query_BHSD,
            key_BHkSD,
            value_BHkSD,
            document_ids,
            scaling if scaling is not None else query_BHSD.shape[-1] ** -0.5,
        )
    return out_BHSD.transpose(1, 2).contiguous(), None


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for the query's device, else the query's own dtype."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return query.dtype


def _no_mask(*_, **__) -> None:
    return None


def register_attention() -> None:
    """Before a model is built with attn_implementation=ATTENTION_NAME. transformers' registries are imported
    here: they pull in torch._dynamo and with it Triton, which importing mtrain's model code must not."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, mtrain_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
