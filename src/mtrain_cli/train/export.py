"""The trained model written as a directory users load: a plain HF model (`export_hf`), a LoRA run's adapters
merged into one or saved alone (`export_lora`), from one process or gathered from the shards of many to rank 0
(`export_gathered`). Every export is written whole or not at all (`write_export`): beside its place, then renamed
over it. Checkpoints, which resume a run, are train/checkpoint.py's.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from mtrain_cli.config import LoraConfig
from mtrain_cli.errors import DiskFull, TrainingDiverged, is_disk_full
from mtrain_cli.parallel import ParallelContext
from mtrain_cli.train.lora import base_weight_name, merged_model, plain_with_adapters, save_adapter


def export_trained(net, tokenizer, out_dir: Path, pc: ParallelContext, lora: LoraConfig | None, base_model) -> Path:
    """The run's export of the model `net` trains (`base_model`: the model directory a LoRA run adapted)."""
    if pc.distributed:
        return export_gathered(net, tokenizer, out_dir, pc, lora, base_model)
    model = net.hf
    if lora is not None:
        state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
        return export_lora(model, state, lora, base_model, tokenizer, out_dir)
    return export_hf(model, tokenizer, out_dir)


def export_hf(model: torch.nn.Module, tokenizer, out_dir: Path) -> Path:
    """A directory `AutoModelForCausalLM.from_pretrained` loads, with the YaRN settings in config.json.

    The registered attention name is ours; the export names SDPA so any transformers install loads it. Training
    turns the KV cache off: the export turns it on (config.json and generation_config.json), as users generate
    with it."""
    generation = getattr(model, "generation_config", None)
    saved = model.config._attn_implementation, model.config.use_cache, getattr(generation, "use_cache", None)
    model.config._attn_implementation = "sdpa"
    model.config.use_cache = True
    if generation is not None:
        generation.use_cache = True
    try:
        return write_export(
            model.state_dict(),
            tokenizer,
            model.config.max_position_embeddings,
            out_dir,
            lambda tmp: model.save_pretrained(tmp, safe_serialization=True),
        )
    finally:
        model.config._attn_implementation, model.config.use_cache = saved[0], saved[1]
        if generation is not None:
            generation.use_cache = saved[2]


def write_export(
    state: dict[str, torch.Tensor], tokenizer, max_length: int, out_dir: Path, save: Callable[[Path], None]
) -> Path:
    """`save(directory)` and the tokenizer (its model_max_length: the extended context) into `out_dir`, whole or
    not at all: written beside it, then renamed over it. Non-finite weights (`state`) and a full disk are one line
    each, and leave `out_dir` as it was."""
    nonfinite = [name for name, t in state.items() if t.is_floating_point() and not t.isfinite().all()]
    if nonfinite:
        raise TrainingDiverged(
            f"{nonfinite[0]} holds non-finite values ({len(nonfinite)} tensors do): nothing is exported to "
            f"{out_dir}; resume an earlier checkpoint with a lower train.lr"
        )
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    saved_max_length = tokenizer.model_max_length
    tokenizer.model_max_length = max_length
    try:
        save(tmp)
        tokenizer.save_pretrained(tmp)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_disk_full(exc):
            raise
        raise DiskFull(
            out_dir,
            sum(t.numel() * t.element_size() for t in state.values()),
            f"the partial export is removed; free some space and run mtrain extend --resume {out_dir.parent}, "
            f"which exports the final checkpoint",
        ) from None
    finally:
        tokenizer.model_max_length = saved_max_length
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def export_lora(model, state: dict[str, torch.Tensor], lora: LoraConfig, base_model: str | None, tokenizer, out_dir):
    """The run's export from the adapted model's full state dict (on the CPU): merged into a plain HF directory
    (export_hf), or the adapter alone (`lora.export`), written as every export is (write_export)."""
    hf_config = model.config
    if lora.export == "merged":
        plain = merged_model(hf_config, lora, state, base_model)
        plain.generation_config = model.generation_config
        return export_hf(plain, tokenizer, out_dir)
    wrapped = plain_with_adapters(hf_config, lora, state, base_model)
    adapters = {name: tensor for name, tensor in state.items() if base_weight_name(name) is None}
    return write_export(
        adapters,
        tokenizer,
        hf_config.max_position_embeddings,
        out_dir,
        lambda tmp: save_adapter(wrapped, hf_config, tmp),
    )


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
