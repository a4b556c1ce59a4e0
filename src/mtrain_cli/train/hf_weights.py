"""Load a local Hugging Face checkpoint into an FSDP2-sharded model, each rank reading only its own rows.

The distributed trainer builds the architecture on the meta device (no memory), shards it with `fully_shard`,
allocates each rank's shards (`to_empty`) and fills them with `dcp.load` through DCP's
`HuggingFaceStorageReader` (as torchtitan does): the reader reads the safetensors headers as DCP metadata, the
planner asks each rank for its shard's rows only, and the reader reads them with `get_slice`, so no process
ever holds the whole model. It reads every *.safetensors file in the directory (one, or the several an index
lists; the index itself is not needed) and casts each weight to the model's dtype (`copy_`): a bf16
checkpoint fills fp32 master weights. Each parameter is asked for once (`named_parameters` skips a tied LM
head, which save_pretrained does not write either). Non-persistent buffers (the rotary frequencies) are not
in the files: the model's own `_init_weights` computes them from its config, as `from_pretrained` does. A model
with LoRA adapters (train/lora.py) reads its base weights under their names in the files, and its adapters get
peft's initial values.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException

from mtrain_cli.errors import UserError
from mtrain_cli.model import weight_shape_mismatch
from mtrain_cli.train.checkpoint import dcp_reason
from mtrain_cli.train.lora import base_weight_name, reset_adapters


@torch.no_grad()
def load_sharded_weights(model: torch.nn.Module, model_dir: Path, device: torch.device) -> None:
    """Allocate the (meta, sharded) HF `model` on `device` and fill this rank's shards from `model_dir`."""
    if next(model_dir.glob("*.safetensors"), None) is None:
        raise UserError(
            f"--model {model_dir}: no *.safetensors files there; distributed loading reads "
            f"safetensors (save the model with safe_serialization)"
        )
    model.to_empty(device=device)
    weights = {
        base: param.detach() for name, param in model.named_parameters() if (base := base_weight_name(name)) is not None
    }
    reader = HuggingFaceStorageReader(str(model_dir))
    saved = reader.read_metadata().state_dict_metadata
    for name, weight in weights.items():
        if name not in saved:
            raise UserError(
                f"--model {model_dir}: weight {name!r} is missing from its safetensors files; "
                f"is it a {model.config.model_type} checkpoint of this size?"
            )
        if list(saved[name].size) != list(weight.shape):
            raise UserError(weight_shape_mismatch(model_dir, name, saved[name].size, weight.shape))
    try:
        dcp.load(weights, storage_reader=reader)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise UserError(f"--model {model_dir}: its weights could not be read ({dcp_reason(exc)})") from None
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__:
            model._init_weights(module)  # inv_freq (YaRN included) from the config; attention_scaling is kept
    reset_adapters(model)
