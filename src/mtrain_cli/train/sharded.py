"""The export of a sharded model: the full weights gathered to rank 0 and written as one HF directory there
(checkpoints, the same for one process and many, are in train/checkpoint.py; the sharding itself in
train/parallelize.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from mtrain_cli.parallel import ParallelContext
from mtrain_cli.train.checkpoint import export_hf
from mtrain_cli.train.lora import export_lora


def export_gathered(net, tokenizer, out_dir: Path, pc: ParallelContext, lora=None, base_model=None) -> Path:
    """Gather the full weights to rank 0 (on CPU) and write one HF directory there (with `lora`, a
    config.LoraConfig: merged or the adapter alone, train/lora.py)."""
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    full = {name.removeprefix("hf."): tensor for name, tensor in full.items()}
    model = net.hf
    failure = None
    if pc.is_main and lora is not None:
        try:
            export_lora(model, full, lora, base_model, tokenizer, out_dir)
        except Exception as exc:  # the other ranks must not wait for rank 0 forever
            failure = exc
    elif pc.is_main:
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
