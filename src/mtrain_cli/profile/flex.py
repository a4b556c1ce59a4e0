"""FlexAttention block masks for a vertical-slash layout: the comparison the kernel benchmark runs against.

`exact`: slash blocks below the diagonal as full blocks; the diagonal block and every block holding a
vertical column (outside the slash blocks) as partial blocks, with a mask_mod that keeps causal pairs on a
slash block or a vertical column. `slash_only`: the same slash blocks, verticals dropped. Flex runs its own
128-wide blocks; a finer layout (block 64) makes partial the Flex blocks it covers only in part. Built straight
from the layout's row-major fields (no dense S x S mask is ever evaluated). Causal self-attention over one
document per row, as in the benchmark.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from mtrain_cli.attention.sparse import BlockLayout


def slash_blocks(layout: BlockLayout) -> torch.Tensor:
    """Bool [B, H, NQ, NK]: the key blocks each query block computes through its slash (and dense) range."""
    B, H, nq, _ = layout.row_BHM6.shape
    nk = layout.num_k_blocks
    row = layout.row_BHM6.long()
    rows_M = torch.arange(nq, device=row.device)
    t_L = torch.arange(layout.delta_BHL.shape[-1], device=row.device)
    in_slice_BHML = (t_L >= row[..., 0, None]) & (t_L < row[..., 1, None])
    j_BHML = torch.where(in_slice_BHML, rows_M[:, None] - layout.delta_BHL.long()[:, :, None, :], nk)
    blocks_BHMN = torch.zeros(B, H, nq, nk + 1, dtype=torch.bool, device=row.device)
    blocks_BHMN.scatter_(3, j_BHML, True)
    cols_N = torch.arange(nk, device=row.device)
    dense_BHMN = (cols_N >= row[..., 2, None]) & (cols_N < row[..., 3, None])
    return blocks_BHMN[..., :nk] | dense_BHMN


def _indices(mask_BHMN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    counts = mask_BHMN.sum(-1, dtype=torch.int32)
    order = torch.argsort(mask_BHMN.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, order


FLEX_BLOCK = 128  # FlexAttention's own tile; a finer layout is described at this size with an exact mask_mod


def block_masks(layout: BlockLayout) -> dict[str, BlockMask]:
    """{"exact": ..., "slash_only": ...} for the layout's pattern (q_offset = k_offset = 0), in FLEX_BLOCK blocks:
    a Flex block is full when every layout block inside it is a slash block below the diagonal, and partial when
    it holds any slash block or vertical column on or below the diagonal; the mask_mod keeps the exact pairs."""
    assert layout.q_offset == 0 and layout.k_offset == 0 and layout.stride == 1 and layout.q_len == layout.k_len
    blk, S = layout.block, layout.k_len
    assert FLEX_BLOCK % blk == 0 and S % FLEX_BLOCK == 0, "benchmark lengths are whole Flex blocks"
    B, H = layout.row_BHM6.shape[:2]
    f, n = FLEX_BLOCK // blk, S // FLEX_BLOCK
    device = layout.row_BHM6.device
    slash_BHMN = slash_blocks(layout)
    slash_coarse_BHMfNf = slash_BHMN.view(B, H, n, f, n, f)
    slash_any_BHMN = slash_coarse_BHMfNf.any(3).any(-1)
    slash_all_BHMN = slash_coarse_BHMfNf.all(3).all(-1)
    rows_M = torch.arange(n, device=device)
    below_MN = rows_M[None, :] < rows_M[:, None]
    causal_MN = rows_M[None, :] <= rows_M[:, None]

    is_vertical_BHS = torch.zeros(B, H, S + 1, dtype=torch.bool, device=device)
    is_vertical_BHS.scatter_(2, layout.vcol_BHV.long().clamp(max=S), True)
    is_vertical_BHS = is_vertical_BHS[..., :S].contiguous()
    vertical_block_BHN = is_vertical_BHS.view(B, H, n, FLEX_BLOCK).any(-1)

    def exact_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (slash_BHMN[b, h, q_idx // blk, kv_idx // blk] | is_vertical_BHS[b, h, kv_idx])

    def slash_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & slash_BHMN[b, h, q_idx // blk, kv_idx // blk]

    full_BHMN = slash_all_BHMN & below_MN
    exact_partial = (slash_any_BHMN | vertical_block_BHN[:, :, None, :]) & causal_MN & ~full_BHMN
    slash_partial = slash_any_BHMN & causal_MN & ~full_BHMN
    masks = {}
    full_num, full_idx = _indices(full_BHMN)
    for name, partial, mod in (("exact", exact_partial, exact_mod), ("slash_only", slash_partial, slash_mod)):
        num, idx = _indices(partial)
        masks[name] = BlockMask.from_kv_blocks(
            num, idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mod, seq_lengths=(S, S)
        )
    return masks
