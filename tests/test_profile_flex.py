"""The FlexAttention anchor of `mtrain profile kernels` computes exactly our layout's pairs, at any layout block."""

from __future__ import annotations

import pytest
import torch

from mtrain_cli.attention.documents import document_spans
from mtrain_cli.attention.sparse.layout import build_layout
from mtrain_cli.attention.sparse.reference import allowed_mask
from mtrain_cli.profile.flex import FLEX_BLOCK, block_masks, slash_blocks
from mtrain_cli.profile.synthetic import random_pattern


def dense_pairs(mask, S: int, H: int) -> torch.Tensor:
    """Element-level pairs a BlockMask visits: full blocks whole, partial blocks through its mask_mod."""
    out = torch.zeros(1, H, S, S, dtype=torch.bool)
    n = FLEX_BLOCK
    for h in range(H):
        for i in range(S // n):
            q_idx = torch.arange(i * n, (i + 1) * n)[:, None]
            for t in range(int(mask.kv_num_blocks[0, h, i])):
                j = int(mask.kv_indices[0, h, i, t])
                out[0, h, i * n : (i + 1) * n, j * n : (j + 1) * n] |= mask.mask_mod(
                    0, h, q_idx, torch.arange(j * n, (j + 1) * n)[None, :]
                )
            for t in range(int(mask.full_kv_num_blocks[0, h, i])):
                j = int(mask.full_kv_indices[0, h, i, t])
                out[0, h, i * n : (i + 1) * n, j * n : (j + 1) * n] = True
    return out


@pytest.mark.parametrize("block", [32, 64, 128])
def test_flex_masks_are_the_layout_pairs(block):
    S, H = 1024, 2
    pattern = random_pattern(1, H, S, 12, 2, 32, torch.device("cpu"))  # few slashes: vertical-only blocks
    doc = torch.zeros(1, S, dtype=torch.int32)
    start, length = document_spans(doc)
    layout = build_layout(pattern, start, length, S, block, 0)
    masks = block_masks(layout)
    assert torch.equal(dense_pairs(masks["exact"], S, H), allowed_mask(layout, doc, doc))
    slash_BHSS = slash_blocks(layout).repeat_interleave(block, 2).repeat_interleave(block, 3)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    assert torch.equal(dense_pairs(masks["slash_only"], S, H), slash_BHSS & causal)
