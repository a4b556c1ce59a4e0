"""Load a local Hugging Face checkpoint into an FSDP2-sharded model, each rank reading only its own rows.

The distributed trainer builds the architecture on the meta device (no memory), shards it with
`fully_shard`, allocates each rank's shards (`to_empty`) and then fills them from the safetensors files
with `safe_open(...).get_slice(name)[rows]`: the files are memory-mapped, so a rank reads its rows of each
weight and nothing else, and no process ever holds the whole model. FSDP2 shards dim 0 like `torch.chunk`
(ceil(n / world) rows per rank, the last ones shorter or empty). Non-persistent buffers (the rotary
frequencies) are not in the files: they are rebuilt from the model's config.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard

from mtrain_cli.errors import UserError


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Weight name → the safetensors file holding it (one file, or an index over several)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise UserError(f"--model {model_dir}: no model.safetensors or model.safetensors.index.json there; "
                        f"distributed loading reads safetensors (save the model with safe_serialization)")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _row_range(param: torch.nn.Parameter) -> tuple[int, int]:
    """Global rows [start, stop) of this rank's shard of a dim-0-sharded parameter."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    assert param.placements == (Shard(0),), f"unexpected placements {param.placements}"
    mesh = param.device_mesh
    rows = param.shape[0]
    per_rank = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * per_rank, rows)
    stop = start + param.to_local().shape[0]
    assert stop <= rows
    return start, stop


@torch.no_grad()
def load_sharded_weights(model: torch.nn.Module, model_dir: Path, device: torch.device) -> None:
    """Allocate the (meta, sharded) `model` on `device` and fill this rank's shards from `model_dir`."""
    model.to_empty(device=device)
    files = weight_files(model_dir)
    with ExitStack() as stack:
        handles: dict[Path, object] = {}
        for name, param in model.named_parameters():
            if name not in files:
                raise UserError(f"--model {model_dir}: weight {name!r} is missing from its safetensors files; "
                                f"is it a {model.config.model_type} checkpoint of this size?")
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            weight = handles[file].get_slice(name)
            if list(weight.get_shape()) != list(param.shape):
                raise UserError(f"--model {model_dir}: weight {name!r} has shape {weight.get_shape()}, the model "
                                f"expects {list(param.shape)}")
            local = param.to_local() if isinstance(param, DTensor) else param
            start, stop = _row_range(param)
            if stop > start:
                local.copy_(weight[start:stop].to(local.dtype))
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor) and hasattr(module, "rope_type"):
            fresh = type(module)(module.config)  # rotary frequencies (YaRN included) from the config
            module.inv_freq = fresh.inv_freq.to(device)
            module.original_inv_freq = fresh.original_inv_freq.to(device)
            module.attention_scaling = fresh.attention_scaling
