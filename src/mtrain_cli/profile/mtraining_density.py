"""Density as MTraining counts it: slashes as unaligned key tiles (MInference's index conversion).

For query block m and a slash at offset d, our layout computes the aligned key blocks that the slash's keys
(m·block - d .. m·block + block - 1 - d) fall in: two, unless d is a multiple of the block. MTraining's kernels
take their blocks from MInference's index conversion instead: one block-wide tile starting at the slash's first
key, and a slash whose first key lies within one block past a run's end extends the run by one tile. A pattern
MTraining reports as "x% of causal blocks" is presumably counted in those tiles, so the same pattern reads about
a fifth sparser there than in our density (bench/results/sparse_kernels_h100.md); `profile kernels` reports both.
"""

from __future__ import annotations

import torch

from mtrain_cli.attention.sparse.layout import BlockLayout
from mtrain_cli.attention.sparse.pattern import SENTINEL, Pattern


def unaligned_slash_tiles(slash_L: torch.Tensor, block: int) -> list[int]:
    """Sorted tile offsets of one head's slashes: a tile at offset o covers keys row_end - o .. row_end - o +
    block - 1 of the query block that ends (exclusive) at row_end, the same for every query block. Slashes are
    taken in decreasing offset: one inside the current run adds nothing, one whose first key is within a block
    past the run's end extends the run by a tile, any later one starts a new run."""
    offsets: list[int] = []
    run_start = run_end = None  # the run covers keys row_end - run_start .. row_end - run_end - 1
    for d in sorted({int(x) for x in slash_L[slash_L < SENTINEL].tolist()}, reverse=True):
        if run_end is not None and d >= run_end:
            continue
        if run_end is not None and d >= run_end - block:
            run_end -= block
            continue
        if run_end is not None:
            offsets += range(run_start, run_end, -block)
        run_start, run_end = d + block, d
    if run_end is not None:
        offsets += range(run_start, run_end, -block)
    return sorted(offsets)


def mtraining_density(pattern: Pattern, layout: BlockLayout) -> float:
    """Share of causal blocks in MTraining's count: each query block's unaligned slash tiles that hold a key at 0
    or later, plus the layout's dense blocks and its vertical columns outside slash blocks (1/block each, as in
    `BlockLayout.active_blocks`), over causal blocks; mean over batch rows and heads. One chunk (no ring offsets)."""
    block, nq = layout.block, layout.num_q_blocks
    row = layout.row_BHM6.long().cpu()
    aligned_BH = (row[..., 1] - row[..., 0]).sum(-1)
    others_BH = layout.active_blocks().cpu() - aligned_BH  # dense blocks and verticals, the same in both counts
    row_last_key_M = (torch.arange(nq) + 2) * block - 1  # a tile at offset o starts at key (m + 1)·block - o
    B, H = aligned_BH.shape
    tiles_BH = torch.zeros(B, H)
    slash_BHL = pattern.slash_BHL.cpu()
    for b in range(B):
        for h in range(H):
            offsets = torch.tensor(unaligned_slash_tiles(slash_BHL[b, h], block), dtype=torch.long)
            reads_M = torch.searchsorted(offsets, row_last_key_M, right=True)
            tiles_BH[b, h] = float(torch.where(row[b, h, :, 1] > row[b, h, :, 0], reads_M, 0).sum())
    return float(((tiles_BH + others_BH).mean() / max(layout.causal_blocks(), 1)))
