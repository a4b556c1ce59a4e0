"""The distributed pieces of training: FSDP2 sharding, DCP checkpoints, the gathered HF export.

FSDP2 (`fully_shard`) wraps every decoder layer and then the root over the flattened dp×cp mesh. FSDP
averages gradients over the ranks; each rank's loss is its token-loss sum divided by the *global* token
count, so the trainer scales it by the world size and the average becomes the sum it needs (a divide
factor of 1 would say the same, but needs PREMUL_SUM, which gloo lacks). On GPU, parameters compute in bf16 and reduce in fp32.
Checkpoints: torch.distributed.checkpoint writes every rank's shards of model and optimizer into a
temporary directory, rank 0 adds the trainer state and renames it into place once all ranks are done, so
a checkpoint exists complete or not at all; DCP reshards on load, so a different world size resumes too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mtrain_cli.parallel.context import ParallelContext
from mtrain_cli.train.checkpoint import TrainState, checkpoint_dirs, export_hf


def apply_fsdp(net: torch.nn.Module, pc: ParallelContext) -> None:
    """Every decoder layer, then the root (`ChunkedLossModel`: embedding, final norm, LM head, loss)."""
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if pc.device.type == "cuda" else MixedPrecisionPolicy())
    for layer in net.hf.model.layers:
        fully_shard(layer, mesh=pc.fsdp_mesh, mp_policy=mp)
    fully_shard(net, mesh=pc.fsdp_mesh, mp_policy=mp)


def save_sharded(root: Path, model, optimizer, state: TrainState, keep_last: int, pc: ParallelContext) -> Path:
    final = root / f"step_{state.step:06d}"
    tmp = root / f"{final.name}.tmp"
    if pc.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    pc.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    torch.save(state.__dict__ | {"world": pc.world, "dp": pc.dp}, tmp / f"state_rank{pc.rank}.pt")
    pc.barrier()
    if pc.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in checkpoint_dirs(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    pc.barrier()
    return final


def load_sharded(path: Path, model, optimizer, pc: ParallelContext) -> tuple[TrainState, int]:
    """-> (this rank's trainer state, the data-parallel size the checkpoint was written with)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    own = path / f"state_rank{pc.rank}.pt"
    raw = torch.load(own if own.exists() else path / "state_rank0.pt", map_location="cpu", weights_only=False)
    saved_dp = raw.pop("dp")
    raw.pop("world")
    return TrainState(**raw), saved_dp


def is_sharded(path: Path) -> bool:
    return (path / "dcp").is_dir()


def export_gathered(net, tokenizer, out_dir: Path, pc: ParallelContext) -> Path:
    """Gather the full weights to rank 0 (on CPU) and write one HF directory there."""
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    full = {name.removeprefix("hf."): tensor for name, tensor in full.items()}
    model = net.hf
    if pc.is_main:
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        with no_init_weights():
            plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        plain.load_state_dict(full, strict=True)
        export_hf(plain, tokenizer, out_dir)
    if pc.distributed:
        dist.barrier()
    return out_dir
