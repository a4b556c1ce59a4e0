"""The distributed pieces of training: FSDP2 sharding, DCP checkpoints, the gathered HF export.

FSDP2 (`fully_shard`) wraps every decoder layer and then the root over the flattened dp×cp mesh. FSDP
averages gradients over the ranks; each rank's loss is its token-loss sum divided by the *global* token
count, so the trainer scales it by the world size and the average becomes the sum it needs (a divide
factor of 1 would say the same, but needs PREMUL_SUM, which gloo lacks). On GPU, parameters compute in bf16 and reduce in fp32.
Checkpoints: torch.distributed.checkpoint writes every rank's shards of model and optimizer into a
temporary directory, rank 0 adds the trainer state and renames it into place once all ranks are done, so
a checkpoint exists complete or not at all; DCP reshards on load, so a different world size resumes too.
`verify_sharded` checks a checkpoint's files against its metadata (present, long enough) before any rank
loads it: every rank reaches the same verdict, so a resume falls back past a damaged one in step.
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

from torch.distributed.checkpoint.api import CheckpointException

from mtrain_cli.errors import UserError
from mtrain_cli.parallel.context import ParallelContext
from mtrain_cli.train.checkpoint import (TrainState, UnreadableCheckpoint, export_hf, first_line, prune_checkpoints,
                                         read_file)


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
        prune_checkpoints(root, state.step, keep_last)
    pc.barrier()
    return final


def verify_sharded(path: Path, model_only: bool = False) -> None:
    """Raise UnreadableCheckpoint naming the first missing or truncated file of checkpoint `path`: DCP's
    .metadata, every data file it points into (long enough for each item), and the trainer states."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = path / "dcp" / ".metadata"
    if not metadata.is_file():
        raise UnreadableCheckpoint(metadata, "missing")
    try:
        storage = FileSystemReader(str(path / "dcp")).read_metadata().storage_data
    except Exception as exc:
        raise UnreadableCheckpoint(metadata, f"truncated or corrupt ({first_line(exc)})") from None
    needed: dict[str, int] = {}
    for index, info in (storage or {}).items():
        if not model_only or index.fqn.startswith("model."):
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / "dcp" / name
        if not file.is_file():
            raise UnreadableCheckpoint(file, "missing")
        if file.stat().st_size < size:
            raise UnreadableCheckpoint(file, f"truncated ({file.stat().st_size:,} bytes; its items need {size:,})")
    if not model_only:
        for file in [path / "state_rank0.pt", *sorted(set(path.glob("state_rank*.pt")) - {path / "state_rank0.pt"})]:
            raw = read_file(file, weights_only=False)
            if not isinstance(raw, dict) or "dp" not in raw or "step" not in raw:
                raise UnreadableCheckpoint(file, "not a trainer state")


def load_sharded(path: Path, model, optimizer, pc: ParallelContext) -> tuple[TrainState, int]:
    """-> (this rank's trainer state, the data-parallel size the checkpoint was written with).
    The files were checked by `verify_sharded`: a failure here means they don't fit the model (or are damaged
    inside), a one-line error."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path / "dcp"))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise UserError(f"--resume: {path} could not be loaded into the model and optimizer built from the "
                        f"config ({dcp_reason(exc)}); resume with the settings the run was trained with"
                        ) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    own = path / f"state_rank{pc.rank}.pt"
    raw = dict(read_file(own if own.exists() else path / "state_rank0.pt", weights_only=False))
    saved_dp = raw.pop("dp")
    raw.pop("world")
    return TrainState(**raw), saved_dp


def dcp_reason(exc: BaseException) -> str:
    """DCP wraps each rank's failure in a CheckpointException: the innermost cause's first line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))  # (exception, traceback)
        exc = inner[0] if isinstance(inner, tuple) else inner
    return first_line(exc)


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
