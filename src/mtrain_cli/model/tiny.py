"""Small random models of each family `mtrain extend` takes, saved as a user brings them: `save_pretrained`
weights (optionally bf16 and sharded with an index), the shipped tokenizer with a chat template, and a
generation_config.json. For tests and GPU checks without a model hub:

    python -m mtrain_cli.model.tiny llama3 /tmp/llama3-tiny --hidden-size 256 --num-layers 4

Each family of mtrain_cli.families carries what makes it differ from the others (its row's `small`: the published
models' settings, at a small size) and its fresh-model settings:
- qwen2: Qwen2.5, plain RoPE θ 1e6, tied embeddings (as Qwen2.5-0.5B/1.5B/3B);
- qwen3: q/k RMSNorm, an explicit head_dim twice hidden/heads (Qwen3-0.6B: 128 vs 64), θ 1e6, tied;
- llama: plain RoPE θ 5e5 (Llama 3.0);
- mistral: Mistral v0.2+ (sliding_window null), θ 1e6; `sliding_window` gives v0.1's windowed attention;
- phi3: Phi-3-mini-4k and Phi-4: fused q/k/v and gate/up projections, plain RoPE θ 1e4;
and one variant: llama3, a llama with Llama 3.1/3.2/3.3's rope_type llama3 (factor 8, bands 1–4, pretrained on
context/16), θ 5e5.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from mtrain_cli.families import FAMILIES as TABLE
from mtrain_cli.model.build import config_class
from mtrain_cli.resources import shipped_path

VARIANTS = {"llama3": "llama"}  # a variant -> its family's model_type
FAMILIES = (*TABLE, *VARIANTS)
# ChatML, as Qwen's tokenizers carry it: enough to check that an export keeps the user's template
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(
    family: str,
    vocab_size: int,
    context: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie: bool | None = None,
    sliding_window: int | None = None,
):
    """The HF config of a small `family` model with `context` tokens of context (max_position_embeddings)."""
    assert family in FAMILIES, family
    row = TABLE[VARIANTS.get(family, family)]
    small = row.small
    fields = dict(
        row.fresh,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=context,
        tie_word_embeddings=small.tie_word_embeddings if tie is None else tie,
        rope_parameters={"rope_type": "default", "rope_theta": small.rope_theta},
    )
    if small.head_dim_ratio != 1:
        fields["head_dim"] = small.head_dim_ratio * hidden_size // num_heads
    if sliding_window is not None:
        fields["sliding_window"] = sliding_window
    if family == "llama3":
        fields["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": context // 16,
        }
    return config_class(row)(**fields)


def save_tiny_model(
    family: str,
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    seed: int = 0,
    **config_fields,
) -> Path:
    """A random `family` model in `out_dir` (config, weights in `dtype`, shipped tokenizer with CHAT_TEMPLATE,
    generation_config.json with sampling defaults and the tokenizer's eos); `max_shard_size` (e.g. "100KB")
    splits the weights into several files with a model.safetensors.index.json. config_fields: tiny_config's."""
    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(shipped_path("data/tokenizer")), local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    hf_config = tiny_config(family, len(tokenizer), **config_fields)
    hf_config.bos_token_id = hf_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=[tokenizer.eos_token_id],
        do_sample=True,
        temperature=0.6,
        top_p=0.9,
    )
    shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **shards)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--context", type=int, default=1024, help="max_position_embeddings")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="save the weights in bf16, as real checkpoints are")
    parser.add_argument("--max-shard-size", default=None, help="e.g. 1MB: several files and an index")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = save_tiny_model(
        args.family,
        args.out_dir,
        dtype=torch.bfloat16 if args.bf16 else torch.float32,
        max_shard_size=args.max_shard_size,
        seed=args.seed,
        context=args.context,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
    )
    print(out)


if __name__ == "__main__":
    main()
