"""MTraining's density count (profile/mtraining_density.py): slashes as unaligned tiles, merged as MInference does."""

from __future__ import annotations

import torch

from mtrain_cli.attention.sparse.layout import build_layout
from mtrain_cli.attention.sparse.pattern import SENTINEL, Pattern, document_spans
from mtrain_cli.profile.mtraining_density import mtraining_density, unaligned_slash_tiles

BLOCK = 16


def _slashes(*offsets: int) -> torch.Tensor:
    return torch.tensor(list(offsets) + [SENTINEL, SENTINEL], dtype=torch.int32)


def test_unaligned_tiles_by_hand():
    assert unaligned_slash_tiles(_slashes(40), BLOCK) == [56]  # one tile, where the aligned layout takes two blocks
    assert unaligned_slash_tiles(_slashes(40, 30), BLOCK) == [40, 56]  # within a block past the run: extends it
    assert unaligned_slash_tiles(_slashes(40, 20), BLOCK) == [36, 56]  # more than a block past: a new run
    assert unaligned_slash_tiles(_slashes(45, 50), BLOCK) == [50, 66]
    assert unaligned_slash_tiles(_slashes(40, 45, 50), BLOCK) == [50, 66]  # 40 is inside that run: nothing more
    assert unaligned_slash_tiles(_slashes(*range(0, 20)), BLOCK) == [3, 19, 35]  # the local window: three tiles
    assert unaligned_slash_tiles(_slashes(), BLOCK) == []


def _tiles_by_rows(slash_L: torch.Tensor, num_q_blocks: int) -> int:
    """Oracle: each query block's runs of key ranges built from its own keys, MInference's way (slashes in
    decreasing offset, a run extended by a block when the next range starts within a block past its end)."""
    offsets = sorted({int(d) for d in slash_L[slash_L < SENTINEL]}, reverse=True)
    total = 0
    for m in range(num_q_blocks):
        row_end = (m + 1) * BLOCK
        runs, start, end = [], None, None
        for d in offsets:
            first = row_end - d - BLOCK  # the slash's first key in this query block
            if end is None:
                start, end = first, first + BLOCK
            elif first > end:
                runs.append((start, end))
                start, end = first, first + BLOCK
            elif first + BLOCK > end:
                end += BLOCK
        if end is not None:
            runs.append((start, end))
        total += sum(1 for s, e in runs for tile in range(s, e, BLOCK) if tile + BLOCK > 0)
    return total


def test_density_counts_unaligned_tiles_and_equals_ours_on_block_multiples():
    S, H = 48 * BLOCK, 3
    gen = torch.Generator().manual_seed(0)
    doc = torch.zeros(1, S, dtype=torch.int32)
    start, length = document_spans(doc)
    vertical = torch.full((1, H, 1), SENTINEL, dtype=torch.int32)
    random_slash = torch.stack([torch.cat([torch.arange(4), torch.randperm(S - 4, generator=gen)[:6] + 4]).sort().values
                                for _ in range(H)])[None].int()
    on_blocks = (torch.arange(0, S, 3 * BLOCK).expand(1, H, -1)).int().contiguous()
    for slash, same in ((random_slash, False), (on_blocks, True)):
        pattern = Pattern(vertical_BHV=vertical, slash_BHL=slash)
        layout = build_layout(pattern, start, length, S, BLOCK, dense_below=0)
        ours = float(layout.density())
        want = sum(_tiles_by_rows(slash[0, h], S // BLOCK) for h in range(H)) / H / layout.causal_blocks()
        got = mtraining_density(pattern, layout)
        assert abs(got - want) < 1e-6, (got, want)  # fp32 means
        assert abs(got - ours) < 1e-6 if same else got < 0.9 * ours  # slashes off the block grid: fewer tiles
