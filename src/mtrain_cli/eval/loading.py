"""Loading the model to evaluate: a Hugging Face directory, an mtrain run directory (its export/), or one
checkpoint `RUN/checkpoints/step_N` rebuilt from the run's config.yaml. bf16 on GPU, fp32 on CPU. LoRA: an adapter
directory (peft's files, as `train.lora.export adapter` writes) or a LoRA run's checkpoint is merged into its base
first, so every suite sees a plain model.

Dense attention runs through transformers' SDPA path, which builds the causal masks that chunked prefill
against a KV cache needs (queries are the last Sq of Sk keys). Sparse attention loads the model with
mtrain's attention hook (`attn_implementation=ATTENTION_NAME`), as training does.

A checkpoint's files are checked before anything is built: a missing, empty or truncated one is a one-line
error naming the file (and the run's newest intact checkpoint)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.initialization import no_init_weights

from mtrain_cli.errors import UserError
from mtrain_cli.train import is_adapter_directory

MODEL_FIX = (
    "pass a local Hugging Face model directory (what save_pretrained writes: config.json, *.safetensors "
    "weights and the tokenizer files), an mtrain run directory (config.yaml) or one of its checkpoints"
)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # for the run directory and the summary
    path: Path
    source: str  # "hf", "run export" or "checkpoint"
    device: torch.device
    dtype: torch.dtype


def _is_checkpoint(path: Path) -> bool:
    """A checkpoint (dcp/) inside an mtrain run; also a RUN/checkpoints/step_N directory whose files are
    missing (reported by _check_checkpoint), or one of an mtrain before DCP (model.pt: refused in one line)."""
    named = path.is_dir() and path.parent.name == "checkpoints" and re.fullmatch(r"step_\d{6,}", path.name)
    return ((path / "dcp").is_dir() or (path / "model.pt").is_file() or bool(named)) and (
        path.parent.parent / "config.yaml"
    ).is_file()


def _check_checkpoint(checkpoint: Path) -> None:
    """The checkpoint's model files, checked against DCP's metadata: UserError naming a missing or damaged one."""
    from mtrain_cli.train import UnreadableCheckpoint, checkpoint_dirs, verify_checkpoint

    try:
        return verify_checkpoint(checkpoint, model_only=True)
    except UnreadableCheckpoint as exc:
        problem = str(exc)
    hint = "pass another checkpoint of the run or, once it has finished, its directory (export/)"
    for _, other in reversed(checkpoint_dirs(checkpoint.parent)):
        if other == checkpoint:
            continue
        try:
            verify_checkpoint(other, model_only=True)
        except (UnreadableCheckpoint, UserError):
            continue
        hint = f"pass an intact checkpoint of the run instead, e.g. {other}"
        break
    raise UserError(f"MODEL {str(checkpoint)!r}: {problem}; {hint}")


def _is_run_directory(path: Path) -> bool:
    return (path / "config.yaml").is_file() and not (path / "config.json").is_file()


def run_config_file(path: Path) -> Path | None:
    """The config.yaml of the mtrain run that MODEL belongs to (a run directory or one of its checkpoints)."""
    path = Path(path).expanduser()
    if _is_checkpoint(path):
        return path.parent.parent / "config.yaml"
    return path / "config.yaml" if _is_run_directory(path) else None


def apply_yarn(hf_config, factor: float) -> None:
    """--yarn: YaRN ×factor over the model's own context, written into `hf_config` as `mtrain extend` writes it
    (context.method yarn: from plain RoPE, llama3 or yarn; model/rope.py), for evaluating a model at that context
    without training."""
    from mtrain_cli.config import ContextConfig
    from mtrain_cli.model import apply_context_extension

    apply_context_extension(hf_config, ContextConfig(method="yarn", factor=factor), label=f"--yarn {factor:g}")


def _load_hf(directory: Path, device: torch.device, dtype: torch.dtype, attn_implementation: str, yarn: float | None):
    from mtrain_cli.inputs import check_model_directory
    from mtrain_cli.model import load_local_weights

    check_model_directory(directory, "MODEL", weights=True, fix=MODEL_FIX)  # names missing files before HF does
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        hf_config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
        if yarn is not None:
            apply_yarn(hf_config, yarn)
        model = load_local_weights(directory, hf_config, dtype, attn_implementation)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"MODEL {str(directory)!r} could not be loaded as a Hugging Face model "
            f"({str(exc).splitlines()[0]}); pass a directory with config.json, weights and tokenizer"
        ) from None
    return model.to(device), tokenizer


def _load_checkpoint(
    checkpoint: Path, device: torch.device, dtype: torch.dtype, attn_implementation: str, yarn: float | None
):
    """The architecture from the run's config.yaml (with its context recipe), weights from the checkpoint.
    Weights are not initialised first: the checkpoint overwrites every parameter (its items must fit exactly)."""
    from mtrain_cli.config import load_config
    from mtrain_cli.model import build_hf_config, load_tokenizer
    from mtrain_cli.train import CheckpointMismatch, load_model_weights

    _check_checkpoint(checkpoint)
    config = load_config(str(checkpoint.parent.parent / "config.yaml"), [])
    tokenizer = load_tokenizer(config)
    hf_config = build_hf_config(config, len(tokenizer))
    hf_config.use_cache = True
    if yarn is not None:
        apply_yarn(hf_config, yarn)
    if config.train.lora is not None:
        return _load_lora_checkpoint(checkpoint, config, tokenizer, hf_config, attn_implementation), tokenizer
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(
            hf_config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    try:
        load_model_weights(checkpoint, model)
    except CheckpointMismatch as exc:
        raise UserError(
            f"MODEL {str(checkpoint)!r}: its weights could not be read ({exc}); pass another checkpoint of the run"
        ) from None
    return model.to(device=device, dtype=dtype), tokenizer


def _load_lora_checkpoint(checkpoint: Path, config, tokenizer, hf_config, attn_implementation: str):
    """A LoRA run's checkpoint (what trains, only) on its base (the model directory, or the fresh model of the
    run's seed), merged: a plain fp32 model."""
    from mtrain_cli.model import build_model
    from mtrain_cli.train import CheckpointMismatch, apply_lora, load_model_weights, merged_model

    adapted = build_model(config, tokenizer, torch.device("cpu"))
    apply_lora(adapted, config.train.lora)
    try:
        load_model_weights(checkpoint, adapted)
    except CheckpointMismatch as exc:
        raise UserError(
            f"MODEL {str(checkpoint)!r}: its adapter could not be read ({exc}); pass another checkpoint of the run"
        ) from None
    hf_config._attn_implementation = attn_implementation
    return merged_model(hf_config, config.train.lora, adapted.state_dict())


