"""The context-parallel ring of one sequence: which ranks form it, how they split into nodes, and the process
groups its transfers and collectives use (inner: within a node; outer: across nodes). Ring attention
(attention/ring/) runs over it; the mesh (parallel/context.py) builds it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class RingTopology:
    """The context-parallel ring of one sequence: `world` ranks, global ranks base .. base + world - 1."""

    rank: int  # position in the ring (context-parallel rank)
    world: int
    node_size: int  # L: ranks per (real or declared) node
    base: int  # global rank of ring position 0
    group: dist.ProcessGroup | None  # the whole ring (collectives of pattern estimation)
    inner_group: dist.ProcessGroup | None  # this rank's node
    outer_group: dist.ProcessGroup | None  # the ranks with this rank's local index, one per node

    @property
    def num_nodes(self) -> int:
        return self.world // self.node_size

    @property
    def node(self) -> int:
        return self.rank // self.node_size

    @property
    def local(self) -> int:
        return self.rank % self.node_size

    def source(self, outer_step: int, inner_step: int) -> int:
        """Ring position whose K/V this rank holds at (outer step, inner step)."""
        L, N = self.node_size, self.num_nodes
        return ((self.node - outer_step) % N) * L + (self.local - inner_step) % L

    def inner_peers(self) -> tuple[int, int]:
        """(next, previous) global ranks in the node's ring."""
        L = self.node_size
        first = self.base + self.node * L
        return first + (self.local + 1) % L, first + (self.local - 1) % L

    def outer_peers(self) -> tuple[int, int]:
        L, N = self.node_size, self.num_nodes
        return self.base + ((self.node + 1) % N) * L + self.local, self.base + ((self.node - 1) % N) * L + self.local


def build_topology(node_size: int | None = None, ring_size: int | None = None) -> RingTopology:
    """Collective (every rank calls it, in the same order). Rings are consecutive global ranks: ring d is
    ranks d·ring_size .. (d+1)·ring_size - 1 (the context-parallel axis is the mesh's innermost)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    W = ring_size or world
    L = node_size or W
    if world % W or W % L:
        raise ValueError(f"{world} ranks do not split into rings of {W} and nodes of {L}")
    mine: dict[str, dist.ProcessGroup] = {}
    for base in range(0, world, W):  # new_group is collective: every rank creates every group
        ring = dist.new_group(list(range(base, base + W)))
        nodes = [dist.new_group(list(range(base + n * L, base + (n + 1) * L))) for n in range(W // L)]
        outers = [dist.new_group(list(range(base + local, base + W, L))) for local in range(L)]
        if base <= rank < base + W:
            position = rank - base
            mine = {"group": ring, "inner_group": nodes[position // L], "outer_group": outers[position % L]}
    return RingTopology(rank % W, W, L, rank - rank % W, **mine)
