"""bench.extension.cap_sweep estimates the first layer's pattern from its queries and keys computed outside the
model: they must be the ones the model's own attention receives (RoPE applied; Qwen3's q/k norms too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bench.extension.cap_sweep import first_layer_qk

SEEN: dict[str, torch.Tensor] = {}


def capture(module, query, key, value, attention_mask, **kwargs):
    if module.layer_idx == 0:
        SEEN.update(q=query.detach().clone(), k=key.detach().clone())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_first_layer_queries_and_keys_are_the_models_own(family):
    if family == "qwen2":
        model = AutoModelForCausalLM.from_pretrained(
            Path(__file__).parents[1] / "data" / "tiny-base", dtype=torch.float32
        )
    else:
        torch.manual_seed(0)
        config = Qwen3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=1024,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "rope_theta": 10000.0,
            },
        )
        model = Qwen3ForCausalLM(config)
    AttentionInterface.register("capture-qk", capture)
    model.set_attn_implementation("capture-qk")
    ids_BS = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids_BS)
        q_BHSD, k_BHkSD = first_layer_qk(model.eval(), ids_BS)
    torch.testing.assert_close(q_BHSD, SEEN["q"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_BHkSD, SEEN["k"], atol=1e-5, rtol=1e-5)
