"""The run's processes set up from the config: the launch checked against the mesh (config.check_launch), the
process group and DeviceMesh, and the ring topology over each cp group, as a ParallelContext (parallel/); the
groups destroyed when the run ends, however it ends.
"""

from __future__ import annotations

import datetime
import gc
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from mtrain_cli.config import Config, check_launch
from mtrain_cli.errors import UserError
from mtrain_cli.parallel import ParallelContext, build_topology, local_node_size

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


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
    node_size = local_node_size(p.node_size, world)
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
