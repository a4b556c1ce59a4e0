"""The distributed pieces of training: FSDP2 sharding and the gathered HF export (checkpoints, the same
for one process and many, are in train/checkpoint.py).

FSDP2 (`fully_shard`) wraps every decoder layer and then the root over the flattened dp×cp mesh. FSDP
averages gradients over the ranks; each rank's loss is its token-loss sum divided by the *global* token
count, so the trainer scales it by the world size and the average becomes the sum it needs (a divide
factor of 1 would say the same, but needs PREMUL_SUM, which gloo lacks). On GPU, parameters compute in bf16
and reduce in fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mtrain_cli.parallel.context import ParallelContext
from mtrain_cli.train.checkpoint import export_hf


def apply_fsdp(net: torch.nn.Module, pc: ParallelContext) -> None:
    """Every decoder layer, then the root (`ChunkedLossModel`: embedding, final norm, LM head, loss)."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if pc.device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    for layer in net.hf.model.layers:
        fully_shard(layer, mesh=pc.fsdp_mesh, mp_policy=mp)
    fully_shard(net, mesh=pc.fsdp_mesh, mp_policy=mp)


def export_gathered(net, tokenizer, out_dir: Path, pc: ParallelContext) -> Path:
    """Gather the full weights to rank 0 (on CPU) and write one HF directory there."""
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    full = {name.removeprefix("hf."): tensor for name, tensor in full.items()}
    model = net.hf
    failure = None
    if pc.is_main:
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        with no_init_weights():
            plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        plain.load_state_dict(full, strict=True)
        plain.generation_config = model.generation_config  # the user's generation_config.json, not the defaults
        try:
            export_hf(plain, tokenizer, out_dir)
        except Exception as exc:  # the other ranks must not wait for rank 0 forever
            failure = exc
    if pc.sum_all(torch.tensor([1.0 if failure is not None else 0.0]))[0] > 0:
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank 0 could not export {out_dir} (it says why)")
    return out_dir
