"""The model families mtrain extends, one row each (in the spirit of torchtitan's ModelSpec and gpt-fast's config
table): a family's model_type and HF config class, what a fresh or small model of it sets, the RoPE mtrain trains it
with, and where its parts sit in the HF causal LM.

Everything that depends on the family asks this table: the choices of model.architecture (config/tree.py), the
families a --model directory may be of and the fresh model's config (model/build.py), the RoPE it may start from
and extend to (model/rope.py), the small test models (model/tiny.py), and the decoder layers, backbone and LM head
that parallelize, compile and the chunked loss reach into (train/). A new family is one row plus its tests
(tests/test_families.py; the distributed cases in tests/test_distributed_train.py).

Torch-free, as config reads it: config classes are named, parts are attribute paths from the causal LM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any


@dataclass(frozen=True)
class SmallModel:
    """What makes a small random model of the family (model/tiny.py) differ from the others: the published
    models' settings, at a small size."""

    rope_theta: float
    tie_word_embeddings: bool = False
    head_dim_ratio: int = 1  # head_dim = ratio × hidden / heads (Qwen3-0.6B: 128 = 2 × 1024 / 16)


@dataclass(frozen=True)
class Family:
    name: str  # the published models it covers, as messages name them
    model_type: str  # config.json's model_type, and model.architecture for a fresh model
    config_class: str  # the transformers config class
    small: SmallModel
    fresh: dict[str, Any] = field(default_factory=dict)  # a fresh model's config sets these beyond the recipe's
    own_head_dim: bool = False  # the config class defaults head_dim to its own value: a fresh model sets hidden/heads
    rope_types: tuple[str, ...] | None = None  # the only rope_types mtrain trains it with; None: any
    layers: str = "model.layers"  # the decoder layers: the units of compile, checkpointing and FSDP
    backbone: str = "model"  # embeddings, decoder layers, final norm: input ids -> last hidden states
    lm_head: str = "lm_head"  # hidden states -> vocabulary logits (tied to the embeddings where the model ties)


FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("Qwen2/Qwen2.5", "qwen2", "Qwen2Config", SmallModel(1e6, tie_word_embeddings=True)),
        Family(
            "Qwen3",
            "qwen3",
            "Qwen3Config",
            SmallModel(1e6, tie_word_embeddings=True, head_dim_ratio=2),  # q/k RMSNorm come with the class
            own_head_dim=True,  # Qwen3Config's own default is 128
        ),
        Family("Llama 2/3.x", "llama", "LlamaConfig", SmallModel(5e5)),
        Family("Mistral", "mistral", "MistralConfig", SmallModel(1e6), fresh={"sliding_window": None}),
        Family(
            "Phi-3/Phi-4",
            "phi3",
            "Phi3Config",
            SmallModel(1e4),
            # its defaults name tokens of its 32K vocabulary (pad 32000 indexes past a smaller embedding)
            fresh={"bos_token_id": None, "eos_token_id": None, "pad_token_id": None},
            rope_types=("default",),  # model/rope.py: check_family_rope
        ),
    )
}


def family_of(model) -> Family:
    """The row of an HF causal LM mtrain built (model/build.py refuses other families)."""
    return FAMILIES[model.config.model_type]


def decoder_layers(model):
    return attrgetter(family_of(model).layers)(model)


def backbone(model):
    return attrgetter(family_of(model).backbone)(model)


def lm_head(model):
    return attrgetter(family_of(model).lm_head)(model)
