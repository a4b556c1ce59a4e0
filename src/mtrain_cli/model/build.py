"""Build the model and tokenizer: a fresh model from the recipe, or a local HF directory of a family mtrain extends.

The context-extension recipe is applied to the HF config before weights are created, and attention is
routed through mtrain's one registered attention function (attention/hook.py): what it runs is up to the
attention router its caller enters around the forward (attention/router.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from mtrain_cli.attention import ATTENTION_NAME, register_attention
from mtrain_cli.config import Config, ModelConfig
from mtrain_cli.errors import UserError
from mtrain_cli.families import FAMILIES, Family
from mtrain_cli.inputs import TOKENIZER_FILES, check_model_directory, directory_contents, safetensors_header
from mtrain_cli.model.rope import apply_context_extension, check_family_rope, check_rope_scaling


def config_class(family: Family) -> type:
    """The family's transformers config class."""
    return getattr(transformers, family.config_class)


def load_tokenizer(config: Config):
    """The tokenizer of model.tokenizer, else of the model directory (--model), else the shipped one. The model
    directory is checked first, so a wrong --model is reported as such (not as a tokenizer problem)."""
    m = config.model
    if m.path is not None:
        check_model_directory(m.path, tokenizer=m.tokenizer is None)
    if m.tokenizer is not None:
        label, source = "model.tokenizer", m.tokenizer
        path = Path(source).expanduser()
        if not path.exists():
            raise UserError(f"model.tokenizer {source!r} does not exist; pass a local tokenizer directory")
        if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise UserError(
                f"model.tokenizer {source!r} has no tokenizer files (tokenizer.json / "
                f"tokenizer_config.json); {directory_contents(path)}; pass the model's tokenizer directory"
            )
    else:
        label, source = "--model", m.path
        path = Path(source).expanduser()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        cause = " ".join(str(exc).split())[:200]
        raise UserError(
            f"{label} {source!r}: the tokenizer could not be loaded ({cause}); "
            f"pass a directory with tokenizer.json / tokenizer_config.json"
        ) from None
    return tokenizer  # as the user's files define it (no pad token added): the export carries it unchanged


def load_hf_config(config: Config, vocab_size: int):
    """The HF config the run starts from: the local model's (a family mtrain extends) or a fresh one."""
    m = config.model
    if m.path is None:
        return _fresh_config(m, vocab_size)
    path = Path(m.path).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(f"--model {m.path!r} is not a Hugging Face model directory (no config.json there)")
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if hf_config.model_type not in FAMILIES:
        families = ", ".join(f"{family.name} ({family.model_type})" for family in FAMILIES.values())
        raise UserError(f"--model {m.path!r} has model_type {hf_config.model_type!r}; mtrain extends {families} models")
    return hf_config


