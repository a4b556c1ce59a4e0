"""The one attention function mtrain registers with transformers' `AttentionInterface`.

HF models call it in place of SDPA/flash for every layer; the model code stays single-device and
unpatched. Packed batches pass `document_ids` [B, S] through the model's forward kwargs; the mask is
built here from them (transformers builds no mask for us: our mask function returns None).
Every call is counted by path, so a run's summary states which attention actually ran.
"""

from __future__ import annotations

from collections import Counter

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from mtrain_cli.attention.dense import dense_attention

ATTENTION_NAME = "mtrain"
_calls_by_path: Counter[str] = Counter()


def mtrain_attention(module: torch.nn.Module, query_BHSD: torch.Tensor, key_BHkSD: torch.Tensor,
                     value_BHkSD: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, document_ids: torch.Tensor | None = None, **_) -> tuple[torch.Tensor, None]:
    """-> (output [B, S, H, D], None): the shape and contract of transformers' attention functions."""
    assert attention_mask is None, "mtrain masks by document_ids; transformers must not pass a mask"
    assert dropout == 0.0, "attention dropout is not supported"
    scale = scaling if scaling is not None else query_BHSD.shape[-1] ** -0.5
    out_BHSD = dense_attention(query_BHSD, key_BHkSD, value_BHkSD, document_ids, scale)
    _calls_by_path["dense"] += 1
    return out_BHSD.transpose(1, 2).contiguous(), None


def _no_mask(*_, **__) -> None:
    return None


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, mtrain_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def attention_calls() -> dict[str, int]:
    """How many attention calls each path served since the process started."""
    return dict(_calls_by_path)
