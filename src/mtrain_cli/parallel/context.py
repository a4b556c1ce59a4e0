"""The process's place in the run: one process, or a rank of a torchrun launch with a (dp, cp) mesh.

Here: the launch checked against the mesh (config.check_launch), the process group and DeviceMesh ("dp", "cp";
cp innermost so a ring is consecutive ranks, ideally one node) and the ring topology over each cp group
(parallel/topology.py). What is applied to the model, in which order: train/parallelize.py.
"""

from __future__ import annotations

import datetime
import gc
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtrain_cli.config import Config, check_launch
from mtrain_cli.errors import UserError
from mtrain_cli.parallel.layouts import TokenLayout
from mtrain_cli.parallel.topology import RingTopology, build_topology

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


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


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device cuda: no CUDA GPU is visible; use train.device=auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def init_parallel(config: Config) -> ParallelContext:
    """Validate the mesh against the launch and set everything up (collective under torchrun)."""
    p = config.parallel
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(config.train.device)
    node_size = p.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_launch(p, world, node_size)
    block = config.attention.block_size
    if world == 1:
        return ParallelContext(1, 0, 1, 1, device, layout=p.layout, block=block)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # GPUs: NCCL for CUDA tensors and gloo for the trainer's few CPU scalars (token counts, loss sums, stop flags)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (p.dp, p.cp), mesh_dim_names=("dp", "cp"))
    fsdp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    topology = build_topology(node_size if p.hierarchical else p.cp, p.cp) if p.cp > 1 else None
    return ParallelContext(world, dist.get_rank(), p.dp, p.cp, device, fsdp_mesh, topology, p.layout, block)


@contextmanager
def parallel_scope(config: Config) -> Iterator[ParallelContext]:
    """The block's parallel context (init_parallel), ended when the block ends, however it ends (end_parallel)."""
    pc = init_parallel(config)
    try:
        yield pc
    except BaseException as exc:
        end_parallel(pc, exc)
        raise
    end_parallel(pc)


def end_parallel(pc: ParallelContext, failure: BaseException | None = None) -> None:
    """Destroy the process groups once the run's model and optimizer are unreachable. Collect them first, while
    the interpreter is whole: FSDP state still holding gloo work at interpreter exit aborts the process
    ("terminate called without an active exception") in about 1 of 15 two-rank CPU runs.

    A `failure` on its way out (a stop signal's Interrupted, an error) still holds the trainer in its traceback's
    frames: their locals are cleared first, and the traceback still prints. With the trainer alive, NCCL's
    destroy never returned: an 8B run's ranks waited there for minutes after their SIGTERM checkpoint landed."""
    if failure is not None:
        _clear_frames(failure)
    gc.collect()
    if pc.distributed and dist.is_initialized():
        dist.destroy_process_group()


def _clear_frames(failure: BaseException) -> None:
    """Clear the locals of every finished frame in `failure`'s traceback and in those of its causes."""
    pending, seen = [failure], set()
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        pending += [exc.__cause__, exc.__context__]