def build_hf_config(config: Config, vocab_size: int, notes: list[str] | None = None):
    """The HF config the run trains: the local model's or a fresh one, with the context recipe applied. What the
    user must be told about it (frequencies the recipe changes beyond the extension) is appended to `notes`."""
    m = config.model
    hf_config = load_hf_config(config, vocab_size)
    original = hf_config.max_position_embeddings
    extension_notes = apply_context_extension(hf_config, config.context)
    if notes is not None:
        notes.extend(extension_notes)
    if m.path is not None and config.data.seq_len > hf_config.max_position_embeddings:
        # config's checks test a fresh model's context up front; a local model's is known once its config is read
        extension = (
            "" if config.context.method == "none" else f" = {original:,} × context.factor {config.context.factor:g}"
        )
        needed = -(-config.data.seq_len // (config.context.original_max_position_embeddings or original))
        raise UserError(
            f"data.seq_len {config.data.seq_len:,} exceeds the extended context "
            f"{hf_config.max_position_embeddings:,} of --model {m.path}{extension}; lower data.seq_len "
            f"or extend further (context.factor {needed} with context.method yarn or theta)"
        )
    _check_sliding_window(hf_config, config.data.seq_len, "--model" if m.path is not None else "model.architecture")
    hf_config.use_cache = False
    return hf_config


def _check_sliding_window(hf_config, seq_len: int, label: str) -> None:
    """mtrain's attention (dense, sparse, ring) is full causal attention within each document: a model whose
    layers attend through a window shorter than the rows it trains on would train as another model."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None  # Qwen2/Qwen3: the window applies only to the layers of type sliding_attention
    if window is not None and window < seq_len:
        raise UserError(
            f"{label}: the model's layers attend through a sliding_window of {window:,} tokens, shorter than "
            f"data.seq_len {seq_len:,}; mtrain trains full causal attention "
            f"(dense and sparse), so it would train a different model: use a checkpoint with sliding_window "
            f"null (Mistral v0.2 and later; Qwen with use_sliding_window false)"
        )


def _fresh_config(m: ModelConfig, vocab_size: int):
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        check_rope_scaling(m.rope_scaling, "model.rope_scaling")
        check_family_rope(m.architecture, m.rope_scaling["rope_type"], "model.rope_scaling", "leave it null")
        rope = {**m.rope_scaling, "rope_theta": m.rope_theta}
    family = FAMILIES[m.architecture]
    extra = dict(family.fresh)
    if m.head_dim is not None or family.own_head_dim:
        extra["head_dim"] = m.head_dim or m.hidden_size // m.num_attention_heads
    return config_class(family)(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        max_position_embeddings=m.max_position_embeddings,
        rope_parameters=rope,
        tie_word_embeddings=m.tie_word_embeddings,
        **extra,
    )


def build_model(config: Config, tokenizer, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """fp32 master weights on `device` (`dtype`: a base that stays frozen may be loaded in bf16); mixed precision
    comes from autocast in the trainer.

    On the meta device a local model (`model.path`) is only its architecture: the distributed trainer shards
    it and each rank then reads its own rows of the weights (train/hf_weights.py)."""
    register_attention()
    vocab_size = len(tokenizer)
    hf_config = build_hf_config(config, vocab_size)
    hf_config._attn_implementation = ATTENTION_NAME
    if config.model.path is not None:
        check_model_directory(config.model.path, tokenizer=False, weights=True)
        if hf_config.vocab_size < vocab_size:
            raise UserError(
                f"model.tokenizer has {vocab_size} tokens but the model's vocab_size is "
                f"{hf_config.vocab_size}; use the model's own tokenizer"
            )
        path = Path(config.model.path).expanduser()
        if device.type == "meta":
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=ATTENTION_NAME)
            if (path / "generation_config.json").is_file():  # what from_pretrained reads, so the export keeps it
                model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
            return model
        model = load_local_weights(path, hf_config, dtype, ATTENTION_NAME)
    else:
        torch.manual_seed(config.run.seed)
        with torch.device(device):  # random init where the model trains: on a GPU seconds, on the host minutes at 8B
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=ATTENTION_NAME)
    return model.to(device)


def check_weight_shapes(config: Config, hf_config) -> None:
    """Every weight in the model directory's safetensors files that the model of `hf_config` has is of the shape
    the model expects (read from the files' headers; the model is built on the meta device, no memory), else one
    line naming the weight, both shapes and the fix. Weights the model lacks, or the files lack, are left to the
    loader."""
    if config.model.path is None:
        return
    with torch.device("meta"):
        expected = {
            name: list(tensor.shape)
            for name, tensor in AutoModelForCausalLM.from_config(hf_config).state_dict().items()
        }
    found = {
        name: list(item["shape"])
        for file in sorted(Path(config.model.path).expanduser().glob("*.safetensors"))
        for name, item in safetensors_header(file).items()
    }
    for name, shape in expected.items():  # the first in the model's own order
        if name in found and found[name] != shape:
            raise UserError(weight_shape_mismatch(config.model.path, name, found[name], shape))


def weight_shape_mismatch(model_dir, name: str, found, expected) -> str:
    return (
        f"--model {model_dir}: weight {name!r} has shape {list(found)}, but its config.json makes it "
        f"{list(expected)}; the weights and config.json are of different models: copy both from one source"
    )


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, parameters used in matmuls per token): the lookup table is not a matmul, the
    LM head is one even when tied to it. The second number drives the 6·N training FLOPs per token."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head is embedding
    return total, total - embedding.numel() + (head.numel() if tied else 0)


def load_local_weights(path: Path, hf_config, dtype: torch.dtype, attn_implementation: str):
    """A local HF directory's model with `hf_config` (its own config, maybe with a context recipe applied)."""
    return AutoModelForCausalLM.from_pretrained(
        str(path), config=hf_config, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
