"""The process's place in the run: one process, or a rank of a torchrun launch with a (dp, cp) mesh ("dp", "cp";
cp innermost so a ring is consecutive ranks, ideally one node) and the ring topology over each cp group
(parallel/topology.py). Values only: the set-up that reads the config and makes them is train/distributed.py; what
is applied to the model, in which order, train/parallelize.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtrain_cli.parallel.layouts import TokenLayout
from mtrain_cli.parallel.topology import RingTopology


@dataclass(frozen=True)
class ContextParallel:
    """A ring of context-parallel ranks, each holding its `layout` share (stripe or zigzag) of every sequence."""

    topology: RingTopology
    layout: str
    block: int

    def token_layout(self, seq_len: int) -> TokenLayout:
        """Which of a `seq_len`-token sequence's positions each rank holds."""
        return TokenLayout(self.layout, self.topology.world, self.block, seq_len)


@dataclass
class ParallelContext:
    world: int
    rank: int
    dp: int
    cp: int
    device: torch.device
    fsdp_mesh: object | None = None  # DeviceMesh over dp×cp (None in one process)
    topology: RingTopology | None = None  # the cp ring (None when cp = 1)
    layout: str = "stripe"
    block: int = 128

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def ring(self) -> ContextParallel | None:
        """The cp ring that attention runs over; None without context parallelism."""
        return ContextParallel(self.topology, self.layout, self.block) if self.topology is not None else None

    def token_layout(self, seq_len: int) -> TokenLayout:
        assert self.ring is not None, "a token layout is for context parallelism"
        return self.ring.token_layout(seq_len)

    def sum_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over every rank (in place, returned); identity in one process."""
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()
