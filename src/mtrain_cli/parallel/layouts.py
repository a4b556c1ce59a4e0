"""Token layouts for context parallelism, applied once to each micro-batch as a step is fed (train/batch_upload.py).

- stripe: global block j (of `block` tokens) goes to rank j mod W. Every rank, at every ring step, sees a
  statistically similar slice of a shift-invariant (vertical-slash) pattern, so sparse work balances.
- zigzag: the sequence is cut into 2W chunks; rank r holds chunks r and 2W-1-r, which balances *dense*
  causal work.
Input ids, labels, position ids and document ids are permuted together; every non-attention op is
token-wise, so the model runs in the permuted order unchanged and the summed loss equals the unpermuted
one. Lengths that do not divide are padded with masked tokens (labels -100, document id -1) and reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mtrain_cli.parallel.sizes import layout_unit

Layout = Literal["stripe", "zigzag"]
PAD_DOCUMENT = -1
IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenLayout:
    kind: Layout
    world: int
    block: int
    seq_len: int  # padded global length

    @property
    def local_len(self) -> int:
        return self.seq_len // self.world

    def positions(self, rank: int) -> torch.Tensor:
        """Global token positions rank `rank` holds, in its local order."""
        if self.kind == "stripe":
            blocks = torch.arange(rank, self.seq_len // self.block, self.world)
            return (blocks[:, None] * self.block + torch.arange(self.block)).reshape(-1)
        chunk = self.seq_len // (2 * self.world)
        return torch.cat(
            [
                torch.arange(rank * chunk, (rank + 1) * chunk),
                torch.arange((2 * self.world - 1 - rank) * chunk, (2 * self.world - rank) * chunk),
            ]
        )

    def permutation(self) -> torch.Tensor:
        """[W * local_len]: global positions in rank-major order (rank 0's tokens, then rank 1's, ...)."""
        return torch.cat([self.positions(r) for r in range(self.world)])


def padded_length(seq_len: int, kind: Layout, world: int, block: int) -> int:
    """Smallest length >= seq_len that the layout splits into whole blocks per rank (zigzag: per chunk)."""
    unit = layout_unit(kind, world, block)
    return -(-seq_len // unit) * unit


def shard_batch(batch: dict[str, torch.Tensor], layout: TokenLayout, rank: int) -> dict[str, torch.Tensor]:
    """This rank's share of a [B, S] batch (input_ids, labels, position_ids, document_ids), padded first."""
    pad = layout.seq_len - batch["input_ids"].shape[1]
    if pad < 0:
        raise ValueError(f"batch of {batch['input_ids'].shape[1]} tokens exceeds the layout's {layout.seq_len}")
    fill = {"input_ids": 0, "labels": IGNORE_INDEX, "position_ids": 0, "document_ids": PAD_DOCUMENT}
    index = layout.positions(rank)
    out = {}
    for name, tensor in batch.items():
        if pad:
            tensor = torch.nn.functional.pad(tensor, (0, pad), value=fill[name])
        out[name] = tensor[:, index.to(tensor.device)]
    return out
