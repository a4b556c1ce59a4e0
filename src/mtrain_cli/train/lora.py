"""LoRA (`train.lora`): peft's low-rank adapters injected into the HF model in place, everything else frozen.

In place (`inject_adapter_in_model`), not wrapped in a PeftModel: the model keeps its structure (`model.layers`,
the embeddings, the LM head), so activation checkpointing, per-layer compile, FSDP2 and the attention router
treat it as any other model; a targeted linear becomes peft's `Linear` holding the frozen `base_layer` and the
adapter's `lora_A`/`lora_B`. With `train_embeddings_norms` the input embeddings and every norm train too (LongLoRA's
"+", what extends context with LoRA). The adapters and what trains are fp32 masters; the frozen base is stored in
`frozen_dtype` (bf16 when training in bf16 on a GPU: half the memory of fp32 and the precision it computes in).

Checkpoints hold what trains and its optimizer state only (train/checkpoint.py); the base is rebuilt from the
model directory (or the seed of a fresh model) on resume. The export is a plain HF directory with the adapters
merged (it loads without peft), or peft's adapter files with the trained model's config (RoPE extension included)
as `base_config.json`.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mtrain_cli.config import LoraConfig
from mtrain_cli.errors import UserError

if TYPE_CHECKING:
    import peft

# peft is imported where adapters are made (it takes seconds to import): a run without LoRA never loads it.
BASE_CONFIG = "base_config.json"  # the adapter export's config of the model it trained (its base, extended)


def peft_config(lora: LoraConfig, base_model: str | None = None) -> peft.LoraConfig:
    import peft

    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def trains_with_base(name: str, module_of: dict[str, torch.nn.Module], embeddings: torch.nn.Module) -> bool:
    """Whether parameter `name` trains under train_embeddings_norms: the input embeddings' and the norms'."""
    owner = module_of[name.rpartition(".")[0]]
    return owner is embeddings or "Norm" in type(owner).__name__


def apply_lora(model: torch.nn.Module, lora: LoraConfig, frozen_dtype: torch.dtype = torch.float32) -> None:
    """Inject the adapters into `model` (on any device, meta included), freeze the rest and store it in
    `frozen_dtype`; what trains is fp32, and the hidden states stay in `frozen_dtype`."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(peft_config(lora), model)
    except ValueError as exc:  # peft: target modules not found
        linear = sorted(
            {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise UserError(
            f"train.lora.target_modules {list(lora.target_modules)}: {str(exc).splitlines()[0]}; the model's "
            f"linear layers are {', '.join(linear)}"
        ) from None
    module_of = dict(model.named_modules())
    embeddings = model.get_input_embeddings()
    for name, param in model.named_parameters():
        param.requires_grad = ".lora_" in name or (
            lora.train_embeddings_norms and trains_with_base(name, module_of, embeddings)
        )
        dtype = torch.float32 if param.requires_grad else frozen_dtype
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    if frozen_dtype != torch.float32 and embeddings.weight.requires_grad:
        # The residual stream in the base's dtype, as the base computes it: the fp32 embeddings that train would
        # make it fp32, and activation checkpointing keeps every layer's input (at 8B and 64K: 32 GiB, not 16).
        embeddings.register_forward_hook(lambda _module, _inputs, out: out.to(frozen_dtype))


def flops_params(model: torch.nn.Module, num_matmul_params: int) -> float:
    """The N of 6·N training FLOPs a token for an adapted model: a frozen weight takes no weight gradient, so its
    matmuls cost 4 FLOPs a parameter a token, not 6 (the trainable matmul weights: the adapters, and the LM head
    where it is the trained embedding)."""
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    trainable = sum(
        p.numel() for p in model.parameters() if p.requires_grad and p.ndim >= 2 and (p is not embeddings or p is head)
    )
    return (4 * num_matmul_params + 2 * trainable) / 6


def reset_adapters(model: torch.nn.Module) -> None:
    """peft's initial adapter weights (A random, B zero): for adapters allocated without values (meta device)."""
    for module in model.modules():
        if hasattr(module, "lora_A") and hasattr(module, "reset_lora_parameters"):  # peft's LoraLayer
            for adapter in module.lora_A:
                module.reset_lora_parameters(adapter, init_lora_weights=True)


def base_weight_name(name: str) -> str | None:
    """The name a weight of the adapted model has in the base model's files; None for an adapter's."""
    return None if ".lora_" in name else name.replace(".base_layer.", ".")


def plain_with_adapters(hf_config, lora: LoraConfig, state: dict[str, torch.Tensor], base_model: str | None):
    """A fresh fp32 model of `hf_config`, wrapped by peft with the trained adapters, loaded from `state` (the
    adapted model's full state dict)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        plain = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=torch.float32)
    plain.tie_weights()  # not done under no_init_weights; a tied model's merged export must stay tied
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = get_peft_model(plain, peft_config(lora, base_model))
    plain.load_state_dict(state, strict=True)
    return wrapped


def merged_model(hf_config, lora: LoraConfig, state: dict[str, torch.Tensor], base_model: str | None = None):
    """The plain HF model (fp32, no peft modules) whose weights are the base with the adapters merged in."""
    return plain_with_adapters(hf_config, lora, state, base_model).merge_and_unload()


def save_adapter(wrapped, hf_config, out_dir: Path) -> None:
    """peft's adapter files and the trained model's config (`base_config.json`) into `out_dir`."""
    wrapped.save_pretrained(str(out_dir))
    config = copy.deepcopy(hf_config)
    config.use_cache = True  # as users generate
    config.to_json_file(str(out_dir / BASE_CONFIG))


def is_adapter_directory(path: Path) -> bool:
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def adapter_base(directory: Path) -> tuple[str, object]:
    """(the base model directory, the config the adapter was trained with: `base_config.json`, else the base's) of
    an adapter export."""
    from transformers import AutoConfig

    adapter = json.loads((directory / "adapter_config.json").read_text(encoding="utf-8"))
    base = adapter.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise UserError(
            f"MODEL {str(directory)!r} is a LoRA adapter whose base model {base!r} is not a local model directory; "
            f"set base_model_name_or_path in its adapter_config.json to the base model's directory"
        )
    config_file = directory / BASE_CONFIG
    hf_config = AutoConfig.from_pretrained(str(config_file if config_file.is_file() else base))
    hf_config.use_cache = True
    return base, hf_config


def load_adapter_model(directory: Path, base: str, hf_config, attn_implementation: str):
    """An adapter export merged into its `base` model directory, built with `hf_config`: (plain fp32 model,
    tokenizer)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        base, config=hf_config, dtype=torch.float32, attn_implementation=attn_implementation, local_files_only=True
    )
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(model, str(directory)).merge_and_unload()
    return model, AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