def _load_adapter(directory: Path, device: torch.device, dtype: torch.dtype, attn_implementation: str, yarn):
    from mtrain_cli.train import adapter_base, load_adapter_model

    base, hf_config = adapter_base(directory)
    if yarn is not None:
        apply_yarn(hf_config, yarn)
    model, tokenizer = load_adapter_model(directory, base, hf_config, attn_implementation)
    return model.to(device=device, dtype=dtype), tokenizer


def load_model(
    path: Path, device: torch.device | None = None, attn_implementation: str = "sdpa", yarn: float | None = None
) -> LoadedModel:
    """An HF directory, a run directory (uses RUN/export), or RUN/checkpoints/step_N. attn_implementation:
    "sdpa", or mtrain's hook (ATTENTION_NAME, registered by the caller) for sparse attention. yarn: apply YaRN
    with this factor to the model's plain RoPE (apply_yarn)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"MODEL {path} does not exist; {MODEL_FIX}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if _is_checkpoint(path):
        model, tokenizer = _load_checkpoint(path, device, dtype, attn_implementation, yarn)
        name, source = f"{path.parent.parent.name}-{path.name}", "checkpoint"
    elif _is_run_directory(path) and is_adapter_directory(path / "export"):
        model, tokenizer = _load_adapter(path / "export", device, dtype, attn_implementation, yarn)
        name, source = path.name, "run export (LoRA adapter)"
    elif is_adapter_directory(path):
        model, tokenizer = _load_adapter(path, device, dtype, attn_implementation, yarn)
        name, source = path.name, "LoRA adapter"
    elif _is_run_directory(path):
        export = path / "export"
        if not (export / "config.json").is_file():
            from mtrain_cli.train import checkpoint_dirs

            saved = checkpoint_dirs(path / "checkpoints")
            raise UserError(
                f"MODEL {str(path)!r} is a run directory without export/ (the run has not finished); "
                + (
                    f"pass one of its checkpoints instead, e.g. the newest: {saved[-1][1]}"
                    if saved
                    else "it has no checkpoint either, so nothing of it can be evaluated yet"
                )
            )
        model, tokenizer = _load_hf(export, device, dtype, attn_implementation, yarn)
        name, source = path.name, "run export"
    elif (path / "config.json").is_file():
        model, tokenizer = _load_hf(path, device, dtype, attn_implementation, yarn)
        name, source = path.name, "hf"
    else:
        from mtrain_cli.inputs import directory_contents

        if not path.is_dir():
            raise UserError(f"MODEL {path} is a file, not a directory; {MODEL_FIX}")
        raise UserError(
            f"MODEL {str(path)!r} is neither a Hugging Face directory (config.json), an mtrain run "
            f"(config.yaml) nor a checkpoint (dcp/): it has no config.json "
            f"({directory_contents(path)}); {MODEL_FIX}"
        )
    model.eval()
    return LoadedModel(model, tokenizer, name, path, source, device, dtype)
